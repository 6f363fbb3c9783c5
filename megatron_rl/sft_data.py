"""SFT rows -> training samples: chat transcripts rendered by the tokenizer's chat template, loss on the final
assistant turn only.

A row is one JSON object per line with a ``messages`` list (``data_synth.sft/1`` rows from ``data_synth distill`` /
``rft``, or any ``{"messages": [...]}`` chat row). Earlier turns of a multi-turn transcript (the failed attempts and
the verifier's feedback) are context: the loss covers the tokens of the last assistant message and its end-of-turn
token, nothing else. ``step_loss_mask`` (slime's per-message key) may mark that message 1 and every other 0; a row
that asks for loss on an earlier turn is refused, since this trainer would silently ignore it otherwise.

Tokens are exactly what the chat template renders, and the prompt part is exactly what the agent sends at
generation time (``render(messages[:-1], add_generation_prompt=True)``): the row is rendered once whole and once
without its answer, and the first must start with the second, token for token (a template that renders the
history differently once an answer follows, or a tokenizer that merges across the boundary, is an error naming the
row). The template's text after the end-of-turn token (a newline) is dropped: the model never generates it.

Malformed rows raise `SFTDataError` naming file and line, or, with ``on_error="skip"``, are logged one by one with
the reason and counted; none is dropped silently.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Iterator, Sequence

from megatron_rl.rollout.prompts import CONTROL_TOKENS, tokenizer_control_tokens
from megatron_rl.tokenizer import QWEN3_ADDED_TOKENS
from megatron_rl.types import TrainSample

log = logging.getLogger("megatron_rl.sft")

ROLES = ("system", "user", "assistant", "tool")


class SFTDataError(ValueError):
    """A malformed SFT row or file; the message starts with ``file:line``."""


@dataclasses.dataclass
class EncodedRow:
    where: str                      # "file:line"
    sample: TrainSample
    sample_id: str | None = None


@dataclasses.dataclass
class LoadReport:
    """What `load_samples` read: rows per file, and every skipped row with its reason."""

    rows: int = 0
    encoded: int = 0
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)   # (file:line, reason)
    files: dict[str, int] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        reasons: dict[str, int] = {}
        for _, r in self.skipped:
            key = r.split(":", 1)[0]
            reasons[key] = reasons.get(key, 0) + 1
        return {"rows": self.rows, "samples": self.encoded, "skipped": len(self.skipped), "skip_reasons": reasons,
                "files": self.files}


def check_messages(messages: Any) -> str | None:
    """None for a well-formed transcript whose last message is the trained assistant answer, else the reason."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}] is not an object"
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return f"messages[{i}].role={role!r}: use one of {', '.join(ROLES)}"
        if not isinstance(content, str):
            return f"messages[{i}].content must be a string, got {type(content).__name__}"
        mask = m.get("step_loss_mask", None)
        if mask not in (None, 0, 1) or isinstance(mask, bool):
            return f"messages[{i}].step_loss_mask={mask!r} must be 0 or 1"
        last = i == len(messages) - 1
        if mask == 1 and not last:
            return (f"messages[{i}].step_loss_mask=1: only the final assistant turn is trained (earlier turns are "
                    f"context); mark it 0")
        bad = next((t for t in CONTROL_TOKENS[:3] if t in content), None)
        if bad is not None:
            return f"messages[{i}].content holds the chat control token {bad!r}"
    final = messages[-1]
    if final["role"] != "assistant":
        return f"the last message is {final['role']!r}: a row must end with the assistant answer it trains on"
    if final.get("step_loss_mask", 1) == 0:
        return "the final assistant message has step_loss_mask=0: the row would train on nothing"
    if not final["content"].strip():
        return "the final assistant message is empty"
    if not any(m["role"] == "user" for m in messages[:-1]):
        return "no user message before the answer"
    return None


def untrainable(row: dict[str, Any]) -> str | None:
    """Why ``python -m megatron_rl.sft`` would refuse ``row`` as far as that is known without its tokenizer, or None:
    a transcript ``sft_data.check_messages`` rejects (a failed earlier answer that spelled ``<|im_end|>``), or a final
    answer that spells one of Qwen3's added tokens other than the reasoning markers (the policy would be trained to
    emit it). A verified answer may hold either in a comment or a string; drawn as a target it stopped the SFT load
    (``on_error=raise``) or cost the prompt a target another cluster would have given. Distill and RFT keep no such
    row."""
    problem = check_messages(row.get("messages"))
    if problem is not None:
        return problem
    answer = row["messages"][-1]["content"]
    spelled = next((t for _, t, _ in QWEN3_ADDED_TOKENS if t not in ("<think>", "</think>") and t in answer), None)
    return None if spelled is None else f"the answer holds the control token {spelled!r}"


def _plain(messages: Sequence[dict]) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def end_of_turn_ids(tokenizer) -> set[int]:
    """The tokens that close an assistant turn (per token lookups: building the whole vocab dict takes seconds)."""
    unk = tokenizer.unk_token_id
    ids = {int(i) for i in tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
           if i is not None and i != unk}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def encode_messages(tokenizer, messages: Sequence[dict], template_kwargs: dict | None = None) -> TrainSample:
    """Tokens of the rendered transcript (through the answer's end-of-turn token) and a loss mask that is 1 on the
    final assistant answer and its end-of-turn token only. Raises ValueError when the chat template or the
    tokenizer cannot give a token-exact split (see the module docstring)."""
    kw = dict(template_kwargs or {})
    msgs = _plain(messages)
    prompt = tokenizer.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True, **kw)
    full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, **kw)
    if not full.startswith(prompt):
        raise ValueError("the chat template renders the conversation differently once the answer follows "
                         "(the generation prompt is not a prefix of the whole transcript)")
    p_ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    f_ids = list(tokenizer.encode(full, add_special_tokens=False))
    if f_ids[:len(p_ids)] != p_ids:
        raise ValueError("tokenizing the whole transcript merges tokens across the prompt/answer boundary")
    stops = end_of_turn_ids(tokenizer)
    end = next((i for i in range(len(p_ids), len(f_ids)) if f_ids[i] in stops), None)
    if end is None:
        raise ValueError("the rendered answer has no end-of-turn token")
    if tokenizer.decode(f_ids[end + 1:]).strip():
        raise ValueError("the chat template renders text after the answer's end-of-turn token")
    tokens = f_ids[:end + 1]
    if end + 1 - len(p_ids) < 2:
        raise ValueError("the answer renders to no tokens")
    control = set(tokenizer_control_tokens(tokenizer).values())
    spelled = next((t for t in f_ids[len(p_ids):end] if t in control), None)
    if spelled is not None:   # (an RFT row holds a policy's answer: it would be trained to emit that token)
        raise ValueError(f"the answer holds the tokenizer's control token "
                         f"{tokenizer.convert_ids_to_tokens(int(spelled))!r}")
    return TrainSample(tokens=tokens, loss_mask=[0] * len(p_ids) + [1] * (len(tokens) - len(p_ids)))


def read_rows(path: str | Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, parsed object or None, parse error or None) for every non-blank line of a JSONL file."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line), None
            except json.JSONDecodeError as e:
                yield n, None, f"not valid JSON ({e.msg} at column {e.colno})"


def load_samples(files: Sequence[str | Path], tokenizer, *, on_error: str = "raise", max_seq_len: int | None = None,
                 require_passed: bool = True, template_kwargs: dict | None = None,
                 vocab_size: int | None = None) -> tuple[list[EncodedRow], LoadReport]:
    """Every row of ``files`` as a training sample. ``on_error``: ``raise`` (`SFTDataError` at the first bad row)
    or ``skip`` (log a warning per row, with its reason). Rows with ``"passed": false`` (``distill --keep all``)
    are skipped with a logged reason when ``require_passed``."""
    report = LoadReport()
    out: list[EncodedRow] = []
    for row in _checked_rows(files, on_error, require_passed, report):   # row by row: the first bad row is named
        out += encode_samples([row], report, tokenizer, on_error=on_error, max_seq_len=max_seq_len,
                              template_kwargs=template_kwargs, vocab_size=vocab_size)
    return out, report


def _bad_row(report: LoadReport, on_error: str, where: str, reason: str) -> None:
    if on_error == "raise":
        raise SFTDataError(f"{where}: {reason}")
    log.warning("skip %s: %s", where, reason)
    report.skipped.append((where, reason))


def read_samples(files: Sequence[str | Path], *, on_error: str = "raise",
                 require_passed: bool = True) -> tuple[list[tuple[str, str, dict]], LoadReport]:
    """The first half of `load_samples`, which needs no tokenizer: every row read and checked, as
    ``(file, "file:line", row)``. A launcher calls it before it changes anything, so bad data stops a run first."""
    report = LoadReport()
    return list(_checked_rows(files, on_error, require_passed, report)), report


def _checked_rows(files: Sequence[str | Path], on_error: str, require_passed: bool,
                  report: LoadReport) -> Iterator[tuple[str, str, dict]]:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be raise or skip, got {on_error!r}")
    for file in files:
        path = Path(file)
        if not path.is_file():
            raise SFTDataError(f"{path}: SFT file not found")
        report.files[str(path)] = 0
        for line, row, error in read_rows(path):
            where = f"{path}:{line}"
            report.rows += 1
            reason = error
            if reason is None and not isinstance(row, dict):
                reason = f"a row must be a JSON object, got {type(row).__name__}"
            if reason is None and "messages" not in row:
                reason = "no 'messages' field"
            if reason is None:
                reason = check_messages(row["messages"])
            if reason is None and require_passed and row.get("passed") is False:
                # a filter, not a malformed row: always a logged skip
                log.warning("skip %s: its answer failed verification (distill --keep all; data.require_passed)",
                            where)
                report.skipped.append((where, "not passed: the answer failed verification"))
                continue
            if reason is not None:
                _bad_row(report, on_error, where, reason)
                continue
            yield str(path), where, row


def encode_samples(rows: Sequence[tuple[str, str, dict]], report: LoadReport, tokenizer, *, on_error: str = "raise",
                   max_seq_len: int | None = None, template_kwargs: dict | None = None,
                   vocab_size: int | None = None) -> list[EncodedRow]:
    """The second half of `load_samples`: `read_samples`' rows rendered and tokenized (``report`` updated)."""
    out: list[EncodedRow] = []
    for path, where, row in rows:
        try:
            sample = encode_messages(tokenizer, row["messages"], template_kwargs)
        except ValueError as e:
            _bad_row(report, on_error, where, f"chat template: {e}")
            continue
        reason = None
        if max_seq_len is not None and len(sample) > max_seq_len:
            reason = f"too long: {len(sample)} tokens > data.max_seq_len={max_seq_len}"
        elif vocab_size is not None and max(sample.tokens) >= vocab_size:
            reason = f"token id {max(sample.tokens)} is outside the model's vocabulary ({vocab_size})"
        if reason is not None:
            _bad_row(report, on_error, where, reason)
            continue
        out.append(EncodedRow(where, sample, row.get("sample_id")))
        report.files[path] = report.files.get(path, 0) + 1
        report.encoded += 1
    return out
