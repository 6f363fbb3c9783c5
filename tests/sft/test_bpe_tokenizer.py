"""The small byte-level BPE a from-scratch model trains with (`megatron_rl.tokenizer.train_bpe`, the recipe's
tokenizer stage): any text round-trips, ChatML control tokens stay single ids, chat turns split token-exactly
(the SFT loss mask needs it), line merges never cross a newline, and bad input is refused by name."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.sft_data import encode_messages
from megatron_rl.tokenizer import BPE_ADDED_TOKENS, BPE_SPECIAL_TOKENS, MIN_BPE_VOCAB, sft_texts, train_bpe

ROOT = Path(__file__).resolve().parents[2]
ANSWER = ("Plan: one C++ extension per op, applied in order:\n1. x = torch.tanh(x) -> ext1\n\n```python\n"
          "import torch\nsrc1 = \"\"\"\ntorch::Tensor run(torch::Tensor x) {\n  return x;\n}\n\"\"\"\n```")


def _row(op: str, n: int) -> dict:
    user = (f"Reference:\n```python\nclass Model(nn.Module):\n    def forward(self, x):\n        x = torch.{op}(x)\n"
            f"        return x\n\nsize = {n}\n```\nRequirements:\n- Answer with exactly one fenced code block.")
    return {"messages": [{"role": "system", "content": "You write kernels."}, {"role": "user", "content": user},
                         {"role": "assistant", "content": ANSWER.replace("tanh", op)}]}


ROWS = [_row(op, n) for op in ("tanh", "relu", "neg", "abs") for n in (7, 1024, 65536)]
UNSEEN = ["数字 12345 和中文 🚀 café", "  leading spaces\r\nand CRLF\n\n\n", "x = torch.sigmoid(x)  # 987654321\n"]


def _texts():
    return [m["content"] for r in ROWS for m in r["messages"]]


@pytest.fixture(scope="module", params=["words", "lines"])
def tok(request):
    return train_bpe(_texts(), 600, merge_within=request.param)


def test_any_text_round_trips_and_control_tokens_are_single_ids(tok):
    assert len(tok) <= 600
    for text in _texts() + UNSEEN:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ids = [tok.convert_tokens_to_ids(t) for t in BPE_SPECIAL_TOKENS + BPE_ADDED_TOKENS]
    assert len(set(ids)) == len(ids) and None not in ids and tok.unk_token_id not in ids
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # digits are single tokens, so a number the data never showed encodes like any other
    assert all(len(tok.decode([i])) == 1 for i in tok.encode("987654321", add_special_tokens=False))


def test_chat_rows_split_token_exactly_with_the_loss_on_the_answer(tok):
    for row in ROWS[:3]:
        s = encode_messages(tok, row["messages"])
        answer = [t for t, m in zip(s.tokens, s.loss_mask) if m]
        assert tok.decode(answer) == row["messages"][-1]["content"] + "<|im_end|>"
    # the chat template is Qwen3's ChatML, thinking switch included
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_line_merges_make_recurring_lines_single_tokens_and_never_cross_a_newline():
    lines = train_bpe(_texts(), 600, merge_within="lines")
    words = train_bpe(_texts(), 600, merge_within="words")
    line = "        x = torch.relu(x)\n"
    assert len(lines.encode(line, add_special_tokens=False)) == 1
    assert len(words.encode(line, add_special_tokens=False)) > 3
    for piece in lines.convert_ids_to_tokens(list(range(len(lines)))):
        text = lines.convert_tokens_to_string([piece])
        assert "\n" not in text[:-1], repr(text)
    rows = [encode_messages(t, ROWS[0]["messages"]).tokens for t in (lines, words)]
    assert len(rows[0]) < len(rows[1]) / 2


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="at least"):
        train_bpe(_texts(), MIN_BPE_VOCAB - 1)
    with pytest.raises(ValueError, match="merge_within"):
        train_bpe(_texts(), 600, merge_within="sentences")
    with pytest.raises(ValueError, match="no text"):
        train_bpe([], 600)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_rl.tokenizer", "train", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_cli_writes_a_loadable_dir_and_names_a_bad_row(tmp_path):
    from transformers import AutoTokenizer

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "tok"
    out.mkdir()
    (out / "stale.txt").write_text("from an older run")
    p = _cli("--data", str(data), "--vocab-size", "600", "--merge-within", "lines", "--out", str(out))
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info["vocab_size"] <= 600 and info["merge_within"] == "lines"
    assert not (out / "stale.txt").exists()   # replaced whole, not merged into
    loaded = AutoTokenizer.from_pretrained(str(out))
    assert loaded.encode("        x = torch.relu(x)\n", add_special_tokens=False) == \
        train_bpe(sft_texts([data]), 600, merge_within="lines").encode("        x = torch.relu(x)\n",
                                                                        add_special_tokens=False)
    assert loaded.chat_template and loaded.eos_token == "<|im_end|>"

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"prompt": "no messages"}) + "\n")
    p = _cli("--data", str(bad), "--out", str(tmp_path / "tok2"))
    assert p.returncode == 2 and "bad.jsonl:2" in p.stderr and not (tmp_path / "tok2").exists()
    p = _cli("--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "tok3"))
    assert p.returncode == 2 and "missing.jsonl" in p.stderr
    p = _cli("--data", str(data), "--vocab-size", "100", "--out", str(tmp_path / "tok4"))
    assert p.returncode == 2 and "at least" in p.stderr and not (tmp_path / "tok4").exists()


def test_a_run_dirs_tiny_model_is_rebuilt_when_its_tokenizer_changes(tmp_path):
    """A reused run dir (the recipe's workdir run twice) must not train a cached tiny model whose vocabulary
    belongs to another tokenizer; the same spec reuses it (a resumed run needs the same initial weights)."""
    from megatron_rl.sft import load_sft_config
    from megatron_rl.train import prepare_model

    (tmp_path / "rows.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    dirs = []
    for name, vocab in (("a", 600), ("b", 400)):
        train_bpe(_texts(), vocab, merge_within="lines").save_pretrained(tmp_path / name)
        dirs.append(str(tmp_path / name))

    def build(tok_dir: str) -> dict:
        cfg = load_sft_config(str(ROOT / "configs/sft_tiny.yaml"), [f"train.log_dir={tmp_path / 'run'}",
                                                                    f"model.tokenizer={tok_dir}",
                                                                    f"data.files=[{tmp_path / 'rows.jsonl'}]"])
        model_dir, _ = prepare_model(cfg, environment_tokenizer=False)
        return json.loads((Path(model_dir) / "config.json").read_text())

    from transformers import AutoTokenizer

    first = build(dirs[0])
    assert first["vocab_size"] == len(AutoTokenizer.from_pretrained(dirs[0]))
    weights = tmp_path / "run" / "model" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    build(dirs[0])
    assert weights.stat().st_mtime_ns == stamp          # same spec: reused
    second = build(dirs[1])
    assert second["vocab_size"] == len(AutoTokenizer.from_pretrained(dirs[1])) != first["vocab_size"]
