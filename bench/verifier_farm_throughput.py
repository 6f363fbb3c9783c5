"""Verifier-farm throughput on a GPU machine: the farm vs a serial compile-then-run loop.

Generates L1-style CUDA candidates (correct kernels, compile errors, wrong results, PyTorch
fallbacks) for bundled level-1 tasks at their "gpu" size profile, every one a distinct source (so
none is a cache hit), then measures in one run:

  (a) the farm: a ``--compile-workers`` process compile pool feeding one device worker per GPU;
  (b) a serial baseline: ``verify()`` (compile, then run) one candidate after another, on a
      representative subset (``--serial-candidates``) with its own empty build cache;
  (c) timing stability: the speedup's coefficient of variation over ``--repeats`` runs of the
      same correct candidates (builds cached);
  (d) agreement of the verifier's medians with ``triton.testing.do_bench`` on the same kernels.

Prints one JSON object (and writes it with ``--out``, also after every phase, so a run cut short keeps
what it measured). Needs no Ray. Example (H200 machine):

    TORCH_CUDA_ARCH_LIST=9.0 python bench/verifier_farm_throughput.py --out bench/results/verifier_farm_h200.json

Duration: on one H200 with 16 cores a CUDA ``load_inline`` takes ~60 s and the device stage ~8 s per
candidate, so the defaults (64 farm + 3 serial candidates, 2x5 stability runs) take ~13 minutes, the farm
part ~8.5; ``--num-candidates 32`` (or ``--skip``) keeps a run under 8 minutes.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# ----------------------------------------------------------------------------- candidate generation

_PRELUDE = '''import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

cuda_source = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
// candidate {tag}
'''

_UNARY = _PRELUDE + '''
__global__ void op_kernel(const float* __restrict__ x, float* __restrict__ y, long long n{kparam_decl}) {{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n{bound_fix}; i += stride) {{
        float v = x[i];
        y[i] = {expr};
    }}
}}

torch::Tensor op_forward(torch::Tensor x{param_decl}) {{
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32, "float32 CUDA tensor expected");
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    long long n = xc.numel();
    int threads = {threads};
    long long want = (n + threads - 1) / threads;
    int blocks = (int)(want < 1048576 ? want : 1048576);
    op_kernel<<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(xc.data_ptr<float>(), y.data_ptr<float>(), n{kparam_arg}){semi}
    return y;
}}
"""

cpp_source = "torch::Tensor op_forward(torch::Tensor x{param_decl});"

ext = load_inline(name="{ext}", cpp_sources=cpp_source, cuda_sources=cuda_source, functions=["op_forward"],
                  extra_cuda_cflags=["-O3"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self{init_sig}):
        super().__init__(){init_body}

    def forward(self, x):
        return {forward}
'''

_BINARY = _PRELUDE + '''
__global__ void add_kernel(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y,
                           long long n) {{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n{bound_fix}; i += stride) {{
        y[i] = a[i] + b[i];
    }}
}}

torch::Tensor add_forward(torch::Tensor a, torch::Tensor b) {{
    TORCH_CHECK(a.is_cuda() && b.is_cuda() && a.sizes() == b.sizes(), "same-shape CUDA tensors expected");
    auto ac = a.contiguous();
    auto bc = b.contiguous();
    auto y = torch::empty_like(ac);
    long long n = ac.numel();
    int threads = {threads};
    long long want = (n + threads - 1) / threads;
    int blocks = (int)(want < 1048576 ? want : 1048576);
    add_kernel<<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        ac.data_ptr<float>(), bc.data_ptr<float>(), y.data_ptr<float>(), n){semi}
    return y;
}}
"""

cpp_source = "torch::Tensor add_forward(torch::Tensor a, torch::Tensor b);"

ext = load_inline(name="{ext}", cpp_sources=cpp_source, cuda_sources=cuda_source, functions=["add_forward"],
                  extra_cuda_cflags=["-O3"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return {forward}
'''

_SOFTMAX = _PRELUDE + '''
// One block per row: block-wide max, then sum of exponentials, then normalise.
__global__ void softmax_rows(const float* __restrict__ x, float* __restrict__ y, int cols) {{
    extern __shared__ float red[];
    const float* in = x + (long long)blockIdx.x * cols;
    float* out = y + (long long)blockIdx.x * cols;
    float m = -INFINITY;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, in[c]);
    red[threadIdx.x] = m;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {{
        if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }}
    m = red[0];
    __syncthreads();
    float sum = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) sum += __expf(in[c] - m);
    red[threadIdx.x] = sum;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {{
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }}
    float inv = 1.f / {sum_expr};
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[c] = __expf(in[c] - m) * inv{semi}
}}

torch::Tensor softmax_forward(torch::Tensor x) {{
    TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == torch::kFloat32, "2D float32 CUDA tensor");
    auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    int threads = {threads};
    softmax_rows<<<(unsigned)xc.size(0), threads, threads * sizeof(float), c10::cuda::getCurrentCUDAStream()>>>(
        xc.data_ptr<float>(), y.data_ptr<float>(), (int)xc.size(1));
    return y;
}}
"""

cpp_source = "torch::Tensor softmax_forward(torch::Tensor x);"

ext = load_inline(name="{ext}", cpp_sources=cpp_source, cuda_sources=cuda_source, functions=["softmax_forward"],
                  extra_cuda_cflags=["-O3"], verbose=False)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return {forward}
'''

# task stem -> (template, correct expression, wrong expression, torch fallback)
_UNARY_OPS = {
    "7_ReLU": ("v > 0.f ? v : 0.f", "v > 0.5f ? v : 0.f", "torch.relu(x)"),
    "9_Sigmoid": ("1.f / (1.f + __expf(-v))", "1.f / (1.f + __expf(v))", "torch.sigmoid(x)"),
    "11_Tanh": ("tanhf(v)", "tanhf(0.5f * v)", "torch.tanh(x)"),
    "10_Swish": ("v / (1.f + __expf(-v))", "v / (1.f + __expf(v))", "x * torch.sigmoid(x)"),
    "8_GELU": ("0.5f * v * (1.f + erff(v * 0.70710678f))", "0.5f * v * (1.f + erff(v))",
               "torch.nn.functional.gelu(x)"),
    "6_Scalar_multiplication": ("v * s", "v * s + 1e-3f", "x * self.scale"),
}


@dataclasses.dataclass
class Candidate:
    task_stem: str
    kind: str          # correct | compile_error | wrong | fallback
    code: str
    expected: str      # the verdict this candidate should get

    @property
    def response(self) -> str:
        return f"Here is the kernel.\n\n```python\n{self.code}```\n"


def _unary(stem: str, kind: str, tag: str, threads: int) -> str:
    good, bad, fallback = _UNARY_OPS[stem]
    scaled = stem == "6_Scalar_multiplication"
    fields = dict(tag=tag, threads=threads, ext=f"bench_{tag}", bound_fix="", semi=";",
                  expr=bad if kind == "wrong" else good,
                  kparam_decl=", float s" if scaled else "", kparam_arg=", (float)s" if scaled else "",
                  param_decl=", double s" if scaled else "",
                  init_sig=", scale: float" if scaled else "",
                  init_body="\n        self.scale = scale" if scaled else "",
                  forward="ext.op_forward(x, self.scale)" if scaled else "ext.op_forward(x)")
    if kind == "compile_error":
        fields["semi"] = ""  # missing ';' after the launch
    if kind == "fallback":  # the kernel is built but forward calls PyTorch
        fields["forward"] = fallback
    return _UNARY.format(**fields)


def _add(kind: str, tag: str, threads: int) -> str:
    return _BINARY.format(tag=tag, threads=threads, ext=f"bench_{tag}", semi="" if kind == "compile_error" else ";",
                          bound_fix=" - 1" if kind == "wrong" else "",
                          forward="a + b" if kind == "fallback" else "ext.add_forward(a, b)")


def _softmax(kind: str, tag: str, threads: int) -> str:
    return _SOFTMAX.format(tag=tag, threads=threads, ext=f"bench_{tag}", semi="" if kind == "compile_error" else ";",
                           sum_expr="red[1]" if kind == "wrong" else "red[0]",
                           forward="torch.softmax(x, dim=1)" if kind == "fallback" else "ext.softmax_forward(x)")


EXPECTED = {"correct": "pass", "compile_error": "compile_error", "wrong": "correctness_error", "fallback": "cheating"}


def make_candidates(n: int, seed_tag: str) -> list[Candidate]:
    """``n`` distinct candidates: 5/8 correct, 1/8 each compile error, wrong result, fallback."""
    stems = list(_UNARY_OPS) + ["5_Elementwise_add", "12_Softmax"]
    kinds = ["correct", "compile_error", "correct", "wrong", "correct", "fallback", "correct", "correct"]
    threads = [256, 512, 128, 1024]
    out = []
    for i in range(n):
        stem = stems[i % len(stems)]
        kind = kinds[(i // len(stems) + i) % len(kinds)]
        tag = f"{seed_tag}_{i}"
        t = threads[(i // len(stems)) % len(threads)]
        if stem == "5_Elementwise_add":
            code = _add(kind, tag, t)
        elif stem == "12_Softmax":
            code = _softmax(kind, tag, t)
        else:
            code = _unary(stem, kind, tag, t)
        out.append(Candidate(stem, kind, code, EXPECTED[kind]))
    return out


# ----------------------------------------------------------------------------- measurements

def _tasks_by_stem(profile: str) -> dict[str, Any]:
    from verifier.size_profiles import apply_size_profile, load_tasks
    tasks = load_tasks(os.path.join(ROOT, "verifier", "tasks"))
    return {os.path.splitext(os.path.basename(t.path))[0]: apply_size_profile(t, profile) for t in tasks}


def verdict_record(index: int, cand: Candidate, result: Any, elapsed_s: float) -> dict[str, Any]:
    """One verdict as it arrives: what it was, when, and where its device stage went (kept even if the run is cut)."""
    det = result.details or {}
    timing = det.get("timing") or {}
    return {"i": index, "task": cand.task_stem, "kind": cand.kind, "got": result.category.value,
            "at_s": round(elapsed_s, 1), "phase_seconds": det.get("phase_seconds"),
            "timed_trials": timing.get("trials"), "timing_repeated": "timing_repeated" in det,
            "device_exclusive_s": det.get("device_exclusive_s"), "seconds": det.get("seconds"),
            # the parent's and the child's own seconds by kind of work (audits, hidden trials, handovers, ...)
            "costs": det.get("costs"), "child_seconds": det.get("child_seconds"),
            "calls_per_trial": timing.get("calls_per_trial"), "audits": len(det.get("audits") or []),
            # the run child's start-up: imports, a spare's wait for the device lock, device start after the grant
            "child_startup_s": (det.get("child") or {}).get("startup_s")}


def run_farm(cands: list[Candidate], tasks: dict[str, Any], cfg: Any, compile_workers: int,
             progress: Any = None, every_s: float = 20.0, workers_per_device: int = 3,
             verdicts: list | None = None) -> dict[str, Any]:
    """All candidates through one farm; ``progress(done, total, stats, elapsed_s)`` every ``every_s``;
    ``verdicts`` (a list) gets each verdict's `verdict_record` as it arrives."""
    import concurrent.futures as cf

    from verifier.farm import FarmConfig, VerifierFarm
    farm = VerifierFarm(cfg, FarmConfig(compile_workers=compile_workers, result_cache=False,
                                        workers_per_device=workers_per_device))
    try:
        t0 = time.perf_counter()
        futures = farm.submit_batch([(tasks[c.task_stem], c.response) for c in cands])
        if verdicts is not None:
            for i, (c, fut) in enumerate(zip(cands, futures)):
                # list.append is atomic: the farm's threads run these callbacks
                fut.add_done_callback(lambda f, i=i, c=c: f.exception() is None and verdicts.append(
                    verdict_record(i, c, f.result(), time.perf_counter() - t0)))
        while True:
            done, pending = cf.wait(futures, timeout=every_s)
            if progress is not None:
                progress(len(done), len(futures), farm.stats(), time.perf_counter() - t0)
            if not pending:
                break
        results = [f.result() for f in futures]
        wall = time.perf_counter() - t0
        stats = farm.stats()
    finally:
        farm.close()
    return {"results": results, "wall_s": wall, "stats": stats}


def warm_page_cache() -> dict[str, Any]:
    """Read the headers and compiler binaries every build uses, so that neither the serial baseline (which
    runs first on a fresh machine) nor the farm pays for cold disk reads the other does not."""
    from torch.utils import cpp_extension
    roots = list(cpp_extension.include_paths("cuda"))
    if cpp_extension.CUDA_HOME:
        roots += [os.path.join(cpp_extension.CUDA_HOME, d) for d in ("bin", "nvvm", "include")]
    roots = list(dict.fromkeys(roots + ["/usr/lib/gcc"]))     # /usr/lib/gcc: cc1plus
    t0, n = time.perf_counter(), 0
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for name in files:
                try:
                    with open(os.path.join(dirpath, name), "rb") as f:
                        while chunk := f.read(1 << 22):
                            n += len(chunk)
                except OSError:
                    pass
    return {"bytes": n, "seconds": round(time.perf_counter() - t0, 2), "roots": roots}


def run_serial(cands: list[Candidate], tasks: dict[str, Any], cfg: Any) -> dict[str, Any]:
    from verifier.evaluate import verify
    t0 = time.perf_counter()
    results = [verify(tasks[c.task_stem], c.response, cfg, device_index=0) for c in cands]
    return {"results": results, "wall_s": time.perf_counter() - t0}


def _verdicts(cands: list[Candidate], results: list[Any]) -> dict[str, Any]:
    agree = sum(r.category.value == c.expected for c, r in zip(cands, results))
    by_kind: dict[str, dict[str, int]] = {}
    unexpected = []
    for c, r in zip(cands, results):
        d = by_kind.setdefault(c.kind, {})
        d[r.category.value] = d.get(r.category.value, 0) + 1
        if r.category.value != c.expected and len(unexpected) < 6:
            det = r.details or {}
            unexpected.append({"task": c.task_stem, "kind": c.kind, "got": r.category.value, "rule": r.rule,
                               "feedback": r.feedback[:400],
                               "why": str(det.get("infra_reason") or det.get("traceback") or "")[-1500:],
                               "infra_history": [h[-600:] for h in det.get("infra_history", [])][:2]})
    return {"expected_verdicts": agree, "total": len(cands), "by_kind": by_kind, "unexpected": unexpected,
            "device_stage_seconds_median": _phase_medians([{"phase_seconds": (r.details or {}).get("phase_seconds")}
                                                           for r in results]),
            "child_startup_seconds_median": _phase_medians(
                [{"phase_seconds": ((r.details or {}).get("child") or {}).get("startup_s")} for r in results])}


def _phase_medians(records: list[dict[str, Any]]) -> dict[str, float]:
    """Median seconds per device-stage phase over the verdicts that have one (compile errors have none)."""
    phases: dict[str, list[float]] = {}
    for rec in records:
        for k, v in (rec.get("phase_seconds") or {}).items():
            if v is not None:   # a step that did not happen (a child's start-up: no lock wait for the stage's own)
                phases.setdefault(k, []).append(v)
    return {k: round(statistics.median(v), 3) for k, v in phases.items()}


def timing_repeats(cands: list[Candidate], tasks: dict[str, Any], cfg: Any, repeats: int) -> dict[str, Any]:
    """Speedup of each correct candidate over ``repeats`` fresh device runs (builds cached)."""
    from verifier.build import build_candidate
    from verifier.evaluate import run_candidate
    from verifier.extract import extract_candidate
    import concurrent.futures as cf
    codes = [extract_candidate(c.response, cfg.max_response_bytes) for c in cands]
    with cf.ThreadPoolExecutor(max(1, len(cands))) as pool:   # cached when the farm built them; else in parallel
        builds = list(pool.map(lambda cc: build_candidate(tasks[cc[0].task_stem], cc[1], cfg), zip(cands, codes)))
    per = []
    for c, code, build in zip(cands, codes, builds):
        task = tasks[c.task_stem]
        runs = [run_candidate(task, code, build, cfg, device_index=0) for _ in range(repeats)]
        sp = [r.speedup for r in runs if r.speedup is not None]
        timing = [(r.details or {}).get("timing") or {} for r in runs]
        paired = [t["paired_speedup_median"] for t in timing if "paired_speedup_median" in t]
        entry = {"task": c.task_stem, "categories": [r.category.value for r in runs], "speedups": sp,
                 "t_cand_ms": [r.t_cand_ms for r in runs], "t_ref_ms": [r.t_ref_ms for r in runs],
                 "paired_speedups": paired,
                 # spread within one run: each runner's per-trial std relative to its median
                 "within_run_rel_std": [{k: round(t[k]["std"] / t[k]["median"], 4) for k in ("ref", "cand")
                                         if t.get(k, {}).get("median")} for t in timing],
                 "trials": [t.get("trials") for t in timing], "calls_per_trial": [t.get("calls_per_trial") for t in timing]}
        if len(sp) >= 2:
            entry["speedup_cv"] = statistics.stdev(sp) / statistics.mean(sp)
        if len(paired) >= 2:
            entry["paired_speedup_cv"] = statistics.stdev(paired) / statistics.mean(paired)
        per.append((entry, runs, build, code))
    cvs = [e["speedup_cv"] for e, *_ in per if "speedup_cv" in e]
    paired_cvs = [e["paired_speedup_cv"] for e, *_ in per if "paired_speedup_cv" in e]
    return {"timing_trials": cfg.num_timing_trials, "per_candidate": [e for e, *_ in per],
            "mean_cv": statistics.mean(cvs) if cvs else None, "max_cv": max(cvs) if cvs else None,
            "paired_mean_cv": statistics.mean(paired_cvs) if paired_cvs else None, "_raw": per}


@contextlib.contextmanager
def cached_load_inline(cfg: Any):
    """Route ``load_inline`` in this process to the farm's extension cache (the key the sandboxed
    children use), so the bench times exactly the binaries the verifier timed, without recompiling."""
    import importlib.util
    import inspect

    from torch.utils import cpp_extension
    from verifier.build import ExtensionService
    real = cpp_extension.load_inline
    sig = inspect.signature(real)
    service = ExtensionService(cfg)

    def load_inline(*args: Any, **kwargs: Any) -> Any:
        call = {k: v for k, v in sig.bind(*args, **kwargs).arguments.items() if k not in ("build_directory", "verbose")}
        if isinstance(call.get("functions"), tuple):
            call["functions"] = list(call["functions"])
        reply = service.handle({"api": "torch.utils.cpp_extension.load_inline", "kwargs": call})
        if reply.get("op") != "ext_ready":
            raise RuntimeError(f"extension not available: {reply.get('log', '')[-500:]}")
        spec = importlib.util.spec_from_file_location(reply["module_name"], reply["so_path"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    cpp_extension.load_inline = load_inline
    try:
        yield
    finally:
        cpp_extension.load_inline = real


def do_bench_agreement(raw: list, tasks: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """Time the same built kernels in this process with triton.testing.do_bench (median) and compare."""
    import torch
    import triton.testing
    from verifier.tasks import load_task_module
    out = []
    for entry, runs, build, code in raw:
        task = tasks[entry["task"]]
        mod = load_task_module(task, module_name=f"bench_task_{len(out)}")
        ns: dict[str, Any] = {"__name__": f"bench_cand_{len(out)}"}
        with cached_load_inline(cfg):
            exec(compile(code, f"<candidate {entry['task']}>", "exec"), ns)  # noqa: S102 - our generated code
        torch.manual_seed(0)
        init = mod.get_init_inputs()
        with torch.device("cuda"):
            ref = mod.Model(*init)
            new = ns["ModelNew"](*init)
            inputs = mod.get_inputs()
        with torch.no_grad():
            t_ref = triton.testing.do_bench(lambda: ref(*inputs), warmup=25, rep=200, return_mode="median")
            t_new = triton.testing.do_bench(lambda: new(*inputs), warmup=25, rep=200, return_mode="median")
        ours_ref = statistics.median([r.t_ref_ms for r in runs if r.t_ref_ms is not None])
        ours_new = statistics.median([r.t_cand_ms for r in runs if r.t_cand_ms is not None])
        out.append({"task": entry["task"], "do_bench_ref_ms": t_ref, "do_bench_cand_ms": t_new,
                    "ours_ref_ms": ours_ref, "ours_cand_ms": ours_new,
                    "rel_diff_ref": abs(ours_ref - t_ref) / t_ref, "rel_diff_cand": abs(ours_new - t_new) / t_new,
                    "rel_diff_speedup": abs(ours_ref / ours_new - t_ref / t_new) / (t_ref / t_new)})
        del ref, new, inputs
        torch.cuda.empty_cache()
    diffs = [max(o["rel_diff_ref"], o["rel_diff_cand"]) for o in out]
    return {"per_kernel": out, "max_rel_diff": max(diffs) if diffs else None,
            "mean_rel_diff_speedup": statistics.mean(o["rel_diff_speedup"] for o in out) if out else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-candidates", type=int, default=64)
    ap.add_argument("--serial-candidates", type=int, default=3,
                    help="candidates in the serial baseline (the start of the same generated mix); its throughput is a rate")
    ap.add_argument("--compile-workers", type=int, default=16)
    ap.add_argument("--workers-per-device", type=int, default=3,
                    help="device-stage workers sharing the GPU (they take turns to time)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stability-candidates", type=int, default=2)
    ap.add_argument("--size-profile", default="gpu")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--timing-trials", type=int, nargs="+", default=None,
                    help="timed trials per verification in the stability phase, one pass per value, side by side "
                         "(default: the config's); do_bench compares against the first")
    ap.add_argument("--skip", nargs="*", default=[], choices=["serial", "farm", "stability", "do_bench"],
                    help="phases to leave out (without the farm, stability and do_bench build their candidates themselves)")
    ap.add_argument("--pch", action="store_true",
                    help="precompiled torch/extension.h on (verifier.pch; off by default, as in the runs before "
                         "it existed); the serial baseline then runs after the farm and uses the PCH it built")
    ap.add_argument("--no-landlock", action="store_true",
                    help="run sandboxed children without Landlock (VerifierConfig.landlock=False)")
    ap.add_argument("--work-dir", default=None, help="build caches go here (default: a temporary folder)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    import torch
    from verifier.config import VerifierConfig

    if not torch.cuda.is_available():
        print(json.dumps({"error": "needs a CUDA device"}))
        return 2
    run_id = f"{os.getpid()}_{int(time.time())}"
    tasks = _tasks_by_stem(args.size_profile)
    work = args.work_dir or tempfile.mkdtemp(prefix="farm-bench-")
    t_start = time.perf_counter()

    def phase(name: str) -> None:
        """Log progress and save what is measured so far (a run cut short still leaves numbers)."""
        print(f"[bench] {time.perf_counter() - t_start:7.1f}s {name}", file=sys.stderr, flush=True)
        if args.out:
            _write_json(args.out, {**report, "total_wall_s": time.perf_counter() - t_start,
                                   "complete": name == "done"})
    report: dict[str, Any] = {
        "machine": {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "host": platform.node()},
        "config": vars(args),
    }

    def cfg_for(sub: str) -> Any:
        cache = os.path.join(work, sub)
        if args.pch and not os.path.exists(os.path.join(cache, "pch")):
            # serial and farm share one PCH store (each its own build cache): both in their steady state
            os.makedirs(os.path.join(work, "pch-shared"), exist_ok=True)
            os.makedirs(cache, exist_ok=True)
            os.symlink(os.path.join(work, "pch-shared"), os.path.join(cache, "pch"))
        return VerifierConfig(backend="cuda", num_correct_trials=args.trials, landlock=not args.no_landlock,
                              build_cache_dir=cache, pch_after_compiles=4 if args.pch else 0)

    # (b) serial first, on its own cache, so nothing it compiles is reused by the farm (with --pch: after the
    # farm, sharing only the PCH the farm built)
    farm_cands = make_candidates(args.num_candidates, f"f{run_id}")
    report["page_cache_warmup"] = warm_page_cache()

    def serial() -> None:
        phase(f"serial baseline: {args.serial_candidates} candidates")
        serial_cands = make_candidates(args.serial_candidates, f"s{run_id}")
        s = run_serial(serial_cands, tasks, cfg_for("serial"))
        report["serial"] = {"candidates": len(serial_cands), "wall_s": s["wall_s"],
                            "throughput_cand_per_s": len(serial_cands) / s["wall_s"],
                            **_verdicts(serial_cands, s["results"])}

    if "serial" not in args.skip and not args.pch:
        serial()
    # (a) the farm
    if "farm" not in args.skip:
        phase(f"farm: {len(farm_cands)} candidates, {args.compile_workers} compile workers")
        arrived: list[dict[str, Any]] = []

        def farm_progress(done: int, total: int, stats: dict[str, Any], elapsed: float) -> None:
            report["farm_verdicts_as_they_came"] = sorted(arrived, key=lambda v: v["at_s"])
            report["farm_progress"] = {"done": done, "total": total, "elapsed_s": round(elapsed, 1),
                                       "device_stage_seconds_median_so_far": _phase_medians(arrived),
                                       "compile_busy_fraction": round(stats["compile"]["busy_fraction"], 3),
                                       "device_busy_fraction": round(stats["device"]["busy_fraction"], 3),
                                       "device_occupied_fraction":
                                           round(stats["device"]["device_occupied_fraction"], 3),
                                       "device_occupied_fraction_since_first_job":
                                           round(stats["device"]["device_occupied_fraction_since_first_job"], 3),
                                       "categories": stats.get("categories")}
            phase(f"farm: {done}/{total} verdicts after {elapsed:.0f} s (compile busy "
                  f"{stats['compile']['busy_fraction']:.2f}, device workers busy "
                  f"{stats['device']['busy_fraction']:.2f}, GPU occupied "
                  f"{stats['device']['device_occupied_fraction']:.2f}, since its first job "
                  f"{stats['device']['device_occupied_fraction_since_first_job']:.2f})")

        f = run_farm(farm_cands, tasks, cfg_for("farm"), args.compile_workers, progress=farm_progress,
                     workers_per_device=args.workers_per_device, verdicts=arrived)
        report["farm_verdicts_as_they_came"] = sorted(arrived, key=lambda v: v["at_s"])
        st = f["stats"]
        report["farm"] = {"candidates": len(farm_cands), "wall_s": f["wall_s"],
                          "throughput_cand_per_s": len(farm_cands) / f["wall_s"],
                          "compile_workers": st["compile"]["workers"], "device_workers": st["device"]["workers"],
                          "workers_per_device": args.workers_per_device,
                          "device_busy_fraction": st["device"]["busy_fraction"],
                          "device_occupied_fraction": st["device"]["device_occupied_fraction"],
                          "device_occupied_fraction_since_first_job":
                              st["device"]["device_occupied_fraction_since_first_job"],
                          "compile_busy_fraction": st["compile"]["busy_fraction"],
                          "retries": st["retries"], "infra": st["infra_final"], **_verdicts(farm_cands, f["results"])}
        if "serial" not in args.skip and args.pch:   # after the farm, with the PCH the farm built
            serial()
        if "serial" in report:
            report["throughput_ratio_farm_over_serial"] = (report["farm"]["throughput_cand_per_s"]
                                                           / report["serial"]["throughput_cand_per_s"])
    # (c) stability and (d) do_bench agreement on correct candidates that passed in the farm (without a farm
    # phase: the mix's correct candidates, built here)
    if "farm" in report:
        passed = [c for c, r in zip(farm_cands, f["results"]) if c.kind == "correct" and r.category.value == "pass"]
    else:
        passed = [c for c in farm_cands if c.kind == "correct"]
    seen, chosen = set(), []
    for c in passed:
        if c.task_stem not in seen:
            seen.add(c.task_stem)
            chosen.append(c)
    chosen = chosen[:args.stability_candidates]
    if "stability" not in args.skip and chosen:
        raw = None
        for trials in args.timing_trials or [cfg_for("farm").num_timing_trials]:
            phase(f"stability: {len(chosen)} candidates x {args.repeats}, {trials} timed trials each")
            cfg = dataclasses.replace(cfg_for("farm"), num_timing_trials=trials)
            rep = timing_repeats(chosen, tasks, cfg, args.repeats)
            raw = raw or rep.pop("_raw")
            rep.pop("_raw", None)
            report.setdefault("speedup_stability_by_trials", {})[str(trials)] = rep
            report.setdefault("speedup_stability", rep)
        if "do_bench" not in args.skip:
            phase("do_bench agreement")
            try:
                report["do_bench_agreement"] = do_bench_agreement(raw, tasks, cfg_for("farm"))
            except ImportError as e:
                report["do_bench_agreement"] = {"error": f"triton not available: {e}"}
    phase("done")
    report["total_wall_s"] = time.perf_counter() - t_start
    report["complete"] = True
    print(json.dumps(report, indent=1, default=str))
    return 0


def _write_json(path: str, data: dict[str, Any]) -> None:
    from megatron_rl.fsutil import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
