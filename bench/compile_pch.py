"""Extension builds with and without the precompiled torch/extension.h (verifier.pch), side by side.

    python bench/compile_pch.py [--builds 3] [--cuda] [--out results.json]

Compiles ``--builds`` distinct one-function extensions (same flags) through the verifier's build service
twice, in fresh caches: once with the PCH off, once with it built after the first build. Prints JSON: wall
seconds per build, the PCH build's seconds, and the mean ratio of the builds that used it. ``--cuda`` adds a
CUDA source (needs nvcc), where only the C++ half can gain.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CPP = "torch::Tensor scale{i}(torch::Tensor x) {{ return x * {i}; }}"
CUDA = r'''
#include <torch/extension.h>
__global__ void k{i}(float* p, int64_t n) {{ int64_t j = blockIdx.x * 256 + threadIdx.x; if (j < n) p[j] *= {i}; }}
torch::Tensor scale{i}(torch::Tensor x) {{
  auto y = x.clone(); k{i}<<<(y.numel() + 255) / 256, 256>>>(y.data_ptr<float>(), y.numel()); return y;
}}'''


def _children_cpu_s() -> float:
    """CPU seconds of finished, waited-for descendants: the build child and the compilers under it (what a
    farm's compile pool pays per build; with --cuda the wall time hides it, nvcc and gcc run side by side)."""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(n: int, cuda: bool, use_pch: bool, work: str) -> dict:
    from verifier.build import ExtensionService
    from verifier.config import VerifierConfig
    cfg = VerifierConfig(backend="cuda" if cuda else "cpu", build_cache_dir=os.path.join(work, f"pch{int(use_pch)}"),
                         pch_after_compiles=1 if use_pch else 0, max_jobs=2)
    service = ExtensionService(cfg)
    builds = []
    for i in range(1, n + 1):
        kw = {"name": f"bench_pch_{int(use_pch)}_{i}", "functions": [f"scale{i}"], "extra_cflags": ["-O2"]}
        if cuda:
            kw.update(cpp_sources=f"torch::Tensor scale{i}(torch::Tensor x);", cuda_sources=CUDA.format(i=i))
        else:
            kw["cpp_sources"] = CPP.format(i=i)
        t0, c0 = time.perf_counter(), _children_cpu_s()
        reply = service.handle({"api": "torch.utils.cpp_extension.load_inline", "kwargs": kw})
        wall, cpu = time.perf_counter() - t0, _children_cpu_s() - c0
        if reply.get("op") != "ext_ready":
            raise SystemExit(f"build {i} failed: {reply.get('log', '')[-2000:]}")
        with open(os.path.join(cfg.build_cache_dir, "ext", reply["key"], "meta.json")) as f:
            meta = json.load(f)
        builds.append({"wall_s": round(wall, 2), "compile_s": round(meta["seconds"], 2), "cpu_s": round(cpu, 2),
                       "pch": meta.get("pch")})
        print(f"[bench] pch={use_pch} build {i}: {builds[-1]}", file=sys.stderr, flush=True)
    return {"builds": builds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builds", type=int, default=3)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import platform

    import torch
    work = tempfile.mkdtemp(prefix="bench-pch-")
    off = run(args.builds, args.cuda, False, work)
    on = run(args.builds, args.cuda, True, work)
    plain = statistics.mean(b["compile_s"] for b in off["builds"])
    used = [b["compile_s"] for b in on["builds"] if b["pch"] == "used"]
    built = [b for b in on["builds"] if b["pch"] == "built"]
    report = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
              "command": " ".join(["python", "bench/compile_pch.py"] + sys.argv[1:]),
              "cuda": args.cuda, "without_pch": off, "with_pch": on,
              "mean_compile_s_without": round(plain, 2),
              "mean_compile_s_with_pch": round(statistics.mean(used), 2) if used else None,
              "pch_build_extra_s": round(built[0]["wall_s"] - built[0]["compile_s"], 2) if built else None,
              "mean_cpu_s_without": round(statistics.mean(b["cpu_s"] for b in off["builds"]), 2),
              "mean_cpu_s_with_pch": round(statistics.mean(b["cpu_s"] for b in on["builds"] if b["pch"] == "used"), 2)
              if used else None,
              "speedup_of_a_build_with_pch": round(plain / statistics.mean(used), 2) if used else None}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        from megatron_rl.fsutil import write_text_atomic
        write_text_atomic(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
