"""Per-phase time of full RL steps on one GPU: generation, verification, logprobs, training, sync.

    python bench/rl_step.py [--layers 36] [--steps 3] [--prompts 4] [--group 4] [--max-new 1024]
                            [--out bench/results/rl_step_h200.json]

Runs the real driver (`megatron_rl.train.run`) with the local backend (no Ray on the GPU machine):
a Qwen3-8B-shaped random model (bf16; `--layers` shrinks it), the embedded engine colocated on the
same GPU, the CUDA verifier farm on the bundled tasks at GPU sizes, one train rank. A random model
writes no valid kernels, so verification mostly sees format errors: the verification phase here is
a lower bound. Reports seconds per phase (median over steps after the first), tokens/s/GPU (all
tokens of the step's trajectories / step wall time) next to NeMo-RL's published 1581 tok/s/GPU
(Llama3.1-8B GRPO, H100, on-policy), and the dominant phase. Prints one JSON object.
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
NEMO_RL_TOKS_PER_GPU = 1581.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=1024)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    from megatron_rl.config import load_config
    from megatron_rl.train import run

    log_dir = tempfile.mkdtemp(prefix="rl-step-")
    gpu = torch.cuda.is_available() and not args.cpu_smoke
    shape = ["model.tiny.hidden_size=4096", "model.tiny.intermediate_size=12288", f"model.tiny.num_layers={args.layers}",
             "model.tiny.num_attention_heads=32", "model.tiny.num_key_value_heads=8", "model.tiny.head_dim=128",
             "model.tiny.tie_word_embeddings=false"] if gpu else []
    overrides = [
        "cluster.backend=local", f"cluster.use_gpu={str(gpu).lower()}", f"train.log_dir={log_dir}",
        f"train.steps={args.steps}", f"data.prompts_per_step={args.prompts}", f"agent.group_size={args.group}",
        f"agent.sampling.max_new_tokens={args.max_new if gpu else 16}",
        f"agent.max_concurrency={args.prompts * args.group}", "agent.max_turns=1",
        f"actor.params_dtype={'bfloat16' if gpu else 'float32'}", f"rollout.engine_dtype={'bfloat16' if gpu else 'float32'}",
        f"kernel_backend={'cuda' if gpu else 'cpu'}",
        "actor.max_tokens_per_gpu=16384", "train.save_interval=0",
        *(["data.size_profile=gpu"] if gpu else []), *shape,
    ]
    cfg = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"), overrides)
    summary = run(cfg)
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    steady = rows[1:] or rows
    # the final checkpoint (written once, at the last step) is not part of a steady-state step
    phases = sorted({k for r in steady for k in r if k.startswith("time/") and k != "time/save"})
    med = {p[5:]: statistics.median(r.get(p, 0.0) for r in steady) for p in phases}
    step_s = sum(med.values())
    toks = statistics.median(r["perf/tokens_per_s"] for r in steady)
    result = {
        "bench": "rl_step", "device": torch.cuda.get_device_name() if gpu else "cpu", "layers": args.layers if gpu else None,
        "prompts_per_step": args.prompts, "group_size": args.group, "max_new_tokens": args.max_new,
        "phase_seconds_median": med, "step_seconds": step_s, "dominant_phase": max(med, key=med.get),
        "tokens_per_s_per_gpu": toks, "nemo_rl_llama8b_tokens_per_s_per_gpu": NEMO_RL_TOKS_PER_GPU,
        "ratio_vs_nemo_rl": toks / NEMO_RL_TOKS_PER_GPU, "summary": summary, "command": " ".join(sys.argv),
    }
    emit_json(result, args.out, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
