"""Buffered Dynamic Retry (BDR): recover gradient signal from prompts whose whole group failed.

A group in which every sample failed has zero reward variance, so GRPO learns nothing from it and
dynamic sampling drops it. BDR keeps such prompts in a bounded FIFO, each with one failing code
sample and its verifier error, and with a small probability ``p`` re-issues the oldest one as a
*repair* prompt (task + failed code + error -> fix; see ``megatron_rl.rollout.prompts.repair_messages``).

The paper publishes neither the buffer size nor ``p``; the defaults here are placeholders.
Everything is deterministic given the seed, and the whole state (entries, counters, RNG) is a
JSON-serialisable dict that goes into checkpoints.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import random
from typing import Any, Sequence

from verifier.types import Category, VerifyResult

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class BDRConfig:
    capacity: int = 256          # placeholder: not published
    replay_prob: float = 0.05    # placeholder: "a small probability"
    max_attempts: int = 3        # an entry that has been replayed this often is not re-buffered
    max_code_chars: int = 16000  # the stored failing sample is truncated to this

    def __post_init__(self):
        if self.capacity < 1:
            raise ValueError(f"BDR capacity must be >= 1, got {self.capacity}")
        if not (0.0 <= self.replay_prob <= 1.0):
            raise ValueError(f"BDR replay_prob must be in [0, 1], got {self.replay_prob}")
        if self.max_attempts < 1:
            raise ValueError(f"BDR max_attempts must be >= 1, got {self.max_attempts}")


@dataclasses.dataclass
class FailedPrompt:
    """One buffered prompt: the task, one failing attempt and what the verifier said about it."""

    task_id: str
    failed_code: str
    category: str
    error: str
    score: float
    attempts: int = 0            # how many times it was replayed before being (re-)buffered
    step: int | None = None      # training step at which it was buffered

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FailedPrompt":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"task_id", "failed_code", "category", "error", "score"} - set(d)
        if missing:
            raise ValueError(f"BDR entry is missing {sorted(missing)}: {d!r:.200}")
        return cls(**{k: v for k, v in d.items() if k in names})


def pick_failing_sample(verdicts: Sequence[VerifyResult], scores: Sequence[float]) -> int:
    """The sample to keep for repair: the best-scoring failure (closest to passing), earliest on ties.

    Samples without code (format errors) are used only when nothing else failed.
    """
    if len(verdicts) != len(scores) or not verdicts:
        raise ValueError(f"pick_failing_sample: {len(verdicts)} verdicts vs {len(scores)} scores")
    order = sorted(range(len(verdicts)),
                   key=lambda i: (verdicts[i].category == Category.FORMAT_ERROR, -scores[i], i))
    return order[0]


class BufferedDynamicRetry:
    def __init__(self, cfg: BDRConfig = BDRConfig(), seed: int = 0):
        self.cfg = cfg
        self._rng = random.Random(seed)
        self._buffer: collections.OrderedDict[str, FailedPrompt] = collections.OrderedDict()
        self.counters = {"pushed": 0, "refreshed": 0, "evicted": 0, "replayed": 0, "retired": 0, "draws": 0,
                         "returned": 0}

    def __len__(self) -> int:
        return len(self._buffer)

    def entries(self) -> list[FailedPrompt]:
        """Oldest first."""
        return list(self._buffer.values())

    def push(self, entry: FailedPrompt) -> bool:
        """Buffer a failed prompt (FIFO; the oldest is evicted when full). False if it was retired.

        A task already in the buffer keeps its place and gets the newer failing sample.
        """
        if entry.attempts >= self.cfg.max_attempts:
            self.counters["retired"] += 1
            return False
        entry = dataclasses.replace(entry, failed_code=entry.failed_code[: self.cfg.max_code_chars])
        if entry.task_id in self._buffer:
            self._buffer[entry.task_id] = entry
            self.counters["refreshed"] += 1
            return True
        if len(self._buffer) >= self.cfg.capacity:
            self._buffer.popitem(last=False)
            self.counters["evicted"] += 1
        self._buffer[entry.task_id] = entry
        self.counters["pushed"] += 1
        return True

    def add_group(self, task_id: str, verdicts: Sequence[VerifyResult], scores: Sequence[float],
                  codes: Sequence[str], attempts: int = 0, step: int | None = None) -> bool:
        """Buffer the prompt if the whole group failed; returns whether it was buffered.

        ``attempts``: pass ``entry.attempts + 1`` when the group was itself a replayed repair prompt.
        """
        if not (len(verdicts) == len(scores) == len(codes)) or not verdicts:
            raise ValueError(f"BDR group {task_id!r}: {len(verdicts)} verdicts, {len(scores)} scores, "
                             f"{len(codes)} codes")
        for i, (v, s) in enumerate(zip(verdicts, scores)):
            if v is None:
                raise ValueError(f"BDR group {task_id!r} sample {i}: missing verdict")
            if v.category == Category.INFRA:
                raise ValueError(f"BDR group {task_id!r} sample {i}: infra verdict (retry it, do not buffer)")
            if not math.isfinite(float(s)):
                raise ValueError(f"BDR group {task_id!r} sample {i}: score {s}")
        if any(v.passed for v in verdicts):
            return False
        i = pick_failing_sample(verdicts, scores)
        return self.push(FailedPrompt(task_id=task_id, failed_code=codes[i], category=verdicts[i].category.value,
                                      error=verdicts[i].feedback, score=float(scores[i]), attempts=attempts,
                                      step=step))

    def maybe_replay(self) -> FailedPrompt | None:
        """One Bernoulli(p) draw; on success pop and return the oldest entry (None if empty or no hit)."""
        self.counters["draws"] += 1
        hit = self._rng.random() < self.cfg.replay_prob
        if not hit or not self._buffer:
            return None
        _, entry = self._buffer.popitem(last=False)
        self.counters["replayed"] += 1
        return dataclasses.replace(entry, attempts=entry.attempts + 1)

    def restore(self, entry: FailedPrompt) -> None:
        """Give back a replayed entry whose repair group was never used (cancelled, or not needed once the
        batch was full): it goes back to the front, its replay not counted. A newer failure of the same task
        buffered in the meantime wins; in a full buffer it is the oldest entry, so FIFO evicts it."""
        self.counters["returned"] += 1
        if entry.task_id in self._buffer:
            return
        if len(self._buffer) >= self.cfg.capacity:
            self.counters["evicted"] += 1
            return
        self._buffer[entry.task_id] = dataclasses.replace(entry, attempts=max(entry.attempts - 1, 0))
        self._buffer.move_to_end(entry.task_id, last=False)

    def draw(self, num_slots: int) -> list[FailedPrompt]:
        """For each of ``num_slots`` prompt slots of a batch, a replay with probability p."""
        out = []
        for _ in range(num_slots):
            e = self.maybe_replay()
            if e is not None:
                out.append(e)
        return out

    # ---- checkpointing

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self._rng.getstate()
        return {
            "version": STATE_VERSION,
            "config": dataclasses.asdict(self.cfg),
            "entries": [dataclasses.asdict(e) for e in self._buffer.values()],
            "counters": dict(self.counters),
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"BDR state has version {state.get('version') if isinstance(state, dict) else state!r}, "
                             f"expected {STATE_VERSION}")
        try:
            version, internal, gauss = state["rng"]
            rng = random.Random()
            rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
            entries = [FailedPrompt.from_dict(d) for d in state["entries"]]
            counters = {k: int(v) for k, v in state["counters"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"BDR state is malformed: {e}") from e
        if len(entries) > self.cfg.capacity:
            raise ValueError(f"BDR state holds {len(entries)} entries > capacity {self.cfg.capacity}")
        self._rng = rng
        self._buffer = collections.OrderedDict((e.task_id, e) for e in entries)
        self.counters.update(counters)
