"""Weight-sync benchmark: an 8B-shaped Qwen3 (random bf16 weights, ~16 GB), or the Qwen3.5-9B hybrid
(~18 GB), from Megatron into the embedded engine.

    python bench/sync_8b.py [--mode colocated|distributed|both] [--shape 8b|9b_hybrid|1b|tiny|tiny_hybrid]
                            [--bucket-mb 512]

colocated: trainer and engine share GPU 0; buckets travel as CUDA IPC handles.
distributed: engine on GPU 1; buckets are NCCL broadcasts over a stateless group (skipped with < 2 GPUs).
Prints one JSON object: per mode, every repeat's total seconds, GB/s and phases (gather = bridge export
with TP/PP gathers and HF layout, convert = flattening into per-dtype buckets, copy = transport +
engine staging + commit, control = pause/flush/continue). Goals: <= 1.0 s colocated for 8b, <= 0.5 s for
the 9B hybrid (issue 15).
Runs as a plain process (no Ray, no SGLang). Needs megatron-core and CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import QWEN3_5_SHAPES, QWEN3_SHAPES, emit_json  # noqa: E402

SHAPES = {"8b": QWEN3_SHAPES["8b"], "1b": QWEN3_SHAPES["1b"], "9b_hybrid": QWEN3_5_SHAPES["9b"],
          "tiny": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64),
          "tiny_hybrid": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)}


def hf_config_dict(shape: str) -> dict:
    hybrid = "linear_num_key_heads" in SHAPES[shape]
    extra = dict(rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}) \
        if hybrid else {}
    return dict(model_type="qwen3_5_text" if hybrid else "qwen3", max_position_embeddings=4096, rms_norm_eps=1e-6,
                tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                **SHAPES[shape], **extra)


def build_megatron(cfg_dict: dict):
    import torch
    from transformers import AutoConfig

    from megatron_rl.models import BuildOptions, ParallelSizes, build_model
    from megatron_rl.parallel import free_port, init_parallel

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    init_parallel(1, 1)
    d = dict(cfg_dict)
    hf_config = AutoConfig.for_model(d.pop("model_type"), **d)
    chunks = build_model(hf_config, ParallelSizes(1, 1), BuildOptions(params_dtype=torch.bfloat16, use_te=False))
    return hf_config, chunks


def start_engine(cfg_dict: dict, device: str, log_dir: str):
    from megatron_rl.rollout.sglang_engine import SGLangServerConfig, ServerProcess

    # The embedded engine with a random init of the same shape (--hf-config instead of --model-path).
    return ServerProcess(SGLangServerConfig(
        model_path=None, launch_module="megatron_rl.rollout.embedded_server", log_dir=log_dir,
        watchdog_interval_s=None, health_poll_s=0.5, startup_timeout_s=600,
        server_args={"device": device, "dtype": "bfloat16", "hf_config": json.dumps(cfg_dict)}))


def run_mode(mode: str, hf_config, chunks, cfg_dict: dict, args) -> dict:
    import torch

    from megatron_rl.bridge import get_bridge
    from megatron_rl.rollout.engine import EngineManager, HttpEngine
    from megatron_rl.sync.weight_sync import WeightSync, WeightSyncConfig

    if args.cpu:
        engine_device = "cpu"
    else:
        engine_device = "cuda:0" if mode == "colocated" else "cuda:1"
    server = start_engine(cfg_dict, engine_device, args.log_dir)
    t = time.perf_counter()
    url = server.start()
    engine_start_s = time.perf_counter() - t
    bridge = get_bridge(hf_config)
    manager = EngineManager([HttpEngine(url, name=f"embedded@{engine_device}")])
    cfg = WeightSyncConfig(transport=mode, bucket_bytes=args.bucket_mb * 1024 * 1024,
                           backend="gloo" if args.cpu else "nccl")
    sync = WeightSync(lambda dtype: bridge.export_hf(chunks, dtype=dtype), manager, cfg,
                      device=torch.device("cpu") if args.cpu else torch.device("cuda", 0))
    runs = []
    try:
        for i in range(args.repeats):
            if not args.cpu:
                torch.cuda.synchronize()
            report = sync.sync()
            runs.append(report.to_json())
            print(f"[{mode}] repeat {i}: {report.seconds:.3f}s {report.gbps:.1f} GB/s "
                  f"(gather {report.gather_s:.3f} convert {report.bucket_s:.3f} copy {report.send_s:.3f} "
                  f"control {report.control_s:.3f})", file=sys.stderr, flush=True)
    finally:
        sync.close()
        server.stop()
    steady = runs[1:] or runs
    return {
        "engine_device": engine_device, "engine_start_s": round(engine_start_s, 2),
        "bytes": runs[-1]["bytes"], "num_tensors": runs[-1]["num_tensors"], "num_buckets": runs[-1]["num_buckets"],
        "total_s_median": round(statistics.median(r["seconds"] for r in steady), 4),
        "total_s_min": round(min(r["seconds"] for r in steady), 4),
        "gbps_median": round(statistics.median(r["gbps"] for r in steady), 2),
        "phases_median_s": {k: round(statistics.median(r[f"{k}_s"] for r in steady), 4)
                            for k in ("gather", "bucket", "send", "control")},
        "phase_names": {"gather": "gather", "bucket": "convert", "send": "copy", "control": "pause/flush/continue"},
        "first_run_s": round(runs[0]["seconds"], 4),
        "runs": runs,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["colocated", "distributed", "both"], default="both")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--log-dir", default="/tmp/sync_bench_logs")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--cpu", action="store_true", help="smoke-run the same code on CPU (gloo, shared memory)")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.cpu:
        print(json.dumps({"error": "needs CUDA (or --cpu for a smoke run)"}))
        return 2
    os.makedirs(args.log_dir, exist_ok=True)
    cfg_dict = hf_config_dict(args.shape)
    t = time.perf_counter()
    hf_config, chunks = build_megatron(cfg_dict)
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    result = {"bench": "sync_8b", "shape": args.shape, "params": n_params, "bucket_mb": args.bucket_mb,
              "gpu": "cpu" if args.cpu else torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
              "megatron_build_s": round(time.perf_counter() - t, 2), "torch": torch.__version__}
    modes = ["colocated", "distributed"] if args.mode == "both" else [args.mode]
    for mode in modes:
        if mode == "distributed" and torch.cuda.device_count() < 2 and not args.cpu:
            result[mode] = {"skipped": "needs 2 GPUs"}
            continue
        result[mode] = run_mode(mode, hf_config, chunks, cfg_dict, args)
    if "runs" in result.get("colocated", {}):
        result["colocated_goal_met"] = result["colocated"]["total_s_median"] <= 1.0
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
