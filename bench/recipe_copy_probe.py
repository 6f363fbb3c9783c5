"""Can the recipe's tiny Qwen3.5 hybrid learn to read the op from a task at all, given cheap steps? (issue 17)

The CPU recipe's SFT model writes well-formed answers with the wrong op: it never learns to copy the op from the
prompt (``bench/results/recipe_cpu.md``). This isolates the two things the recipe cannot afford, many optimizer
steps and many distinct tasks, from everything else. It uses the recipe's tiny model shape (3 Gated DeltaNet
layers + 1 gated attention, hidden 64, transformers' ``Qwen3_5ForCausalLM``), a character vocabulary (~60 tokens,
so a step costs ~0.2 s on one CPU thread instead of the 152k-token output layer's seconds), and a KernelBench-like
prompt: the reference's ``forward`` (1-3 unary ops nested around a random variable name), its input shape, then
``Plan:``. The target is the plan the compact teacher writes (``1. x = torch.relu(x)`` ...). The loss covers the
answer only. With ``--pool 0`` every row is a fresh random task; with ``--pool N`` the rows cycle N fixed tasks, as
the recipe's 56 do. Every ``--eval-every`` steps: the accuracy, on 48 held-out tasks, of picking the first op by
its teacher-forced mean character logprob after ``1. <var> = torch.`` (chance: 1/6).

    python bench/recipe_copy_probe.py [--steps 3000] [--budget-s 1200] [--pool 0] [--out FILE]
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import emit_json  # noqa: E402

OPS = ("relu", "tanh", "sigmoid", "neg", "square", "abs")
HELD_OUT_SEED, POOL_SEED = 10_000, 50_000


def make_task(r: random.Random) -> tuple[str, str, list[str]]:
    """(prompt, answer, ops) of one random task."""
    ops = [r.choice(OPS) for _ in range(r.choice([1, 1, 2, 3]))]
    var = r.choice(["x", "a", "inp", "t", "h"])
    expr = var
    for op in ops:
        expr = f"torch.{op}({expr})"
    shape = [r.choice([16, 32, 64, 128, 256, 1024]) for _ in range(r.choice([1, 2, 3]))]
    prompt = ("import torch\nimport torch.nn as nn\n\nclass Model(nn.Module):\n    def __init__(self):\n"
              f"        super().__init__()\n\n    def forward(self, {var}):\n        return {expr}\n\n"
              f"# {var}: tensor shape={shape} dtype=float32\nPlan:\n")
    answer = "".join(f"{i + 1}. {var} = torch.{op}({var})\n" for i, op in enumerate(ops)) + "<end>"
    return prompt, answer, ops


def tiny_model(vocab_size: int) -> Qwen3_5ForCausalLM:
    """The recipe's tiny hybrid (configs/sft_tiny.yaml's widths) with a small vocabulary."""
    cfg = Qwen3_5TextConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=True,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, layer_types=["linear_attention"] * 3 + ["full_attention"],
                            max_position_embeddings=1024)
    return Qwen3_5ForCausalLM(cfg)


@torch.no_grad()
def first_op_accuracy(model, encode, held) -> float:
    model.eval()
    correct = 0
    for prompt, answer, ops in held:
        var = answer.split(" = ")[0].split(". ")[1]
        prefix = encode(prompt + f"1. {var} = torch.")

        def score(op: str) -> float:
            ids = torch.tensor([prefix + encode(op)])
            lp = torch.log_softmax(model(ids).logits[0, len(prefix) - 1:-1], dim=-1)
            return sum(lp[i, t].item() for i, t in enumerate(encode(op))) / len(op)

        correct += max(OPS, key=score) == ops[0]
    model.train()
    return correct / len(held)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--budget-s", type=float, default=1200.0, help="stop after this many seconds of training")
    p.add_argument("--pool", type=int, default=0, help="0: a fresh task per row; N: cycle N fixed tasks")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--eval-every", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.steps < 1 or args.pool < 0 or args.batch < 1:
        p.error("--steps and --batch must be positive, --pool non-negative")

    chars = sorted(set("".join(pr + a for pr, a, _ in (make_task(random.Random(i)) for i in range(2000)))))
    stoi = {c: i for i, c in enumerate(chars)}

    def encode(s: str) -> list[int]:
        return [stoi[c] for c in s]

    torch.manual_seed(0)
    rng = random.Random(0)
    model = tiny_model(len(chars))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(   # 20 warm-up steps, cosine to a tenth
        opt, lambda s: min(1.0, (s + 1) / 20)
        * max(0.1, 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    held = [make_task(random.Random(HELD_OUT_SEED + i)) for i in range(48)]
    pool = [make_task(random.Random(POOL_SEED + i)) for i in range(args.pool)]
    log, t0 = [], time.time()
    for step in range(args.steps):
        batch = [rng.choice(pool) if pool else make_task(rng) for _ in range(args.batch)]
        seqs = [encode(pr + a) for pr, a, _ in batch]
        ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        labels = torch.full(ids.shape, -100)
        for i, ((pr, _, _), s) in enumerate(zip(batch, seqs)):
            ids[i, :len(s)] = torch.tensor(s)
            labels[i, len(pr):len(s)] = torch.tensor(s[len(pr):])
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        last = step == args.steps - 1 or time.time() - t0 > args.budget_s
        if step % args.eval_every == 0 or last:
            log.append({"step": step, "loss": round(loss.item(), 4), "held_out_first_op_accuracy":
                        first_op_accuracy(model, encode, held), "seconds": round(time.time() - t0, 1)})
            print(log[-1], file=sys.stderr, flush=True)
        if last:
            break
    emit_json({"pool": args.pool, "batch": args.batch, "lr": args.lr, "vocab": len(chars), "chance": 1 / len(OPS),
               "torch": torch.__version__, "log": log}, args.out, indent=1)


if __name__ == "__main__":
    main()
