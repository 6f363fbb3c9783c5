"""The Megatron actor on real megatron-core over gloo (CPU), checked against HF transformers.

Two spawned runs (world size 1, then 2) cover: logprobs/entropy vs HF on packed micro-batches,
packed == unpacked, the SFT loss and gradient norm vs HF autograd and the updated weights vs a
plain torch AdamW step for 1 vs several micro-batches, fixed-size micro-batches, TP=2, DP=2,
PP=2 (tied), PP=2 x VPP=2; seq-mean aggregation with sample weights; a NaN loss skipping the step
cleanly; a learning curve; PPO mini-batches of an RL batch (π_old fixed before the first: the clip
acts); torch's fused Adam against the foreach fallback; and a checkpoint saved at TP=1 reloaded at
TP=2 (loss, RNG, iteration, extra, and the next optimizer step all identical).
"""
import os

import pytest

from megatron_rl.parallel import spawn

pytestmark = pytest.mark.slow


def test_actor_single_rank_then_two_ranks(tmp_path):
    from tests.actor import dist_cases

    spawn(dist_cases.single_rank, 1, str(tmp_path))
    assert os.path.exists(tmp_path / "single_rank.pt")
    spawn(dist_cases.two_ranks, 2, str(tmp_path))
    assert os.path.exists(tmp_path / "two_ranks.pt")
