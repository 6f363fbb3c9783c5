"""What a run shows: TensorBoard scalars, one console line per step, JSONL metrics and samples.

Everything lands under the run dir: ``tb/`` (TensorBoard), ``metrics.jsonl`` (one row per step),
``samples/step_XXXXXX.jsonl`` (every trajectory of a step: turns, verdicts, rewards) and
``summary.json`` (written at exit, also printed as the last stdout line).
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from megatron_rl.fsutil import write_text_atomic


class PhaseTimer:
    """Wall-clock seconds per named phase of one step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class RunLogger:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True, dump_samples: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.dump = dump_samples
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        self._metrics = open(self.run_dir / "metrics.jsonl", "a")

    def log_step(self, step: int, scalars: dict[str, Any], phases: dict[str, float], total_steps: int) -> None:
        row = {"step": step, **{k: v for k, v in scalars.items()}, **{f"time/{k}": v for k, v in phases.items()}}
        self._metrics.write(json.dumps(row, default=float) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and _finite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        print(self.console_line(step, total_steps, scalars, phases), flush=True)

    @staticmethod
    def console_line(step: int, total: int, s: dict[str, Any], phases: dict[str, float]) -> str:
        def f(key: str, fmt: str = "{:.3f}") -> str:
            v = s.get(key)
            return fmt.format(v) if _finite(v) else "-"

        phase = " ".join(f"{k}={v:.1f}s" for k, v in phases.items())
        return (f"[step {step + 1}/{total}] reward={f('reward/mean')} pass={f('pass_rate/any_turn', '{:.2f}')} "
                f"speedup={f('speedup/geomean', '{:.2f}')} loss={f('train/loss', '{:.4f}')} "
                f"kl={f('train/ppo_kl', '{:.2e}')} grad={f('train/grad_norm', '{:.3f}')} "
                f"masked={f('train/mirrorpop_masked_frac', '{:.2f}')} tok/s={f('perf/tokens_per_s', '{:.0f}')} | {phase}")

    def dump_samples(self, step: int, trajectories: Sequence[Any]) -> None:
        if not self.dump:
            return
        d = self.run_dir / "samples"
        d.mkdir(exist_ok=True)
        lines = []
        for t in trajectories:
            lines.append(json.dumps({
                "step": step, "task_id": t.task_id, "group_id": t.group_id, "sample_index": t.sample_index,
                "kind": t.kind, "reward": t.reward,
                "turns": [{"turn": tr.turn, "response": tr.response_text, "category": tr.verdict.category.value,
                           "q": tr.verdict.q, "speedup": tr.verdict.speedup, "score": tr.score,
                           "feedback": tr.verdict.feedback, "finish_reason": tr.finish_reason,
                           "num_tokens": len(tr.response_ids), "weight_version": tr.weight_version}
                          for tr in t.turns],
            }, default=str))
        write_text_atomic(d / f"step_{step:06d}.jsonl", "\n".join(lines) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        self._metrics.close()


def print_summary(summary: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(summary, default=str) + "\n")
    sys.stdout.flush()
