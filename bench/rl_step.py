"""Per-phase time of full RL steps on one GPU: generation, verification, logprobs, training, sync.

    python bench/rl_step.py [--arch dense|hybrid] [--layers 36] [--steps 3] [--warmup-steps 1]
                            [--prompts 4] [--group 4]
                            [--max-new 1024] [--offload-actor auto|on|off] [--async-rollout] [--no-farm-share]
                            [--out bench/results/rl_step_h200.json]

Runs the real driver (`megatron_rl.train.run`) with the local backend (no Ray on the GPU machine):
a random bf16 model shaped like Qwen3-8B (``--arch dense``) or Qwen3.5-9B (``--arch hybrid``; every 4th
layer gated attention, the rest Gated DeltaNet), cut to ``--layers``, the embedded engine colocated on
the same GPU, the CUDA verifier farm on the bundled tasks at GPU sizes, one train rank. Reports seconds
per phase (median over the steps after ``--warmup-steps``; every step's phases are listed too), tokens/s/GPU
(all tokens of the step's trajectories / step wall time) next to NeMo-RL's published 1581 tok/s/GPU
(Llama3.1-8B GRPO, H100, on-policy), and the dominant phase.

A random model writes no valid kernels, so the step's own verification sees format errors only. So that
the farm's share of a step is known for a model that does write kernels, the same farm configuration then
verifies one step's worth (prompts x group) of correct CUDA kernels for the bundled tasks (the farm
benchmark's candidates, every one a distinct source, so every one compiles): its wall time is reported
beside the median step, and as the share of a step that would take that long. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit_json  # noqa: E402
from megatron_rl.fsutil import write_text_atomic  # noqa: E402
from megatron_rl.observability import dump_stacks_on_sigusr1  # noqa: E402
NEMO_RL_TOKS_PER_GPU = 1581.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=("dense", "hybrid"), default="dense")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup-steps", type=int, default=1,
                    help="first steps left out of the medians (first-shape compiles and fla's Triton autotuning: the "
                         "hybrid actor needs about 3, bench/results/actor_shapes_hybrid_h200.md)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    ap.add_argument("--no-farm-share", action="store_true", help="skip verifying a step's worth of correct kernels")
    ap.add_argument("--async-rollout", action="store_true",
                    help="cluster.async_rollout=true: the next rollout runs beside training (one step off-policy; "
                         "engines and actor resident together). Colocated, steps 1-2 are not overlapped (the first "
                         "runs synchronously) and the last has nothing beside it: use --steps 6 --warmup-steps 2")
    ap.add_argument("--offload-actor", choices=("auto", "on", "off"), default="auto",
                    help="cluster.offload_actor (auto: only when the engine's cache would not fit beside the actor)")
    ap.add_argument("--log-dir", default=None, help="the run's logs, metrics and engine logs (default: a temp dir)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dump_stacks_on_sigusr1()

    import torch

    from megatron_rl.config import load_config
    from megatron_rl.train import run

    # async: the last step has no next rollout beside its training, so it is left out of the medians too
    last_out = 1 if args.async_rollout else 0
    if not 0 <= args.warmup_steps < args.steps - last_out:
        ap.error(f"--warmup-steps {args.warmup_steps} must be >= 0 and leave at least one of --steps {args.steps}"
                 + (" besides the last (--async-rollout)" if last_out else ""))
    if args.log_dir and os.path.exists(os.path.join(args.log_dir, "metrics.jsonl")):
        ap.error(f"--log-dir {args.log_dir} holds an earlier run (its steps would mix into the medians)")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="rl-step-")
    gpu = torch.cuda.is_available() and not args.cpu_smoke
    if not gpu:
        shape = [f"model.tiny.arch={'qwen3' if args.arch == 'dense' else 'qwen3_5'}"]
    elif args.arch == "dense":   # Qwen3-8B
        shape = ["model.tiny.arch=qwen3", "model.tiny.hidden_size=4096", "model.tiny.intermediate_size=12288",
                 f"model.tiny.num_layers={args.layers}", "model.tiny.num_attention_heads=32",
                 "model.tiny.num_key_value_heads=8", "model.tiny.head_dim=128", "model.tiny.tie_word_embeddings=false"]
    else:                        # Qwen3.5-9B (bench/common.py's QWEN3_5_SHAPES["9b"])
        shape = ["model.tiny.arch=qwen3_5", "model.tiny.hidden_size=4096", "model.tiny.intermediate_size=12288",
                 f"model.tiny.num_layers={args.layers}", "model.tiny.num_attention_heads=16",
                 "model.tiny.num_key_value_heads=4", "model.tiny.head_dim=256", "model.tiny.tie_word_embeddings=false",
                 "model.tiny.full_attention_interval=4", "model.tiny.linear_num_key_heads=16",
                 "model.tiny.linear_num_value_heads=32", "model.tiny.linear_key_head_dim=128",
                 "model.tiny.linear_value_head_dim=128"]
    overrides = [
        "cluster.backend=local", f"cluster.use_gpu={str(gpu).lower()}", f"train.log_dir={log_dir}",
        f"train.steps={args.steps}", f"data.prompts_per_step={args.prompts}", f"agent.group_size={args.group}",
        f"agent.sampling.max_new_tokens={args.max_new if gpu else 16}",
        f"agent.max_concurrency={args.prompts * args.group}", "agent.max_turns=1",
        f"actor.params_dtype={'bfloat16' if gpu else 'float32'}", f"rollout.engine_dtype={'bfloat16' if gpu else 'float32'}",
        f"kernel_backend={'cuda' if gpu else 'cpu'}", f"farm.compile_workers={max(1, (os.cpu_count() or 2) // 2)}",
        "actor.max_tokens_per_gpu=16384", "train.save_interval=0", "train.save_final=false",
        f"cluster.offload_actor={ {'auto': 'null', 'on': 'true', 'off': 'false'}[args.offload_actor] }",
        f"cluster.async_rollout={str(args.async_rollout).lower()}",
        *(["data.size_profile=gpu"] if gpu else []), *shape,
    ]
    cfg = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"), overrides)
    summary = run(cfg)
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    steady = rows[args.warmup_steps:len(rows) - last_out] or rows[-1:]
    # the final checkpoint (written once, at the last step) is not part of a steady-state step
    phases = sorted({k for r in steady for k in r if k.startswith("time/") and k != "time/save"})
    med = {p[5:]: statistics.median(r.get(p, 0.0) for r in steady) for p in phases}
    step_s = sum(med.values())
    toks = statistics.median(r["perf/tokens_per_s"] for r in steady)
    result = {
        "bench": "rl_step", "arch": args.arch, "device": torch.cuda.get_device_name() if gpu else "cpu",
        "layers": args.layers if gpu else None, "async_rollout": args.async_rollout,
        "warmup_steps": args.warmup_steps, "steady_steps": len(steady),
        "per_step_seconds": [{k[5:]: round(v, 2) for k, v in r.items() if k.startswith("time/")} for r in rows],
        "prompts_per_step": args.prompts, "group_size": args.group, "max_new_tokens": args.max_new if gpu else 16,
        "phase_seconds_median": med, "step_seconds": step_s, "dominant_phase": max(med, key=med.get),
        "tokens_per_s_per_gpu": toks, "nemo_rl_llama8b_tokens_per_s_per_gpu": NEMO_RL_TOKS_PER_GPU,
        "ratio_vs_nemo_rl": toks / NEMO_RL_TOKS_PER_GPU,
        "rollout_tokens_median": {k: statistics.median(r.get(f"rollout/{k}", 0.0) for r in steady)
                                  for k in ("tokens_generated", "tokens_in_batch", "discarded_token_frac")},
        # the embedded engine's own split of the rollout (prefill / decode seconds, mean running batch)
        "engine_median": {k[7:]: statistics.median(r[k] for r in steady if k in r)
                          for k in sorted({k for r in steady for k in r if k.startswith("engine/")})},
        "summary": summary, "command": " ".join(sys.argv),
    }
    if not args.no_farm_share:
        # the steps' figures are written first: the farm measurement compiles kernels and may be cut short
        if args.out:
            write_text_atomic(args.out, json.dumps({**result, "farm_correct_kernels": "not finished"}, indent=2,
                                                   default=str) + "\n")
        print(f"[rl_step] verifying {args.prompts * args.group} correct kernels on the farm", flush=True)
        farm = farm_on_correct_kernels(cfg, args.prompts * args.group)
        farm["share_of_step"] = farm["wall_s"] / (step_s + farm["wall_s"])
        result["farm_correct_kernels"] = farm
    emit_json(result, args.out, indent=2, default=str)
    return 0


def farm_on_correct_kernels(cfg, n: int) -> dict:
    """`n` correct, distinct kernels for the bundled tasks through a farm laid out as the run's (cfg.farm),
    with the run's verifier settings: what a step's verification costs once the model writes real kernels."""
    from bench.verifier_farm_throughput import make_candidates, run_farm
    from verifier.size_profiles import apply_size_profile, load_tasks

    backend = cfg.verifier.backend
    profile = cfg.data.size_profile
    tasks = {os.path.splitext(os.path.basename(t.path))[0]: apply_size_profile(t, profile) if profile else t
             for t in load_tasks(os.path.join(ROOT, "verifier", "tasks"))}
    cands = [c for c in make_candidates(8 * n, "rl_step") if c.kind == "correct"][:n]
    if backend != "cuda":   # the candidates are CUDA sources; a CPU smoke run checks the plumbing only
        return {"skipped": f"verifier backend {backend!r}: the correct-kernel candidates are CUDA", "wall_s": 0.0}
    out = run_farm(cands, tasks, cfg.verifier, cfg.farm.compile_workers)
    categories = [str(getattr(r.category, "value", r.category)) for r in out["results"]]
    return {"candidates": n, "wall_s": out["wall_s"], "compile_workers": cfg.farm.compile_workers,
            "categories": {c: categories.count(c) for c in sorted(set(categories))}}


if __name__ == "__main__":
    sys.exit(main())
