"""Generation throughput of the embedded engine over HTTP, beside transformers' compiled generate and the bandwidth limit.

    python bench/embedded_generate.py [--shape 8b|9b_hybrid|1b|tiny|tiny_hybrid] [--concurrency 1 16 64 256]
        [--prompt-len 512] [--new-tokens 512] [--decode slots dynamic] [--dynamic-levels 1 16]
        [--hf-levels 1 64] [--profile] [--out FILE]

One random bf16 model of the given shape serves, in-process, through the same engine and HTTP server as
``python -m megatron_rl.rollout.embedded_server``; `concurrency` simultaneous seeded requests go through one
EngineClient. Side by side in the same run:

* each decode path named in ``--decode`` (``slots``: preallocated slots + CUDA graphs, flash varlen decode
  attention in bf16; ``+sdpa``: the same with SDPA under a boolean mask over every slot's whole width, the
  attention it had before; ``+eager``: norm and MLP blocks not compiled (`compile_blocks` off); ``+compile``:
  torch.compile over the whole step instead of the blocks; ``+sync``: each step's tokens read back before the
  next step is launched (`overlap_decode` off, the engine before 2026-12-05); ``+ungrouped``: each projection
  its own GEMM (`group_projections` off, the engine before 2026-12-06); ``+fp32head``: logits as the LM head
  GEMM's fp32 output (`fp32_lm_head`, what the trainer asks of its engines since 2026-12-06); ``dynamic``: the
  DynamicCache path this engine had before),
  the dynamic one only at ``--dynamic-levels`` (it is slow);
* transformers' own ``generate`` on the same model with ``cache_implementation="static"`` (which compiles the
  decode step with torch.compile), greedy, at ``--hf-levels``;
* the memory-bandwidth limit: the device-to-device copy bandwidth measured here, and per level the tokens/s
  if a decode step only read the weights once plus every request's K/V at its mean length.

``--profile`` splits each level's wall time into decode forward (or graph replay), sampling, and the rest
(device-synchronised timers, so it slows the run a little), with a prefill/decode step count; and, per decode
path, profiles the decode steps of one request (and of ``--profile-concurrency`` requests) under torch.profiler,
the prefill subtracted: wall ms per decode step beside the GPU kernel time, kernel launches and time per kernel
kind (a step far longer than its kernels is host-bound), and the top kernels.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import copy_bandwidth, emit_json  # noqa: E402
from megatron_rl.fsutil import write_text_atomic  # noqa: E402
from bench.sync_8b import SHAPES, hf_config_dict  # noqa: E402  (the sync benchmark's shapes and HF config)


def _install_profile(engine, device) -> dict:
    """Synchronised timers around the decode forward of either path, the sampler, and prefill."""
    import torch

    acc = {"decode_s": 0.0, "sample_s": 0.0, "prefill_s": 0.0, "decode_steps": 0, "prefills": 0}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(obj, name, key, count=None):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            sync()
            t = time.perf_counter()
            out = fn(*a, **k)
            sync()
            acc[key] += time.perf_counter() - t
            if count:
                acc[count] += 1
            return out
        setattr(obj, name, wrapper)

    timed(engine, "_sample_and_record", "sample_s")
    if engine._slots is not None:
        timed(engine._slots, "step", "decode_s", "decode_steps")
        timed(engine, "_prefill_into_slots", "prefill_s", "prefills")
    else:
        timed(engine, "_decode_step", "decode_s", "decode_steps")
        timed(engine, "_prefill", "prefill_s", "prefills")
    return acc


def _prompts(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    return [[(seed * 131 + i * 17 + j * 7) % (vocab - 1) + 1 for j in range(prompt_len)] for i in range(n)]


async def _wave(client, n: int, prompt_len: int, new_tokens: int, vocab: int, seed: int):
    from megatron_rl.rollout.protocol import SamplingParams

    prompts = _prompts(n, prompt_len, vocab, seed)
    sp = lambda i: SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, seed=seed + i,  # noqa: E731
                                  ignore_eos=True)
    t = time.perf_counter()
    results = await asyncio.gather(*(client.generate(p, sp(i)) for i, p in enumerate(prompts)))
    return time.perf_counter() - t, sum(len(r.token_ids) for r in results)


# first match wins: flash kernels carry `cutlass::` in their template arguments, inductor's fused kernels
# `_to_copy` in their names, so attention is matched first and copies only outside Triton kernels
_KERNEL_KINDS = (("attention", ("flash_fwd", "fmha", "cudnn", "attention")),
                 ("gemm", ("nvjet", "gemm", "cutlass_", "splitkreduce", "cublas")),
                 ("copy", ("memcpy", "copy_kernel", "catarray", "index_elementwise", "scatter", "gather")))


def _kernel_kind(name: str) -> str:
    low = name.lower()
    if low.startswith("triton_"):
        return "triton (fused)"
    return next((kind for kind, keys in _KERNEL_KINDS if any(k in low for k in keys)), "elementwise/reduce")


async def _profiled_wave(client, cfg, args, requests: int, new_tokens: int) -> tuple[float, dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        await _wave(client, requests, args.prompt_len, new_tokens, cfg["vocab_size"], 5)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    return wall, {e.key: (e.self_device_time_total, e.count) for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA}


async def _kernel_profile(client, cfg, args, new_tokens: int = 64, requests: int = 1) -> dict:
    """Decode steps alone under torch.profiler: a wave of `requests` x (`new_tokens` + 16) minus the same wave
    with 16 new tokens (same prefill, `new_tokens` fewer decode steps), after a profiled warm-up wave (the
    profiler's own start-up). Per decode step: wall time beside summed kernel time, launches, time per kernel
    kind (a step far longer than its kernels is host-bound), and the top kernels."""
    await _profiled_wave(client, cfg, args, requests, 2)
    wall_s, short = await _profiled_wave(client, cfg, args, requests, 16)
    wall_l, long = await _profiled_wave(client, cfg, args, requests, 16 + new_tokens)
    steps = new_tokens
    per_step = {k: ((us - short.get(k, (0, 0))[0]) / steps, (n - short.get(k, (0, 0))[1]) / steps)
                for k, (us, n) in long.items()}
    busy_us = sum(us for us, _ in per_step.values())
    kinds: dict[str, float] = {}
    for k, (us, _) in per_step.items():
        kinds[_kernel_kind(k)] = kinds.get(_kernel_kind(k), 0.0) + us / 1e3
    wall_step = (wall_l - wall_s) / steps
    top = sorted(per_step.items(), key=lambda kv: -kv[1][0])[:12]
    return {"requests": requests, "decode_steps": steps, "wall_ms_per_step": round(wall_step * 1e3, 2),
            "kernel_ms_per_step": round(busy_us / 1e3, 2),
            "kernel_launches_per_step": round(sum(n for _, n in per_step.values()), 1),
            "gpu_busy_fraction": round(busy_us / 1e6 / wall_step, 3) if wall_step > 0 else None,
            "kernel_ms_by_kind": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": k[:80], "ms_per_step": round(us / 1e3, 3), "calls_per_step": round(n, 1)}
                            for k, (us, n) in top]}


def engine_levels(model, cfg, args, decode: str, levels: list[int], device) -> dict:
    import torch

    from megatron_rl.rollout.client import EngineClient
    from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.embedded_server import EmbeddedServer
    from megatron_rl.models.fp32_logits import plain_lm_head
    from megatron_rl.rollout.slot_decode import uncompile_blocks

    from torch._dynamo.utils import counters

    path, *variants = decode.split("+")
    graphs_before = counters["stats"]["unique_graphs"]
    engine = EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=max(levels), gather_ms=args.gather_ms,
                                                        decode=path, compile_decode="compile" in variants,
                                                        compile_blocks=path == "slots" and "eager" not in variants,
                                                        cuda_graphs=not args.no_cuda_graphs,
                                                        overlap_decode="sync" not in variants,
                                                        group_projections=False if "ungrouped" in variants else None,
                                                        fp32_lm_head="fp32head" in variants,
                                                        kv_cache_fraction=args.kv_cache_fraction))
    if "sdpa" in variants:   # the decode attention before flash varlen, for the comparison
        engine._slots.flash, engine._slots.flash_reason = False, "turned off by the benchmark (slots+sdpa)"
    acc = _install_profile(engine, device) if args.profile else None
    server = EmbeddedServer(engine)
    server.start_in_thread()
    client = EngineClient(server.url)
    out = {"decode": decode, "levels": []}

    async def run_all():
        try:
            # warm-up: the slot buffers sized for the run, and (slots) every level's graph captured
            t = time.perf_counter()
            for n in levels:
                await _wave(client, n, args.prompt_len, 3, cfg["vocab_size"], 0)
                print(json.dumps({"decode": decode, "warmed_up": n, "after_s": round(time.perf_counter() - t, 1),
                                  "dynamo_graphs": counters["stats"]["unique_graphs"] - graphs_before}),
                      file=sys.stderr, flush=True)
            out["warmup_s"] = round(time.perf_counter() - t, 2)
            out["dynamo_graphs_in_warmup"] = counters["stats"]["unique_graphs"] - graphs_before
            for n in levels:
                if acc is not None:
                    acc.update({k: 0 if isinstance(v, int) else 0.0 for k, v in acc.items()})
                before = dataclasses.asdict(engine.stats)
                secs, toks = await _wave(client, n, args.prompt_len, args.new_tokens, cfg["vocab_size"], 1)
                st = {k: v - before[k] for k, v in dataclasses.asdict(engine.stats).items()}
                level = {"concurrency": n, "seconds": round(secs, 3), "generated_tokens": toks,
                         "tokens_per_s": round(toks / secs, 1),
                         # the engine's own accounting (with overlap, a step's time is the interval between two
                         # recorded steps): decode ms per step, prefill seconds, rows computed and dropped
                         "engine": {"decode_ms_per_step": round(1e3 * st["decode_s"] / max(st["decode_steps"], 1), 3),
                                    "decode_steps": st["decode_steps"], "prefill_s": round(st["prefill_s"], 3),
                                    "decode_rows_discarded": st["decode_rows_discarded"]}}
                if acc is not None:
                    steps = max(acc["decode_steps"], 1)
                    level["profile"] = {
                        "decode_ms_per_step": round(acc["decode_s"] / steps * 1e3, 2),
                        "sample_ms_per_step": round(acc["sample_s"] / (steps + acc["prefills"]) * 1e3, 2),
                        "prefill_s": round(acc["prefill_s"], 3), "prefills": acc["prefills"],
                        "other_s": round(secs - acc["decode_s"] - acc["sample_s"] - acc["prefill_s"], 3),
                        "decode_steps": acc["decode_steps"]}
                out["levels"].append(level)
                print(json.dumps({"decode": decode, **level}), file=sys.stderr, flush=True)
            # kernel profiles after the timed levels: a profiler session slows later launches while CUPTI stays
            # attached (main sets TEARDOWN_CUPTI=1 so that it detaches; this keeps the levels clear either way)
            if args.profile and device.type == "cuda":
                out["one_request_profile"] = await _kernel_profile(client, cfg, args)
                for n in args.profile_concurrency:
                    out[f"profile_{n}_requests"] = await _kernel_profile(client, cfg, args, requests=n)
        finally:
            await client.close()

    try:
        asyncio.run(run_all())
        out["engine"] = engine.decode_info()
    finally:
        uncompile_blocks(model)   # the next engine or baseline starts from the model as loaded
        plain_lm_head(model)
        if engine.projection_groups is not None:
            engine.projection_groups.undo()
        server.stop()
        engine.release_memory(["kv_cache", "cuda_graph"]) if engine.is_idle() else None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def hf_generate_levels(model, cfg, args, levels: list[int], device) -> dict:
    """transformers' generate with a static cache (its decode step compiled by torch.compile), greedy; the first
    call at each batch size compiles and is not timed."""
    import torch

    out = {"path": "transformers generate, cache_implementation=static (torch.compile)", "levels": []}
    for n in levels:
        ids = torch.tensor(_prompts(n, args.prompt_len, cfg["vocab_size"], 1), device=device)
        kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                  cache_implementation="static", pad_token_id=0)
        try:
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), **kw)   # compiles
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t
            t = time.perf_counter()
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            torch.cuda.synchronize()
            secs = time.perf_counter() - t
        except Exception as e:   # a baseline failure must not lose the engine's figures
            out["levels"].append({"concurrency": n, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        toks = (gen.shape[1] - ids.shape[1]) * n
        level = {"concurrency": n, "seconds": round(secs, 3), "generated_tokens": toks,
                 "tokens_per_s": round(toks / secs, 1), "first_call_s": round(compile_s, 1)}
        out["levels"].append(level)
        print(json.dumps({"hf": True, **level}), file=sys.stderr, flush=True)
    return out


def bandwidth_limit(model, cfg, args, levels: list[int], device) -> dict:
    """Measured copy bandwidth, and per level the tokens/s of a decode step that only reads the weights once and
    each request's K/V (attention layers) at the run's mean context length."""
    bw = copy_bandwidth(device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    c = model.config
    attn_layers = sum(t == "full_attention" for t in (getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers))
    kv_per_token = attn_layers * 2 * c.num_key_value_heads * getattr(c, "head_dim", c.hidden_size // c.num_attention_heads) * 2
    mean_ctx = args.prompt_len + args.new_tokens / 2
    levels_out = []
    for n in levels:
        step_bytes = weight_bytes + n * mean_ctx * kv_per_token
        levels_out.append({"concurrency": n, "step_ms": round(step_bytes / bw * 1e3, 3),
                           "tokens_per_s": round(n * bw / step_bytes, 1)})
    return {"copy_bandwidth_gb_s": round(bw / 1e9, 1), "weight_gb": round(weight_bytes / 1e9, 2),
            "kv_bytes_per_token": kv_per_token, "levels": levels_out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--decode", nargs="+", default=["slots", "dynamic"],
                   choices=("slots", "slots+sync", "slots+eager", "slots+sdpa", "slots+sdpa+eager", "slots+compile",
                            "slots+compile+sync", "slots+sdpa+compile", "slots+ungrouped", "slots+fp32head", "dynamic"),
                   help="slots[+sdpa][+compile] (see above), or the older dynamic path")
    p.add_argument("--dynamic-levels", type=int, nargs="*", default=[1, 16],
                   help="concurrency levels at which the (slow) dynamic path runs")
    p.add_argument("--hf-levels", type=int, nargs="*", default=[1, 64],
                   help="concurrency levels of the transformers static-cache generate baseline (none: skip)")
    p.add_argument("--gather-ms", type=float, default=20.0, help="the engine's wave-gathering window")
    p.add_argument("--kv-cache-fraction", type=float, default=0.6)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--profile", action="store_true", help="split each level into decode / sampling / prefill / rest")
    p.add_argument("--profile-concurrency", type=int, nargs="*", default=[],
                   help="with --profile, also profile a wave of this many requests (64 tokens each)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    # Kineto leaves CUPTI attached after a profiler session unless this is set when it stops, and an attached
    # CUPTI slows every later kernel launch (pytorch/pytorch#144455): the next engine's levels would read low
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    import torch

    from megatron_rl.rollout.embedded_server import load_model, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    cfg = hf_config_dict(args.shape)
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), args.prompt_len + args.new_tokens + 64)
    t = time.perf_counter()
    model, _ = load_model(None, hf_config=cfg, device=device, dtype=resolve_dtype(args.dtype))
    load_s = time.perf_counter() - t
    out = {"bench": "embedded_generate", "shape": args.shape, "device": str(device), "dtype": args.dtype,
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "sampling": "temperature 1, no filter",
           "gather_ms": args.gather_ms, "params": sum(x.numel() for x in model.parameters()),
           "model_init_s": round(load_s, 2),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    if device.type == "cuda":
        out["bandwidth_limit"] = bandwidth_limit(model, cfg, args, args.concurrency, device)
    out["engine"] = []
    for decode in args.decode:
        levels = args.concurrency if decode.startswith("slots") else [n for n in args.concurrency if n in args.dynamic_levels]
        if levels:
            out["engine"].append(engine_levels(model, cfg, args, decode, levels, device))
            if args.out:   # keep what is measured if a later part runs out of time
                write_text_atomic(args.out, json.dumps(out) + "\n")
    if args.hf_levels and device.type == "cuda":
        out["hf_generate"] = hf_generate_levels(model, cfg, args, args.hf_levels, device)
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
