"""The actor's RL step when every step packs a different number of tokens: warm-up (compiles, Triton
autotuning) against steady state, per way of running megatron's torch.compile'd Gated DeltaNet helpers.

    python bench/actor_shapes.py [--layers 4] [--steps 6] [--samples 16] [--modes compiled,dynamic,eager]
                                 [--log-dir DIR] [--out FILE] [--tiny]

`bench/actor_mfu.py` trains on fixed 8,192-token sequences, so every compile happens once, in warm-up. An RL
step does not look like that: its samples are new prompts with new response lengths, so every micro-batch has a
new packed length, and each step runs the model without grad (pi_old logprobs) and then with grad (training).
Here every step draws new lengths (prompt 150-600 tokens, response 16-256, the RL benchmark's ranges), computes
the logprobs, then takes one train step, as `MegatronActor.train_rl_batch` does.

megatron-core 0.19 wraps ``_prepare_input_for_gated_delta_rule``, ``_apply_gated_norm`` and
``_compute_g_and_beta`` of ``_GDNBase`` in ``jit_fuser`` (``torch.compile``). Modes (`set_gdn_fusion`):
``compiled`` (megatron's own wrapping), ``dynamic`` (``torch.compile(dynamic=True)``: symbolic sizes from the
first call), ``eager`` (the plain methods). Each mode runs in a fresh process on Qwen3.5-9B-shaped hybrid
layers; the same steps on Qwen3-8B-shaped dense layers (no GDN helpers, nothing to compile) are the reference in
the same run. Per step: seconds, the graphs
dynamo compiled and the Triton autotunings that step (run with TRITON_PRINT_AUTOTUNING=1 to count those), and
the dynamo recompile reasons (TORCH_LOGS=recompiles) land in each child's log under --log-dir.
Prints one JSON object (and writes it to --out).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.actor_mfu import init_single_rank, qwen3_5_9b_config, qwen3_8b_config  # noqa: E402
from bench.common import emit_json  # noqa: E402
from megatron_rl.fsutil import write_text_atomic  # noqa: E402

PROMPT_TOKENS = (150, 600)
RESPONSE_TOKENS = (16, 256)
STEP_MARK = "[step]"
GDN_FUSION_MODES = ("compiled", "dynamic", "eager")
_GDN_HELPERS = ("_apply_gated_norm", "_prepare_input_for_gated_delta_rule", "_compute_g_and_beta")


def set_gdn_fusion(mode: str) -> None:
    """Run megatron's three compiled GDN helpers as ``mode`` in this process (a GPU child; on CPU,
    `megatron_rl.parallel.cpu_compat` has already made them plain and ``compiled`` leaves them so)."""
    import torch
    from megatron.core.ssm.gated_delta_net import common

    from megatron_rl.parallel import cpu_compat

    if mode == "compiled" or cpu_compat.is_cpu_mode():
        return
    for name in _GDN_HELPERS:
        stock = common._GDNBase.__dict__[name]
        plain = getattr(stock, "_torchdynamo_orig_callable", stock)
        setattr(common._GDNBase, name, torch.compile(plain, dynamic=True) if mode == "dynamic" else plain)


def rl_like_samples(n: int, vocab: int, seed: int):
    """``n`` samples of new random lengths: prompt tokens untrained, response tokens trained."""
    import torch

    from megatron_rl.types import TrainSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1, (1,), generator=g))
        r = int(torch.randint(RESPONSE_TOKENS[0], RESPONSE_TOKENS[1] + 1, (1,), generator=g))
        out.append(TrainSample(torch.randint(0, vocab, (p + r,), generator=g).tolist(), [0] * p + [1] * r))
    return out


def dynamo_graphs() -> int:
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def run_child(case: dict) -> dict:
    """Build the actor, then per step: new lengths, no-grad logprobs, one train step."""
    import torch

    from megatron_rl.actor import ActorConfig, MegatronActor, SFTLoss

    init_single_rank()
    tiny = case["tiny"]
    hf = qwen3_5_9b_config(case["layers"], tiny) if case["arch"] == "hybrid" else qwen3_8b_config(case["layers"], tiny)
    cuda = torch.cuda.is_available()
    cfg = ActorConfig(params_dtype="bfloat16" if cuda else "float32", lr=1e-6, clip_grad=1.0,
                      attention_backend="sdpa", max_tokens_per_gpu=16384, recompute_logprob_chunks=False,
                      megatron={"bias_activation_fusion": True})
    set_gdn_fusion(case["mode"])
    t0 = time.perf_counter()
    actor = MegatronActor(cfg, hf)
    print(f"[progress] built in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    loss = SFTLoss()
    steps = []
    for i in range(case["steps"]):
        samples = rl_like_samples(case["samples"], hf.vocab_size, seed=100 + i)
        graphs0 = dynamo_graphs()
        print(f"{STEP_MARK} {i} begins", file=sys.stderr, flush=True)
        t1 = time.perf_counter()
        actor.compute_logprobs(samples, trained_only=True)
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        metrics = actor.train_step(samples, loss)
        if cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        steps.append({"tokens": sum(len(s.tokens) for s in samples), "micro_batches": int(metrics["num_micro_batches"]),
                      "logprobs_s": round(t2 - t1, 3), "train_s": round(t3 - t2, 3), "step_s": round(t3 - t1, 3),
                      "new_dynamo_graphs": dynamo_graphs() - graphs0, "loss": round(metrics["loss"], 4)})
        print(f"[progress] step {i}: {json.dumps(steps[-1])}", file=sys.stderr, flush=True)
    print(f"{STEP_MARK} end", file=sys.stderr, flush=True)
    return {"ok": True, "steps": steps,
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None}


def autotunings_per_step(log_text: str, steps: int) -> list[int]:
    """Triton's 'autotuning ... finished' lines (TRITON_PRINT_AUTOTUNING=1) between the child's step marks."""
    counts, current = [], None
    for line in log_text.splitlines():
        if line.startswith(STEP_MARK):
            if current is not None:
                counts.append(current)
            current = 0
        elif current is not None and "Triton autotuning for function" in line:
            current += 1
    return (counts + [0] * steps)[:steps]


def summarize(steps: list[dict]) -> dict:
    """Warm-up is every step up to the last one that compiled a dynamo graph or autotuned a Triton kernel; steady
    state is the rest."""
    compiled = [i for i, s in enumerate(steps) if s["new_dynamo_graphs"] or s.get("triton_autotunings")]
    warm = compiled[-1] + 1 if compiled else 0
    steady = steps[warm:]
    out = {"warmup_steps": warm, "warmup_s": round(sum(s["step_s"] for s in steps[:warm]), 1),
           "steady_steps": len(steady)}
    if steady:
        out["steady_step_s_median"] = round(statistics.median(s["step_s"] for s in steady), 3)
        out["steady_tokens_per_s"] = round(sum(s["tokens"] for s in steady) / sum(s["step_s"] for s in steady), 1)
    return out


def spawn(case: dict, log_path: str, timeout: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            # one log for both streams: Triton prints its autotuning lines to stdout, between the step marks
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
        except subprocess.TimeoutExpired:
            proc = None
    text = open(log_path, errors="replace").read()
    progress = [ln for ln in text.splitlines() if ln.startswith("[progress]")]
    if proc is None:
        return {"ok": False, "error": f"timed out after {timeout} s", "progress": progress[-8:]}
    for line in text.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT "):])
            out["wall_s"] = round(time.perf_counter() - t0, 1)
            for step, n in zip(out["steps"], autotunings_per_step(text, len(out["steps"]))):
                step["triton_autotunings"] = n   # counted with TRITON_PRINT_AUTOTUNING=1 only
            out.update(summarize(out["steps"]))
            return out
    return {"ok": False, "error": " | ".join(text.strip().splitlines()[-6:])[-800:], "progress": progress[-8:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="hybrid layers (every 4th gated attention)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--samples", type=int, default=16, help="samples per step (prompts x group)")
    ap.add_argument("--modes", default="compiled,dynamic,eager")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense reference")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per child")
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (checks the script)")
    ap.add_argument("--log-dir", default=None, help="each child's stderr (default: a temp dir)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_child(json.loads(args.child))), flush=True)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in GDN_FUSION_MODES]
    if bad or not modes:
        ap.error(f"--modes {args.modes!r}: each must be one of {', '.join(GDN_FUSION_MODES)}")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="actor-shapes-")
    os.makedirs(log_dir, exist_ok=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    import torch

    base = {"layers": args.layers, "steps": args.steps, "samples": args.samples, "tiny": args.tiny}
    runs = [("hybrid", m) for m in modes] + ([] if args.no_dense else [("dense", "compiled")])
    report = {"bench": "actor_shapes",
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "layers": args.layers, "samples_per_step": args.samples,
              "prompt_tokens": PROMPT_TOKENS, "response_tokens": RESPONSE_TOKENS,
              "env": {k: os.environ.get(k) for k in ("TORCH_LOGS", "TRITON_PRINT_AUTOTUNING")},
              "log_dir": log_dir, "command": " ".join(sys.argv), "runs": {}}
    for arch, mode in runs:
        name = f"{arch}_{mode}" if arch == "hybrid" else "dense_reference"
        print(f"[actor_shapes] {name}", file=sys.stderr, flush=True)
        res = spawn({**base, "arch": arch, "mode": mode}, os.path.join(log_dir, f"{name}.log"), args.timeout)
        report["runs"][name] = res
        print(f"[actor_shapes] {name}: {json.dumps(res)[:600]}", file=sys.stderr, flush=True)
        if args.out:   # what has run so far survives a later child that hangs
            write_text_atomic(args.out, json.dumps(report, indent=2) + "\n")
    emit_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
