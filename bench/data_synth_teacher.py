"""How many offline-teacher answers pass the real verifier: generate teacher-covered tasks, distill them offline,
report per family and recipe.

    python bench/data_synth_teacher.py --backend cpu --out runs/teacher_cpu                     # CPU verifier
    python bench/data_synth_teacher.py --backend cuda --profile gpu --out runs/teacher_cuda     # on a GPU

Writes OUT/tasks (the task set), OUT/sft.jsonl, OUT/verdicts.jsonl and OUT/summary.json; the last stdout line is
the summary.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data_synth.decontam import Decontaminator, Reference  # noqa: E402
from data_synth.distill import DistillConfig, distill  # noqa: E402
from data_synth.generate import GenConfig  # noqa: E402
from data_synth.pipeline import generate_task_set  # noqa: E402
from data_synth.taskset import read_task_set, write_task_set  # noqa: E402
from data_synth.teacher import offline_answer  # noqa: E402
from data_synth.validate import ValidationConfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--profile", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stage1", type=int, default=24)
    ap.add_argument("--stage2", type=int, default=8)
    ap.add_argument("--families", default="elementwise,broadcast,reduction,softmax,scan,normalization,gemm,loss")
    ap.add_argument("--dtypes", default="float32:0.6,float16:0.2,bfloat16:0.2")
    ap.add_argument("--compile-workers", type=int, default=None)
    ap.add_argument("--timing-trials", type=int, default=20)
    args = ap.parse_args()
    t0 = time.time()
    dtypes = {k: float(v) for k, v in (x.split(":") for x in args.dtypes.split(","))}
    device = "cuda" if args.backend == "cuda" else "cpu"
    vcfg = ValidationConfig(profile=args.profile, device=device)
    decontam = Decontaminator([Reference.load_index()])
    tasks = []
    for stage, n, fams in ((1, args.stage1, tuple(args.families.split(","))), (2, args.stage2, None)):
        if n <= 0:
            continue
        cfg = GenConfig(stage=stage, n=n, seed=args.seed, families=fams, teacher_only=True, dtypes=dtypes)
        got, _ = generate_task_set(cfg, validation=vcfg, decontam=decontam, progress=False)
        for t in got:
            t.task_id = f"s{stage}_{t.task_id}"
        tasks += got
    folder = write_task_set(tasks, os.path.join(args.out, "tasks"), force=True)
    gen_s = time.time() - t0
    dcfg = DistillConfig(offline=True, backend=args.backend, keep="all", compile_workers=args.compile_workers,
                         timing_trials=args.timing_trials, size_profile=None if args.profile == "cpu" else args.profile,
                         cache_dir=os.path.join(args.out, "build_cache"))
    summary = distill(read_task_set(folder), os.path.join(args.out, "sft.jsonl"), dcfg,
                      verdicts_path=os.path.join(args.out, "verdicts.jsonl"), progress=False)
    rows = [json.loads(x) for x in open(os.path.join(args.out, "sft.jsonl"))]
    by_family: dict[str, list[int]] = {}
    by_recipe: dict[str, list[int]] = {}
    by_dtype: dict[str, list[int]] = {}
    speedups = []
    fails = []
    tmap = {t.task_id: t for t in tasks}
    for r in rows:
        t = tmap[r["task_id"]]
        ok = int(r["passed"])
        for key, table in ((t.primary_family, by_family), (offline_answer(t, args.backend).recipe, by_recipe),
                           (t.precisions[0], by_dtype)):
            table.setdefault(key, [0, 0])
            table[key][0] += ok
            table[key][1] += 1
        if ok and r["speedup"]:
            speedups.append(r["speedup"])
        if not ok:
            fails.append({"task_id": r["task_id"], "category": r["verdict"]["category"],
                          "feedback": r["verdict"]["feedback"][:300]})
    speedups.sort()
    result = {"backend": args.backend, "profile": args.profile, "tasks": len(tasks), "rows": len(rows),
              "passed": sum(r["passed"] for r in rows), "by_family": by_family, "by_recipe": by_recipe,
              "by_dtype": by_dtype, "median_speedup": speedups[len(speedups) // 2] if speedups else None,
              "failures": fails, "categories": summary.categories, "generate_seconds": round(gen_s, 1),
              "wall_seconds": round(time.time() - t0, 1)}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
