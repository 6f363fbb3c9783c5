"""Scored rollout groups -> the actor's training batch, plus the rollout metrics of a step.

Pure bookkeeping on the rollout side, between the agent loop and the actor: GRPO advantages per
group, one `TrainSample` per trained turn of each trajectory (loss mask on the response, rollout
logprobs and advantages aligned to tokens), and the numbers the run logs (reward, pass rate, speedup,
turns per success, turns cut or skipped for lack of context).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

from megatron_rl.algorithms import AdvantageConfig, batch_advantages
from megatron_rl.rollout.agent import GroupResult, Trajectory
from megatron_rl.types import TrainSample


def build_train_batch(groups: Sequence[GroupResult], adv_cfg: AdvantageConfig, group_size: int | None = None
                      ) -> tuple[list[TrainSample], list[Trajectory]]:
    """The samples of every trained turn, in group order. Groups must be scored (status ok)."""
    if not groups:
        raise ValueError("no scored groups to train on")
    advantages = batch_advantages([g.to_reward_group() for g in groups], adv_cfg, group_size)
    samples: list[TrainSample] = []
    trajectories: list[Trajectory] = []
    for group, adv in zip(groups, advantages):
        for traj, a in zip(group.trajectories, adv):
            samples += traj.to_train_samples(advantage=a)
            trajectories.append(traj)
    return samples, trajectories


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Reward, pass rate, speedup, turns per success and verdict mix of one step's trajectories."""
    n = len(trajectories)
    if n == 0:
        return {}
    rewards = [t.reward for t in trajectories]
    mean = sum(rewards) / n
    first = [t.turns[0] for t in trajectories]
    passed = [t for t in trajectories if t.passed]
    speedups = [tr.verdict.speedup for t in passed for tr in t.turns
                if tr.verdict.passed and tr.verdict.speedup and tr.verdict.speedup > 0]
    cats = Counter(t.turns[0].verdict.category.value for t in trajectories)
    out = {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / n),
        "reward/first_turn_score": sum(t.score for t in first) / n,
        "pass_rate/any_turn": len(passed) / n,
        "pass_rate/first_turn": sum(1 for t in first if t.verdict.passed) / n,
        "turns/mean": sum(t.num_turns for t in trajectories) / n,
        "turns/per_success": (sum(t.first_pass_turn for t in passed) / len(passed)) if passed else float("nan"),
        "speedup/geomean": math.exp(sum(math.log(s) for s in speedups) / len(speedups)) if speedups else float("nan"),
        "response/len_mean": sum(len(t.turns[0].response_ids) for t in trajectories) / n,
        "response/truncated_frac": sum(1 for t in first if t.finish_reason == "length") / n,
        "turns/cut_frac": sum(tr.cut for t in trajectories for tr in t.turns) / sum(t.num_turns for t in trajectories),
        "turns/context_exhausted_frac": sum(t.context_exhausted for t in trajectories) / n,
    }
    for cat, c in cats.items():
        out[f"verdict/{cat}"] = c / n
    return out
