"""A run's throughput report: markdown plus PNG plots from its metrics.jsonl.

    python -m megatron_rl.report RUN_DIR [--out DIR] [--warmup N]

Reads RUN_DIR/metrics.jsonl (one row per step, written by the trainer), RUN_DIR/summary.json and
RUN_DIR/config.yaml when present, and writes DIR (default RUN_DIR/report/): report.md, reward.png,
step_time.png (seconds per phase, stacked), throughput.png (tokens/s/GPU per phase) and mfu.png (when the
run logged MFU). Figures follow NeMo-RL's units: tokens/s/GPU = tokens processed / (phase seconds x GPUs of
that phase); MFU against the GPU's dense bf16 peak. Rows written before the trainer logged per-GPU figures
get them derived the same way (megatron_rl.observability.throughput_scalars). Steady-state figures are the
mean, p50 and p95 over the steps after the first `--warmup` (default 2, fewer for short runs).
The last stdout line is a JSON object: {"report": PATH, "plots": [...], "steps": N}.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from PIL import Image, ImageDraw, ImageFont

from megatron_rl.fsutil import write_atomic, write_text_atomic
from megatron_rl.observability import RunFacts, throughput_scalars


class ReportError(ValueError):
    """A run dir that cannot be reported on; names the file and the problem."""


PHASE_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
                (227, 119, 194), (127, 127, 127)]
THROUGHPUT_KEYS = [("perf/e2e_tokens_per_s_per_gpu", "end to end"), ("perf/rollout_tokens_per_s_per_gpu", "rollout (generated)"),
                   ("perf/train_tokens_per_s_per_gpu", "train"), ("perf/logprob_tokens_per_s_per_gpu", "logprobs")]


def load_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise ReportError(f"run dir not found: {run_dir}")
    if not path.is_file():
        raise ReportError(f"{path} not found: not a trainer run dir (expected metrics.jsonl)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}:{i}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or "step" not in row:
            raise ReportError(f"{path}:{i}: a metrics row needs a 'step'")
        rows.append(row)
    if not rows:
        raise ReportError(f"{path} has no steps yet")
    # a resumed run appends: keep the last row of each step
    by_step = {int(r["step"]): r for r in rows}
    return [by_step[s] for s in sorted(by_step)]


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _stats(values: Sequence[float]) -> dict[str, float] | None:
    v = sorted(x for x in values if _finite(x))
    if not v:
        return None
    p95 = v[min(len(v) - 1, math.ceil(0.95 * len(v)) - 1)]
    return {"mean": statistics.fmean(v), "p50": statistics.median(v), "p95": p95, "n": len(v)}


# ---------------------------------------------------------------------------------------------- plots (PIL)

def _font(size: int = 14):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # older pillow: one bitmap size
        return ImageFont.load_default()


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    e = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * e:
            return m * e
    return 10 * e


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


class _Canvas:
    W, H, L, R, T, B = 900, 420, 80, 200, 40, 50

    def __init__(self, title: str, ylabel: str, x_values: Sequence[int], y_min: float, y_max: float,
                 slots: bool = False, xlabel: str = "step"):
        self.slots = slots               # bars: each step in the middle of its own slot
        self.img = Image.new("RGB", (self.W, self.H), "white")
        self.d = ImageDraw.Draw(self.img)
        self.xs, self.y_min, self.y_max = list(x_values), y_min, y_max if y_max > y_min else y_min + 1
        f = _font(16)
        self.d.text((self.L + 140, 10), title, fill="black", font=f)
        self.d.text((8, self.T - 22), ylabel, fill=(80, 80, 80), font=_font(12))
        x0, y0, x1, y1 = self.L, self.T, self.W - self.R, self.H - self.B
        self.d.rectangle([x0, y0, x1, y1], outline=(120, 120, 120))
        for i in range(5):
            yv = self.y_min + (self.y_max - self.y_min) * i / 4
            y = self.py(yv)
            self.d.line([x0, y, x1, y], fill=(230, 230, 230))
            self.d.text((8, y - 7), _fmt(yv), fill="black", font=_font(12))
        n = len(self.xs)
        for i in sorted({0, n - 1, *range(0, n, max(1, n // 8))}):
            x = self.px(i)
            self.d.text((x - 6, y1 + 6), str(self.xs[i]), fill="black", font=_font(12))
        self.d.text(((x0 + x1) // 2 - 15, self.H - 22), xlabel, fill=(80, 80, 80), font=_font(12))
        self.legend_y = self.T

    def px(self, i: float) -> float:
        if self.slots:
            return self.L + (self.W - self.R - self.L) * (i + 0.5) / max(len(self.xs), 1)
        n = max(len(self.xs) - 1, 1)
        return self.L + (self.W - self.R - self.L) * (i / n if len(self.xs) > 1 else 0.5)

    def py(self, v: float) -> float:
        return self.H - self.B - (self.H - self.B - self.T) * (v - self.y_min) / (self.y_max - self.y_min)

    def legend(self, label: str, color: tuple[int, int, int]) -> None:
        x = self.W - self.R + 12
        self.d.rectangle([x, self.legend_y + 3, x + 12, self.legend_y + 13], fill=color)
        self.d.text((x + 18, self.legend_y), label, fill="black", font=_font(12))
        self.legend_y += 20

    def save(self, path: Path) -> None:
        write_atomic(path, lambda f: self.img.save(f, format="PNG"))


def line_plot(path: Path, title: str, ylabel: str, steps: Sequence[int], series: dict[str, Sequence[float]]) -> bool:
    vals = [v for s in series.values() for v in s if _finite(v)]
    if not vals:
        return False
    lo = min(0.0, min(vals))
    c = _Canvas(title, ylabel, steps, lo, _nice_max(max(vals)) if max(vals) > 0 else 1.0)
    for k, (label, ys) in enumerate(series.items()):
        color = PHASE_COLORS[k % len(PHASE_COLORS)]
        pts = [(c.px(i), c.py(y)) for i, y in enumerate(ys) if _finite(y)]
        if len(pts) > 1:
            c.d.line(pts, fill=color, width=2)
        for x, y in pts:
            c.d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
        c.legend(label, color)
    c.save(path)
    return True


def stacked_bars(path: Path, title: str, ylabel: str, steps: Sequence[int], stacks: dict[str, Sequence[float]],
                 xlabel: str = "step") -> bool:
    """Stacked bars, one slot per x value (steps, or any labels: histogram bins, op families)."""
    totals = [sum(v[i] for v in stacks.values() if _finite(v[i])) for i in range(len(steps))]
    if not totals or max(totals) <= 0:
        return False
    c = _Canvas(title, ylabel, steps, 0.0, _nice_max(max(totals)), slots=True, xlabel=xlabel)
    width = max(2.0, (c.W - c.R - c.L) / max(len(steps), 1) * 0.7)
    for i in range(len(steps)):
        base = 0.0
        for k, ys in enumerate(stacks.values()):
            v = ys[i] if _finite(ys[i]) else 0.0
            x = c.px(i)
            c.d.rectangle([x - width / 2, c.py(base + v), x + width / 2, c.py(base)], fill=PHASE_COLORS[k % len(PHASE_COLORS)])
            base += v
    for k, label in enumerate(stacks):
        c.legend(label, PHASE_COLORS[k % len(PHASE_COLORS)])
    c.save(path)
    return True


# ---------------------------------------------------------------------------------------------- report

def build_report(run_dir: Path, out_dir: Path, warmup: int | None = None) -> dict[str, Any]:
    rows = load_rows(run_dir)
    facts = RunFacts.from_run_dir(run_dir)
    if facts is not None:
        for r in rows:   # rows from before the trainer logged per-GPU throughput
            r.update({k: v for k, v in throughput_scalars(r, facts).items() if k not in r})
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [int(r["step"]) + 1 for r in rows]
    phases = list(dict.fromkeys(k for r in rows for k in r if k.startswith("time/")))
    warm = warmup if warmup is not None else (2 if len(rows) > 4 else 0)
    steady = rows[warm:] or rows
    summary: dict[str, Any] = {}
    if (run_dir / "summary.json").is_file():
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except json.JSONDecodeError:
            summary = {}

    plots = []
    if line_plot(out_dir / "reward.png", "reward and pass rate", "value", steps,
                 {"reward/mean": [r.get("reward/mean") for r in rows],
                  "pass_rate/any_turn": [r.get("pass_rate/any_turn") for r in rows]}):
        plots.append("reward.png")
    if phases and stacked_bars(out_dir / "step_time.png", "step time by phase", "seconds", steps,
                               {p[5:]: [r.get(p, 0.0) for r in rows] for p in phases}):
        plots.append("step_time.png")
    tp_series = {label: [r.get(k) for r in rows] for k, label in THROUGHPUT_KEYS if any(_finite(r.get(k)) for r in rows)}
    if tp_series and line_plot(out_dir / "throughput.png", "tokens/s/GPU by phase", "tokens/s/GPU", steps, tp_series):
        plots.append("throughput.png")
    if any(_finite(r.get("perf/mfu")) for r in rows) and line_plot(
            out_dir / "mfu.png", "training MFU (dense bf16 peak)", "%", steps,
            {"MFU %": [100 * r["perf/mfu"] if _finite(r.get("perf/mfu")) else None for r in rows]}):
        plots.append("mfu.png")

    step_times = [sum(v for k, v in r.items() if k.startswith("time/") and _finite(v)) for r in steady]
    md = [f"# Run report: {run_dir.name}", "",
          f"- run dir: `{run_dir}`", f"- steps logged: {len(rows)} (steady state: steps {steady[0]['step'] + 1}-"
          f"{steady[-1]['step'] + 1}, after {len(rows) - len(steady)} warm-up)"]
    if summary:
        md.append(f"- summary: reward first {summary.get('reward_first')}, last {summary.get('reward_last')}, "
                  f"wall {summary.get('wall_seconds')} s")
    if facts is not None:
        md.append(f"- GPUs: train {facts.train_gpus}, rollout {facts.rollout_gpus} "
                  f"({'colocated' if facts.rollout_gpus == facts.train_gpus else 'disaggregated'}); "
                  f"{facts.trajectories_per_step} trajectories per step"
                  + (f"; model {facts.shape.name} ({_params(facts.shape.total_params())} params)" if facts.shape else "")
                  + ("" if facts.peak_tflops else "; no GPU peak known (CPU run): no MFU"))
    st = _stats(step_times)
    md += ["", "## Step time (steady state)", "", "| phase | mean s | p50 s | p95 s | share |", "|---|---|---|---|---|"]
    for p in phases:   # a phase missing from a step (e.g. `save` between checkpoints) took 0 s there
        s = _stats([r.get(p, 0.0) for r in steady])
        if s:
            md.append(f"| {p[5:]} | {s['mean']:.3f} | {s['p50']:.3f} | {s['p95']:.3f} | "
                      f"{100 * s['mean'] / st['mean'] if st and st['mean'] else 0:.1f} % |")
    if st:
        md.append(f"| **step** | **{st['mean']:.3f}** | {st['p50']:.3f} | {st['p95']:.3f} | 100 % |")
    md += ["", "## Throughput (steady state, NeMo-RL units)", "", "| figure | mean | p50 | p95 |", "|---|---|---|---|"]
    for k, label in THROUGHPUT_KEYS + [("perf/tokens_per_s", "tokens/s (whole step, all GPUs)"),
                                       ("perf/tflops_per_gpu", "train TFLOP/s per GPU"), ("perf/mfu", "train MFU")]:
        s = _stats([r.get(k) for r in steady])
        if s:
            f = (lambda v: f"{100 * v:.1f} %") if k == "perf/mfu" else (lambda v: f"{v:,.1f}")
            md.append(f"| {label} | {f(s['mean'])} | {f(s['p50'])} | {f(s['p95'])} |")
    md += ["", "## Learning", "", "| step | reward | pass rate | step s | tokens/s/GPU (e2e) |", "|---|---|---|---|---|"]
    stride = max(1, len(rows) // 40)
    for r in rows[::stride]:
        t = sum(v for k, v in r.items() if k.startswith("time/") and _finite(v))
        cells = [r.get("reward/mean"), r.get("pass_rate/any_turn"), t, r.get("perf/e2e_tokens_per_s_per_gpu")]
        md.append(f"| {int(r['step']) + 1} | " + " | ".join(f"{c:.3f}" if _finite(c) else "-" for c in cells) + " |")
    md += ["", "## Plots", ""] + [f"![{p[:-4]}]({p})" for p in plots]
    report = out_dir / "report.md"
    write_text_atomic(report, "\n".join(md) + "\n")
    return {"report": str(report), "plots": [str(out_dir / p) for p in plots], "steps": len(rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_rl.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a trainer run dir (holds metrics.jsonl)")
    ap.add_argument("--out", help="where to write report.md and the PNGs (default RUN_DIR/report)")
    ap.add_argument("--warmup", type=int, help="steps left out of the steady-state figures (default 2 when > 4 steps)")
    a = ap.parse_args(argv)
    run_dir = Path(a.run_dir).resolve()
    try:
        if a.warmup is not None and a.warmup < 0:
            raise ReportError(f"--warmup must be >= 0, got {a.warmup}")
        result = build_report(run_dir, Path(a.out).resolve() if a.out else run_dir / "report", a.warmup)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[report] {result['report']} ({len(result['plots'])} plots)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
