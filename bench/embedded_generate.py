"""Generation throughput of the embedded engine (HF transformers, batched KV-cached decode) over HTTP.

    python bench/embedded_generate.py [--shape 8b|1b|tiny] [--concurrency 1 16 64] [--prompt-len 128]
                                      [--new-tokens 128]

Serves a random bf16 Qwen3 of the given shape in-process (the same engine and HTTP server as
``python -m megatron_rl.rollout.embedded_server``), sends `concurrency` simultaneous seeded requests
through the one EngineClient and reports generated tokens/s per concurrency level as JSON.
``--profile`` also splits each level's wall time into the model forward, the sampler and the rest
(device-synchronised timers around both, so it slows the run a little): where a decode step goes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import emit_json  # noqa: E402
from bench.sync_8b import SHAPES, hf_config_dict  # noqa: E402  (the sync benchmark's shapes and HF config)


def _install_profile(model, device) -> dict:
    """Wrap the model forward and the engine's sampler with synchronised timers."""
    import torch

    import megatron_rl.rollout.embedded_engine as engine_mod

    acc = {"forward_s": 0.0, "sample_s": 0.0, "steps": 0}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn, key, count=False):
        def wrapper(*a, **k):
            sync()
            t = time.perf_counter()
            out = fn(*a, **k)
            sync()
            acc[key] += time.perf_counter() - t
            acc["steps"] += int(count)
            return out
        return wrapper

    model.forward = timed(model.forward, "forward_s", count=True)
    engine_mod.sample = timed(engine_mod.sample, "sample_s")
    return acc


async def _wave(client, n: int, prompt_len: int, new_tokens: int, vocab: int, seed: int):
    from megatron_rl.rollout.protocol import SamplingParams

    prompts = [[(seed * 131 + i * 17 + j * 7) % (vocab - 1) + 1 for j in range(prompt_len)] for i in range(n)]
    sp = lambda i: SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=new_tokens, seed=seed + i,  # noqa: E731
                                  ignore_eos=True)
    t = time.perf_counter()
    results = await asyncio.gather(*(client.generate(p, sp(i)) for i, p in enumerate(prompts)))
    return time.perf_counter() - t, sum(len(r.token_ids) for r in results)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--gather-ms", type=float, default=20.0, help="the engine's wave-gathering window")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--profile", action="store_true", help="split the time into forward / sampling / other")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch

    from megatron_rl.rollout.client import EngineClient
    from megatron_rl.rollout.embedded_engine import EmbeddedEngine, EmbeddedEngineConfig
    from megatron_rl.rollout.embedded_server import EmbeddedServer, load_model, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    cfg = hf_config_dict(args.shape)
    t = time.perf_counter()
    model, _ = load_model(None, hf_config=cfg, device=device, dtype=resolve_dtype(args.dtype))
    load_s = time.perf_counter() - t
    acc = _install_profile(model, device) if args.profile else None
    server = EmbeddedServer(EmbeddedEngine(model, EmbeddedEngineConfig(max_batch_size=args.max_batch_size,
                                                                       gather_ms=args.gather_ms)))
    server.start_in_thread()
    client = EngineClient(server.url)
    out = {"bench": "embedded_generate", "shape": args.shape, "device": str(device), "dtype": args.dtype,
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "max_batch_size": args.max_batch_size,
           "gather_ms": args.gather_ms,
           "params": sum(x.numel() for x in model.parameters()), "model_init_s": round(load_s, 2),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "levels": []}

    async def run_all():
        try:
            await _wave(client, 2, args.prompt_len, 4, cfg["vocab_size"], 0)  # warm-up
            for n in args.concurrency:
                if acc is not None:
                    acc.update(forward_s=0.0, sample_s=0.0, steps=0)
                secs, toks = await _wave(client, n, args.prompt_len, args.new_tokens, cfg["vocab_size"], 1)
                level = {"concurrency": n, "seconds": round(secs, 3), "generated_tokens": toks,
                         "tokens_per_s": round(toks / secs, 1)}
                if acc is not None:
                    steps = max(acc["steps"], 1)
                    level["profile_ms_per_step"] = {
                        "forward": round(acc["forward_s"] / steps * 1e3, 2),
                        "sample": round(acc["sample_s"] / steps * 1e3, 2),
                        "other": round((secs - acc["forward_s"] - acc["sample_s"]) / steps * 1e3, 2),
                        "steps": acc["steps"]}
                out["levels"].append(level)
                print(json.dumps(level), file=sys.stderr, flush=True)
        finally:
            await client.close()

    try:
        asyncio.run(run_all())
    finally:
        server.stop()
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
