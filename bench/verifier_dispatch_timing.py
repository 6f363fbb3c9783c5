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
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
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


# do_bench in a process of its own: with nothing else in it (``fresh``), or confined and with the environment the
# verifier gives its children (``isolated``: ``sandbox.child_env`` + ``apply_isolation``, started with ``-I -B``).
# Each also reports the host's enqueue time per call (no sync), which is what a dispatch-bound call's device time
# follows, and how many threads the process holds.
_DO_BENCH_SCRIPT = r'''
import json, os, statistics, sys, time
args = json.loads(sys.argv[1])
sys.path.insert(0, args["repo"])
if args["isolate"]:
    from verifier import sandbox
    from verifier.config import VerifierConfig
    report = sandbox.apply_isolation(sandbox.policy_for(VerifierConfig(backend="cuda"), [args["workdir"]]))
import torch, triton.testing
ns = {}
exec(compile(open(args["task"]).read(), args["task"], "exec"), ns)
cns = {"__name__": "bench_candidate"}
exec(compile(args["code"], "candidate", "exec"), cns)
ref, cand = ns["Model"]().cuda(), cns["ModelNew"]().cuda()
x = [t.cuda() for t in ns["get_inputs"]()]
out = {"threads": len(os.listdir("/proc/self/task"))}
with torch.no_grad():
    for k, m in (("ref", ref), ("cand", cand)):
        out[k + "_do_bench_ms"] = triton.testing.do_bench(lambda: m(*x), warmup=25, rep=200, return_mode="median")
        enq = []
        for i in range(200):
            t0 = time.perf_counter(); m(*x); enq.append((time.perf_counter() - t0) * 1e3)
            if i % 10 == 9:
                torch.cuda.synchronize()
        out[k + "_enqueue_ms"] = statistics.median(enq)
print("RESULT " + json.dumps(out))
'''


def do_bench_in_process(task_path: str, code: str, ext_dir: str, workdir: str, isolate: bool) -> dict:
    """``_DO_BENCH_SCRIPT`` in a new process (see there); its figures, or the error it ended with."""
    from verifier.config import VerifierConfig
    from verifier.devices import get_backend
    from verifier.sandbox import child_env

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    payload = json.dumps({"repo": repo, "task": task_path, "code": code, "isolate": isolate, "workdir": workdir})
    if isolate:
        env = child_env(VerifierConfig(backend="cuda"), get_backend("cuda"), 0, workdir)
        argv = [sys.executable, "-I", "-B", "-c", _DO_BENCH_SCRIPT, payload]
    else:
        env = dict(os.environ)
        argv = [sys.executable, "-c", _DO_BENCH_SCRIPT, payload]
    env["TORCH_EXTENSIONS_DIR"] = ext_dir   # the build made in this process: found, not rebuilt
    p = subprocess.run(argv, env=env, cwd=workdir, capture_output=True, text=True, timeout=600)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"exit {p.returncode}: {p.stderr[-800:]}"}


def host_enqueue_ms(fn, calls: int = 200) -> float:
    """Median host time to enqueue one call (synchronised every ten calls), in this process."""
    import torch
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if i % 10 == 9:
            torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--trials", type=int, default=120, help="verifier timed trials per candidate")
    parser.add_argument("--repeats", type=int, default=1,
                        help="verifier checks per task and setting (the spread of a dispatch-bound reference)")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=sorted(TASKS))
    parser.add_argument("--no-hide", action="store_true", help="skip the timing_hide_dispatch rows")
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
    for name in args.tasks:
        task_src, fn, arg = TASKS[name]
        path = os.path.join(tmp, f"{name}.py")
        with open(path, "w") as f:
            f.write(task_src)
        task = load_task(path)
        code = candidate(fn, arg)
        row = {}
        hides = (False,) if args.no_hide else (False, True)
        for teardown, hide, rep in ((t, h, r) for t in teardowns for h in hides for r in range(args.repeats)):
            cfg = VerifierConfig(backend="cuda", build_cache_dir=cache, max_jobs=os.cpu_count(), run_timeout_s=120.0,
                                 num_timing_trials=args.trials, timing_hide_dispatch=hide, cupti_teardown=teardown,
                                 speedup_cap=1e6)   # the cap is a verdict rule: the chain's honest fusion is ~150x
            t0 = time.monotonic()
            r = verify(task, f"```python\n{code}\n```", cfg)
            key = (("hide_dispatch" if hide else "dispatch_counted") + ("" if teardown else "_cupti_attached")
                   + (f"_run{rep + 1}" if rep else ""))
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
            enqueue = {k: host_enqueue_ms(lambda m=m: m(*x)) for k, m in (("ref", ref), ("cand", cand))}
        row["do_bench"] = {"t_ref_ms": db["ref"], "t_cand_ms": db["cand"], "speedup": db["ref"] / db["cand"],
                           "ref_enqueue_ms": enqueue["ref"], "cand_enqueue_ms": enqueue["cand"],
                           "threads": len(os.listdir("/proc/self/task")), "python_threads": threading.active_count()}
        for label, isolate in (("do_bench_fresh_process", False), ("do_bench_isolated_process", True)):
            workdir = tempfile.mkdtemp(prefix=f"{label}-", dir=tmp)
            ext = os.path.join(workdir, "ext")   # a copy inside the only place an isolated process may write
            shutil.copytree(os.path.join(tmp, "ext"), ext)
            sub = do_bench_in_process(path, code, ext, workdir, isolate)
            if "error" not in sub:
                sub.update(t_ref_ms=sub["ref_do_bench_ms"], t_cand_ms=sub["cand_do_bench_ms"],
                           speedup=sub["ref_do_bench_ms"] / sub["cand_do_bench_ms"])
            row[label] = sub
        row["kernelbench_timer"] = {"t_ref_ms": kb["ref"], "t_cand_ms": kb["cand"], "speedup": kb["ref"] / kb["cand"]}
        for key in [k for k in row if k.startswith(("dispatch_counted", "hide_dispatch"))]:
            s = row[key]["speedup"]
            row[key]["vs_do_bench"] = None if s is None else s / row["do_bench"]["speedup"] - 1.0
            for other in ("do_bench_fresh_process", "do_bench_isolated_process"):
                if s is not None and "speedup" in row[other]:
                    row[key]["vs_" + other] = s / row[other]["speedup"] - 1.0
        results[name] = row
        print({name: row}, file=sys.stderr, flush=True)
    emit_json({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "trials": args.trials,
               "tasks": results}, args.out, indent=1, default=str)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
