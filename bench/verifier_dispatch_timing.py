"""What a speedup means when the reference is bound by host dispatch (issue 19, item 0). GPU only.

    python bench/verifier_dispatch_timing.py [--out results.json] [--trials N] [--cupti detached|attached|both]

Two tasks, each with a one-kernel CUDA candidate: ``chain`` (the reference is 64 small elementwise ops on a
4096-element vector: dispatch-bound) and ``relu`` (a 4096x4096 ReLU: bandwidth-bound). For each, the verifier's
speedup with ``timing_hide_dispatch`` off (dispatch gaps inside a call count) and on (the device spins after each
flush until the call is enqueued: device time only), each with the child's CUPTI detached after its profiler
sessions (``VerifierConfig.cupti_teardown=True``) and left attached (the default; rows ``*_cupti_attached``), next
to ``triton.testing.do_bench`` and a KernelBench-style
timer (256 MB fill, events around one call), both run here in the bench process on the same modules. Prints one
JSON object: per task and setting the verifier's t_ref/t_cand/speedup and its verdict, the reference timers'
figures, and the relative difference of each verifier speedup to do_bench's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import emit_json  # noqa: E402

TASKS = {
    "chain": ('''import torch
import torch.nn as nn


class Model(nn.Module):
    """64 small elementwise ops on a short vector: bound by host dispatch, not by the device."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        for _ in range(32):
            x = x * 1.0001
            x = x + 0.0001
        return x


def get_inputs():
    return [torch.randn(4096)]


def get_init_inputs():
    return []
''', "chain", "x"),
    "relu": ('''import torch
import torch.nn as nn


class Model(nn.Module):
    """ReLU of a 4096x4096 matrix: bound by memory bandwidth."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(4096, 4096)]


def get_init_inputs():
    return []
''', "relu", "x"),
}

CUDA_SRC = r'''
#include <ATen/cuda/CUDAContext.h>

__global__ void chain_kernel(const float* a, float* o, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) {
    float v = a[i];
    for (int k = 0; k < 32; ++k) { v = __fmul_rn(v, 1.0001f); v = __fadd_rn(v, 0.0001f); }
    o[i] = v;
  }
}
__global__ void relu_kernel(const float* a, float* o, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) o[i] = a[i] > 0.f ? a[i] : 0.f;
}
torch::Tensor chain(torch::Tensor a) {
  auto o = torch::empty_like(a);
  chain_kernel<<<(unsigned)((a.numel() + 255) / 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), o.data_ptr<float>(), a.numel());
  return o;
}
torch::Tensor relu(torch::Tensor a) {
  auto o = torch::empty_like(a);
  relu_kernel<<<(unsigned)((a.numel() + 255) / 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), o.data_ptr<float>(), a.numel());
  return o;
}
'''
CPP = "torch::Tensor chain(torch::Tensor a);\ntorch::Tensor relu(torch::Tensor a);"


def candidate(fn: str, arg: str) -> str:
    return (f'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

ext = load_inline(name="dispatch_bench", cpp_sources={CPP!r}, cuda_sources=r"""{CUDA_SRC}""",
                  functions=["chain", "relu"], extra_cuda_cflags=["-O3"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, {arg}):
        return ext.{fn}({arg})
''')


def kernelbench_timer(fn, trials: int = 100) -> float:
    """Median of KernelBench's cuda_event timer: a 256 MB fill, then events around one call."""
    import torch
    fill = torch.empty(32 * 1024 * 1024, dtype=torch.int64, device="cuda")
    times = []
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fill.fill_(0)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--trials", type=int, default=120, help="verifier timed trials per candidate")
    parser.add_argument("--cupti", choices=("detached", "attached", "both"), default="both",
                        help="the child's CUPTI after its profiler sessions (VerifierConfig.cupti_teardown); "
                             "'attached' rows carry the suffix _cupti_attached")
    args = parser.parse_args()

    import torch
    import triton.testing

    from verifier.config import VerifierConfig
    from verifier.evaluate import verify
    from verifier.tasks import load_task

    teardowns = {"detached": (True,), "attached": (False,), "both": (True, False)}[args.cupti]
    tmp = tempfile.mkdtemp(prefix="verifier-dispatch-")
    cache = os.path.join(tmp, "cache")
    results = {}
    for name, (task_src, fn, arg) in TASKS.items():
        path = os.path.join(tmp, f"{name}.py")
        with open(path, "w") as f:
            f.write(task_src)
        task = load_task(path)
        code = candidate(fn, arg)
        row = {}
        for teardown, hide in ((t, h) for t in teardowns for h in (False, True)):
            cfg = VerifierConfig(backend="cuda", build_cache_dir=cache, max_jobs=os.cpu_count(), run_timeout_s=120.0,
                                 num_timing_trials=args.trials, timing_hide_dispatch=hide, cupti_teardown=teardown,
                                 speedup_cap=1e6)   # the cap is a verdict rule: the chain's honest fusion is ~150x
            t0 = time.monotonic()
            r = verify(task, f"```python\n{code}\n```", cfg)
            key = ("hide_dispatch" if hide else "dispatch_counted") + ("" if teardown else "_cupti_attached")
            row[key] = {
                "category": r.category.value, "rule": r.rule, "speedup": r.speedup, "t_ref_ms": r.t_ref_ms,
                "t_cand_ms": r.t_cand_ms, "dispatch": r.details.get("dispatch"),
                "timing_trials": (r.details.get("timing") or {}).get("trials"),
                "seconds": round(time.monotonic() - t0, 1),
                "feedback": r.feedback[:200]}
        # the same modules in this process, under the other timers
        ns: dict = {}
        exec(compile(task_src, path, "exec"), ns)  # noqa: S102 - the bench's own task source
        ref = ns["Model"]().cuda()
        cns: dict = {"__name__": "bench_candidate"}
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(tmp, "ext")
        exec(compile(code, "candidate", "exec"), cns)  # noqa: S102 - the bench's own candidate
        cand = cns["ModelNew"]().cuda()
        x = [t.cuda() for t in ns["get_inputs"]()]
        with torch.no_grad():
            db = {k: triton.testing.do_bench(lambda m=m: m(*x), warmup=25, rep=200, return_mode="median")
                  for k, m in (("ref", ref), ("cand", cand))}
            kb = {k: kernelbench_timer(lambda m=m: m(*x)) for k, m in (("ref", ref), ("cand", cand))}
        row["do_bench"] = {"t_ref_ms": db["ref"], "t_cand_ms": db["cand"], "speedup": db["ref"] / db["cand"]}
        row["kernelbench_timer"] = {"t_ref_ms": kb["ref"], "t_cand_ms": kb["cand"], "speedup": kb["ref"] / kb["cand"]}
        for key in [k for k in row if k.startswith(("dispatch_counted", "hide_dispatch"))]:
            s = row[key]["speedup"]
            row[key]["vs_do_bench"] = None if s is None else s / row["do_bench"]["speedup"] - 1.0
        results[name] = row
        print({name: row}, file=sys.stderr, flush=True)
    emit_json({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "trials": args.trials,
               "tasks": results}, args.out, indent=1, default=str)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
