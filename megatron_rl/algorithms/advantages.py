"""Group-relative advantages (GRPO, Dr.GRPO) and dynamic sampling.

GRPO: every prompt is sampled G times (G = 8 in MusaCoder) and each sample's advantage is its reward
normalised within the group, ``A_i = (r_i − mean(r)) / (std(r) + ε)``. Dr.GRPO drops the division by
the std (it over-weights near-uniform groups). ``std`` is the Bessel-corrected sample std, as
``torch.std`` computes it (slime and verl use the same); ``unbiased_std=False`` gives the population std.

A group whose rewards are all equal carries no signal (every advantage is 0). Dynamic sampling
(DAPO) drops such groups and keeps drawing until the batch is full: :func:`fill_batch`. Groups are
offered in the order they were drawn, never in the order they finished: a filter fed by finish time
would keep fast tasks and starve slow ones (the agent loop decides in submission order).
Bad input (a missing verdict, NaN/inf reward, wrong group size) raises and names the sample.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Sequence

ESTIMATORS = ("grpo", "dr_grpo")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    estimator: str = "grpo"          # "grpo" | "dr_grpo" (no std division)
    eps: float = 1e-6
    unbiased_std: bool = True

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {self.estimator!r}; expected one of {ESTIMATORS}")
        if not (self.eps >= 0.0):
            raise ValueError(f"eps must be >= 0, got {self.eps}")


@dataclasses.dataclass
class RewardGroup:
    """The G samples of one prompt: their rewards (None = no verdict yet) and payloads."""

    group_id: str
    rewards: list[float | None]
    items: list[Any] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.items and len(self.items) != len(self.rewards):
            raise ValueError(f"group {self.group_id!r}: {len(self.rewards)} rewards but {len(self.items)} items")


def validate_rewards(rewards: Sequence[float | None], group_id: str, group_size: int | None = None) -> list[float]:
    """Finite floats, one per sample; raises naming the group and the sample index otherwise."""
    if len(rewards) == 0:
        raise ValueError(f"group {group_id!r} is empty")
    if group_size is not None and len(rewards) != group_size:
        raise ValueError(f"group {group_id!r} has {len(rewards)} samples, expected group_size={group_size}")
    out = []
    for i, r in enumerate(rewards):
        if r is None:
            raise ValueError(f"group {group_id!r} sample {i}: missing verdict/reward")
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise TypeError(f"group {group_id!r} sample {i}: reward {r!r} is not a number")
        if not math.isfinite(float(r)):
            raise ValueError(f"group {group_id!r} sample {i}: reward is {r}")
        out.append(float(r))
    return out


def has_reward_variance(rewards: Sequence[float]) -> bool:
    """True unless all rewards are identical (exact test: a float std of equal values may be 1e-17)."""
    return max(rewards) != min(rewards)


def group_advantages(rewards: Sequence[float | None], cfg: AdvantageConfig = AdvantageConfig(),
                     group_id: str = "?", group_size: int | None = None) -> list[float]:
    """Per-sample advantages of one group (GRPO or Dr.GRPO); ``group_size`` is enforced when given (the
    rollout's group size is its only owner)."""
    r = validate_rewards(rewards, group_id, group_size)
    if not has_reward_variance(r):
        return [0.0] * len(r)
    n = len(r)
    mean = math.fsum(r) / n
    centred = [x - mean for x in r]
    if cfg.estimator == "dr_grpo":
        return centred
    ddof = 1 if cfg.unbiased_std else 0
    if n - ddof <= 0:
        raise ValueError(f"group {group_id!r}: a single sample has no unbiased std; use group_size >= 2")
    std = math.sqrt(math.fsum(c * c for c in centred) / (n - ddof))
    return [c / (std + cfg.eps) for c in centred]


def batch_advantages(groups: Sequence[RewardGroup], cfg: AdvantageConfig = AdvantageConfig(),
                     group_size: int | None = None) -> list[list[float]]:
    return [group_advantages(g.rewards, cfg, g.group_id, group_size) for g in groups]


@dataclasses.dataclass
class DynamicSamplingStats:
    groups_drawn: int = 0
    groups_kept: int = 0
    groups_dropped_zero_std: int = 0
    stop_reason: str = ""            # "full" | "stream_end" | "max_draws"

    @property
    def keep_rate(self) -> float:
        return self.groups_kept / self.groups_drawn if self.groups_drawn else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["keep_rate"] = self.keep_rate
        return d


class DynamicSampler:
    """Incremental dynamic-sampling filter: ``offer`` groups until it says the batch is full.

    Groups are anything with ``group_id`` and ``rewards`` (e.g. :class:`RewardGroup`, or the agent
    loop's ``GroupResult``). ``require_variance=False`` keeps every group (plain batching, same stats).
    """

    def __init__(self, num_groups: int, group_size: int | None = None, max_draws: int | None = None,
                 require_variance: bool = True):
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if max_draws is not None and max_draws < num_groups:
            raise ValueError(f"max_draws={max_draws} < num_groups={num_groups}: the batch can never fill")
        self.num_groups, self.group_size, self.max_draws = num_groups, group_size, max_draws
        self.require_variance = require_variance
        self.batch: list[Any] = []
        self.stats = DynamicSamplingStats()

    def offer(self, group: Any) -> bool:
        """Take one group; True when the sampler wants no more."""
        if self.stats.stop_reason:
            raise RuntimeError(f"dynamic sampler already stopped ({self.stats.stop_reason})")
        self.stats.groups_drawn += 1
        rewards = validate_rewards(group.rewards, group.group_id, self.group_size)
        if not self.require_variance or has_reward_variance(rewards):
            self.batch.append(group)
            self.stats.groups_kept += 1
        else:
            self.stats.groups_dropped_zero_std += 1
        if len(self.batch) >= self.num_groups:
            self.stats.stop_reason = "full"
        elif self.max_draws is not None and self.stats.groups_drawn >= self.max_draws:
            self.stats.stop_reason = "max_draws"
        return bool(self.stats.stop_reason)

    def result(self) -> tuple[list[Any], DynamicSamplingStats]:
        if not self.stats.stop_reason:
            self.stats.stop_reason = "stream_end"
        return self.batch, self.stats


def fill_batch(groups: Iterable[RewardGroup], num_groups: int, *, group_size: int | None = None,
               max_draws: int | None = None) -> tuple[list[RewardGroup], DynamicSamplingStats]:
    """Draw groups until ``num_groups`` with nonzero reward variance are collected (DAPO dynamic sampling).

    The batch may be short when the stream ends or ``max_draws`` is hit; ``stats.stop_reason`` says
    which. The caller oversamples by making the stream longer than the batch.
    """
    sampler = DynamicSampler(num_groups, group_size, max_draws)
    for g in groups:
        if sampler.offer(g):
            break
    return sampler.result()

