"""Multi-GPU actor benchmark: training throughput, MFU and peak memory at any (TP, PP, DP), plus an
optional colocated weight sync into the embedded engine on the same GPUs.

    torchrun --nproc-per-node 4 bench/actor_scale.py --shape 32b --tp 4 --layers 16 --sync
    torchrun --nproc-per-node 8 bench/actor_scale.py --shape 32b --tp 4 --pp 2 --layers 32
    sbatch -N 2 launch/slurm_bench_actor.sbatch --shape 32b --tp 8 --pp 2 --layers 64
    torchrun --nproc-per-node 2 bench/actor_scale.py --shape tiny --tp 2     # CPU (gloo) smoke run

Random weights and tokens, SFT loss, Megatron DDP + distributed Adam, bf16 on GPU (fp32 on CPU).
FLOPs per step count model matmuls only (recomputation excluded), as in bench/actor_mfu.py:
6*N*tokens + 6*L*s^2*n_heads*head_dim per sequence; MFU is against the measured 790 TFLOP/s per GPU.
With --sync, global rank 0 starts the embedded engine (random weights of the same shape) on its GPU
and the group pushes the trained weights into it (CUDA IPC), reporting seconds and GB/s per phase.
Prints one JSON object on rank 0 (and writes --out). Runs without Ray.
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

from bench.common import PEAK_TFLOPS, QWEN3_SHAPES, emit_json, model_flops  # noqa: E402

SHAPES = {"32b": QWEN3_SHAPES["32b"], "8b": QWEN3_SHAPES["8b"],  # untied embeddings
          "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=250)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="32b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=None, help="sequences per step (default: 2 per DP rank)")
    ap.add_argument("--max-tokens-per-gpu", type=int, default=None, help="micro-batch budget (default: --seq)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--recompute", choices=["none", "selective", "full"], default="selective")
    ap.add_argument("--sync", action="store_true", help="also time a colocated weight sync into the embedded engine")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import Qwen3Config

    from megatron_rl.actor.actor import ActorConfig, MegatronActor
    from megatron_rl.actor.losses import SFTLoss
    from megatron_rl.parallel import init_parallel
    from megatron_rl.types import TrainSample

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        from megatron_rl.parallel import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    gpu = torch.cuda.is_available()
    info = init_parallel(args.tp, args.pp)
    shape = dict(SHAPES[args.shape])
    layers = args.layers or shape["num_hidden_layers"]
    shape["num_hidden_layers"] = layers
    hf = Qwen3Config(**shape, tie_word_embeddings=False, max_position_embeddings=max(args.seq, 4096),
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6)
    n_seqs = args.seqs or 2 * info.dp
    cfg = ActorConfig(tp=args.tp, pp=args.pp, params_dtype="bfloat16" if gpu else "float32", lr=1e-5,
                      max_tokens_per_gpu=args.max_tokens_per_gpu or args.seq, clip_grad=1.0,
                      recompute_granularity=None if args.recompute == "none" else args.recompute)
    actor = MegatronActor(cfg, hf)
    g = torch.Generator().manual_seed(1234)
    samples = [TrainSample(tokens=torch.randint(0, shape["vocab_size"], (args.seq,), generator=g).tolist(),
                           loss_mask=[0] + [1] * (args.seq - 1), fields={}) for _ in range(n_seqs)]
    loss = SFTLoss()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.steps):
        if gpu:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        m = actor.train_step(samples, loss)
        if gpu:
            torch.cuda.synchronize()
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0
    peaks = [None] * info.world_size
    dist.all_gather_object(peaks, round(peak, 2))
    tokens = args.seq * n_seqs
    flops = model_flops(hf, [args.seq] * n_seqs)
    result = {
        "bench": "actor_scale", "shape": args.shape, "layers": layers, "tp": args.tp, "pp": args.pp, "dp": info.dp,
        "world_size": info.world_size, "seq": args.seq, "seqs_per_step": n_seqs, "recompute": args.recompute,
        "step_seconds_median": step_s, "step_seconds": times, "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_gpu": tokens / step_s / info.world_size,
        "tflops_per_gpu": flops / step_s / info.world_size / 1e12,
        "mfu": flops / step_s / info.world_size / 1e12 / PEAK_TFLOPS if gpu else None,
        "peak_memory_gib_per_rank": peaks, "last_loss": m.get("loss"),
        "device": torch.cuda.get_device_name() if gpu else platform.processor() or "cpu",
        "torch": torch.__version__, "command": " ".join(sys.argv),
    }
    if args.sync:
        result["sync"] = colocated_sync(actor, hf, gpu)
    if info.rank == 0:
        emit_json(result, args.out, indent=2)
    dist.barrier()
    return 0


def colocated_sync(actor, hf, gpu: bool) -> dict:
    """Start the embedded engine on rank 0's device and push the actor's weights into it (twice)."""
    import torch
    import torch.distributed as dist

    from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.embedded_server import EmbeddedServer, load_model
    from megatron_rl.rollout.engine import EngineManager, HttpEngine
    from megatron_rl.sync.weight_sync import WeightSync, WeightSyncConfig

    manager = None
    if dist.get_rank() == 0:
        device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
        model, _ = load_model(None, hf_config=hf.to_dict(), device=device,
                              dtype=torch.bfloat16 if gpu else torch.float32)
        url = EmbeddedServer(EmbeddedEngine(model, EmbeddedEngineConfig())).start_in_thread()
        manager = EngineManager([HttpEngine(url, name="embedded-0")])
    sync = WeightSync.for_actor(actor, manager, WeightSyncConfig(transport="colocated"))
    reports = [sync.sync(v).to_json() for v in (1, 2)]
    sync.close()
    return {"runs": reports, "seconds_best": min(r["seconds"] for r in reports),
            "gbps_best": max(r["gbps"] for r in reports)}


if __name__ == "__main__":
    sys.exit(main())
