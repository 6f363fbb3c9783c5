"""Does an SFT model read the op from the task? A teacher-forced probe of an HF export (issue 17's diagnosis).

For every task of a task set (single unary ops and chains, as the CPU recipe generates them), the prompt the
evaluation uses (``--view full``) or a short one holding only the reference's ``forward`` (``--view forward``) is
followed by the compact teacher's (``data_synth.compact``) plan prefix up to ``1. x = torch``; the next token's probabilities over the
ops' tokens (``.relu``, ``.neg``, ... as the tokenizer splits them) are read. A model that reads the task puts its
mass on the task's first op; one that does not gives every prompt the same distribution. The JSON has the
per-task distributions, the argmax accuracy, and ``spread``: the largest change of any op's probability across
the tasks (0 means the prompt does not matter at all).

    python bench/recipe_probe.py --model runs/recipe_cpu/sft/hf --tasks runs/recipe_cpu/tasks/heldout
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_synth.compact import PLAN_HEADER  # noqa: E402
from data_synth.taskset import read_task_set  # noqa: E402
from megatron_rl.rollout.prompts import DEFAULT_SYSTEM_PROMPT, initial_messages  # noqa: E402

PLAN_PREFIX = PLAN_HEADER + "1. x = torch"


def forward_source(source: str) -> str:
    """The source of ``Model.forward`` (a helper module's own ``forward`` earlier in the file is not the task)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "Model":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "forward":
                    return ast.get_source_segment(source, item) or ""
    raise ValueError("the reference has no Model.forward()")


def messages(task, view: str) -> list[dict[str, str]]:
    if view == "full":
        return initial_messages(task, "cpu")
    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
            {"role": "user", "content": f"Reference (`Model`):\n```python\n{forward_source(task.source)}\n```"}]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory (an SFT or RFT export)")
    p.add_argument("--tasks", required=True, help="a task set written by data_synth (the recipe's tasks/heldout)")
    p.add_argument("--view", choices=("full", "forward"), default="full")
    p.add_argument("--ops", default=None, help="comma-separated ops to score (default: the tasks' first ops)")
    a = p.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    tasks = read_task_set(a.tasks)
    ops = a.ops.split(",") if a.ops else sorted({t.ops[0] for t in tasks if t.ops})
    first_ids = [tok.encode("." + o, add_special_tokens=False)[0] for o in ops]
    if len(set(first_ids)) != len(ops):
        raise SystemExit(f"the ops' first tokens collide under this tokenizer: {dict(zip(ops, first_ids))}")
    rows, hits = [], 0
    for t in tasks:
        if not t.ops or t.ops[0] not in ops:
            continue
        text = tok.apply_chat_template(messages(t, a.view), tokenize=False, add_generation_prompt=True)
        ids = tok(text + PLAN_PREFIX, return_tensors="pt").input_ids
        with torch.no_grad():
            probs = torch.softmax(model(ids).logits[0, -1, first_ids].float(), -1).tolist()
        hits += int(max(range(len(ops)), key=probs.__getitem__) == ops.index(t.ops[0]))
        rows.append({"task": t.task_id, "first_op": t.ops[0], "prompt_tokens": ids.shape[1],
                     "p": {o: round(v, 4) for o, v in zip(ops, probs)}})
    if not rows:
        raise SystemExit(f"no task in {a.tasks} starts with one of {ops}")
    spread = max(max(r["p"][o] for r in rows) - min(r["p"][o] for r in rows) for o in ops)
    out = {"bench": "recipe_probe", "model": a.model, "tasks": a.tasks, "view": a.view, "n": len(rows),
           "first_op_argmax_accuracy": hits / len(rows), "chance": 1 / len(ops), "spread": spread,
           "mean_p_first_op": sum(r["p"][r["first_op"]] for r in rows) / len(rows), "per_task": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
