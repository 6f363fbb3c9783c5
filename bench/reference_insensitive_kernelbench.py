"""Which KernelBench references give the same output for every input: the verifier's `reference_insensitive` check
(`verifier.evaluate.reference_ignores_inputs`) run on KernelBench's own tasks, outside the verifier.

    python bench/reference_insensitive_kernelbench.py --kernelbench KernelBench/KernelBench [--levels 1 2]
        [--profile fit] [--precision float32] [--trials 5] [--out FILE]

Per task, as a verification does it: the reference built under one construction seed, run on the inputs of
`--trials` different seeds (`verifier.inputs`), each output cut to the verifier's probe (`_probe`), and compared
(a) as the check does (a hundredth of the precision's tolerance: flagged tasks get `infra` for every kernel), and
(b) at the tolerance itself (outputs that move by less than a candidate may err: a constant passes there too, but
the task is still scored). Prints one JSON object: a summary, then every flagged or failing task.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import emit_json  # noqa: E402
from verifier.config import VerifierConfig  # noqa: E402
from verifier.evaluate import INSENSITIVE_TOLERANCE_FACTOR, _probe, reference_ignores_inputs  # noqa: E402
from verifier.inputs import build_model, make_init_inputs, make_inputs  # noqa: E402
from verifier.size_profiles import apply_size_profile  # noqa: E402
from verifier.tasks import load_task, load_task_module  # noqa: E402


def scan_task(path: str, profile: str, precision: str, trials: int, tolerance: float) -> dict:
    t0 = time.perf_counter()
    task = apply_size_profile(load_task(path), profile)
    module = load_task_module(task, module_name="insensitive_bench_task")
    model = build_model(module.Model, make_init_inputs(module, 1, "cpu"), 1, torch.device("cpu"), precision)
    probes = []
    for seed in range(trials):
        with torch.no_grad():
            out = model(*make_inputs(module, 1000 + seed, "cpu", precision))
        probes.append(_probe(list(out) if isinstance(out, (tuple, list)) else [out]))
    return {"insensitive": reference_ignores_inputs(probes, tolerance, VerifierConfig.scale_floor),
            "alike_at_tolerance": reference_ignores_inputs(probes, tolerance / INSENSITIVE_TOLERANCE_FACTOR,
                                                         VerifierConfig.scale_floor),
            "seconds": round(time.perf_counter() - t0, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernelbench", required=True, help="KernelBench's task folder (holding level1/ level2/ ...)")
    p.add_argument("--levels", nargs="+", type=int, default=[1, 2])
    p.add_argument("--profile", default="fit", help="size profile (default fit: the CPU budget)")
    p.add_argument("--precision", default="float32")
    p.add_argument("--trials", type=int, default=VerifierConfig.num_correct_trials)
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(1)
    tolerance = VerifierConfig(precision=a.precision).tolerance
    rows, summary = [], {}
    for level in a.levels:
        paths = sorted(glob.glob(os.path.join(a.kernelbench, f"level{level}", "*.py")))
        if not paths:
            sys.exit(f"no tasks under {a.kernelbench}/level{level}")
        counts = {"tasks": len(paths), "insensitive": 0, "alike_at_tolerance": 0, "errors": 0}
        for path in paths:
            row = {"task": f"level{level}/{os.path.basename(path)}"}
            try:
                row.update(scan_task(path, a.profile, a.precision, a.trials, tolerance))
            except Exception as e:  # noqa: BLE001 - recorded per task
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            counts["insensitive"] += bool(row.get("insensitive"))
            counts["alike_at_tolerance"] += bool(row.get("alike_at_tolerance"))
            counts["errors"] += "error" in row
            if row.get("insensitive") or row.get("alike_at_tolerance") or "error" in row:
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
        summary[f"level{level}"] = counts
    emit_json({"profile": a.profile, "precision": a.precision, "trials": a.trials, "tolerance": tolerance,
               "summary": summary, "flagged_or_failed": rows}, a.out, indent=1)


if __name__ == "__main__":
    main()
