"""Micro-batch planning and packing (pure python/torch, no process groups)."""
import numpy as np
import pytest
import torch

from megatron_rl.actor.batching import (chunk_fixed, equalize_micro_batch_counts, pack_first_fit_decreasing,
                                        pack_micro_batch, plan_batches, split_for_data_parallel)
from megatron_rl.actor.forward import block_causal_mask
from megatron_rl.actor.losses import token_weights
from megatron_rl.types import SampleError, TrainSample, validate_samples


def test_ffd_hand_example():
    lengths = [5, 9, 3, 7, 2, 4]
    bins = pack_first_fit_decreasing(range(6), lengths, max_tokens=10)
    # decreasing: 9(#1) 7(#3) 5(#0) 4(#5) 3(#2) 2(#4)
    # 9 -> b0; 7 -> b1; 5 -> b2; 4 -> b2 (9); 3 -> b1 (10); 2 fits nowhere (11, 12, 11) -> b3
    assert bins == [[1], [2, 3], [0, 5], [4]]
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(6))


def test_ffd_is_stable_for_ties_and_isolates_oversized_samples():
    lengths = [4, 4, 4, 4, 50]
    assert pack_first_fit_decreasing(range(5), lengths, 8) == [[4], [0, 1], [2, 3]]
    # same input, same answer (no dependence on hash order / randomness)
    assert pack_first_fit_decreasing([3, 2, 1, 0, 4], lengths, 8) == [[4], [0, 1], [2, 3]]


def test_dp_split_balances_tokens_deterministically():
    lengths = [10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    shares = split_for_data_parallel(lengths, 2)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert loads == [10, 10] and shares[0] == [0]
    capped = split_for_data_parallel(lengths, 2, max_samples_per_rank=6)
    assert sorted(len(s) for s in capped) == [5, 6]
    with pytest.raises(ValueError, match="dp_size"):
        split_for_data_parallel(lengths, 0)


def test_equalize_splits_bins_then_adds_dummies():
    lengths = [3, 3, 3, 3, 8]
    per_rank = [[[0, 1, 2, 3]], [[4]]]
    out = equalize_micro_batch_counts([[list(b) for b in r] for r in per_rank], lengths)
    assert out[0] == [[0, 1, 2, 3]] and out[1] == [[4]]          # already equal
    out = equalize_micro_batch_counts([[[0, 1, 2, 3]], [[4], []]], lengths)
    assert out[0] == [[0, 2], [1, 3]]                              # split 12 tokens 6/6
    out = equalize_micro_batch_counts([[[4]], [[0], [1], [2]]], lengths)
    assert out[0] == [[4], [], []]                                  # single-sample bins: dummies
    out = equalize_micro_batch_counts([[[0], [1], [2]]], lengths, count_multiple=2)
    assert len(out[0]) == 4                                         # interleaved PP needs a multiple


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("budget", [8, 20, 1000])
def test_plan_covers_every_sample_once_with_equal_counts(dp, budget):
    rng = np.random.default_rng(dp * 1000 + budget)
    lengths = [int(x) for x in rng.integers(1, 15, size=17)]
    plan = plan_batches(lengths, dp, max_tokens_per_gpu=budget)
    counts = {len(r) for r in plan.micro_batches}
    assert len(counts) == 1
    seen = sorted(i for r in plan.micro_batches for mb in r for i in mb)
    assert seen == list(range(17))
    for r in plan.micro_batches:
        for mb in r:
            assert len(mb) == 1 or sum(lengths[i] for i in mb) <= budget
    assert plan == plan_batches(lengths, dp, max_tokens_per_gpu=budget)


def test_fixed_micro_batches():
    assert chunk_fixed([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3], [4]]
    plan = plan_batches([3] * 5, 2, micro_batch_size=2)
    assert [len(r) for r in plan.micro_batches] == [2, 2]
    with pytest.raises(ValueError, match="max_tokens_per_gpu"):
        plan_batches([3], 1)


def _samples():
    return [
        TrainSample([5, 6, 7, 8], [0, 0, 1, 1], {"adv": [0.0, 0.0, 1.5, -2.0]}),
        TrainSample([9, 10, 11], [0, 1, 0], {"adv": [0.0, 3.0, 0.0]}, weight=2.0),
    ]


def test_pack_trained_rows_layout():
    s = _samples()
    w = token_weights(s, "token_mean")
    mb = pack_micro_batch(s, [0, 1], token_weights=w, field_names=["adv"], rows="trained", pad_multiple=4)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert mb.segment_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 2]
    assert mb.segment_lengths == [4, 3, 1] and mb.num_real_tokens == 7
    # output row t predicts packed token t+1: tokens 7, 8 of sample 0 and token 10 of sample 1
    assert mb.rows.tolist() == [1, 2, 4]
    assert mb.row_labels.tolist() == [7, 8, 10]
    assert mb.row_sample.tolist() == [0, 0, 1] and mb.row_token.tolist() == [2, 3, 1]
    assert mb.row_fields["adv"].tolist() == [1.5, -2.0, 3.0]
    # token mean over 3 trained tokens, sample 1 weighted x2
    assert torch.allclose(mb.row_weight, torch.tensor([1 / 3, 1 / 3, 2 / 3]))


def test_pack_all_rows_and_dummy():
    s = _samples()
    mb = pack_micro_batch(s, [1, 0], rows="all")
    assert mb.rows.tolist() == [0, 1, 3, 4, 5]
    assert mb.row_sample.tolist() == [1, 1, 0, 0, 0] and mb.row_token.tolist() == [1, 2, 1, 2, 3]
    dummy = pack_micro_batch(s, [], rows="trained", field_names=["adv"], pad_multiple=2)
    assert dummy.is_dummy and dummy.input_ids.shape == (1, 2)
    assert dummy.row_sample.tolist() == [-1] and dummy.row_weight.tolist() == [0.0]
    assert dummy.row_loss_mask.tolist() == [0.0] and dummy.row_fields["adv"].tolist() == [0.0]


def test_block_causal_mask():
    mb = pack_micro_batch(_samples(), [0, 1], rows="all")
    mask = block_causal_mask(mb)[0, 0]
    allowed = ~mask
    seg = mb.segment_ids
    for i in range(7):
        for j in range(7):
            assert bool(allowed[i, j]) == (j <= i and seg[i] == seg[j])
    assert block_causal_mask(pack_micro_batch(_samples(), [0], rows="all")) is None


def test_token_weights_hand_computed():
    s = [TrainSample([1, 2, 3, 4], [0, 1, 1, 1], weight=1.0),
         TrainSample([1, 2], [0, 1], weight=0.5),
         TrainSample([1, 2, 3], [0, 0, 0])]
    tm = token_weights(s, "token_mean")
    assert np.allclose(tm[0], [0, 0.25, 0.25, 0.25]) and np.allclose(tm[1], [0, 0.125])
    assert np.allclose(tm[2], 0)
    sm = token_weights(s, "seq_mean")  # 2 sequences with trained tokens
    assert np.allclose(sm[0], [0, 1 / 6, 1 / 6, 1 / 6]) and np.allclose(sm[1], [0, 0.25])
    with pytest.raises(ValueError, match="loss_aggregation"):
        token_weights(s, "sum")


@pytest.mark.parametrize("sample,match", [
    (TrainSample([1, 2, 3], [0, 1]), "sample 0: loss_mask has length 2"),
    (TrainSample([1, 2, 3], [1, 1, 1]), "loss_mask\\[0\\] must be 0"),
    (TrainSample([1, 2, 3], [0, 2, 1]), "loss_mask\\[1\\]=2"),
    (TrainSample([1, -2, 3], [0, 1, 1]), "tokens\\[1\\]=-2"),
    (TrainSample([1, 999, 3], [0, 1, 1]), "outside the vocabulary \\(size 250\\)"),
    (TrainSample([1, 2, 3], [0, 1, 1], {"advantages": [0.0, 1.0]}), "field 'advantages' has length 2"),
    (TrainSample([1, 2, 3], [0, 1, 1], {"advantages": [0.0, float("nan"), 1.0]}), "not finite at trained token 1"),
    (TrainSample([1, 2, 3], [0, 1, 1], weight=-1.0), "weight=-1.0"),
    (TrainSample([], []), "tokens is empty"),
])
def test_sample_validation_names_index_and_field(sample, match):
    good = TrainSample([1, 2], [0, 1], dict(sample.fields and {k: [0.0, 0.0] for k in sample.fields}))
    with pytest.raises(SampleError, match=match.replace("sample 0", "sample 1")):
        validate_samples([good, sample], vocab_size=250)


def test_validation_of_batch_fields():
    a = TrainSample([1, 2], [0, 1], {"advantages": [0.0, 1.0]})
    b = TrainSample([1, 2], [0, 1], {})
    with pytest.raises(SampleError, match="sample 1: fields"):
        validate_samples([a, b])
    with pytest.raises(SampleError, match="required field 'old_logprobs'"):
        validate_samples([a], required_fields=["old_logprobs"])
    with pytest.raises(SampleError, match="empty batch"):
        validate_samples([])
    # untrained positions may hold placeholders
    validate_samples([TrainSample([1, 2], [0, 1], {"x": [float("nan"), 1.0]})])
