"""Diagnostic: does a weight sync make the engine reproduce the Megatron actor's logprobs?

    python -m megatron_rl.check_sync --tp N --pp M [--model HF_DIR] [--engine embedded|sglang]
                                     [--transport colocated|distributed] [--dtype float32|bfloat16] [--json]

Spawns tp*pp trainer ranks, builds the actor (a tiny random model of ``--arch`` when no --model: the
Qwen3.5 hybrid by default, or dense Qwen3), starts an engine
whose initial weights differ from the actor's (another random init of the same config, so every weight
has to arrive through the sync; a running --engine-url or an SGLang engine starts from the checkpoint),
syncs, samples one sequence from the engine at temperature 1, and compares the engine's per-token
logprobs with ``MegatronActor.compute_logprobs`` on the same tokens. Prints
``max_abs_logprob_diff`` (and the mean), ``weight_version`` and ``sync_seconds`` (plus the sync's phases); exits 0
within tolerance (default 1e-3 in fp32, 5e-2 in bf16), 1 beyond it, 2 on errors.

Bad input (a missing or corrupt checkpoint, an unsupported model_type, a TP/PP the model cannot be
sharded at) is reported before any engine or rank starts, with a message naming the file or field.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import traceback
from typing import Any

from megatron_rl.fsutil import write_text_atomic

TINY_QWEN3 = dict(model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
#: Qwen3.5 hybrid: 3 Gated DeltaNet layers then a gated-attention one, GDN value heads 2x key heads, partial RoPE
TINY_QWEN3_5 = dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=128, intermediate_size=256,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=24, linear_conv_kernel_dim=4, max_position_embeddings=1024,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2,
                    eos_token_id=None, bos_token_id=None, pad_token_id=None)
TINY = {"qwen3": TINY_QWEN3, "qwen3_5": TINY_QWEN3_5}


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
    samples: int = 1  # sequences sampled (concurrently) from the engine and compared
    keep_sequences: bool = False  # also return each sequence's tokens and both sides' logprobs
    fp32_lm_head: bool = True     # the actor's logits as fp32 GEMM output (the engine is launched to match)


def write_tiny_model(path: str, seed: int = 0, arch: str = "qwen3", **overrides) -> str:
    """A random tiny HF checkpoint (config + safetensors) of `arch` (a key of `TINY`) for checks without a
    real model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in TINY:
        raise ValueError(f"--arch {arch!r}: use one of {sorted(TINY)}")
    cfg = dict(TINY[arch], **overrides)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def check_model(hf_dir: str, tp: int, pp: int):
    """The HF config of `hf_dir` once everything the ranks will need from it is known to be there:
    config.json, a supported model_type, a shape the actor can shard at tp x pp, readable safetensors
    whose tensor names and shapes fit the config. The same checks as `ckpt_tools hf-to-mcore`; raises
    ValueError naming the file or field, before any engine or rank is started."""
    from megatron_rl.bridge import BridgeError, HFCheckpointError
    from megatron_rl.bridge.hf_dir import check_hf_input
    from megatron_rl.models import ConfigMismatchError, ParallelSizes

    try:
        hf, _bridge, _state = check_hf_input(hf_dir, ParallelSizes(tp, pp))
    except (HFCheckpointError, ConfigMismatchError, BridgeError, ValueError) as e:
        raise ValueError(f"--model {hf_dir}: {e} (--tp {tp} --pp {pp})") from None
    return hf


def _rank_main(a: CheckArgs) -> None:
    import torch.distributed as dist
    from transformers import AutoConfig

    from megatron_rl.actor import ActorConfig, MegatronActor
    from megatron_rl.models import text_config
    from megatron_rl.parallel import init_parallel
    from megatron_rl.rollout.engine import BackgroundLoop, EngineManager, HttpEngine
    from megatron_rl.rollout.protocol import SamplingParams
    from megatron_rl.sync.weight_sync import WeightSync, WeightSyncConfig
    from megatron_rl.types import TrainSample

    info = init_parallel(a.tp, a.pp)
    hf_config = AutoConfig.from_pretrained(a.hf_dir)
    actor = MegatronActor(ActorConfig(tp=a.tp, pp=a.pp, params_dtype=a.dtype, fp32_lm_head=a.fp32_lm_head), hf_config)
    actor.load_hf(a.hf_dir)
    manager = EngineManager([HttpEngine(a.engine_url, name="engine")]) if info.rank == 0 else None
    sync = WeightSync.for_actor(actor, manager, WeightSyncConfig(transport=a.transport, sglang_native=a.sglang_native))
    try:
        report = sync.sync()
        gen: list[Any] = [None]
        prompts = [a.prompt[k:] + a.prompt[:k] for k in range(a.samples)]  # rotations: distinct prompts
        if info.rank == 0:
            loop = BackgroundLoop("check-sync")

            async def sample_all():
                return await asyncio.gather(*[
                    manager.generate(p, SamplingParams(temperature=1.0, max_new_tokens=a.max_new_tokens,
                                                       seed=a.seed + k, ignore_eos=True))
                    for k, p in enumerate(prompts)])
            try:
                results = loop.run(sample_all())
                gen[0] = ([r.token_ids for r in results], [r.logprobs for r in results], results[0].weight_version)
                loop.run(manager.close())
            finally:
                loop.close()
        dist.broadcast_object_list(gen, src=0)
        token_lists, engine_lps, served_version = gen[0]
        batch = [TrainSample(tokens=p + t, loss_mask=[0] * len(p) + [1] * len(t)) for p, t in zip(prompts, token_lists)]
        diffs, sequences = [], []
        for p, t, lps, e_lps in zip(prompts, token_lists, actor.compute_logprobs(batch), engine_lps):
            actor_lps = lps[len(p):].tolist()
            diffs += [abs(float(x) - float(y)) for x, y in zip(actor_lps, e_lps)]
            sequences.append({"prompt": list(p), "tokens": list(t), "engine_logprobs": [float(x) for x in e_lps],
                              "actor_logprobs": actor_lps})
        tokens = [t for ts in token_lists for t in ts]
        # max() skips a NaN that is not first: a NaN logprob on either side must fail the check, not vanish
        finite = all(math.isfinite(x) for x in diffs)
        diff = max(diffs) if finite else math.inf
        if info.rank == 0:
            out = {"max_abs_logprob_diff": diff, "mean_abs_logprob_diff": sum(diffs) / len(diffs) if finite else None,
                   "model_type": hf_config.model_type, "vocab_size": text_config(hf_config).vocab_size, "weight_version": report.weight_version,
                   "served_weight_version": served_version, "sync_seconds": round(report.seconds, 4),
                   "tokens": len(tokens), "samples": a.samples, "tp": a.tp, "pp": a.pp, "transport": a.transport, "dtype": a.dtype,
                   "sync": report.to_json()}
            if a.keep_sequences:
                out["sequences"] = sequences
            write_text_atomic(a.result_path, json.dumps(out))
    finally:
        sync.close()


def run_check(*, tp: int, pp: int, model: str | None, arch: str = "qwen3_5", engine: str = "embedded",
              transport: str = "colocated",
              dtype: str = "float32", engine_url: str | None = None, max_new_tokens: int = 24, seed: int = 0,
              workdir: str | None = None, sglang_args: dict | None = None, engine_device: str = "auto",
              samples: int = 1, keep_sequences: bool = False, fp32_lm_head: bool = True) -> dict:
    """Library entry of the CLI: returns the result dict (raises on errors). ``keep_sequences`` adds
    ``sequences``: per sampled sequence its prompt, tokens and the engine's and the actor's logprobs (for
    analyses such as ``bench/logprob_mismatch.py --reference``). ``fp32_lm_head`` is the actor's setting of that
    name; a launched engine gets the same (a running ``engine_url`` is taken as it is)."""
    if tp < 1 or pp < 1:
        raise ValueError(f"--tp and --pp must be >= 1, got tp={tp} pp={pp}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1 (with no generated token nothing is compared), "
                         f"got {max_new_tokens}")
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    if engine not in ("embedded", "sglang"):
        raise ValueError(f"--engine {engine!r}: use 'embedded' or 'sglang'")
    # a work directory of our own (the tiny model, the engine's log, the ranks' result) is removed after a check
    # that ran to its result, and kept when the engine or a rank failed: the engine's log is there
    work = workdir or tempfile.mkdtemp(prefix="check-sync-")
    started: list[bool] = []   # set once an engine or the ranks start: from then on a failure keeps `work`
    keep = False
    try:
        result = _check_in(work, started, tp=tp, pp=pp, model=model, arch=arch, engine=engine, transport=transport,
                           dtype=dtype, engine_url=engine_url, max_new_tokens=max_new_tokens, seed=seed,
                           sglang_args=sglang_args, engine_device=engine_device, samples=samples,
                           keep_sequences=keep_sequences, fp32_lm_head=fp32_lm_head)
    except BaseException:
        keep = workdir is None and bool(started)
        if keep:
            print(f"check_sync: kept its work directory (engine log, rank output): {work}", file=sys.stderr)
        raise
    finally:
        if workdir is None and not keep:
            shutil.rmtree(work, ignore_errors=True)
    return result


def _check_in(work: str, started: list[bool], *, tp: int, pp: int, model: str | None, arch: str, engine: str,
              transport: str, dtype: str, engine_url: str | None, max_new_tokens: int, seed: int,
              sglang_args: dict | None, engine_device: str, samples: int, keep_sequences: bool,
              fp32_lm_head: bool) -> dict:
    from megatron_rl.parallel import spawn
    from megatron_rl.rollout.sglang_engine import SGLangServerConfig, ServerProcess

    hf_dir = model
    if hf_dir is None:
        hf_dir = write_tiny_model(os.path.join(work, f"tiny-{arch}"), seed=0, arch=arch)
    from megatron_rl.models import text_config

    hf = text_config(check_model(hf_dir, tp, pp))
    prompt = [(seed * 7919 + 13 * i + 1) % max(hf.vocab_size - 1, 1) + 1 for i in range(8)]
    context = int(hf.max_position_embeddings)
    if len(prompt) + max_new_tokens >= context:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: {len(prompt)} prompt tokens + {max_new_tokens} do not "
                         f"fit the model's context length {context} (max_position_embeddings)")

    started.append(True)   # the input is checked: what the engine and the ranks write from here is worth keeping
    server = None
    if engine_url is None:
        if engine == "embedded":
            # a different random init of the same config: a weight the sync misses shows in the logprobs
            args: dict[str, Any] = {"device": engine_device, "dtype": dtype,
                                    "hf_config": os.path.join(hf_dir, "config.json"), "init_seed": seed + 1,
                                    "enable_fp32_lm_head": fp32_lm_head}
            cfg = SGLangServerConfig(model_path=None, launch_module="megatron_rl.rollout.embedded_server",
                                     server_args=args, log_dir=work, watchdog_interval_s=None, health_poll_s=0.25)
        else:
            gpu = {} if engine_device == "auto" else {"base_gpu_id": int(engine_device.split(":")[-1])}
            cfg = SGLangServerConfig(model_path=hf_dir, log_dir=work, watchdog_interval_s=None, **gpu,
                                     server_args={"skip_tokenizer_init": True, "dtype": dtype,
                                                  "enable_fp32_lm_head": fp32_lm_head, **(sglang_args or {})})
        server = ServerProcess(cfg)
        engine_url = server.start()
    try:
        result_path = os.path.join(work, "result.json")
        a = CheckArgs(tp=tp, pp=pp, hf_dir=hf_dir, engine_url=engine_url, transport=transport, dtype=dtype,
                      prompt=prompt, max_new_tokens=max_new_tokens, seed=seed, result_path=result_path,
                      sglang_native=(engine == "sglang"), samples=samples, keep_sequences=keep_sequences,
                      fp32_lm_head=fp32_lm_head)
        spawn(_rank_main, tp * pp, a)
        with open(result_path) as f:
            return json.load(f)
    finally:
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.rollout.sglang_engine import ServerLaunchError

    p = argparse.ArgumentParser(prog="python -m megatron_rl.check_sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: a tiny random model of --arch)")
    p.add_argument("--arch", choices=sorted(TINY), default="qwen3_5",
                   help="architecture of the tiny random model used without --model (default: the Qwen3.5 hybrid)")
    p.add_argument("--engine", choices=["embedded", "sglang"], default="embedded")
    p.add_argument("--engine-url", default=None, help="use a running engine instead of launching one")
    p.add_argument("--engine-device", default="auto",
                   help="where the launched engine runs: auto | cpu | cuda:N (distributed on 2 GPUs: cuda:1)")
    p.add_argument("--transport", choices=["colocated", "distributed"], default="colocated")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tolerance", type=float, default=None, help="default: 1e-3 (float32), 5e-2 (bfloat16)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--samples", type=int, default=1, help="sequences sampled concurrently and compared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16-lm-head", action="store_true",
                   help="round logits to the model's dtype on both sides (default: fp32 logits, as actor.fp32_lm_head)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    tol = args.tolerance if args.tolerance is not None else (1e-3 if args.dtype == "float32" else 5e-2)
    if not (math.isfinite(tol) and tol >= 0):
        return _fail(f"--tolerance must be a non-negative number, got {tol}", args.json)
    try:
        result = run_check(tp=args.tp, pp=args.pp, model=args.model, arch=args.arch, engine=args.engine,
                           transport=args.transport,
                           dtype=args.dtype, engine_url=args.engine_url, max_new_tokens=args.max_new_tokens,
                           seed=args.seed, engine_device=args.engine_device, samples=args.samples,
                           fp32_lm_head=not args.bf16_lm_head)
    except (ValueError, ServerLaunchError) as e:  # bad input found before the ranks start; the engine's log tail
        return _fail(str(e), args.json)
    except Exception as e:  # noqa: BLE001 - a rank or the engine failed: the last line says why, the log says where
        detail = traceback.format_exc()
        log_path = os.path.join(tempfile.mkdtemp(prefix="check-sync-error-"), "error.log")
        with open(log_path, "w") as f:
            f.write(detail)
        return _fail(f"{type(e).__name__}: {_last_line(str(e))} (full traceback: {log_path})", args.json)
    result["tolerance"] = tol
    result["ok"] = result["max_abs_logprob_diff"] <= tol
    if not math.isfinite(result["max_abs_logprob_diff"]):
        result["max_abs_logprob_diff"] = None  # JSON has no infinity; ok=false says it failed
        result["error"] = "a logprob on the actor or the engine side is not finite"
    if args.json:
        print(json.dumps(result))
    elif result["max_abs_logprob_diff"] is None:
        print(f"check_sync: {result['error']}", file=sys.stderr)
    else:
        s = result["sync"]
        print(f"tp={args.tp} pp={args.pp} {args.transport}: max |logprob diff| = {result['max_abs_logprob_diff']:.3g} "
              f"(tolerance {tol:g}) over {result['tokens']} tokens; weight version {result['weight_version']}; "
              f"sync {result['sync_seconds']:.3f}s (gather {s['gather_s']:.3f}s, bucket {s['bucket_s']:.3f}s, "
              f"send {s['send_s']:.3f}s, {s['gbps']:.2f} GB/s)")
    return 0 if result["ok"] else 1


def _fail(message: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"error": message, "ok": False}))
    print(f"check_sync: error: {message}", file=sys.stderr)
    return 2


def _last_line(text: str) -> str:
    """A rank's failure arrives as its whole traceback; its last line names the error."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else text


if __name__ == "__main__":
    sys.exit(main())
