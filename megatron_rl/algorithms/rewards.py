"""Rewards: the per-turn score s_k (MusaCoder eq. 2) and the PrimeEcho trajectory reward (eq. 9).

A turn's score comes from the verifier's verdict; a trajectory (up to K feedback turns) is scored by
PrimeEcho, which anchors the reward to the first turn because the first turn is what ships:

    R = α·s_1 + (1 − α)·max_k s_k + b_early(k*)      k* = turn of the first pass (no bonus if none)

Per-turn reward functions are pluggable by import path (``"pkg.module:function"``) so other tasks
(or a toy task in tests) can reuse the whole loop. ``infra`` verdicts are a farm failure, not a
model failure: scoring one raises :class:`InfraVerdictError`, so the caller must retry the sample.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any, Callable, Sequence

from verifier.types import Category, RewardParams, VerifyResult, reward_eq2


class InfraVerdictError(RuntimeError):
    """A verdict that must be retried, never scored (the farm failed, not the model)."""

    def __init__(self, task_id: str, detail: str = ""):
        self.task_id = task_id
        super().__init__(f"task {task_id!r}: infra verdict cannot be scored; re-queue the sample"
                         + (f" ({detail})" if detail else ""))


@dataclasses.dataclass
class TurnOutcome:
    """What a per-turn reward function sees: one response and its verdict."""

    task: Any                       # the task object (verifier.tasks.Task or a custom one)
    turn: int                       # 1-based
    response_text: str
    verdict: VerifyResult
    response_ids: list[int] | None = None  # the generated token ids, for token-level reward fns


TurnRewardFn = Callable[[TurnOutcome], float]


def eq2_turn_reward(outcome: TurnOutcome, params: RewardParams = RewardParams()) -> float:
    """s_k: MusaCoder eq. 2 recomputed from the verdict's category, q and speedup."""
    v = outcome.verdict
    if v.category == Category.INFRA:
        raise InfraVerdictError(v.task_id, v.feedback[:200])
    return reward_eq2(v.category, v.q, v.speedup, params)


def load_callable(path: str) -> Callable[..., Any]:
    """Resolve ``"pkg.module:function"`` (also ``"pkg.module:Class.method"``) to a callable."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ValueError(f"expected an import path 'pkg.module:function', got {path!r}")
    module_name, attr_path = path.split(":")
    if not module_name or not attr_path:
        raise ValueError(f"expected an import path 'pkg.module:function', got {path!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} of {path!r}: {e}") from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"{path!r}: {obj!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{path!r} resolves to a non-callable {type(obj).__name__}")
    return obj


def resolve_turn_reward(spec: str | TurnRewardFn | None, params: RewardParams = RewardParams()) -> TurnRewardFn:
    """The per-turn reward fn: None/"eq2" -> eq. 2 with ``params``; a callable; or an import path."""
    if spec is None or spec == "eq2":
        return lambda outcome: eq2_turn_reward(outcome, params)
    if callable(spec):
        return spec
    return load_callable(spec)


def checked_turn_score(fn: TurnRewardFn, outcome: TurnOutcome) -> float:
    """Run a reward fn and refuse infra verdicts and non-finite scores, naming the task and turn."""
    if outcome.verdict is None:
        raise ValueError(f"task {getattr(outcome.task, 'task_id', outcome.task)!r} turn {outcome.turn}: "
                         "missing verdict")
    if outcome.verdict.category == Category.INFRA:
        raise InfraVerdictError(outcome.verdict.task_id, outcome.verdict.feedback[:200])
    score = fn(outcome)
    if not isinstance(score, (int, float)) or not math.isfinite(float(score)):
        raise ValueError(f"task {outcome.verdict.task_id!r} turn {outcome.turn}: reward fn returned {score!r}")
    return float(score)


@dataclasses.dataclass(frozen=True)
class PrimeEchoConfig:
    """PrimeEcho weights. α = 0.75 is the paper's default.

    ``early_bonus`` maps the turn of the first pass to b_early. The paper publishes no values; the
    defaults {1: 0.15, 2: 0.08} are the *illustrative* numbers from its figure, not tuned ones.
    """

    alpha: float = 0.75
    early_bonus: dict[int, float] = dataclasses.field(default_factory=lambda: {1: 0.15, 2: 0.08})

    def __post_init__(self):
        if not (0.0 <= self.alpha <= 1.0):
            raise ValueError(f"PrimeEcho alpha must be in [0, 1], got {self.alpha}")
        for k, b in self.early_bonus.items():
            if int(k) < 1 or not math.isfinite(float(b)):
                raise ValueError(f"PrimeEcho early_bonus entry {k!r}: {b!r} is invalid")


def primeecho_reward(scores: Sequence[float], passed: Sequence[bool],
                     cfg: PrimeEchoConfig = PrimeEchoConfig()) -> float:
    """R = α·s_1 + (1−α)·max_k s_k + b_early(first passing turn). ``scores[k-1]`` is s_k."""
    if len(scores) == 0:
        raise ValueError("PrimeEcho needs at least one turn score")
    if len(scores) != len(passed):
        raise ValueError(f"PrimeEcho: {len(scores)} scores but {len(passed)} pass flags")
    for k, s in enumerate(scores, start=1):
        if s is None or not math.isfinite(float(s)):
            raise ValueError(f"PrimeEcho: turn {k} score is {s!r}")
    first_pass = next((k for k, p in enumerate(passed, start=1) if p), None)
    bonus = float(cfg.early_bonus.get(first_pass, 0.0)) if first_pass is not None else 0.0
    return cfg.alpha * float(scores[0]) + (1.0 - cfg.alpha) * max(float(s) for s in scores) + bonus
