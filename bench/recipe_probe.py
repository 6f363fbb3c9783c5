"""Does an SFT model read the op from the task? A teacher-forced probe of an HF export (issue 17's diagnosis).

For every task of a task set (single unary ops and chains, as the CPU recipe generates them), the prompt the
evaluation uses (``--view full``) or a short one holding only the reference's ``forward`` (``--view forward``) is
followed by the compact teacher's (``data_synth.compact``) plan header, then each candidate op's plan line
(``1. x = torch.<op>(x) -> ext1``) is scored by its teacher-forced log-probability (summed over its tokens, so any
tokenizer works: Qwen3's, or the recipe's own BPE whose line may be one token). The candidates' softmax is the
model's distribution over the first op. Later lines of a chain are scored the same way after the correct earlier
lines (``line_accuracy``). A model that reads the task puts its mass on the task's op; one that does not gives
every prompt the same distribution. The JSON has the per-task distributions, the argmax accuracy, and ``spread``:
the largest change of any op's probability across the tasks (0 means the prompt does not matter at all).

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
from data_synth.compact import PLAN_HEADER, forward_lines  # noqa: E402
from data_synth.taskset import read_task_set  # noqa: E402
from megatron_rl.rollout.prompts import DEFAULT_SYSTEM_PROMPT, initial_messages  # noqa: E402


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
    ops = a.ops.split(",") if a.ops else sorted({o for t in tasks for o in t.ops})

    def plan_line(k: int, line: str, true_op: str, op: str, earlier: list[str]) -> str:
        distinct = list(dict.fromkeys(earlier + [op]))
        return f"{k}. {line.replace(f'torch.{true_op}(', f'torch.{op}(')} -> ext{distinct.index(op) + 1}\n"

    @torch.no_grad()
    def distribution(prefix: str, continuations: list[str]) -> list[float]:
        """Softmax over the continuations' summed token log-probabilities after ``prefix``."""
        head = tok(prefix, add_special_tokens=False, return_tensors="pt").input_ids[0]
        n = len(head)
        scores = []
        for c in continuations:
            ids = tok(prefix + c, add_special_tokens=False, return_tensors="pt").input_ids
            if not torch.equal(ids[0, :n], head):
                raise SystemExit("the tokenizer merges the prompt with the plan line: cannot score lines apart")
            logp = torch.log_softmax(model(ids).logits[0, n - 1:-1].float(), -1)
            scores.append(logp.gather(1, ids[0, n:, None]).sum().item())
        return torch.softmax(torch.tensor(scores), 0).tolist()

    rows, hits, line_hits, lines = [], 0, 0, 0
    for t in tasks:
        fwd = forward_lines(t.source)
        if not t.ops or any(o not in ops for o in t.ops) or len(fwd) != len(t.ops):
            continue
        prompt = tok.apply_chat_template(messages(t, a.view), tokenize=False, add_generation_prompt=True)
        prefix, per_line = prompt + PLAN_HEADER, []
        for k, (line, true_op) in enumerate(zip(fwd, t.ops), 1):
            earlier = list(t.ops[:k - 1])
            probs = distribution(prefix, [plan_line(k, line, true_op, o, earlier) for o in ops])
            hit = int(max(range(len(ops)), key=probs.__getitem__) == ops.index(true_op))
            line_hits, lines = line_hits + hit, lines + 1
            if k == 1:
                hits += hit
            per_line.append({o: round(v, 4) for o, v in zip(ops, probs)})
            prefix += plan_line(k, line, true_op, true_op, earlier)
        rows.append({"task": t.task_id, "ops": list(t.ops), "prompt_tokens": len(tok(prompt).input_ids),
                     "p": per_line[0], "p_lines": per_line})
    if not rows:
        raise SystemExit(f"no task in {a.tasks} starts with one of {ops}")
    spread = max(max(r["p"][o] for r in rows) - min(r["p"][o] for r in rows) for o in ops)
    out = {"bench": "recipe_probe", "model": a.model, "tasks": a.tasks, "view": a.view, "n": len(rows),
           "first_op_argmax_accuracy": hits / len(rows), "line_accuracy": line_hits / lines, "chance": 1 / len(ops),
           "spread": spread, "mean_p_first_op": sum(r["p"][r["ops"][0]] for r in rows) / len(rows),
           "per_task": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
