"""What a run shows: TensorBoard scalars, one console line per step, JSONL metrics and samples.

Everything lands under the run dir: ``tb/`` (TensorBoard), ``metrics.jsonl`` (one row per step),
``samples/step_XXXXXX.jsonl`` (every trajectory of a step: turns, verdicts, rewards) and
``summary.json`` (written at exit, also printed as the last stdout line).

Throughput in NeMo-RL's units rides along every step row (`throughput_scalars`): tokens/s/GPU of each phase
(tokens processed / (phase seconds x GPUs of that phase)), end to end, and the training MFU against the GPU's
dense bf16 peak. The facts they need (model FLOPs per token, GPUs per role, the GPU's peak) are read once
from the run dir's config.yaml and the model's config.json (`RunFacts.from_run_dir`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import io
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from megatron_rl.fsutil import LineLog, write_text_atomic

# Dense bf16 peak per GPU, TFLOP/s, matched against torch.cuda.get_device_name() (MFU is reported against it).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0, "S5000": 500.0}


def dump_stacks_on_sigusr1() -> bool:
    """`kill -USR1 <pid>` then writes every thread's stack to stderr without stopping the process: the way to
    see where a long GPU run waits (a compile, a lock, a kernel build). Returns False, arming nothing, when
    stderr is not a real file (pytest's capture, an embedding host), since faulthandler needs a descriptor."""
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (io.UnsupportedOperation, AttributeError, ValueError, RuntimeError):   # RuntimeError: stderr is None
        return False
    return True


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


@dataclasses.dataclass
class RunFacts:
    """What per-GPU throughput and MFU need beyond a step's row."""

    train_gpus: int                      # train ranks (GPUs, or processes on a CPU run)
    rollout_gpus: int                    # GPUs the engines use (colocated: the same ones)
    trajectories_per_step: int           # prompts_per_step x group_size
    shape: Any = None                    # megatron_rl.plan.ModelShape, None when the model is not known yet
    peak_tflops: float | None = None     # None: no GPU (or an unknown one): no MFU

    @property
    def all_gpus(self) -> int:
        return self.train_gpus + (self.rollout_gpus if self.rollout_gpus != self.train_gpus else 0)

    @classmethod
    def from_run_dir(cls, run_dir: Path) -> "RunFacts | None":
        """From run_dir/config.yaml (written by the trainer) and the model's config.json; None if unreadable."""
        from omegaconf import OmegaConf

        from megatron_rl.plan import PlanError, shape_from_hf

        try:
            cfg = OmegaConf.to_container(OmegaConf.load(Path(run_dir) / "config.yaml"), resolve=False)
        except Exception:  # noqa: BLE001 - no config (yet): no per-GPU figures
            return None
        cluster, data, agent = (cfg.get(k) or {} for k in ("cluster", "data", "agent"))
        train = int(cluster.get("actor_world_size") or 1)
        colocated = (cluster.get("placement") or "colocated") == "colocated"
        roll = train if colocated else int(cluster.get("rollout_gpus") or 0) or train
        shape = None
        model_dir = Path((cfg.get("model") or {}).get("path") or Path(run_dir) / "model")
        try:
            shape = shape_from_hf(json.loads((model_dir / "config.json").read_text()), model_dir.name)
        except (OSError, ValueError, PlanError):
            shape = None
        peak = None
        try:
            import torch

            if torch.cuda.is_available():
                name = torch.cuda.get_device_name(0).upper()
                peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        except Exception:  # noqa: BLE001 - no device query, no MFU
            peak = None
        return cls(train, roll, int(data.get("prompts_per_step") or 1) * int(agent.get("group_size") or 1), shape, peak)


def throughput_scalars(row: dict[str, Any], facts: RunFacts) -> dict[str, float]:
    """NeMo-RL-style throughput of one step row (needs `perf/tokens_per_s` and `time/*`): tokens/s/GPU per phase
    and end to end, generated tokens/s/GPU of the rollout (`rollout/tokens_generated`, else estimated from the mean
    first-turn response length and turns, over the rollout's own `rollout/seconds` when logged), and the training
    MFU. Missing inputs leave the figure out."""
    phases = {k[5:]: v for k, v in row.items() if k.startswith("time/") and _finite(v)}
    total = sum(phases.values())
    tps = row.get("perf/tokens_per_s")
    if not _finite(tps) or total <= 0:
        return {}
    tokens = tps * total                                  # tokens in the step's training samples
    out: dict[str, float] = {"perf/step_tokens": tokens, "perf/e2e_tokens_per_s_per_gpu": tokens / total / facts.all_gpus}
    if phases.get("train"):
        out["perf/train_tokens_per_s_per_gpu"] = tokens / phases["train"] / facts.train_gpus
    if phases.get("logprobs"):
        out["perf/logprob_tokens_per_s_per_gpu"] = tokens / phases["logprobs"] / facts.train_gpus
    generated = row.get("rollout/tokens_generated")
    if not _finite(generated):   # older rows: estimated from the mean first-turn response and the turns
        resp, turns = row.get("response/len_mean"), row.get("turns/mean")
        generated = resp * turns * facts.trajectories_per_step if _finite(resp) and _finite(turns) else None
    # the rollout's own wall time (`rollout/seconds`): with async rollouts the `rollout` phase is only the part
    # that training did not hide (often ~0 s), and colocated it also holds the engines' memory moves
    gen_seconds = row.get("rollout/seconds") if _finite(row.get("rollout/seconds")) else phases.get("rollout")
    if gen_seconds and gen_seconds > 0 and generated is not None:
        out["perf/rollout_tokens_per_s_per_gpu"] = generated / gen_seconds / facts.rollout_gpus
    if facts.shape is not None and facts.peak_tflops and phases.get("train"):
        seq = tokens / max(facts.trajectories_per_step, 1)
        flops = tokens * facts.shape.train_flops_per_token(seq)
        out["perf/tflops_per_gpu"] = flops / phases["train"] / facts.train_gpus / 1e12
        out["perf/mfu"] = out["perf/tflops_per_gpu"] / facts.peak_tflops
    return out


class RunLogger:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True, dump_samples: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.dump = dump_samples
        self.facts: RunFacts | None = None   # read from the run dir at the first step (see RunFacts)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        # whole rows only, opened at the first row (the rollout side's logger writes samples, never a row); a failed
        # write (a full disk) raises naming the file and leaves it as it was, so a resume appends after whole rows
        self._metrics = LineLog(self.run_dir / "metrics.jsonl")

    def log_step(self, step: int, scalars: dict[str, Any], phases: dict[str, float], total_steps: int) -> None:
        row = {"step": step, **{k: v for k, v in scalars.items()}, **{f"time/{k}": v for k, v in phases.items()}}
        if self.facts is None:
            self.facts = RunFacts.from_run_dir(self.run_dir)
        if self.facts is not None:
            row.update({k: v for k, v in throughput_scalars(row, self.facts).items() if k not in row})
        self._metrics.write(json.dumps(row, default=float))
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
        if _finite(s.get("engine/decode_s")) and _finite(s.get("engine/decode_ms_per_step")):
            # the embedded engines' share of the rollout: decode seconds, ms per step, mean running batch
            phase += (f" (decode={s['engine/decode_s']:.1f}s, {s['engine/decode_ms_per_step']:.1f}ms/step, "
                      f"batch={f('engine/mean_batch', '{:.1f}')})")
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
