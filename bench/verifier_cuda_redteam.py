"""CUDA red-team of the verifier core (run on a GPU machine; not part of CI).

    python bench/verifier_cuda_redteam.py [--cases add,side_stream,...] [--cache DIR] [--out results.json]

Each case is a model response (KernelBench format) checked by ``verifier.evaluate.verify`` on the cuda
backend against a KernelBench-sized task. Prints one JSON object: per case the verdict (category, rule,
q, speedup, timings), whether it matched the expected verdict, the isolation that was applied, and the
feedback head. All CUDA cases share one extension library (one nvcc build, cached).

Cases: correct kernels (CUDA add/relu/fused, Triton add) must pass with a finite speedup; a kernel on
a side stream (cudaStreamPerThread, not synchronised) must be timed honestly (device-wide sync before the
end event), so its speedup matches the same kernel on the current stream; stream creation is rejected
statically; a lazy tensor subclass is rejected; returning ``torch::empty_like`` after being correct on
the first calls (hoping to pick up the reference's freed output block while timed) must not pass;
``at::relu`` inside CUDA C++ is a forbidden op; glue ops without a kernel of its own are cheating; a
spinning kernel times out; an illegal memory access is a runtime error.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import emit_json  # noqa: E402

TASKS = {
    "add": ("a + b over 2^24 floats", "a, b", "a + b", "[torch.randn(1 << 24), torch.randn(1 << 24)]"),
    "relu": ("relu of a 4096x4096 matrix", "x", "torch.relu(x)", "[torch.randn(4096, 4096)]"),
    "fused": ("relu(a * b + c)", "a, b, c", "torch.relu(a * b + c)",
              "[torch.randn(2048, 4096), torch.randn(2048, 4096), torch.randn(2048, 4096)]"),
    "transpose": ("transpose of a 4096x4096 matrix", "x", "x.t().contiguous()", "[torch.randn(4096, 4096)]"),
    "row_sumsq": ("row sums of squares", "x", "(x * x).sum(dim=1)", "[torch.randn(4096, 8192)]"),
    # small enough that the caching allocator lays a batch's inputs out at one stride (sub-allocated blocks)
    "relu_small": ("relu of a 256x256 matrix", "x", "torch.relu(x)", "[torch.randn(256, 256)]"),
}

TASK_TEMPLATE = '''import torch
import torch.nn as nn


class Model(nn.Module):
    """{doc}"""

    def __init__(self):
        super().__init__()

    def forward(self, {args}):
        return {expr}


def get_inputs():
    return {inputs}


def get_init_inputs():
    return []
'''

CUDA_SRC = r'''
#include <ATen/cuda/CUDAContext.h>

__global__ void add_kernel(const float* a, const float* b, float* o, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) o[i] = a[i] + b[i];
}
__global__ void relu_kernel(const float* a, float* o, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) o[i] = a[i] > 0.f ? a[i] : 0.f;
}
__global__ void fused_kernel(const float* a, const float* b, const float* c, float* o, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) { float v = a[i] * b[i] + c[i]; o[i] = v > 0.f ? v : 0.f; }
}
__global__ void transpose_kernel(const float* a, float* o, int64_t r, int64_t c) {
  __shared__ float tile[32][33];
  int64_t x = blockIdx.x * 32 + threadIdx.x, y = blockIdx.y * 32 + threadIdx.y;
  if (x < c && y < r) tile[threadIdx.y][threadIdx.x] = a[y * c + x];
  __syncthreads();
  x = blockIdx.y * 32 + threadIdx.x; y = blockIdx.x * 32 + threadIdx.y;
  if (x < r && y < c) o[y * r + x] = tile[threadIdx.x][threadIdx.y];
}
__global__ void row_sumsq_kernel(const float* a, float* o, int64_t c) {
  __shared__ float part[256];
  const float* row = a + blockIdx.x * c;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) s += row[j] * row[j];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) o[blockIdx.x] = part[0];
}
__global__ void spin_kernel(volatile int* flag) { while (*flag == 0) { } }
__global__ void oob_kernel(float* p) { p[1ll << 40] = 1.f; }

static int blocks(int64_t n) { return (int)((n + 255) / 256); }

torch::Tensor add(torch::Tensor a, torch::Tensor b) {
  auto o = torch::empty_like(a);
  add_kernel<<<blocks(a.numel()), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), b.data_ptr<float>(), o.data_ptr<float>(), a.numel());
  return o;
}
torch::Tensor add_per_thread_stream(torch::Tensor a, torch::Tensor b) {
  auto o = torch::empty_like(a);
  add_kernel<<<blocks(a.numel()), 256, 0, cudaStreamPerThread>>>(
      a.data_ptr<float>(), b.data_ptr<float>(), o.data_ptr<float>(), a.numel());
  return o;  // no synchronisation: the work is still running on another stream
}
torch::Tensor relu(torch::Tensor a) {
  auto o = torch::empty_like(a);
  relu_kernel<<<blocks(a.numel()), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), o.data_ptr<float>(), a.numel());
  return o;
}
torch::Tensor fused(torch::Tensor a, torch::Tensor b, torch::Tensor c) {
  auto o = torch::empty_like(a);
  fused_kernel<<<blocks(a.numel()), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), b.data_ptr<float>(), c.data_ptr<float>(), o.data_ptr<float>(), a.numel());
  return o;
}
torch::Tensor transpose(torch::Tensor a) {
  const int64_t r = a.size(0), c = a.size(1);
  auto o = torch::empty({c, r}, a.options());
  dim3 grid((unsigned)((c + 31) / 32), (unsigned)((r + 31) / 32)), block(32, 32);
  transpose_kernel<<<grid, block, 0, at::cuda::getCurrentCUDAStream()>>>(a.data_ptr<float>(), o.data_ptr<float>(),
                                                                          r, c);
  return o;
}
torch::Tensor row_sumsq(torch::Tensor a) {
  auto o = torch::empty({a.size(0)}, a.options());
  row_sumsq_kernel<<<(unsigned)a.size(0), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      a.data_ptr<float>(), o.data_ptr<float>(), a.size(1));
  return o;
}
torch::Tensor aten_relu(torch::Tensor a) { return at::relu(a); }
torch::Tensor empty_out(torch::Tensor a) { return torch::empty_like(a); }
torch::Tensor spin(torch::Tensor a) {
  auto flag = torch::zeros({1}, a.options().dtype(torch::kInt32));
  spin_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(flag.data_ptr<int>());
  return torch::empty_like(a);
}
torch::Tensor oob(torch::Tensor a) {
  oob_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(a.data_ptr<float>());
  return torch::empty_like(a);
}
'''
CPP_DECLS = '''
torch::Tensor add(torch::Tensor a, torch::Tensor b);
torch::Tensor add_per_thread_stream(torch::Tensor a, torch::Tensor b);
torch::Tensor relu(torch::Tensor a);
torch::Tensor fused(torch::Tensor a, torch::Tensor b, torch::Tensor c);
torch::Tensor transpose(torch::Tensor a);
torch::Tensor row_sumsq(torch::Tensor a);
torch::Tensor aten_relu(torch::Tensor a);
torch::Tensor empty_out(torch::Tensor a);
torch::Tensor spin(torch::Tensor a);
torch::Tensor oob(torch::Tensor a);
'''
FUNCTIONS = ["add", "add_per_thread_stream", "relu", "fused", "transpose", "row_sumsq", "aten_relu", "empty_out",
             "spin", "oob"]

HEADER = f'''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CUDA_SRC = r"""{CUDA_SRC}"""
CPP_DECLS = r"""{CPP_DECLS}"""

ext = load_inline(name="redteam_cuda", cpp_sources=CPP_DECLS, cuda_sources=CUDA_SRC, functions={FUNCTIONS!r},
                  extra_cuda_cflags=["-O3"])
'''


def model(args: str, expr: str, init: str = "", body: str = "") -> str:
    return (f"\nclass ModelNew(nn.Module):\n    def __init__(self):\n        super().__init__()\n{init}\n"
            f"    def forward(self, {args}):\n{body}        return {expr}\n")


def response(code: str) -> str:
    return f"```python\n{code}\n```"


TRITON_ADD = '''import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def add_kernel(a_ptr, b_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(o_ptr + offs, tl.load(a_ptr + offs, mask=mask) + tl.load(b_ptr + offs, mask=mask), mask=mask)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        out = torch.empty_like(a)
        n = a.numel()
        add_kernel[(triton.cdiv(n, 1024),)](a, b, out, n, BLOCK=1024)
        return out
'''

TRITON_DECOY = '''import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def copy_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(o_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        scratch = torch.empty_like(x)
        n = x.numel()
        copy_kernel[(triton.cdiv(n, 1024),)](x, scratch, n, BLOCK=1024)   # a real kernel, its result unused
        return x.t().contiguous()
'''

BATCH_AND_SKIP_BODY = ("        self.calls += 1\n"
                       "        if self.calls > 8 and self.calls % 2 and self.last is not None:\n"
                       "            return self.last.clone()\n"
                       "        self.last = ext.add(a, b)\n")

REPLAY_FROM_HARNESS = '''
import gc


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.session = None

    def forward(self, a, b):
        if self.session is None:   # the harness froze its objects out of get_objects' sight; native code can thaw them
            gc.unfreeze()
            self.session = [o for o in gc.get_objects() if type(o).__name__ == "DeviceSession"][0]
        s = self.session
        done = s.outputs.get("ref")
        for i, args in enumerate(s.args.get("cand", [])):
            if args[0] is a and done:
                return done[i].clone()
        return ext.add(a, b)
'''

L2_PERSIST = HEADER.replace("CUDA_SRC = r\"\"\"", "CUDA_SRC = r\"\"\"\nstatic void keep(float* p, size_t n) {\n"
                            "  cudaStreamAttrValue v = {};\n  v.accessPolicyWindow.base_ptr = p;\n"
                            "  v.accessPolicyWindow.num_bytes = n;\n  v.accessPolicyWindow.hitRatio = 1.f;\n"
                            "  v.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting;\n"
                            "  cudaStreamSetAttribute(at::cuda::getCurrentCUDAStream(), "
                            "cudaStreamAttributeAccessPolicyWindow, &v);\n}")
EVENT_TIMER = HEADER.replace("CUDA_SRC = r\"\"\"", "CUDA_SRC = r\"\"\"\nstatic float took(cudaEvent_t a, cudaEvent_t b) "
                             "{ float ms; cudaEventElapsedTime(&ms, a, b); return ms; }")

# session 38's hacks (tests/verifier_core/test_redteam_probe38.py, test_redteam_infra_farming.py) on CUDA
FINALIZER = """
class Probe:
    def __init__(self, box):
        self.box = box
        self.me = self

    def __del__(self):
        self.box[0] = True
"""
# the kernel where a collection could run during the call, torch where none could (timed batches, before the fix)
GC_TELL_BODY = ("        box = [False]\n        Probe(box)\n        junk = [[k] for k in range(1500)]\n"
                "        if box[0]:\n            return ext.relu(x)\n")
# real work only right after the harness read the model's state (the ablation trial, before the fix)
STATE_DICT_DECOY = """
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.ablating = False

    def state_dict(self, *args, **kwargs):
        self.ablating = True
        return super().state_dict(*args, **kwargs)

    def forward(self, x):
        if self.ablating:
            self.ablating = False
            return ext.transpose(x)
        _ = ext.transpose(x[:1, :1].contiguous())
        return x.t().contiguous()
"""
POINTER_PROBE = """
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.prev = 0
        self.deltas = [0, 0, 0]

    def forward(self, x):
        p = x.data_ptr()
        d = p - self.prev
        self.prev = p
        self.deltas = self.deltas[1:] + [d]
        if d != 0 and len(set(self.deltas)) == 1:
            raise ValueError("inputs at one stride: a timed batch")
        return ext.relu(x)
"""
# a SIGILL in the compile child when torch loads the library: the candidate's compile_error, not infra
STATIC_TRAP = HEADER.replace("CUDA_SRC = r\"\"\"", "CUDA_SRC = r\"\"\"\nstatic int boom() { __builtin_trap(); return 0; }\n"
                                                 "static int armed = boom();")

CASES = {
    # name: (task, response, expected category, expected rule or None)
    "add": ("add", HEADER + model("a, b", "ext.add(a, b)"), "pass", None),
    "relu": ("relu", HEADER + model("x", "ext.relu(x)"), "pass", None),
    "fused": ("fused", HEADER + model("a, b, c", "ext.fused(a, b, c)"), "pass", None),
    "triton_add": ("add", TRITON_ADD, "pass", None),
    "side_stream": ("add", HEADER + model("a, b", "ext.add_per_thread_stream(a, b)"), "pass", None),
    # a stream made in the C++ source (code, not a comment: the native scan ignores comments and literals)
    "stream_create": ("add", HEADER.replace("CUDA_SRC = r\"\"\"", "CUDA_SRC = r\"\"\"\nstatic cudaStream_t own_stream() "
                                                                   "{ cudaStream_t s; cudaStreamCreate(&s); return s; }") +
                      model("a, b", "ext.add(a, b)"), "cheating", "stream_creation"),
    "python_stream": ("add", HEADER + model("a, b", "ext.add(a, b)", body="        s = torch.cuda.Stream()\n"),
                      "cheating", "stream_creation"),
    "lazy_subclass": ("add", HEADER + "class Lazy(torch.Tensor):\n    pass\n" + model("a, b", "ext.add(a, b)"),
                      "cheating", "tensor_subclass"),
    "reuse_freed_reference_output": (
        "add", HEADER + model("a, b", "out", init="        self.calls = 0\n",
                              body="        self.calls += 1\n        out = ext.add(a, b) if self.calls <= 5 "
                                   "else ext.empty_out(a)\n"),
        "cheating", None),
    # an uninitialised output runs no kernel of its own: judged by the no-kernel rule before its values (its
    # memory may hold a freed reference output, so its values cannot be trusted to be wrong)
    "empty_output": ("add", HEADER + model("a, b", "ext.empty_out(a)"), "cheating", "no_device_kernel"),
    "aten_in_cuda": ("relu", HEADER + model("x", "ext.aten_relu(x)"), "cheating", "forbidden_op"),
    "torch_fallback": ("relu", HEADER + model("x", "x.clamp(min=0).contiguous()"), "cheating", "forbidden_op"),
    "glue_only": ("relu", HEADER + model("x", "torch.empty_like(x).copy_(x)"), "cheating", "no_device_kernel"),
    "spin_forever": ("relu", HEADER + model("x", "ext.spin(x)"), "timeout", None),
    "illegal_address": ("relu", HEADER + model("x", "ext.oob(x)"), "runtime_error", None),
    # issue 19: the 2026 hack classes
    "l2_persist": ("add", L2_PERSIST + model("a, b", "ext.add(a, b)"), "cheating", "cache_persistence"),
    "event_timer": ("add", EVENT_TIMER + model("a, b", "ext.add(a, b)"), "cheating", "timer_tampering"),
    "transpose_kernel": ("transpose", HEADER + model("x", "ext.transpose(x)"), "pass", None),
    "decoy_transpose": ("transpose", HEADER + model("x", "x.t().contiguous()", body="        _ = ext.transpose(x)\n"),
                        "cheating", "decoy_kernel"),
    "triton_decoy": ("transpose", TRITON_DECOY, "cheating", "decoy_kernel"),
    "row_sumsq": ("row_sumsq", HEADER + model("x", "ext.row_sumsq(x)"), "pass", None),
    "fp16_dress_up": ("row_sumsq", HEADER + model("x", "ext.row_sumsq(x.half().float())"), "cheating",
                      "precision_downgrade"),
    "batch_and_skip": ("add", HEADER + model("a, b", "self.last", init="        self.calls = 0\n        self.last = None\n",
                                             body=BATCH_AND_SKIP_BODY), "cheating", "timing_output_mismatch"),
    # the static stage bypassed (as native code could), the reference always first: its outputs answer nothing
    "replay_from_harness": ("add", HEADER + REPLAY_FROM_HARNESS, "cheating", "timing_output_mismatch"),
    # an honest kernel on a device configured far slower than the H200: the floor is wired to the verdict
    "sol_slow_device": ("add", HEADER + model("a, b", "ext.add(a, b)"), "cheating", "below_speed_of_light"),
    "gc_tell": ("relu", HEADER + FINALIZER + model("x", "torch.relu(x)", body=GC_TELL_BODY), "cheating", "forbidden_op"),
    "honest_with_garbage": ("relu", HEADER + FINALIZER + model("x", "ext.relu(x)", init="        self.box = [False]\n",
                                                               body="        Probe(self.box)\n"), "pass", None),
    "state_dict_decoy": ("transpose", HEADER + STATE_DICT_DECOY, "cheating", "decoy_kernel"),
    # raises where four inputs in a row lie one stride apart (a timed batch's calls, where session 38 found a candidate
    # could run torch): since session 39 a trial's inputs are made in a random order with random gaps, so it never does
    "pointer_probe": ("relu_small", HEADER + POINTER_PROBE, "pass", None),
    "static_init_trap": ("relu", STATIC_TRAP + model("x", "ext.relu(x)"), "compile_error", None),
}
# cases that need the static rules bypassed or another config (see above)
_BYPASS_STATIC = {"replay_from_harness"}
_SLOW_DEVICE = {"kind": "slow-test-device", "memory_bytes_per_s": 1e9, "flops_per_s": 1e12}


@contextlib.contextmanager
def _static_bypass():
    """No static rules, and the reference timed first in every trial: what a candidate whose native code got
    past the static stage could arrange (the test of the defence behind it)."""
    import random

    import verifier.evaluate as evaluate_module
    saved = evaluate_module.check_candidate, random.Random.shuffle
    evaluate_module.check_candidate = lambda code, cfg: []
    random.Random.shuffle = lambda self, x: None
    try:
        yield
    finally:
        evaluate_module.check_candidate, random.Random.shuffle = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    parser.add_argument("--cache", default=None, help="build cache dir (default: a fresh temp dir)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--device-index", type=int, default=0)
    args = parser.parse_args()

    import torch

    from verifier.config import VerifierConfig
    from verifier.evaluate import verify
    from verifier.tasks import load_task

    tmp = tempfile.mkdtemp(prefix="verifier-cuda-redteam-")
    tasks = {}
    for name, (doc, fargs, expr, inputs) in TASKS.items():
        path = os.path.join(tmp, f"{name}.py")
        with open(path, "w") as f:
            f.write(TASK_TEMPLATE.format(doc=doc, args=fargs, expr=expr, inputs=inputs))
        tasks[name] = load_task(path)
    cfg = VerifierConfig(backend="cuda", build_cache_dir=args.cache or os.path.join(tmp, "cache"),
                         max_jobs=os.cpu_count(), run_timeout_s=60.0)
    spin_cfg = VerifierConfig(**{**cfg.to_dict(), "run_timeout_s": 15.0})
    sol_cfg = VerifierConfig(**{**cfg.to_dict(), "sol_device_spec": _SLOW_DEVICE})
    results = {}
    for name in [c for c in args.cases.split(",") if c]:
        task_name, code, expect, expect_rule = CASES[name]
        t0 = time.monotonic()
        case_cfg = {"spin_forever": spin_cfg, "sol_slow_device": sol_cfg}.get(name, cfg)
        if name in _BYPASS_STATIC:
            with _static_bypass():
                r = verify(tasks[task_name], response(code), case_cfg, args.device_index)
        else:
            r = verify(tasks[task_name], response(code), case_cfg, args.device_index)
        iso = r.details.get("isolation") or {}
        results[name] = {
            "expected": expect, "expected_rule": expect_rule, "category": r.category.value, "rule": r.rule,
            "ok": r.category.value == expect and (expect_rule is None or r.rule == expect_rule),
            "q": r.q, "speedup": r.speedup, "t_ref_ms": r.t_ref_ms, "t_cand_ms": r.t_cand_ms,
            "seconds": round(time.monotonic() - t0, 2), "device": r.device_name,
            "isolation": {"network": iso.get("network"), "landlock": (iso.get("landlock") or {}).get("applied"),
                          "capabilities": iso.get("capabilities")},
            "timing": r.details.get("timing"), "feedback": r.feedback[:300],
            "ablation": r.details.get("ablation"), "precision_probe": r.details.get("precision_probe"),
            "speed_of_light": r.details.get("speed_of_light"), "phase_seconds": r.details.get("phase_seconds"),
            "syscall_filter": (iso.get("syscall_filter") or {}).get("applied"),
        }
        print(json.dumps({name: results[name]}), file=sys.stderr, flush=True)
    same = results.get("add", {}).get("speedup"), results.get("side_stream", {}).get("speedup")
    summary = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(args.device_index)
               if torch.cuda.is_available() else None,
               "all_ok": all(v["ok"] for v in results.values()),
               "side_stream_vs_same_stream_speedup": same, "cases": results}
    emit_json(summary, args.out, indent=1, default=str)
    shutil.rmtree(tmp, ignore_errors=True)  # tasks and (unless --cache) the build cache


if __name__ == "__main__":
    main()
