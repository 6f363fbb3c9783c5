"""MirrorPop: off-policy sequence masking by the mean *absolute* log importance ratio (MusaCoder eqs. 20–21).

With ``ρ_t = π_train(y_t) / π_rollout(y_t)`` over a sequence's trained tokens,

    m_t = max(ρ_t, 1/ρ_t) = exp(|log ρ_t|),        M = 1[ mean_t |log ρ_t| ≤ δ ]

and a sequence with M = 0 is dropped from the policy loss entirely. The absolute value is the point:
the vanilla sequence mask (DeepSeek-style OPSM) thresholds the mean of *signed* log-ratios, where
positive and negative drifts cancel, so a badly off-policy sequence can look on-policy. The signed
variant is kept here (``mode="signed"``, two-sided ``|mean_t log ρ_t| ≤ δ``) for ablations.

Works on packed 1-D tensors (the actor's micro-batch layout: ``sample_index`` says which sequence a
token belongs to) and, for the trainer, on per-sample lists.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

MODES = ("abs", "signed")


@dataclasses.dataclass
class SequenceMask:
    token_keep: torch.Tensor     # [T] float 0/1: 0 on every token of a masked sequence
    seq_keep: torch.Tensor       # [S] bool, S = distinct sequences in sample_index (sorted order)
    seq_drift: torch.Tensor      # [S] mean |log ρ| (or signed mean) over trained tokens
    seq_ids: torch.Tensor        # [S] the sample_index value of each sequence
    seq_has_tokens: torch.Tensor # [S] bool: sequence has >= 1 trained token

    @property
    def num_masked(self) -> int:
        return int((~self.seq_keep & self.seq_has_tokens).sum())

    @property
    def num_sequences(self) -> int:
        return int(self.seq_has_tokens.sum())

    @property
    def masked_fraction(self) -> float:
        n = self.num_sequences
        return self.num_masked / n if n else 0.0


def sequence_drift(log_ratio: torch.Tensor, loss_mask: torch.Tensor, sample_index: torch.Tensor,
                   mode: str = "abs") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence mean of |log ρ| ("abs") or log ρ ("signed") over trained tokens.

    Returns (drift [S], token_count [S], seq_ids [S], inverse [T]) with sequences in sorted id order.
    """
    if mode not in MODES:
        raise ValueError(f"unknown MirrorPop mode {mode!r}; expected one of {MODES}")
    if not (log_ratio.shape == loss_mask.shape == sample_index.shape) or log_ratio.dim() != 1:
        raise ValueError(f"MirrorPop needs equal 1-D shapes, got log_ratio {tuple(log_ratio.shape)}, "
                         f"loss_mask {tuple(loss_mask.shape)}, sample_index {tuple(sample_index.shape)}")
    seq_ids, inverse = torch.unique(sample_index, sorted=True, return_inverse=True)
    mask = loss_mask.to(torch.float64)
    values = log_ratio.detach().to(torch.float64)
    values = values.abs() if mode == "abs" else values
    # masked-out positions may hold garbage (e.g. prompt tokens with logprob 0 vs NaN): zero them first
    values = torch.where(mask > 0, values, torch.zeros_like(values))
    s = seq_ids.numel()
    total = torch.zeros(s, dtype=torch.float64, device=values.device).index_add_(0, inverse, values * mask)
    count = torch.zeros(s, dtype=torch.float64, device=values.device).index_add_(0, inverse, mask)
    drift = total / count.clamp_min(1.0)
    return drift, count, seq_ids, inverse


def mirrorpop_mask(log_ratio: torch.Tensor, loss_mask: torch.Tensor, sample_index: torch.Tensor,
                   delta: float, mode: str = "abs") -> SequenceMask:
    """Keep a sequence iff its drift ≤ δ (``mode="signed"``: iff |signed mean| ≤ δ)."""
    if not (delta >= 0.0):
        raise ValueError(f"MirrorPop delta must be >= 0, got {delta}")
    drift, count, seq_ids, inverse = sequence_drift(log_ratio, loss_mask, sample_index, mode)
    if not torch.isfinite(drift).all():
        bad = seq_ids[~torch.isfinite(drift)].tolist()
        raise ValueError(f"MirrorPop: non-finite log-ratio on trained tokens of samples {bad}")
    seq_keep = drift.abs() <= delta
    token_keep = seq_keep[inverse].to(log_ratio.dtype if log_ratio.is_floating_point() else torch.float32)
    return SequenceMask(token_keep=token_keep, seq_keep=seq_keep, seq_drift=drift, seq_ids=seq_ids,
                        seq_has_tokens=count > 0)


def mirrorpop_keep(train_logprobs: Sequence[Sequence[float]], rollout_logprobs: Sequence[Sequence[float]],
                   loss_masks: Sequence[Sequence[int]], delta: float, mode: str = "abs") -> SequenceMask:
    """Per-sample form for the trainer (e.g. to set ``TrainSample.weight = 0`` on masked samples)."""
    n = len(train_logprobs)
    if len(rollout_logprobs) != n or len(loss_masks) != n:
        raise ValueError(f"MirrorPop: {n} train, {len(rollout_logprobs)} rollout, {len(loss_masks)} mask lists")
    lr, lm, idx = [], [], []
    for i, (a, b, m) in enumerate(zip(train_logprobs, rollout_logprobs, loss_masks)):
        if not (len(a) == len(b) == len(m)):
            raise ValueError(f"MirrorPop sample {i}: train_logprobs {len(a)}, rollout_logprobs {len(b)}, "
                             f"loss_mask {len(m)} differ in length")
        ta, tb = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        lr.append(ta - tb)
        lm.append(torch.as_tensor(m, dtype=torch.float64))
        idx.append(torch.full((len(a),), i, dtype=torch.long))
    if n == 0:
        raise ValueError("MirrorPop: no samples")
    res = mirrorpop_mask(torch.cat(lr), torch.cat(lm), torch.cat(idx), delta, mode)
    if res.seq_ids.numel() != n:  # a zero-length sample: re-expand to one entry per sample
        full_keep = torch.ones(n, dtype=torch.bool)
        full_drift = torch.zeros(n, dtype=torch.float64)
        full_has = torch.zeros(n, dtype=torch.bool)
        full_keep[res.seq_ids], full_drift[res.seq_ids], full_has[res.seq_ids] = (
            res.seq_keep, res.seq_drift, res.seq_has_tokens)
        res = SequenceMask(res.token_keep, full_keep, full_drift, torch.arange(n), full_has)
    return res
