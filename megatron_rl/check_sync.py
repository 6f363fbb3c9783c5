"""Diagnostic: does a weight sync make the engine reproduce the Megatron actor's logprobs?

    python -m megatron_rl.check_sync --tp N --pp M [--model HF_DIR] [--engine embedded|sglang]
                                     [--transport colocated|distributed] [--dtype float32|bfloat16] [--json]

Spawns tp*pp trainer ranks, builds the actor (a tiny random Qwen3 when no --model), starts an engine
whose initial weights differ from the actor's (another random init; with --model, the checkpoint),
syncs, samples one sequence from the engine at temperature 1, and compares the engine's per-token
logprobs with ``MegatronActor.compute_logprobs`` on the same tokens. Prints
``max_abs_logprob_diff``, ``weight_version`` and ``sync_seconds`` (plus the sync's phases); exits 0
within tolerance (default 1e-3 in fp32, 5e-2 in bf16), 1 beyond it, 2 on errors.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import traceback
from typing import Any

TINY_QWEN3 = dict(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)


@dataclasses.dataclass
class CheckArgs:
    tp: int
    pp: int
    hf_dir: str
    engine_url: str
    transport: str
    dtype: str
    prompt: list[int]
    max_new_tokens: int
    seed: int
    result_path: str
    sglang_native: bool = False


def write_tiny_model(path: str, seed: int = 0, **overrides) -> str:
    """A random tiny Qwen3 HF checkpoint (config + safetensors) for checks without a real model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_QWEN3, **overrides)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _rank_main(a: CheckArgs) -> None:
    import torch.distributed as dist
    from transformers import AutoConfig

    from megatron_rl.actor import ActorConfig, MegatronActor
    from megatron_rl.parallel import init_parallel
    from megatron_rl.rollout.engine import BackgroundLoop, EngineManager, HttpEngine
    from megatron_rl.rollout.protocol import SamplingParams
    from megatron_rl.sync.weight_sync import WeightSync, WeightSyncConfig
    from megatron_rl.types import TrainSample

    info = init_parallel(a.tp, a.pp)
    hf_config = AutoConfig.from_pretrained(a.hf_dir)
    actor = MegatronActor(ActorConfig(tp=a.tp, pp=a.pp, params_dtype=a.dtype), hf_config)
    actor.load_hf(a.hf_dir)
    manager = EngineManager([HttpEngine(a.engine_url, name="engine")]) if info.rank == 0 else None
    sync = WeightSync.for_actor(actor, manager, WeightSyncConfig(transport=a.transport, sglang_native=a.sglang_native))
    try:
        report = sync.sync()
        gen: list[Any] = [None]
        if info.rank == 0:
            loop = BackgroundLoop("check-sync")
            try:
                r = loop.run(manager.generate(a.prompt, SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens,
                                                                       seed=a.seed, ignore_eos=True)))
                gen[0] = (r.token_ids, r.logprobs, r.weight_version)
                loop.run(manager.close())
            finally:
                loop.close()
        dist.broadcast_object_list(gen, src=0)
        tokens, engine_lps, served_version = gen[0]
        sample = TrainSample(tokens=a.prompt + tokens, loss_mask=[0] * len(a.prompt) + [1] * len(tokens))
        actor_lps = actor.compute_logprobs([sample])[0][len(a.prompt):]
        diff = max(abs(float(x) - float(y)) for x, y in zip(actor_lps.tolist(), engine_lps)) if tokens else 0.0
        if info.rank == 0:
            out = {"max_abs_logprob_diff": diff, "weight_version": report.weight_version,
                   "served_weight_version": served_version, "sync_seconds": round(report.seconds, 4),
                   "tokens": len(tokens), "tp": a.tp, "pp": a.pp, "transport": a.transport, "dtype": a.dtype,
                   "sync": report.to_json()}
            tmp = a.result_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f)
            os.replace(tmp, a.result_path)
    finally:
        sync.close()


def run_check(*, tp: int, pp: int, model: str | None, engine: str = "embedded", transport: str = "colocated",
              dtype: str = "float32", engine_url: str | None = None, max_new_tokens: int = 24, seed: int = 0,
              workdir: str | None = None, sglang_args: dict | None = None, engine_device: str = "auto") -> dict:
    """Library entry of the CLI: returns the result dict (raises on errors)."""
    from megatron_rl.parallel import spawn
    from megatron_rl.rollout.sglang_engine import SGLangServerConfig, ServerProcess

    if tp < 1 or pp < 1:
        raise ValueError(f"--tp and --pp must be >= 1, got tp={tp} pp={pp}")
    work = workdir or tempfile.mkdtemp(prefix="check-sync-")
    hf_dir = model
    if hf_dir is None:
        hf_dir = write_tiny_model(os.path.join(work, "tiny-qwen3"), seed=0)
    elif not os.path.exists(os.path.join(hf_dir, "config.json")):
        raise FileNotFoundError(f"--model {hf_dir!r} is not an HF checkpoint directory (no config.json)")

    server = None
    if engine_url is None:
        if engine == "embedded":
            args: dict[str, Any] = {"device": engine_device, "dtype": dtype}
            if model is None:  # a different random init, so the sync has to move every weight
                engine_model = write_tiny_model(os.path.join(work, "tiny-qwen3-engine"), seed=1)
            else:
                engine_model = hf_dir
            cfg = SGLangServerConfig(model_path=engine_model, launch_module="megatron_rl.rollout.embedded_server",
                                     server_args=args, log_dir=work, watchdog_interval_s=None, health_poll_s=0.25)
        elif engine == "sglang":
            gpu = {} if engine_device == "auto" else {"base_gpu_id": int(engine_device.split(":")[-1])}
            cfg = SGLangServerConfig(model_path=hf_dir, log_dir=work, watchdog_interval_s=None, **gpu,
                                     server_args={"skip_tokenizer_init": True, "dtype": dtype, **(sglang_args or {})})
        else:
            raise ValueError(f"--engine {engine!r}: use 'embedded' or 'sglang'")
        server = ServerProcess(cfg)
        engine_url = server.start()
    try:
        result_path = os.path.join(work, "result.json")
        prompt = [(seed * 7919 + 13 * i + 1) % 500 + 1 for i in range(8)]
        a = CheckArgs(tp=tp, pp=pp, hf_dir=hf_dir, engine_url=engine_url, transport=transport, dtype=dtype,
                      prompt=prompt, max_new_tokens=max_new_tokens, seed=seed, result_path=result_path,
                      sglang_native=(engine == "sglang"))
        spawn(_rank_main, tp * pp, a)
        with open(result_path) as f:
            return json.load(f)
    finally:
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_rl.check_sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: a tiny random Qwen3)")
    p.add_argument("--engine", choices=["embedded", "sglang"], default="embedded")
    p.add_argument("--engine-url", default=None, help="use a running engine instead of launching one")
    p.add_argument("--engine-device", default="auto",
                   help="where the launched engine runs: auto | cpu | cuda:N (distributed on 2 GPUs: cuda:1)")
    p.add_argument("--transport", choices=["colocated", "distributed"], default="colocated")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tolerance", type=float, default=None, help="default: 1e-3 (float32), 5e-2 (bfloat16)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    tol = args.tolerance if args.tolerance is not None else (1e-3 if args.dtype == "float32" else 5e-2)
    try:
        result = run_check(tp=args.tp, pp=args.pp, model=args.model, engine=args.engine, transport=args.transport,
                           dtype=args.dtype, engine_url=args.engine_url, max_new_tokens=args.max_new_tokens,
                           seed=args.seed, engine_device=args.engine_device)
    except Exception as e:
        if args.json:
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        else:
            traceback.print_exc()
            print(f"check_sync: error: {e}", file=sys.stderr)
        return 2
    result["tolerance"] = tol
    result["ok"] = result["max_abs_logprob_diff"] <= tol
    if args.json:
        print(json.dumps(result))
    else:
        s = result["sync"]
        print(f"tp={args.tp} pp={args.pp} {args.transport}: max |logprob diff| = {result['max_abs_logprob_diff']:.3g} "
              f"(tolerance {tol:g}) over {result['tokens']} tokens; weight version {result['weight_version']}; "
              f"sync {result['sync_seconds']:.3f}s (gather {s['gather_s']:.3f}s, bucket {s['bucket_s']:.3f}s, "
              f"send {s['send_s']:.3f}s, {s['gbps']:.2f} GB/s)")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
