"""The `fit` size profile on KernelBench's own tasks: how many fit a CPU budget, what it changed, how long it took,
and whether the shrunk reference then runs for real.

    python bench/size_fit_kernelbench.py --kernelbench KernelBench/KernelBench [--levels 1 2 3] [--profile fit]
        [--run-levels 1] [--out FILE]

Per task: the reference call's bytes (inputs, outputs, parameters) and FLOPs on meta tensors before and after
(`verifier.size_profiles.meta_cost`), the constants changed, the seconds fitting took, and, for tasks of
`--run-levels` that fit, whether `Model(*get_init_inputs())(*get_inputs())` runs on the CPU at the new sizes.
Prints one JSON object (a summary, then every task).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verifier.size_profiles import apply_size_profile, meta_cost, parse_fit_profile  # noqa: E402
from verifier.tasks import load_task, load_task_module  # noqa: E402


def run_for_real(task) -> str:
    try:
        module = load_task_module(task, module_name="fit_bench_task")
        torch.manual_seed(0)
        with torch.no_grad():
            module.Model(*module.get_init_inputs())(*module.get_inputs())
        return "ok"
    except Exception as e:  # noqa: BLE001 - recorded per task
        return f"{type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernelbench", required=True, help="the folder holding level1 .. level4")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--profile", default="fit")
    p.add_argument("--run-levels", type=int, nargs="*", default=[1])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    max_bytes, max_flops = parse_fit_profile(a.profile) or sys.exit(f"--profile {a.profile}: not a fit profile")
    torch.set_num_threads(1)
    rows = []
    for level in a.levels:
        files = sorted(glob.glob(os.path.join(a.kernelbench, f"level{level}", "*.py")))
        if not files:
            sys.exit(f"no task files in {os.path.join(a.kernelbench, f'level{level}')}")
        for path in files:
            task = load_task(path)
            t0 = time.perf_counter()
            fitted = apply_size_profile(task, a.profile)
            seconds = time.perf_counter() - t0
            before, after = meta_cost(task), meta_cost(fitted)
            fits = after is not None and after.within(max_bytes, max_flops)
            rows.append({"task": f"level{level}/{os.path.basename(path)}", "fits": fits,
                         "sized_on_meta": before is not None, "seconds": round(seconds, 2),
                         "before": None if before is None else {"bytes": before.nbytes, "flops": before.flops},
                         "after": None if after is None else {"bytes": after.nbytes, "flops": after.flops},
                         "resized": fitted.meta.get("resized", {}),
                         "runs_for_real": run_for_real(fitted) if fits and level in a.run_levels else None})
            print(f"{rows[-1]['task']}: fits={fits} {seconds:.2f}s", file=sys.stderr, flush=True)
    summary = {"profile": a.profile, "max_bytes": max_bytes, "max_flops": max_flops, "levels": {}}
    for level in a.levels:
        mine = [r for r in rows if r["task"].startswith(f"level{level}/")]
        ran = [r for r in mine if r["runs_for_real"] is not None]
        summary["levels"][str(level)] = {
            "tasks": len(mine), "fit": sum(r["fits"] for r in mine),
            "already_within": sum(r["fits"] and not r["resized"] for r in mine),
            "not_sized_on_meta": sum(not r["sized_on_meta"] for r in mine),
            "ran_for_real": len(ran), "ran_ok": sum(r["runs_for_real"] == "ok" for r in ran),
            "seconds_total": round(sum(r["seconds"] for r in mine), 1),
            "seconds_max": max((r["seconds"] for r in mine), default=0.0)}
    result = {"bench": "size_fit_kernelbench", "command": " ".join(sys.argv), "torch": torch.__version__,
              "summary": summary, "tasks": rows}
    text = json.dumps(result, indent=1)
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, a.out)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
