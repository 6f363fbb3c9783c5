"""Split a global batch across DP ranks and pack each rank's share into micro-batches.

Every rank receives the same global batch and computes the same plan, so no communication is
needed to agree on it. Micro-batches are packed 1-D (batch size 1, samples concatenated), which
wastes no compute on padding; `forward.py` keeps the packed samples from attending to each other.

Megatron's pipeline schedules need the same number of micro-batches on every rank, so the plan
equalises the count across DP ranks by splitting packed bins and, as a last resort, adding empty
(dummy) micro-batches that contribute nothing to the loss or the gradient.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from megatron_rl.types import TrainSample

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# planning (pure python, deterministic)
# --------------------------------------------------------------------------------------------

def split_for_data_parallel(lengths: Sequence[int], dp_size: int, max_samples_per_rank: int | None = None
                            ) -> list[list[int]]:
    """Longest-processing-time greedy split of sample indices over ``dp_size`` ranks by tokens.

    Deterministic: samples are taken longest first (ties by index) and go to the rank with the
    fewest tokens so far (ties to the lower rank). Each rank's indices come back sorted.
    ``max_samples_per_rank`` caps the count per rank (used with fixed-size micro-batches so that
    sample counts stay balanced too).
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * dp_size
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        candidates = [r for r in range(dp_size)
                      if max_samples_per_rank is None or len(shares[r]) < max_samples_per_rank]
        r = min(candidates, key=lambda r: (loads[r], r))
        shares[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shares]


def pack_first_fit_decreasing(indices: Sequence[int], lengths: Sequence[int], max_tokens: int
                              ) -> list[list[int]]:
    """First-fit-decreasing bin packing of samples into bins of at most ``max_tokens`` tokens.

    Stable: ties in length keep index order; bins come out in creation order with sorted indices.
    A sample longer than ``max_tokens`` gets a bin of its own (it cannot be split).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    loads: list[int] = []
    too_long = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > max_tokens:
            too_long.append(i)
            bins.append([i])
            loads.append(n)
            continue
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    if too_long:
        logger.warning("samples %s are longer than max_tokens_per_gpu=%d; each runs as its own "
                       "micro-batch", too_long[:8], max_tokens)
    return [sorted(b) for b in bins]


def chunk_fixed(indices: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` samples (the fixed-size fallback)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    idx = list(indices)
    return [idx[k:k + micro_batch_size] for k in range(0, len(idx), micro_batch_size)]


def _split_bin(b: list[int], lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for i in sorted(b, key=lambda i: (-lengths[i], i)):
        k = 0 if loads[0] <= loads[1] else 1
        halves[k].append(i)
        loads[k] += lengths[i]
    return sorted(halves[0]), sorted(halves[1])


def equalize_micro_batch_counts(per_rank_bins: list[list[list[int]]], lengths: Sequence[int],
                                count_multiple: int = 1) -> list[list[list[int]]]:
    """Give every rank the same number of micro-batches: the maximum over ranks, rounded up to a
    multiple of ``count_multiple`` (the interleaved pipeline schedule needs a multiple of PP).

    A rank short of micro-batches splits its heaviest multi-sample bin in two (balanced by
    tokens); when every bin holds one sample it appends empty bins (dummy micro-batches).
    """
    target = max((len(b) for b in per_rank_bins), default=0)
    target = max(target, 1)
    target = -(-target // count_multiple) * count_multiple
    out = []
    for bins in per_rank_bins:
        bins = [list(b) for b in bins]
        while len(bins) < target:
            splittable = [k for k, b in enumerate(bins) if len(b) >= 2]
            if not splittable:
                bins.append([])
                continue
            k = max(splittable, key=lambda k: (sum(lengths[i] for i in bins[k]), -k))
            a, b = _split_bin(bins[k], lengths)
            bins[k:k + 1] = [a, b]
        out.append(bins)
    return out


def mini_batch_indices(num_samples: int, num_mini_batches: int) -> list[list[int]]:
    """Contiguous, near-equal mini-batches of a rollout batch (PPO: one optimizer step each). Samples come in
    group order, so equal shares keep a group together whenever the group count divides evenly. At most
    one mini-batch per sample."""
    if num_mini_batches < 1:
        raise ValueError(f"num_mini_batches must be >= 1, got {num_mini_batches}")
    k = min(num_mini_batches, num_samples)
    bounds = [round(i * num_samples / k) for i in range(k + 1)]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class BatchPlan:
    """``micro_batches[dp_rank]`` = list of micro-batches, each a list of global sample indices."""

    micro_batches: list[list[list[int]]]

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches[0])

    def for_rank(self, dp_rank: int) -> list[list[int]]:
        return self.micro_batches[dp_rank]


def plan_batches(lengths: Sequence[int], dp_size: int, *, max_tokens_per_gpu: int | None = None,
                 micro_batch_size: int | None = None, count_multiple: int = 1) -> BatchPlan:
    """Dynamic (token budget, first-fit-decreasing) or fixed-size micro-batching, equalised over DP."""
    if not lengths:
        raise ValueError("cannot plan an empty batch")
    if max_tokens_per_gpu is None and micro_batch_size is None:
        raise ValueError("set max_tokens_per_gpu (dynamic micro-batching) or micro_batch_size")
    if max_tokens_per_gpu is not None:
        shares = split_for_data_parallel(lengths, dp_size)
        bins = [pack_first_fit_decreasing(s, lengths, max_tokens_per_gpu) for s in shares]
    else:
        cap = -(-len(lengths) // dp_size)
        shares = split_for_data_parallel(lengths, dp_size, max_samples_per_rank=cap)
        bins = [chunk_fixed(s, micro_batch_size) for s in shares]
    return BatchPlan(equalize_micro_batch_counts(bins, lengths, count_multiple))


# --------------------------------------------------------------------------------------------
# packing one micro-batch into tensors
# --------------------------------------------------------------------------------------------

@dataclass
class MicroBatch:
    """One packed micro-batch: samples concatenated into a single row of length ``seq_len``.

    Output row ``t`` of the model predicts packed token ``t + 1``; ``rows`` lists the output rows
    whose logprobs are needed (trained tokens for training, every token after the first of each
    sample for logprob computation) and ``row_*`` say which sample/token each belongs to.
    """

    input_ids: torch.Tensor          # [1, S] long
    position_ids: torch.Tensor       # [1, S] long, restarting at 0 for every sample
    segment_ids: torch.Tensor        # [S] long, sample slot within the micro-batch; padding = last
    rows: torch.Tensor               # [T] long, output rows (positions predicting the next token)
    row_labels: torch.Tensor         # [T] long, the token each row predicts
    row_sample: torch.Tensor         # [T] long, global sample index (-1 for a dummy row)
    row_token: torch.Tensor          # [T] long, token index inside its sample
    row_loss_mask: torch.Tensor      # [T] float
    row_weight: torch.Tensor         # [T] float, aggregation weight (see losses.token_weights)
    row_fields: dict[str, torch.Tensor] = field(default_factory=dict)  # [T] float each
    sample_indices: list[int] = field(default_factory=list)
    segment_lengths: list[int] = field(default_factory=list)  # per packed segment, padding included
    num_real_tokens: int = 0

    @property
    def num_segments(self) -> int:
        return len(self.segment_lengths)

    @property
    def max_position(self) -> int:
        return max(self.segment_lengths) - 1

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def is_dummy(self) -> bool:
        return not self.sample_indices

    @property
    def needs_attention_mask(self) -> bool:
        """A plain causal mask suffices for a single unpadded sample."""
        return self.num_segments > 1

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {}
        for name in ("input_ids", "position_ids", "segment_ids", "rows", "row_labels", "row_sample",
                     "row_token", "row_loss_mask", "row_weight"):
            moved[name] = getattr(self, name).to(device, non_blocking=True)
        moved["row_fields"] = {k: v.to(device, non_blocking=True) for k, v in self.row_fields.items()}
        return MicroBatch(**moved, sample_indices=self.sample_indices,
                          segment_lengths=self.segment_lengths, num_real_tokens=self.num_real_tokens)


def pack_micro_batch(samples: Sequence[TrainSample], indices: Sequence[int], *,
                     token_weights: Sequence[np.ndarray] | None = None,
                     field_names: Sequence[str] = (), rows: str = "trained",
                     pad_multiple: int = 1, pad_token_id: int = 0) -> MicroBatch:
    """Pack ``samples[i] for i in indices`` into one row.

    ``rows="trained"`` keeps the output rows of tokens with ``loss_mask == 1`` (training);
    ``rows="all"`` keeps every token after the first of each sample (logprob computation).
    An empty ``indices`` gives a dummy micro-batch of one pad token with one zero-weight row, so
    every parameter still takes part in the backward pass (DDP expects the same grad hooks on
    every micro-batch).
    """
    if rows not in ("trained", "all"):
        raise ValueError(f"rows must be 'trained' or 'all', got {rows!r}")
    toks, pos, seg = [], [], []
    r_rows, r_lab, r_smp, r_tok, r_mask, r_w = [], [], [], [], [], []
    r_fields: dict[str, list[np.ndarray]] = {f: [] for f in field_names}
    offset = 0
    seg_lens = []
    for slot, i in enumerate(indices):
        s = samples[i]
        t = np.asarray(s.tokens, dtype=np.int64)
        n = t.shape[0]
        seg_lens.append(n)
        toks.append(t)
        pos.append(np.arange(n, dtype=np.int64))
        seg.append(np.full(n, slot, dtype=np.int64))
        mask = np.asarray(s.loss_mask, dtype=np.int64)
        keep = np.flatnonzero(mask[1:] == 1) + 1 if rows == "trained" else np.arange(1, n)
        r_rows.append(offset + keep - 1)
        r_lab.append(t[keep])
        r_smp.append(np.full(keep.shape[0], i, dtype=np.int64))
        r_tok.append(keep)
        r_mask.append(mask[keep].astype(np.float32))
        if token_weights is not None:
            r_w.append(np.asarray(token_weights[i], dtype=np.float64)[keep])
        else:
            r_w.append(np.zeros(keep.shape[0]))
        for f in field_names:
            r_fields[f].append(np.asarray(s.fields[f], dtype=np.float64)[keep])
        offset += n
    real = offset
    total = max(real, 1)
    total = -(-total // pad_multiple) * pad_multiple
    if total > real:
        npad = total - real
        toks.append(np.full(npad, pad_token_id, dtype=np.int64))
        pos.append(np.arange(npad, dtype=np.int64))
        seg.append(np.full(npad, len(indices), dtype=np.int64))
        seg_lens.append(npad)
    num_rows = sum(len(r) for r in r_rows)
    if num_rows == 0:
        # Keep one zero-weight row so the output layer still runs (see docstring).
        r_rows, r_lab, r_smp, r_tok = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)], \
            [np.full(1, -1, np.int64)], [np.zeros(1, np.int64)]
        r_mask, r_w = [np.zeros(1, np.float32)], [np.zeros(1)]
        r_fields = {f: [np.zeros(1)] for f in field_names}

    def cat(parts, dtype):
        return torch.from_numpy(np.concatenate(parts)).to(dtype)

    return MicroBatch(
        input_ids=cat(toks, torch.long)[None],
        position_ids=cat(pos, torch.long)[None],
        segment_ids=cat(seg, torch.long),
        rows=cat(r_rows, torch.long),
        row_labels=cat(r_lab, torch.long),
        row_sample=cat(r_smp, torch.long),
        row_token=cat(r_tok, torch.long),
        row_loss_mask=cat(r_mask, torch.float32),
        row_weight=cat(r_w, torch.float32),
        row_fields={f: cat(v, torch.float32) for f, v in r_fields.items()},
        sample_indices=list(indices),
        segment_lengths=seg_lens,
        num_real_tokens=real,
    )
