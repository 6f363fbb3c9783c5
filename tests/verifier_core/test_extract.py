"""Response -> candidate source, and the format errors a model can act on."""
import pytest

from verifier.extract import FormatError, extract_candidate

GOOD = "import torch.nn as nn\n\nclass ModelNew(nn.Module):\n    pass\n"


def test_last_python_block_wins():
    resp = f"first:\n```python\nclass ModelNew: 1\n```\nbetter:\n```py\n{GOOD}```\nok?"
    assert extract_candidate(resp, 10_000) == GOOD


def test_untagged_block_that_parses_counts_other_languages_do_not():
    resp = f"```cpp\nint main() {{}}\n```\n```\n{GOOD}```\n```text\nnot code at all (\n```"
    assert extract_candidate(resp, 10_000) == GOOD


def test_plain_source_and_bytes():
    assert extract_candidate(GOOD, 10_000) == GOOD
    assert extract_candidate(GOOD.encode(), 10_000) == GOOD
    assert extract_candidate("~~~python\n" + GOOD + "~~~", 10_000) == GOOD


@pytest.mark.parametrize("resp,msg", [
    ("I don't know.", "no ```python"),
    ("", "no code"),
    ("```python\n\n```", "no code"),
    ("```python\nimport torch\n```", "ModelNew"),
    ("```python\nclass ModelNew(:\n```", "does not parse"),
    (b"```python\n\xff\xfe\n```", "UTF-8"),
    ("x" * 2000, "over the 1000-byte limit"),
    ("```python\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return (x", "cut off"),
    ("a\x00b", "NUL"),
])
def test_format_errors_say_why(resp, msg):
    with pytest.raises(FormatError, match=msg):
        extract_candidate(resp, 1000)
