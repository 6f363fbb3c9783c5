"""`MegatronActor.compute_logprobs` throughput on one GPU (Qwen3-8B-shaped layers, bf16).

    python bench/logprobs_throughput.py [--layers 12] [--seq 4096] [--seqs 16] [--repeats 2]
                                        [--out bench/results/logprobs_throughput.json]

Forward-only through megatron's pipeline schedule with packed micro-batches and chunked
vocab-parallel logprobs; sweeps the per-micro-batch token budget, the logprob chunk size and
entropy on/off in one process (one model build). Prints one JSON object (and writes it to --out).
Forward FLOPs counted: 2 * N * tokens + 2 * L * s^2 * n_heads * head_dim per sequence (causal),
N as in bench/actor_mfu.py. Plain process, no Ray.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.actor_mfu import init_single_rank, qwen3_8b_config, random_samples  # noqa: E402
from bench.common import PEAK_TFLOPS, emit_json, model_flops  # noqa: E402

SWEEP = [  # (micro-batch budget in sequences, logprob chunk size, entropy)
    (1, 4096, False),
    (2, 4096, False),
    (4, 4096, False),
    (4, 1024, False),
    (4, 8192, False),
    (4, 4096, True),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--attention-backend", default="sdpa")
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test of the script)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "logprobs_throughput.json"))
    args = ap.parse_args()

    import torch

    from megatron_rl.actor import ActorConfig, MegatronActor

    init_single_rank()
    hf = qwen3_8b_config(args.layers, tiny=args.tiny)
    cuda = torch.cuda.is_available()
    actor = MegatronActor(ActorConfig(params_dtype="bfloat16", attention_backend=args.attention_backend,
                                      max_tokens_per_gpu=args.seq), hf)
    samples = random_samples(args.seqs, args.seq, hf.vocab_size)
    flops = model_flops(hf, [args.seq] * args.seqs, passes=1.0)
    report = {
        "model": f"Qwen3-8B-shaped, {args.layers} layers, bf16, attention {actor.attention_backend}",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "seq": args.seq, "seqs": args.seqs, "peak_tflops": PEAK_TFLOPS,
        "flops_formula": "2*N*tokens + 2*L*s^2*n_heads*head_dim per sequence (forward only, causal)",
        "runs": [],
    }
    for per_mb, chunk, entropy in SWEEP:
        actor.cfg.max_tokens_per_gpu = per_mb * args.seq
        actor.cfg.logprob_chunk_size = chunk
        try:
            actor.compute_logprobs(samples[: max(per_mb, 1)], with_entropy=entropy)  # warm-up
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(args.repeats):
                out = actor.compute_logprobs(samples, with_entropy=entropy)
            if cuda:
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / args.repeats
            lps = out[0] if entropy else out
            assert all(torch.isfinite(lp).all() for lp in lps)
            tflops = flops / dt / 1e12
            run = {"seqs_per_micro_batch": per_mb, "chunk": chunk, "entropy": entropy, "ok": True,
                   "seconds": round(dt, 3), "tokens_per_s": round(args.seqs * args.seq / dt, 1),
                   "tflops": round(tflops, 1), "mfu": round(tflops / PEAK_TFLOPS, 4),
                   "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None}
        except torch.OutOfMemoryError:
            run = {"seqs_per_micro_batch": per_mb, "chunk": chunk, "entropy": entropy, "ok": False,
                   "error": "out of memory"}
            torch.cuda.empty_cache()
        report["runs"].append(run)
        print(json.dumps(run), file=sys.stderr, flush=True)
    ok = [r for r in report["runs"] if r["ok"]]
    if ok:
        report["best_tokens_per_s"] = max(r["tokens_per_s"] for r in ok)
    emit_json(report, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
