"""GRPO / Dr.GRPO advantages and dynamic sampling."""
import math

import pytest

from megatron_rl.algorithms.advantages import (AdvantageConfig, DynamicSampler, RewardGroup, fill_batch,
                                               group_advantages)

G8 = [1.5, -1.0, -1.0, -0.2, -1.0, -1.0, -1.0, -1.0]


def test_grpo_hand_numbers_group_of_8():
    # mean = -0.5875; centred = 2.0875, -0.4125, 0.3875; sample std = sqrt(5.52875 / 7) = 0.8887189817773831
    adv = group_advantages(G8)
    expected = [2.3488838360820172, -0.46415069814794346, -0.46415069814794346, 0.43602035280564394] + \
               [-0.46415069814794346] * 4
    assert adv == pytest.approx(expected, abs=1e-12)
    assert math.fsum(adv) == pytest.approx(0.0, abs=1e-12)


def test_grpo_std_variants_and_dr_grpo():
    r = [1.0, 0.0, 0.0, 1.0]
    unbiased = group_advantages(r, AdvantageConfig(), group_size=4)
    assert unbiased == pytest.approx([0.5 / (math.sqrt(1 / 3) + 1e-6)] * 1 + [-0.5 / (math.sqrt(1 / 3) + 1e-6)] * 2
                                     + [0.5 / (math.sqrt(1 / 3) + 1e-6)], abs=1e-12)
    assert unbiased[0] == pytest.approx(0.8660239, abs=1e-6)
    population = group_advantages(r, AdvantageConfig(unbiased_std=False), group_size=4)
    assert population == pytest.approx([0.999998, -0.999998, -0.999998, 0.999998], abs=1e-6)
    dr = group_advantages(r, AdvantageConfig(estimator="dr_grpo"))
    assert dr == [0.5, -0.5, -0.5, 0.5]


def test_equal_rewards_give_exact_zero():
    # float mean of 8 × 0.1 is not exactly 0.1; the advantages must still be exactly 0
    assert group_advantages([0.1] * 8) == [0.0] * 8


@pytest.mark.parametrize("rewards,match", [
    ([1.0, None, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], "sample 1: missing verdict"),
    ([1.0, 0.0, float("nan"), 0.0, 1.0, 1.0, 0.0, 0.0], "sample 2: reward is nan"),
    ([1.0, 0.0, 0.0, float("inf"), 1.0, 1.0, 0.0, 0.0], "sample 3: reward is inf"),
    ([1.0, 0.0], "expected group_size=8"),
    ([], "empty"),
])
def test_bad_groups_raise_naming_the_sample(rewards, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_id="prompt-7", group_size=8)
    with pytest.raises(ValueError, match="prompt-7"):
        group_advantages(rewards, group_id="prompt-7", group_size=8)


def _stream(pattern):
    for i, kind in enumerate(pattern):
        rewards = [1.0, -1.0, -1.0, -1.0] if kind == "mixed" else ([-1.0] * 4 if kind == "fail" else [1.2] * 4)
        yield RewardGroup(group_id=f"g{i}", rewards=rewards)


def test_dynamic_sampling_fills_the_batch():
    stream = _stream(["fail", "mixed", "pass", "mixed", "fail", "mixed", "mixed", "mixed"])
    batch, stats = fill_batch(stream, 3, group_size=4)
    assert [g.group_id for g in batch] == ["g1", "g3", "g5"]
    assert (stats.groups_drawn, stats.groups_kept, stats.groups_dropped_zero_std) == (6, 3, 3)
    assert stats.stop_reason == "full" and stats.keep_rate == 0.5
    # the unconsumed part of the stream is left alone
    rest = _stream(["fail", "mixed"])
    assert fill_batch(rest, 5)[1].stop_reason == "stream_end"
    batch, stats = fill_batch(_stream(["fail"] * 10), 2, max_draws=4)
    assert batch == [] and stats.stop_reason == "max_draws" and stats.groups_drawn == 4


def test_dynamic_sampling_rejects_bad_groups():
    bad = [RewardGroup("ok", [1.0, 0.0]), RewardGroup("broken", [1.0, None])]
    with pytest.raises(ValueError, match="broken.*sample 1"):
        fill_batch(iter(bad), 5)
    s = DynamicSampler(1, require_variance=False)
    assert s.offer(RewardGroup("flat", [0.0, 0.0])) is True
    with pytest.raises(RuntimeError):
        s.offer(RewardGroup("late", [0.0, 1.0]))
