"""Prompt variants: a verified answer shown again under other tasks that take the very same answer.

A tiny model fine-tuned on one prompt per answer learns which prompt goes with which answer by whatever tells the
prompts apart (their shapes, their names) and never learns to read the op from the reference: on the CPU recipe's
112 teacher rows it memorised them and guessed on held-out tasks. Shown each answer under several tasks of the same
op sequence at other shapes, it has to read the op, and does (bench/results/recipe_cpu.md, session 32).

A variant row repeats, word for word, the final answer of a row the verifier passed, and only where the teacher
writes exactly that answer for the variant's task too (``answer_for``: the compact teacher's answers depend on the
op sequence alone, since their loops run over ``numel`` of contiguous inputs). The row is not verified again: it
says which row's verdict it stands on (``verified_on``), and its ``source`` says it is a variant.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterable, Sequence

from megatron_rl.rollout.prompts import DEFAULT_SYSTEM_PROMPT, initial_messages

from .distill import ROW_FORMAT, sft_messages
from .generate import GeneratedTask
from .taskset import verifier_task

VARIANT_SOURCE = "prompt_variant"


def final_answer(row: dict[str, Any]) -> str:
    """The last assistant message of an SFT row (the turn that carries loss)."""
    answers = [m["content"] for m in row.get("messages") or [] if m.get("role") == "assistant"]
    if not answers:
        raise ValueError(f"SFT row {row.get('sample_id') or row.get('task_id')!r} has no assistant message")
    return answers[-1]


def variant_rows(rows: Iterable[dict[str, Any]], variants: Sequence[GeneratedTask],
                 answer_for: Callable[[GeneratedTask], str | None], backend: str,
                 system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """SFT rows for ``variants`` (the prompt each would get, the answer of a passed single-turn row that
    ``answer_for`` writes for it too) and the count of variants skipped, by reason."""
    verified: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row.get("passed") and row.get("turns", 1) == 1 and row.get("source") != VARIANT_SOURCE:
            verified.setdefault(final_answer(row), row)
    out: list[dict[str, Any]] = []
    skipped: Counter[str] = Counter()
    for task in variants:
        answer = answer_for(task)
        if answer is None:
            skipped["the teacher has no answer for it"] += 1
            continue
        row = verified.get(answer)
        if row is None:
            skipped["no passed row has the answer the teacher writes for it"] += 1
            continue
        prompt = initial_messages(verifier_task(task), backend, system_prompt)
        out.append({"format": ROW_FORMAT, "task_id": task.task_id, "sample_id": f"{task.task_id}#variant",
                    "messages": sft_messages(prompt, [(answer, None)]), "passed": True,
                    "verified_on": row["sample_id"], "turns": 1, "source": VARIANT_SOURCE, "backend": backend,
                    "stage": task.stage, "families": task.families, "ops": task.ops, "level": task.stage})
    return out, dict(skipped)
