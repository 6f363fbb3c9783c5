"""Two per-step hot paths of the single-machine loop, each timed side by side with the code it replaced.

    python bench/cpu_hotpaths.py [--out bench/results/cpu_hotpaths.json]

1. The embedded engine's sampling step (batch 16, Qwen3's 151,936-token vocabulary, temperature 1,
   no top-k/top-p): the previous method (sort the vocabulary for the filters, then one
   ``torch.multinomial`` per row) against the current one (``megatron_rl.rollout.sampling.sample``:
   no sort when nothing filters, one batched inverse-CDF draw), plus the filtered (top-p 0.95) path.
2. The trainer's old-logprob pass: ``MegatronActor.compute_logprobs`` over every token against
   ``trained_only=True`` (what the driver uses), on a quickstart-shaped batch (tiny Qwen3 with the
   real vocabulary, 8 samples of a 1,536-token prompt and a 48-token response).

Runs on the CPU (one rank, gloo; no Ray). Prints one JSON object (and writes --out).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import QWEN3_SHAPES, emit_json  # noqa: E402

VOCAB = QWEN3_SHAPES["8b"]["vocab_size"]  # Qwen3's vocabulary


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def sampler(batch: int, repeats: int) -> dict:
    import torch

    from megatron_rl.rollout.sampling import RequestSampling, filtered_probs, request_uniforms, rollout_logprobs, \
        sample

    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(0))
    plain = [RequestSampling.from_sglang({"temperature": 1.0})] * batch
    nucleus = [RequestSampling.from_sglang({"temperature": 1.0, "top_p": 0.95})] * batch
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]

    def previous():  # filters through a full sort, then one multinomial per row
        lp = rollout_logprobs(logits, torch.ones(batch))
        w = filtered_probs(lp, torch.full((batch,), -1), torch.ones(batch), torch.zeros(batch))
        tokens = torch.stack([torch.multinomial(w[i], 1, generator=gens[i])[0] for i in range(batch)])
        return lp.gather(-1, tokens.unsqueeze(-1))

    prev = _time(previous, repeats)
    uniforms = lambda: request_uniforms(torch.arange(batch), torch.zeros(batch, dtype=torch.long))  # noqa: E731
    now = _time(lambda: sample(logits, plain, uniforms()), repeats)
    filt = _time(lambda: sample(logits, nucleus, uniforms()), repeats)
    return {"batch": batch, "vocab": VOCAB, "previous_ms": round(prev, 2), "current_ms": round(now, 2),
            "speedup": round(prev / now, 2), "current_top_p_0.95_ms": round(filt, 2)}


def old_logprobs(repeats: int) -> dict:
    import torch
    from transformers import Qwen3Config

    from megatron_rl.actor import ActorConfig, MegatronActor
    from megatron_rl.parallel import free_port, init_parallel
    from megatron_rl.types import TrainSample

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    init_parallel(1, 1)
    hf = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                     max_position_embeddings=4096)
    actor = MegatronActor(ActorConfig(params_dtype="float32", max_tokens_per_gpu=8192), hf)
    g = torch.Generator().manual_seed(0)
    prompt, response = 1536, 48
    samples = [TrainSample(torch.randint(0, VOCAB, (prompt + response,), generator=g).tolist(),
                           [0] * prompt + [1] * response) for _ in range(8)]
    every = _time(lambda: actor.compute_logprobs(samples), repeats)
    trained = _time(lambda: actor.compute_logprobs(samples, trained_only=True), repeats)
    return {"samples": len(samples), "prompt_tokens": prompt, "response_tokens": response,
            "all_tokens_ms": round(every, 1), "trained_only_ms": round(trained, 1),
            "speedup": round(every / trained, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = {"bench": "cpu_hotpaths", "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}", "torch": torch.__version__,
              "sampler": sampler(16, args.repeats), "old_logprobs": old_logprobs(args.repeats),
              "command": " ".join(sys.argv)}
    emit_json(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
