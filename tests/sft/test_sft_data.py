"""SFT rows -> samples: the final-turn loss mask, token for token against the chat template, and bad rows."""
import json
import logging

import pytest

from megatron_rl.rollout.agent import ConversationCodec
from megatron_rl.sft_data import SFTDataError, encode_messages, load_samples
from megatron_rl.tokenizer import load_tokenizer

FINAL = "```python\nimport torch\nclass ModelNew: pass\n```"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3-offline")


def transcript():
    return [{"role": "system", "content": "You write kernels.", "step_loss_mask": 0},
            {"role": "user", "content": "Write relu.", "step_loss_mask": 0},
            {"role": "assistant", "content": "<think>\nplan A\n</think>\n\nfirst try", "step_loss_mask": 0},
            {"role": "user", "content": "Verdict: compile_error. Fix it.", "step_loss_mask": 0},
            {"role": "assistant", "content": FINAL, "step_loss_mask": 1}]


def test_loss_covers_exactly_the_final_answer_as_the_chat_template_renders_it(tok):
    msgs = transcript()
    s = encode_messages(tok, msgs)
    plain = [{"role": m["role"], "content": m["content"]} for m in msgs]
    full = tok.encode(tok.apply_chat_template(plain, tokenize=False), add_special_tokens=False)
    # the sample is the template's rendering, token for token, up to and including the answer's <|im_end|>
    assert full[:len(s.tokens)] == s.tokens and tok.decode(full[len(s.tokens):]) == "\n"
    assert s.tokens[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    # the untrained prefix is exactly what the agent sends at generation time
    prompt = ConversationCodec(tok).prompt_ids(plain[:-1])
    first = s.loss_mask.index(1)
    assert s.tokens[:first] == prompt and set(s.loss_mask[:first]) == {0} and set(s.loss_mask[first:]) == {1}
    assert tok.decode(s.tokens[first:]) == FINAL + "<|im_end|>"
    # the earlier answer is context, rendered without its reasoning (Qwen3's template drops past <think>)
    context = tok.decode(s.tokens[:first])
    assert "first try" in context and "plan A" not in context


@pytest.mark.parametrize("row, reason", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "must be a JSON object"),
    ('{"task_id": "x"}', "no 'messages' field"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "must end with the assistant answer"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}', "role='robot'"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}]}', "must be a string"),
    ('{"messages": [{"role": "user", "content": "hi", "step_loss_mask": 1}, {"role": "assistant", "content": "a"}]}',
     "only the final assistant turn is trained"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a", "step_loss_mask": 0}]}',
     "would train on nothing"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a<|im_end|>b"}]}',
     "control token"),
    # any added token of the tokenizer, not only ChatML's: an RFT row holds a policy's answer
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a<|vision_start|>b"}]}',
     "control token '<|vision_start|>'"),
])
def test_a_malformed_row_is_an_error_naming_file_and_line(tmp_path, tok, row, reason):
    good = json.dumps({"messages": transcript()})
    path = tmp_path / "rows.jsonl"
    path.write_text(good + "\n\n" + row + "\n" + good + "\n")
    with pytest.raises(SFTDataError, match=f"{path}:3: .*{reason}".replace("[", r"\[").replace("(", r"\(")):
        load_samples([path], tok)


def test_skip_mode_logs_every_skipped_row_and_counts_it(tmp_path, tok, caplog):
    good = json.dumps({"messages": transcript(), "passed": True})
    failed = json.dumps({"messages": transcript(), "passed": False})
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join([good, "{oops", failed, good]) + "\n")
    with caplog.at_level(logging.WARNING, logger="megatron_rl.sft"):
        rows, report = load_samples([path], tok, on_error="skip", max_seq_len=10_000)
    assert [r.where for r in rows] == [f"{path}:1", f"{path}:4"]
    assert report.rows == 4 and report.encoded == 2 and len(report.skipped) == 2
    logged = [r.getMessage() for r in caplog.records]
    assert any(f"{path}:2" in m and "not valid JSON" in m for m in logged)
    assert any(f"{path}:3" in m and "failed verification" in m for m in logged)
    # a too-long row is malformed too: an error by default, a logged skip when asked
    with pytest.raises(SFTDataError, match=f"{path}:1: too long"):
        load_samples([path], tok, max_seq_len=20)
    with pytest.raises(SFTDataError, match="not found"):
        load_samples([tmp_path / "missing.jsonl"], tok)
