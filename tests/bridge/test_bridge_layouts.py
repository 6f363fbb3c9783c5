"""Layout transforms against hand-computed layouts, and TP round trips (pure torch, no processes)."""
import pytest
import torch

from megatron_rl.bridge import (ColumnParallel, GatedMLP, LayoutError, QKVInterleave, Replicated, RowParallel,
                                VocabParallel)
from megatron_rl.bridge.transforms import DictSource, megatron_full


def col(values):
    return torch.tensor(values, dtype=torch.float32).reshape(-1, 1)


def rows(t):
    return t.reshape(-1).tolist()


def shards(transform, tensors, names, tp, local_shape):
    src = DictSource(tensors)
    return [transform.shard(src, names, r, tp, local_shape) for r in range(tp)]


QKV_NAMES = ("q", "k", "v")


def qkv_hand():
    # 4 heads, 2 groups, head_dim 2, hidden 1: q head h = rows [2h, 2h+1]; k/v offset 100/200.
    return {"q": col(range(8)), "k": col([100, 101, 102, 103]), "v": col([200, 201, 202, 203])}


def test_qkv_interleave_matches_hand_layout():
    t = QKVInterleave(num_heads=4, num_groups=2, head_dim=2)
    full = megatron_full(t, qkv_hand(), QKV_NAMES, 1, (16, 1))
    assert rows(full) == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


def test_qkv_tp2_gives_each_rank_whole_groups():
    t = QKVInterleave(num_heads=4, num_groups=2, head_dim=2)
    s = shards(t, qkv_hand(), QKV_NAMES, 2, (8, 1))
    assert rows(s[0]) == [0, 1, 2, 3, 100, 101, 200, 201]
    assert rows(s[1]) == [4, 5, 6, 7, 102, 103, 202, 203]


def test_qkv_tp_above_groups_splits_the_fused_rows_contiguously():
    # tp=4 > 2 groups: Megatron splits "q1 q2 k1 v1" across ranks and all-gathers activations.
    t = QKVInterleave(num_heads=4, num_groups=2, head_dim=2)
    s = shards(t, qkv_hand(), QKV_NAMES, 4, (4, 1))
    assert [rows(x) for x in s] == [[0, 1, 2, 3], [100, 101, 200, 201], [4, 5, 6, 7], [102, 103, 202, 203]]


def test_gated_qkv_hand_layout_and_round_trip():
    # HF q_proj rows per head: [q_h; gate_h]. Megatron per group: [q heads | gate heads | k | v].
    t = QKVInterleave(num_heads=2, num_groups=1, head_dim=1, gated=True)
    hf = {"q": col([0, 10, 1, 11]), "k": col([100]), "v": col([200])}
    full = megatron_full(t, hf, QKV_NAMES, 1, (6, 1))
    assert rows(full) == [0, 1, 10, 11, 100, 200]
    q, k, v = t.to_hf(full, 1)
    assert rows(q) == [0, 10, 1, 11] and rows(k) == [100] and rows(v) == [200]


def test_gated_mlp_holds_gate_and_up_per_rank():
    t = GatedMLP()
    hf = {"g": col([0, 1, 2, 3]), "u": col([10, 11, 12, 13])}
    s = shards(t, hf, ("g", "u"), 2, (4, 1))
    assert rows(s[0]) == [0, 1, 10, 11] and rows(s[1]) == [2, 3, 12, 13]
    g, u = t.to_hf(torch.cat(s), 2)
    assert rows(g) == [0, 1, 2, 3] and rows(u) == [10, 11, 12, 13]


def test_vocab_pads_with_zero_rows_and_strips_them():
    t = VocabParallel(vocab_size=5)
    emb = torch.arange(10, dtype=torch.float32).reshape(5, 2) + 1
    s = shards(t, {"e": emb}, ("e",), 2, (4, 2))
    assert torch.equal(s[0], emb[:4])
    assert torch.equal(s[1][0], emb[4]) and not s[1][1:].any()
    (back,) = t.to_hf(torch.cat(s), 2)
    assert torch.equal(back, emb)


def test_vocab_rank_entirely_in_padding():
    t = VocabParallel(vocab_size=3)
    s = shards(t, {"e": torch.ones(3, 2)}, ("e",), 4, (2, 2))
    assert torch.equal(s[1][0], torch.ones(2)) and not s[1][1].any()  # row 2, then one pad row
    assert not s[2].any() and not s[3].any()  # ranks 2 and 3 hold padding only


def test_row_and_column_parallel_split_the_right_dim():
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    c = shards(ColumnParallel(), {"w": w}, ("w",), 2, (2, 6))
    r = shards(RowParallel(), {"w": w}, ("w",), 3, (4, 2))
    assert torch.equal(c[1], w[2:]) and torch.equal(r[2], w[:, 4:])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_random_round_trips(tp):
    g = torch.Generator().manual_seed(tp)
    H = 8
    cases = [
        (QKVInterleave(num_heads=8, num_groups=2, head_dim=4), {"q": (32, H), "k": (8, H), "v": (8, H)}),
        (QKVInterleave(num_heads=8, num_groups=4, head_dim=4, gated=True), {"q": (64, H), "k": (16, H), "v": (16, H)}),
        (QKVInterleave(num_heads=4, num_groups=2, head_dim=4), {"q": (16,), "k": (8,), "v": (8,)}),  # bias
        (GatedMLP(), {"g": (12, H), "u": (12, H)}),
        (RowParallel(), {"w": (H, 12)}),
        (ColumnParallel(), {"w": (12, H)}),
        (VocabParallel(vocab_size=13), {"w": (13, H)}),
        (Replicated(), {"w": (H,)}),
    ]
    for t, shapes in cases:
        hf = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
        names = tuple(hf)
        full_shape = list(t.full_shape(next(iter(hf.values())).shape, 1))
        if isinstance(t, QKVInterleave):
            full_shape[0] = t.num_groups * t.rows_per_group
        elif isinstance(t, GatedMLP):
            full_shape[0] *= 2
        elif isinstance(t, VocabParallel):
            full_shape[0] = 16
        local = list(full_shape)
        if t.tp_dim is not None:
            local[t.tp_dim] //= tp
        full = megatron_full(t, hf, names, tp, local)
        back = t.to_hf(full, tp)
        for name, b in zip(names, back):
            assert torch.equal(b, hf[name]), (type(t).__name__, name, tp)


def test_shape_errors_name_the_tensor():
    with pytest.raises(LayoutError, match="o_proj"):
        shards(RowParallel(), {"o_proj": torch.zeros(4, 6)}, ("o_proj",), 4, (4, 1))
    with pytest.raises(LayoutError, match="embed"):
        shards(VocabParallel(vocab_size=7), {"embed": torch.zeros(6, 2)}, ("embed",), 1, (8, 2))
    with pytest.raises(LayoutError, match="k_proj"):
        QKVInterleave(num_heads=4, num_groups=2, head_dim=2).shard(
            DictSource({"q_proj": torch.zeros(8, 1), "k_proj": torch.zeros(6, 1), "v_proj": torch.zeros(4, 1)}),
            ("q_proj", "k_proj", "v_proj"), 0, 1, (16, 1))
    with pytest.raises(LayoutError, match="norm"):
        Replicated().shard(DictSource({"norm": torch.zeros(5)}), ("norm",), 0, 1, (4,))
