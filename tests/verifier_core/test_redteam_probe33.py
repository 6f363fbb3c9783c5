"""Probe 33: awkward and hostile outputs on the cpu backend that the other red-team files do not cover.

Fixed here (each was wrong before):
- NaN in an input disabled the input-mutation rule: ``torch.equal`` calls a NaN unequal to its own copy, so the
  reference "modified" its inputs too and the rule was waived; a candidate that zeroed its inputs passed. Inputs
  are now compared byte for byte (``correctness.same_bits``, ``DeviceSession._same_bits``).
- A Python float the reference returns (``x.sum().item()``) was compared for exact equality: an honest kernel
  summing in another order failed. It is held to the tensors' tolerance now (``compare_outputs``).
- A stray closing fence after the answer (it opens an empty block) or a usage example in a later ```python block
  was taken as the candidate and rejected a correct kernel as a format error (``extract._select``).
- ``at::intraop_launch_future`` slipped past the native thread rule (only the plain name matched).

Pinned end to end (already right; a sample of what the probe tried, to keep the suite's time): NaN placement, a
stride-0 output, 0-dim vs 1-element shapes, a dict for a pair, meta-device outputs, an ``__init__(*args, **kwargs)``
signature, file-descriptor exhaustion. Also tried and right: non-contiguous and offset outputs, list/tuple/nested
structures, outputs sharing one buffer, in-place outputs aliasing an input, other ``__init__`` signatures.
"""
import textwrap

import pytest
import torch

from verifier.correctness import compare_outputs, same_bits
from verifier.evaluate import verify
from verifier.extract import FormatError, extract_candidate
from verifier.native_checks import scan_native
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import ADD, RELU, calling, compiled, task_path

GOOD = "import torch\nimport torch.nn as nn\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x\n"


# ------------------------------------------------------------------------------------------------ unit
def test_inputs_are_compared_bit_for_bit_so_nan_inputs_do_not_look_modified():
    a = torch.tensor([1.0, float("nan"), float("inf"), 0.0])
    assert not torch.equal(a, a.clone()) and same_bits(a, a.clone())
    changed = a.clone()
    changed[0] = 0.0
    assert not same_bits(a, changed)
    signed = a.clone()
    signed[3] = -0.0   # a write, even where the values compare equal
    assert not same_bits(a, signed)
    assert same_bits(a.view(2, 2).t(), a.view(2, 2).t().clone())       # non-contiguous inputs
    assert not same_bits(a, a.double()) and not same_bits(a, a[:3])


@pytest.mark.parametrize("got,expected,ok", [
    (4300.08154296875, 4300.08203125, True),     # float32 sums in two orders
    (4321.0, 4278.2, False),
    (float("nan"), float("nan"), True),
    (1.0, float("nan"), False),
    (float("nan"), 1.0, False),
    (float("inf"), float("inf"), True),
    (-float("inf"), float("inf"), False),
    (3, 3.0, True),
    (1e-6, 0.0, False),                          # a zero reference needs a zero answer, as for tensors
    (10 ** 400, 1.0, False),                     # an int too large for a float: a mismatch, not an exception
    ("1.0", 1.0, False),
    (torch.tensor(1.0), 1.0, False),             # a tensor where the reference returns a Python float
    (4, 3, False),                               # ints stay exact
])
def test_python_float_outputs_are_held_to_the_tolerance(got, expected, ok):
    c = compare_outputs([got], [expected], 1e-4, 1e-4)
    assert c.ok is ok, c.mismatch
    if not ok:
        assert len(c.mismatch.describe()) < 300


@pytest.mark.parametrize("response", [
    "```python\n" + GOOD + "```\n```\n",                                        # a stray closing fence
    "Answer:\n```python\n" + GOOD + "```\nThat is all.\n```\n",
    "```python\n" + GOOD + "```\nUsage:\n```python\nm = ModelNew()\nprint(m(torch.randn(2)))\n```\n",
    "```python\n" + GOOD + "```\n```python\n\n```\n",                           # an empty last block
    "```cpp\nint f();\n```\n```python\n" + GOOD + "```\n",
])
def test_the_answer_is_found_past_stray_fences_and_usage_examples(response):
    assert extract_candidate(response, 200_000) == GOOD


@pytest.mark.parametrize("response,msg", [
    ("```python\n" + GOOD + "```\n```python\nclass ModelNew(:\n```\n", "does not parse"),   # no earlier draft
    ("```python\n" + GOOD + "```\n```python\nclass ModelNew(nn.Module):\n    def f(self):\n        return (x\n",
     "cut off"),
    ("```python\nx = 1\n```\n", "ModelNew"),
    ("```python\n\n```", "no code"),
])
def test_a_broken_last_block_is_still_the_candidate(response, msg):
    with pytest.raises(FormatError, match=msg):
        extract_candidate(response, 200_000)


def test_intraop_launch_future_is_a_thread():
    found = {rule for rule, _ in scan_native(["void f(){ auto fut = at::intraop_launch_future([]{}); }"], [], "cpu")}
    assert "process_or_thread" in found


# ------------------------------------------------------------------------------------------ end to end
TASKS = {
    "add_nan": '''
        class Model(nn.Module):
            """A + B where A holds NaN and Inf entries."""
            def forward(self, a, b):
                return a + b

        def get_inputs():
            a = torch.randn(4096)
            a[::97] = float("nan")
            a[5::101] = float("inf")
            return [a, torch.randn(4096)]
        ''',
    "relu_nan": '''
        class Model(nn.Module):
            """torch.relu propagates NaN."""
            def forward(self, x):
                return torch.relu(x)

        def get_inputs():
            x = torch.randn(16, 512)
            x[:, ::37] = float("nan")
            return [x]
        ''',
    "relu_rows": '''
        class Model(nn.Module):
            """ReLU of a vector repeated over 8 rows (a contiguous output)."""
            def forward(self, x):
                return torch.relu(x).repeat(8, 1)

        def get_inputs():
            return [torch.randn(512)]
        ''',
    "sumsq_scalar": '''
        class Model(nn.Module):
            """A 0-dim output."""
            def forward(self, x):
                return (x * x).sum()

        def get_inputs():
            return [torch.randn(1, 4096)]
        ''',
    "sumsq_item": '''
        class Model(nn.Module):
            """A Python float output."""
            def forward(self, x):
                return (x * x).sum().item()

        def get_inputs():
            return [torch.randn(1, 4096)]
        ''',
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe33_tasks")
    for name, body in TASKS.items():
        (root / f"{name}.py").write_text("import torch\nimport torch.nn as nn\n\n" + textwrap.dedent(body)
                                         + "\n\ndef get_init_inputs():\n    return []\n")
    return lambda name: str(root / f"{name}.py") if name in TASKS else task_path(name)


def expect(result, category, rule=None):
    assert result.category == category, (result.category, result.rule, result.feedback,
                                         result.details.get("traceback"))
    if rule is not None:
        assert result.rule == rule, (result.rule, result.feedback)
    assert (result.reward == -1.0) == (category != Category.PASS)


PAIR = "(ext.relu(x), ext.mul_add(x, torch.ones(x.shape[-1]), torch.ones(x.shape[-1]), False))"
SIGNATURE = '''
class ModelNew(nn.Module):
    def __init__(self, {init}):
        super().__init__()
        self.weight = nn.Parameter(torch.randn({n}))
        self.bias = nn.Parameter(torch.randn({n}))

    def forward(self, {args}):
        return ext.mul_add({x}, self.weight, self.bias, False)
'''
FD_HOG = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.keep = [torch.empty(1).share_memory_() for _ in range(4000)]

    def forward(self, x):
        self.keep += [torch.empty(1).share_memory_() for _ in range(30)]
        return ext.relu(x)
'''

CASES = [
    # NaN / Inf: honest kernels pass, NaN in the wrong place fails, and NaN inputs keep the mutation rule
    ("add_nan", compiled(ADD), Category.PASS, None),
    ("add_nan", compiled(calling("ext.add_then_zero_inputs(a, b)")), Category.CHEATING, "input_mutation"),
    ("relu_nan", compiled(RELU), Category.CORRECTNESS_ERROR, None),   # this kernel maps NaN to 0
    # layouts: the values count, not the strides
    ("relu_rows", compiled(calling("ext.relu(x).expand(8, -1)", "x")), Category.PASS, None),       # stride 0
    ("relu", compiled(calling("ext.relu(x).to('meta')", "x")), Category.RUNTIME_ERROR, None),
    # 0-dim against 1-element
    ("sumsq_scalar", compiled(calling("ext.row_sumsq(x)", "x")), Category.CORRECTNESS_ERROR, None),
    # a Python float output, as a float32 kernel computes it
    ("sumsq_item", compiled(calling("ext.row_sumsq(x)[0].item()", "x")), Category.PASS, None),
    ("sumsq_item", compiled(calling("ext.row_sumsq(x)[0].item() * 1.01", "x")), Category.CORRECTNESS_ERROR, None),
    # structures: list and tuple alike, anything else differs
    ("relu_pair", compiled(calling(f"dict(enumerate({PAIR}))", "x")), Category.CORRECTNESS_ERROR, None),
    # __init__ signatures: what the reference's init inputs fit passes, the rest is the candidate's error
    ("scale_shift", compiled(SIGNATURE.format(init="*args, **kwargs", n="args[0]", args="*xs", x="xs[0]")),
     Category.PASS, None),
    # descriptors exhausted: the candidate's error, never infra
    ("relu", compiled(FD_HOG), Category.RUNTIME_ERROR, None),
]


@pytest.mark.slow
@pytest.mark.parametrize("task_name,response,category,rule", CASES,
                         ids=[f"{i}-{c[0]}-{c[2].value}" for i, c in enumerate(CASES)])
def test_awkward_outputs_get_their_verdicts(make_cfg, tasks, task_name, response, category, rule):
    r = verify(load_task(tasks(task_name)), response, make_cfg())
    expect(r, category, rule)
