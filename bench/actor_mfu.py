"""Training throughput / MFU of the Megatron actor on one GPU (Qwen3-8B-shaped layers, bf16).

    python bench/actor_mfu.py [--layers 12] [--seq 4096] [--seqs 8] [--steps 2] [--only NAME,...]
                              [--profile NAME,...] [--max-fit-layers 26,22] [--out bench/results/actor_mfu.json]
    python bench/actor_mfu.py --hybrid-vs-dense [--layers 8] [--seq 8192] [--seqs 4] [--profile hybrid]

``--hybrid-vs-dense`` runs the dense sweep's best options on Qwen3-8B-shaped layers and on Qwen3.5-9B-shaped
hybrid layers (3 Gated DeltaNet : 1 gated attention, fla's kernels) side by side, and reports the hybrid's
MFU as a fraction of the dense one (issue goal: >= 0.85).

Each configuration of the sweep runs `MegatronActor.train_step` (SFT loss, distributed Adam,
random weights and tokens) in a fresh process, so an out-of-memory configuration cannot disturb
the next one. Prints one JSON object (and writes it to --out).

FLOPs per step (model FLOPs; recomputation is not counted):
    6 * N * tokens + sum_over_sequences 6 * L * s^2 * n_heads * head_dim
with N = L * (h*(n_heads + 2*n_kv)*head_dim + n_heads*head_dim*h + 3*h*ffn) + V*h (decoder
matmuls + output projection; the embedding lookup does no matmul) and the attention term for
causal attention (QK^T and PV: 2*s^2*n_heads*head_dim forward, x3 with backward).
MFU = achieved TFLOP/s / 790 (the bf16 matmul rate measured on this H200).
Runs as plain processes (no Ray); each child initialises a 1-rank process group itself.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import (PEAK_TFLOPS, QWEN3_5_SHAPES, QWEN3_SHAPES, emit_json,  # noqa: E402
                          gpu_kernel_breakdown, matmul_params, model_flops)

# name -> overrides of the base configuration (see `base_case`)
SWEEP = {
    "sdpa_mb1": {},
    "local_attention_mb1": {"attention_backend": "local"},
    "sdpa_pack2": {"max_tokens_per_gpu": 2},            # in units of --seq: 2 sequences per micro-batch
    "sdpa_pack4": {"max_tokens_per_gpu": 4},
    "sdpa_recompute_selective": {"recompute_granularity": "selective"},
    "sdpa_recompute_full": {"recompute_granularity": "full"},
    "sdpa_bias_swiglu_fusion": {"megatron": {"bias_activation_fusion": True}},
    "sdpa_bias_swiglu_fusion_stock_rope": {"megatron": {"bias_activation_fusion": True}, "stock_thd_rope": True},
    "sdpa_bf16_grads": {"grad_reduce_in_fp32": False},
    "sdpa_pack2_bf16_grads": {"max_tokens_per_gpu": 2, "grad_reduce_in_fp32": False},
    "sdpa_keep_output_chunks": {"recompute_logprob_chunks": False},   # no output-layer recompute in backward
    "sdpa_fused_swiglu_keep_output_chunks": {"recompute_logprob_chunks": False,
                                             "megatron": {"bias_activation_fusion": True}},
    # the wgrad GEMM accumulates into the fp32 main_grad (megatron_rl/parallel/wgrad_fusion.py without apex)
    "sdpa_fused_swiglu_keep_output_chunks_wgrad_fusion": {
        "recompute_logprob_chunks": False,
        "megatron": {"bias_activation_fusion": True, "gradient_accumulation_fusion": True}},
    # megatron's torch-Adam fallback as it comes (multi-tensor foreach) instead of torch's fused kernel
    "sdpa_fused_swiglu_keep_output_chunks_foreach_adam": {
        "recompute_logprob_chunks": False, "fused_adam": False, "megatron": {"bias_activation_fusion": True}},
    # 16 sequences per optimizer step: the optimizer's fixed cost per step is spread over twice the tokens
    "sdpa_fused_swiglu_seqs16": {"seqs": 16, "megatron": {"bias_activation_fusion": True}},
    "sdpa_combined": {"max_tokens_per_gpu": 2, "grad_reduce_in_fp32": False, "recompute_logprob_chunks": False,
                      "megatron": {"bias_activation_fusion": True}},
}
# Fusions that need a kernel library the GPU machine lacks; probed without starting a child.
NEEDS = {
    "apply_rope_fusion": ("transformer_engine", "TransformerEngine >= 1.4"),
    "masked_softmax_fusion": ("scaled_upper_triang_masked_softmax_cuda", "megatron fused softmax extension"),
}


def qwen3_8b_config(layers: int, tiny: bool = False):
    from transformers import Qwen3Config

    if tiny:  # CPU smoke test of this script
        return Qwen3Config(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                           max_position_embeddings=8192, rms_norm_eps=1e-6)
    return Qwen3Config(**{**QWEN3_SHAPES["8b"], "num_hidden_layers": layers}, tie_word_embeddings=False,
                       max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       rms_norm_eps=1e-6)


def qwen3_5_9b_config(layers: int, tiny: bool = False):
    """Qwen3.5-9B-shaped hybrid layers (every 4th one gated attention, as the real model)."""
    from transformers import Qwen3_5TextConfig

    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
    if tiny:
        return Qwen3_5TextConfig(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                 tie_word_embeddings=False, max_position_embeddings=16384, rope_parameters=rope)
    return Qwen3_5TextConfig(**{**QWEN3_5_SHAPES["9b"], "num_hidden_layers": layers}, tie_word_embeddings=False,
                             max_position_embeddings=262144, rope_parameters=rope, rms_norm_eps=1e-6)


def model_config(case: dict):
    if case.get("arch", "qwen3") == "qwen3_5":
        return qwen3_5_9b_config(case["layers"], tiny=case.get("tiny", False))
    return qwen3_8b_config(case["layers"], tiny=case.get("tiny", False))


# the dense sweep's best configuration (bench/results/actor_h200.md, 55.9 % MFU): what both sides run
BEST_DENSE = {"recompute_logprob_chunks": False,
              "megatron": {"bias_activation_fusion": True, "gradient_accumulation_fusion": True}}


def random_samples(n: int, seq: int, vocab: int, seed: int = 0):
    import torch

    from megatron_rl.types import TrainSample

    g = torch.Generator().manual_seed(seed)
    return [TrainSample(torch.randint(0, vocab, (seq,), generator=g).tolist(), [0] + [1] * (seq - 1))
            for _ in range(n)]


def init_single_rank():
    from megatron_rl.parallel import free_port, init_parallel

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init_parallel(1, 1)


def build_actor(case: dict, hf):
    from megatron_rl.actor import ActorConfig, MegatronActor

    keys = {"attention_backend", "max_tokens_per_gpu", "recompute_granularity", "megatron",
            "grad_reduce_in_fp32", "logprob_chunk_size", "recompute_logprob_chunks", "fused_adam"}
    kwargs = {k: v for k, v in case.items() if k in keys}
    kwargs["max_tokens_per_gpu"] = case.get("max_tokens_per_gpu", 1) * case["seq"]
    cfg = ActorConfig(params_dtype="bfloat16", lr=1e-5, clip_grad=1.0, **kwargs)
    return MegatronActor(cfg, hf)


def run_case(case: dict) -> dict:
    """Child process: build the actor, time train steps, return the measurements."""
    import torch

    from megatron_rl.actor import SFTLoss

    init_single_rank()
    hf = model_config(case)
    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    actor = build_actor(case, hf)
    build_s = time.perf_counter() - t0
    if case.get("stock_thd_rope"):   # megatron's own packed RoPE (host syncs every layer), for comparison
        from megatron_rl.actor.attention import uninstall_sync_free_thd_rope
        uninstall_sync_free_thd_rope()
    samples = random_samples(case["seqs"], case["seq"], hf.vocab_size)
    loss = SFTLoss()
    print(f"[progress] built in {build_s:.1f} s", file=sys.stderr, flush=True)
    for i in range(case["warmup"]):
        t1 = time.perf_counter()
        actor.train_step(samples, loss)
        print(f"[progress] warmup step {i} {time.perf_counter() - t1:.1f} s", file=sys.stderr, flush=True)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    metrics = None
    for _ in range(case["steps"]):
        metrics = actor.train_step(samples, loss)
    if cuda:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / case["steps"]
    profile = None
    if case.get("profile") and cuda:   # one more step, traced: where the device time goes
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            t1 = time.perf_counter()
            actor.train_step(samples, loss)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t1
        profile = gpu_kernel_breakdown(prof, wall, top=40)
        profile["host_syncs"] = count_host_syncs(lambda: actor.train_step(samples, loss))
    tokens = case["seqs"] * case["seq"]
    flops = model_flops(hf, [case["seq"]] * case["seqs"])
    tflops = flops / dt / 1e12
    return {
        "ok": True,
        "arch": case.get("arch", "qwen3"),
        "layers": case["layers"],
        "attention_backend": actor.attention_backend,
        "params_billion": round(sum(p.numel() for c in actor.model for p in c.parameters()) / 1e9, 3),
        "matmul_params_billion": round(matmul_params(hf) / 1e9, 3),
        "build_s": round(build_s, 1),
        "step_s": round(dt, 3),
        "tokens_per_step": tokens,
        "tokens_per_s": round(tokens / dt, 1),
        "tflops": round(tflops, 1),
        "mfu": round(tflops / PEAK_TFLOPS, 4),
        "micro_batches": int(metrics["num_micro_batches"]),
        "loss": round(metrics["loss"], 4),
        "grad_norm": round(metrics["grad_norm"], 4),
        "skipped": metrics["skipped"],
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        **({"profile": profile} if profile else {}),
    }


def count_host_syncs(fn, top: int = 10) -> dict:
    """Run ``fn`` with CUDA sync debugging on: how many operations made the host wait for the device, and
    from which source lines (a sync inside the layer loop leaves the GPU idle while the host catches up)."""
    import collections
    import warnings

    import torch

    sites: collections.Counter = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{os.path.relpath(w.filename, ROOT) if w.filename.startswith(ROOT) else w.filename}:{w.lineno}"] += 1
    return {"count": sum(sites.values()), "sites": sites.most_common(top)}


def probe_fusion(module: str) -> str | None:
    """None when the kernel module imports, else why not."""
    import importlib

    try:
        importlib.import_module(module)
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def spawn_case(case: dict, timeout: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        progress = [ln for ln in tail.splitlines() if ln.startswith("[progress]")]
        return {"ok": False, "error": f"timed out after {timeout} s", "progress": progress[-6:]}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT "):])
            out["wall_s"] = round(time.perf_counter() - t0, 1)
            return out
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
    oom = any("OutOfMemory" in l or "out of memory" in l for l in tail)
    return {"ok": False, "error": "out of memory" if oom else " | ".join(tail)[-800:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="layers for the option sweep")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated sweep names")
    ap.add_argument("--max-fit-layers", default="26,22", help="comma-separated layer counts to try with the fastest sweep options, then with full "
                    "recompute and bf16 grads; the largest that runs is reported ('' to skip)")
    ap.add_argument("--profile", default="", help="comma-separated sweep names to trace one extra step of "
                    "(device time per kernel category, top kernels, idle share)")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per configuration")
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test of the script)")
    ap.add_argument("--hybrid-vs-dense", action="store_true",
                    help="Qwen3.5-9B hybrid layers beside Qwen3-8B dense layers, the dense sweep's best options")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "actor_mfu.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        result = run_case(json.loads(args.child))
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    import torch

    base = {"layers": args.layers, "seq": args.seq, "seqs": args.seqs, "steps": args.steps,
            "warmup": args.warmup, "tiny": args.tiny, "attention_backend": "sdpa"}
    if args.hybrid_vs_dense:
        return hybrid_vs_dense(base, args)
    names = args.only.split(",") if args.only else list(SWEEP)
    report = {
        "model": "Qwen3-8B-shaped (hidden 4096, 32/8 heads x 128, ffn 12288, vocab 151936), bf16, local spec",
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "peak_tflops": PEAK_TFLOPS,
        "flops_formula": "6*N*tokens + 6*L*s^2*n_heads*head_dim per sequence (causal attention, fwd+bwd); "
                         "N = decoder matmul params + output projection",
        "seq": args.seq, "seqs_per_step": args.seqs, "sweep_layers": args.layers,
        "sweep": {}, "fusions_unavailable": {}, "max_fit": None,
    }
    for name in names:
        case = {**base, **SWEEP[name]}
        if "megatron" in SWEEP[name]:
            case["megatron"] = dict(SWEEP[name]["megatron"])
        case["profile"] = name in args.profile.split(",")
        res = spawn_case(case, args.timeout)
        res["overrides"] = SWEEP[name]
        report["sweep"][name] = res
        print(name, json.dumps(res), file=sys.stderr, flush=True)
    for flag, (module, what) in NEEDS.items():
        why = probe_fusion(module)
        if why is not None:
            report["fusions_unavailable"][flag] = f"needs {what} ({why})"
    # the largest model that fits: the fastest sweep options first, full recompute only when that runs out of memory
    ok = [(n, r) for n, r in report["sweep"].items() if r.get("ok")]
    fastest = json.loads(json.dumps(SWEEP[max(ok, key=lambda nr: nr[1]["tflops"])[0]])) if ok else {}
    attempts = [(layers, extra) for layers in [int(x) for x in args.max_fit_layers.split(",") if x.strip()]
                for extra in (fastest, {**fastest, "recompute_granularity": "full", "grad_reduce_in_fp32": False})]
    for layers, extra in attempts:
        case = {**base, **extra, "layers": layers}
        res = spawn_case(case, args.timeout + 60)
        res.update(layers=layers, overrides=extra)
        print("max_fit", json.dumps(res), file=sys.stderr, flush=True)
        if res.get("ok"):
            report["max_fit"] = res
            break
        report.setdefault("max_fit_failed", []).append(res)
    ok = [r for r in report["sweep"].values() if r.get("ok")]
    if ok:
        best = max(ok, key=lambda r: r["tflops"])
        report["best_sweep"] = {k: best[k] for k in ("tokens_per_s", "tflops", "mfu", "overrides")}
    emit_json(report, args.out, indent=2)
    return 0


def hybrid_vs_dense(base: dict, args) -> int:
    """Both architectures with the same options, layer count and packed sequences, in one run."""
    import torch

    report = {
        "bench": "actor_mfu --hybrid-vs-dense",
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "peak_tflops": PEAK_TFLOPS, "seq": args.seq, "seqs_per_step": args.seqs, "layers": args.layers,
        "options": BEST_DENSE,
        "flops_formula": "2*N*tokens*3 (decoder matmuls + output projection) + causal attention of the full-"
                         "attention layers + the chunked delta rule of the GDN layers (bench/common.model_flops)",
        "shapes": {"dense": "Qwen3-8B layers (hidden 4096, 32/8 heads x 128, ffn 12288, vocab 151936)",
                   "hybrid": "Qwen3.5-9B layers (hidden 4096, attention 16/4 heads x 256 gated, GDN 16 key / 32 "
                             "value heads x 128, ffn 12288, vocab 248320; layers 3 GDN : 1 attention)"},
        "runs": {},
    }
    for arch, name in (("qwen3", "dense"), ("qwen3_5", "hybrid")):
        options = json.loads(json.dumps(BEST_DENSE))
        if not torch.cuda.is_available():  # the CPU smoke run: the wgrad fusion is a GPU kernel
            options["megatron"].pop("gradient_accumulation_fusion")
        case = {**base, **options, "arch": arch, "profile": name in args.profile.split(",")}
        res = spawn_case(case, args.timeout)
        report["runs"][name] = res
        print(name, json.dumps(res), file=sys.stderr, flush=True)
    dense, hybrid = report["runs"]["dense"], report["runs"]["hybrid"]
    if dense.get("ok") and hybrid.get("ok") and dense["mfu"] > 0:
        report["hybrid_mfu_over_dense"] = round(hybrid["mfu"] / dense["mfu"], 3)
        report["goal"] = ">= 0.85"
    emit_json(report, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
