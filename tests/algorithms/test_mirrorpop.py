"""MirrorPop (mean |log ρ|) vs the signed-mean mask it replaces."""
import pytest
import torch

from megatron_rl.algorithms.mirrorpop import mirrorpop_keep, mirrorpop_mask


def test_abs_mean_trips_where_signed_drifts_cancel():
    train = [[-0.7, -1.3, -0.7, -1.3], [-0.9, -1.05, -1.0, -0.95], [-0.5, -0.5]]
    rollout = [[-1.0] * 4, [-1.0] * 4, [-1.0] * 2]
    masks = [[1] * 4, [1] * 4, [1] * 2]
    # log ρ: seq0 = [+.3, −.3, +.3, −.3] (signed 0, |.| 0.3); seq1 = [.1, −.05, 0, .05] (|.| 0.05); seq2 = [.5, .5]
    res = mirrorpop_keep(train, rollout, masks, delta=0.2)
    assert res.seq_drift.tolist() == pytest.approx([0.3, 0.05, 0.5], abs=1e-12)
    assert res.seq_keep.tolist() == [False, True, False]
    assert res.masked_fraction == pytest.approx(2 / 3)
    signed = mirrorpop_keep(train, rollout, masks, delta=0.2, mode="signed")
    assert signed.seq_drift.tolist() == pytest.approx([0.0, 0.025, 0.5], abs=1e-12)
    assert signed.seq_keep.tolist() == [True, True, False]
    assert signed.masked_fraction == pytest.approx(1 / 3)


def test_only_trained_tokens_count_and_threshold_is_inclusive():
    log_ratio = torch.tensor([9.0, 0.1, -0.1, float("nan"), 0.2], dtype=torch.float64)
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    idx = torch.tensor([5, 5, 5, 9, 9])
    res = mirrorpop_mask(log_ratio, mask, idx, delta=0.2)
    assert res.seq_ids.tolist() == [5, 9]
    assert res.seq_drift.tolist() == pytest.approx([0.1, 0.2], abs=1e-7)
    assert res.seq_keep.tolist() == [True, True]          # 0.2 <= δ = 0.2 keeps
    assert res.token_keep.tolist() == [1.0] * 5
    res = mirrorpop_mask(log_ratio, mask, idx, delta=0.15)
    assert res.token_keep.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_bad_input():
    with pytest.raises(ValueError, match="sample 1"):
        mirrorpop_keep([[-1.0], [-1.0, -2.0]], [[-1.0], [-1.0]], [[1], [1, 1]], 0.1)
    with pytest.raises(ValueError, match="non-finite.*\\[1\\]"):
        mirrorpop_keep([[-1.0], [float("inf")]], [[-1.0], [-1.0]], [[1], [1]], 0.1)
    with pytest.raises(ValueError, match="delta"):
        mirrorpop_keep([[-1.0]], [[-1.0]], [[1]], -0.1)
