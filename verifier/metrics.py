"""Benchmark metrics over verdict rows, per level (KernelBench and MusaCoder definitions).

Definitions (n = scored samples of a task, c = those that passed):
- compile %: samples whose code built and loaded (the verdict came from the device stage);
- correct %: samples with category ``pass`` (numerically correct on every trial *and* legal);
- Pass@k: per task ``1 - C(n-c, k) / C(n, k)`` (unbiased estimator), averaged over tasks;
- Avg@k: per task ``c / n`` (expected correctness of one of the k samples), averaged over tasks;
- fast_p: per task the fraction of samples that are correct AND have speedup > p (strict),
  averaged over ALL tasks of the level, failures counting as 0 (KernelBench ``fastp``; with one
  sample per task it is exactly KernelBench's number);
- geomean speedup: ``exp(mean(log s))`` over correct samples only (report it next to fast_p, it
  ignores failures).
``infra`` rows are the farm's failures, not the model's: they are excluded from every denominator
and counted separately. Tasks whose samples are all ``infra`` are left out.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterable, Mapping, Sequence

from .types import Category

# categories whose verdict needs the built code to have loaded on the device
_POST_BUILD = {Category.PASS.value, Category.RUNTIME_ERROR.value, Category.CORRECTNESS_ERROR.value}
_STAGES_AFTER_BUILD = {"device", "run"}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n-c, k)/C(n, k); needs n >= k."""
    if not (0 <= c <= n):
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if k < 1 or k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def geometric_mean(values: Iterable[float]) -> float | None:
    logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def compiled(row: Mapping[str, Any]) -> bool:
    """Whether the sample's code built and loaded; uses the farm's stage when recorded."""
    cat = row.get("category")
    stage = (row.get("details") or {}).get("farm_stage")
    if stage is not None:
        return stage in _STAGES_AFTER_BUILD and cat != Category.INFRA.value
    return cat in _POST_BUILD


def _fast_key(p: float) -> str:
    return f"fast_{p:g}" if p != int(p) else f"fast_{p:.1f}"


@dataclasses.dataclass
class LevelSummary:
    level: str
    n_tasks: int
    n_samples: int
    n_infra: int
    compile_rate: float | None
    correct_rate: float | None
    pass_at_k: dict[int, float | None]
    avg_at_k: dict[int, float | None]
    fast_p: dict[str, float | None]            # vs eager, e.g. {"fast_1.0": .., "fast_1.1": ..}
    fast_p_compile: dict[str, float | None]    # vs torch.compile (empty when never measured)
    geomean_speedup: float | None
    geomean_speedup_compile: float | None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["pass_at_k"] = {f"pass@{k}": v for k, v in self.pass_at_k.items()}
        d["avg_at_k"] = {f"avg@{k}": v for k, v in self.avg_at_k.items()}
        return d


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _summarize_group(name: str, rows: Sequence[Mapping[str, Any]], ks: Sequence[int],
                     ps: Sequence[float]) -> LevelSummary:
    scored = [r for r in rows if r.get("category") != Category.INFRA.value]
    by_task: dict[str, list[Mapping[str, Any]]] = {}
    for r in scored:
        by_task.setdefault(str(r["task_id"]), []).append(r)
    has_compile = any(r.get("speedup_compile") is not None for r in scored)

    pass_k: dict[int, float | None] = {}
    for k in ks:
        vals = [pass_at_k(len(rs), sum(r["category"] == "pass" for r in rs), k)
                for rs in by_task.values() if len(rs) >= k]
        # Tasks with fewer than k samples cannot be scored at k; if any exist the number is n/a.
        pass_k[k] = _mean(vals) if vals and len(vals) == len(by_task) else None
    avg = _mean([sum(r["category"] == "pass" for r in rs) / len(rs) for rs in by_task.values()])

    def fast(key: str, p: float) -> float | None:
        per_task = [sum(1 for r in rs if r["category"] == "pass" and r.get(key) is not None
                        and r[key] > p) / len(rs) for rs in by_task.values()]
        return _mean(per_task)

    passed = [r for r in scored if r["category"] == "pass"]
    return LevelSummary(
        level=name, n_tasks=len(by_task), n_samples=len(scored), n_infra=len(rows) - len(scored),
        compile_rate=_mean([1.0 if compiled(r) else 0.0 for r in scored]),
        correct_rate=_mean([1.0 if r["category"] == "pass" else 0.0 for r in scored]),
        pass_at_k=pass_k, avg_at_k={k: avg for k in ks},
        fast_p={_fast_key(p): fast("speedup", p) for p in ps},
        fast_p_compile={_fast_key(p): fast("speedup_compile", p) for p in ps} if has_compile else {},
        geomean_speedup=geometric_mean(r.get("speedup") for r in passed),
        geomean_speedup_compile=geometric_mean(r.get("speedup_compile") for r in passed) if has_compile else None,
    )


def summarize(rows: Iterable[Mapping[str, Any]], ks: Sequence[int] = (1,),
              ps: Sequence[float] = (1.0, 1.1)) -> dict[str, LevelSummary]:
    """Per-level summaries plus ``"all"``. Rows are result rows (``task_id``, ``level``,
    ``category``, ``speedup``, optional ``speedup_compile``/``details``), e.g. the ``eval`` output."""
    rows = [dict(r) for r in rows]
    for r in rows:
        if "task_id" not in r or "category" not in r:
            raise ValueError(f"result row lacks task_id/category: {sorted(r)}")
        Category(r["category"])  # unknown categories are an error, not silently a failure
    levels: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        lvl = r.get("level")
        levels.setdefault(f"level{lvl}" if lvl is not None else "unleveled", []).append(r)
    # numeric order: level2 before level10
    order = sorted(levels, key=lambda name: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)])
    out = {name: _summarize_group(name, levels[name], ks, ps) for name in order}
    out["all"] = _summarize_group("all", rows, ks, ps)
    return out


def _fmt(v: float | None, pct: bool = True) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:.1f}" if pct else f"{v:.2f}x"


def format_table(summary: Mapping[str, LevelSummary], with_compile: bool = False) -> str:
    """A fixed-width text table (percentages, speedups as ``1.23x``)."""
    first = next(iter(summary.values()))
    ks = list(first.pass_at_k)
    fast_keys = list(first.fast_p)
    cols = ["level", "tasks", "samples", "infra", "compile%", "correct%"]
    cols += [f"pass@{k}" for k in ks] + [f"avg@{k}" for k in ks] + fast_keys + ["geomean"]
    if with_compile:
        cols += [f"{k}(compile)" for k in fast_keys] + ["geomean(compile)"]
    table = []
    for s in summary.values():
        row = [s.level, str(s.n_tasks), str(s.n_samples), str(s.n_infra), _fmt(s.compile_rate), _fmt(s.correct_rate)]
        row += [_fmt(s.pass_at_k[k]) for k in ks] + [_fmt(s.avg_at_k[k]) for k in ks]
        row += [_fmt(s.fast_p[k]) for k in fast_keys] + [_fmt(s.geomean_speedup, pct=False)]
        if with_compile:
            row += [_fmt(s.fast_p_compile.get(k)) for k in fast_keys]
            row += [_fmt(s.geomean_speedup_compile, pct=False)]
        table.append(row)
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in table]
    return "\n".join(lines)
