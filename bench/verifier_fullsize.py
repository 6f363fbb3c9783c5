"""What one verifier check costs on KernelBench level-1 tasks at their own full sizes (issue 19, item 0).

    python bench/verifier_fullsize.py [--device cuda|cpu] [--scale N] [--tasks relu,sigmoid,softmax] [--out F]

Writes KernelBench-format task files (our own) for ReLU, Sigmoid and Softmax(dim=1) on ``torch.rand(4096 / N,
393216)`` float32 (N = ``--scale``, 1 by default: 6.4 GB in and 6.4 GB out per call) into a temp dir, each with an
honest one-kernel candidate (CUDA via ``load_inline`` on ``--device cuda``, the farm bench's kernels; a C++ loop on
``--device cpu``), runs one ``verify()`` per task with the default config, and prints one JSON object: per task the
verdict, speedup, wall seconds, ``phase_seconds``, the parent's cost breakdown (``costs``), the child's
(``child_seconds``), the seconds the device was held exclusively, and the bandwidth lower bound of all the
check's trials (the bytes every reference and candidate call of the check reads and writes, over the H200's
4.8 TB/s) beside it. Progress lines go to stderr.

On a CPU host: ``python bench/verifier_fullsize.py --device cpu --scale 64`` (100 MB per call, about a minute
per task); the H200 run: ``python bench/verifier_fullsize.py --device cuda --out bench/results/verifier_fullsize_h200.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.common import emit_json  # noqa: E402
from megatron_rl.fsutil import write_text_atomic  # noqa: E402

ROWS, COLS = 4096, 393216
H200_BYTES_PER_S = 4.8e12

_TASK = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """{doc}"""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return {expr}


batch_size = {rows}
dim = {cols}


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return []
'''

TASKS = {   # name -> (docstring, reference expression, farm-bench stem)
    "relu": ("ReLU of a full-size KernelBench input.", "torch.relu(x)", "7_ReLU"),
    "sigmoid": ("Sigmoid of a full-size KernelBench input.", "torch.sigmoid(x)", "9_Sigmoid"),
    "softmax": ("Softmax over the 393216 columns of a full-size KernelBench input.", "torch.softmax(x, dim=1)",
                "12_Softmax"),
}

# honest CPU kernels (one loop each; softmax accumulates in double, as an honest float32 kernel may)
_CPP = r'''
#include <cmath>
#include <cstdint>

static void expect_f32(const torch::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == torch::kFloat32, "expected a contiguous float32 tensor");
}

torch::Tensor relu_fwd(torch::Tensor a) {
  expect_f32(a);
  auto out = torch::empty_like(a);
  const float* x = a.data_ptr<float>(); float* o = out.data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) o[i] = x[i] > 0.f ? x[i] : 0.f;
  return out;
}

torch::Tensor sigmoid_fwd(torch::Tensor a) {
  expect_f32(a);
  auto out = torch::empty_like(a);
  const float* x = a.data_ptr<float>(); float* o = out.data_ptr<float>();
  for (int64_t i = 0, n = a.numel(); i < n; ++i) o[i] = 1.f / (1.f + std::exp(-x[i]));
  return out;
}

torch::Tensor softmax_fwd(torch::Tensor a) {
  expect_f32(a);
  TORCH_CHECK(a.dim() == 2, "2D input expected");
  auto out = torch::empty_like(a);
  const int64_t r = a.size(0), c = a.size(1);
  const float* x = a.data_ptr<float>(); float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < r; ++i) {
    const float* in = x + i * c; float* y = o + i * c;
    float m = -INFINITY;
    for (int64_t j = 0; j < c; ++j) m = in[j] > m ? in[j] : m;
    double s = 0.0;
    for (int64_t j = 0; j < c; ++j) s += std::exp((double)in[j] - m);
    const double inv = 1.0 / s;
    for (int64_t j = 0; j < c; ++j) y[j] = (float)(std::exp((double)in[j] - m) * inv);
  }
  return out;
}
'''


def cpu_candidate(name: str) -> str:
    return f'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

SRC = r"""{_CPP}"""

ext = load_inline(name="fullsize_cpu", cpp_sources=SRC, functions=["relu_fwd", "sigmoid_fwd", "softmax_fwd"],
                  extra_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return ext.{name}_fwd(x)
'''


def cuda_candidate(name: str) -> str:
    """The farm bench's honest one-kernel candidates (grid-stride elementwise; one block per softmax row)."""
    from bench.verifier_farm_throughput import _softmax, _unary
    stem = TASKS[name][2]
    if name == "softmax":
        return _softmax("correct", f"fullsize_{name}", 512)
    return _unary(stem, "correct", f"fullsize_{name}", 256)


def task_source(name: str, rows: int) -> str:
    doc, expr, _ = TASKS[name]
    return _TASK.format(doc=doc, expr=expr, rows=rows, cols=COLS)


def bandwidth_bound_s(result, nbytes_per_call: int) -> dict:
    """The device-time lower bound of every reference and candidate call the check made (each reads its input
    and writes its output once), at the H200's bandwidth."""
    d = result.details or {}
    timing = d.get("timing") or {}
    timed = sum(int((timing.get(r) or {}).get("n", 0)) for r in ("ref", "cand")) * int(timing.get("calls_per_trial", 1))
    warmup = 2 * 3    # default num_warmup per runner
    trials = len(d.get("trials") or []) + (1 if d.get("ablation") else 0) + len(d.get("audits") or [])
    calls = timed + warmup + 2 * trials       # a correctness trial runs the candidate and the parent's reference
    return {"calls": calls, "bytes": calls * nbytes_per_call,
            "seconds": round(calls * nbytes_per_call / H200_BYTES_PER_S, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--scale", type=int, default=1, help=f"divide the first dim ({ROWS}) by this")
    parser.add_argument("--tasks", default="relu,sigmoid,softmax",
                        help="comma-separated; a task named again runs again in the same process (row 'relu#2'): "
                             "the first check of a process pays the parent's one-time device set-up")
    parser.add_argument("--out", default=None)
    parser.add_argument("--run-timeout-s", type=float, default=None, help="VerifierConfig.run_timeout_s (default: "
                        "the config's)")
    args = parser.parse_args()
    if args.scale < 1 or ROWS % args.scale:
        parser.error(f"--scale must divide {ROWS}")
    names = [n.strip() for n in args.tasks.split(",") if n.strip()]
    unknown = sorted(set(names) - set(TASKS))
    if unknown:
        parser.error(f"unknown tasks {unknown}; known: {sorted(TASKS)}")

    import torch

    from verifier.config import VerifierConfig
    from verifier.evaluate import verify
    from verifier.tasks import load_task

    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = ROWS // args.scale
    nbytes = 2 * rows * COLS * 4          # one call reads its input and writes its output
    tmp = tempfile.mkdtemp(prefix="verifier-fullsize-")
    extra = {} if args.run_timeout_s is None else {"run_timeout_s": args.run_timeout_s}
    cfg = VerifierConfig(backend=args.device, build_cache_dir=os.path.join(tmp, "cache"), max_jobs=os.cpu_count(),
                         **extra)
    out: dict = {"device": args.device, "scale": args.scale, "shape": [rows, COLS], "bytes_per_call": nbytes,
                 "torch": torch.__version__, "host": platform.node(),
                 "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" and torch.cuda.is_available() else None,
                 "tasks": {}}
    try:
        for i, name in enumerate(names):
            key = name if name not in names[:i] else f"{name}#{names[:i + 1].count(name)}"
            path = os.path.join(tmp, f"fullsize_{name}.py")
            with open(path, "w") as f:
                f.write(task_source(name, rows))
            code = cuda_candidate(name) if args.device == "cuda" else cpu_candidate(name)
            print(f"[fullsize] {name}: {rows}x{COLS} float32 on {args.device} ...", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            r = verify(load_task(path), f"```python\n{code}\n```", cfg)
            wall = time.monotonic() - t0
            d = r.details or {}
            row = {"verdict": r.category.value, "rule": r.rule, "speedup": r.speedup, "t_ref_ms": r.t_ref_ms,
                   "t_cand_ms": r.t_cand_ms, "wall_s": round(wall, 2), "build": d.get("build"),
                   "device_use": d.get("device_use"), "device_exclusive_s": d.get("device_exclusive_s"),
                   "bandwidth_bound": bandwidth_bound_s(r, nbytes), "phase_seconds": d.get("phase_seconds"),
                   "parent_seconds": d.get("parent_seconds"), "costs": d.get("costs"),
                   "child_seconds": d.get("child_seconds"), "handover": d.get("handover"),
                   "timing_trials": (d.get("timing") or {}).get("trials"),
                   "precision_probe": d.get("precision_probe"), "ablation": d.get("ablation"),
                   "feedback": None if r.category.value == "pass" else r.feedback[:400]}
            out["tasks"][key] = row
            print(f"[fullsize] {key}: {row['verdict']} speedup={r.speedup} wall={wall:.1f}s exclusive="
                  f"{row['device_exclusive_s']}s bound={row['bandwidth_bound']['seconds']}s phases="
                  f"{row['phase_seconds']} handover={row['handover']}", file=sys.stderr, flush=True)
            if args.out:   # each task's row is kept even if a later one runs out of time
                write_text_atomic(args.out, json.dumps(out, indent=1, default=str) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    emit_json(out, args.out, indent=1, default=str)


if __name__ == "__main__":
    main()
