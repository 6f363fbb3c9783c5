"""The loss interface between the actor and the algorithms, and the SFT (cross-entropy) loss.

The actor hands a loss function one micro-batch at a time, packed 1-D over the trained tokens
of its samples. Token weights are precomputed over the *global* batch, so a loss of the form
``sum(token_weight * loss_mask * per_token_loss)`` summed over all micro-batches and DP ranks is
exactly the chosen aggregation (token mean or sequence mean); the actor then makes the gradient
equal d(global sum)/dθ whatever the DP size and micro-batch count. Metrics are (sum, count) pairs
so the actor can reduce them exactly over the global batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

import numpy as np
from torch import Tensor

from megatron_rl.types import TrainSample

Aggregation = Literal["token_mean", "seq_mean"]
Metrics = dict[str, tuple[Tensor, Tensor]]


@dataclass
class LossContext:
    """One micro-batch, packed 1-D over the trained positions of its samples (length T)."""

    logprobs: Tensor                 # [T] log p(token | prefix) under the current policy (requires grad)
    entropy: Tensor | None           # [T] entropy of the predictive distribution, when needs_entropy
    loss_mask: Tensor                # [T] float 0/1
    token_weight: Tensor             # [T] aggregation weight (see `token_weights`)
    fields: dict[str, Tensor] = field(default_factory=dict)  # [T] each (advantages, old_logprobs, ...)
    sample_index: Tensor | None = None  # [T] global sample index of each token (-1 for padding rows)


class LossFn(Protocol):
    """Returns ``(loss, metrics)`` with ``loss = sum(token_weight * loss_mask * per_token_loss)``
    and ``metrics: name -> (sum, count)`` (both tensors; the actor reports sum/count over the
    global batch). An optional ``required_fields`` attribute lists the `TrainSample.fields` the
    loss reads; the actor checks them up front with an error naming the sample."""

    needs_entropy: bool

    def __call__(self, ctx: LossContext) -> tuple[Tensor, Metrics]: ...


def token_weights(samples: Sequence[TrainSample], aggregation: Aggregation) -> list[np.ndarray]:
    """Per-token aggregation weights over the global batch (one float64 array per sample).

    ``token_mean``: ``weight_i / N`` with N the number of trained tokens in the batch.
    ``seq_mean``: ``weight_i / (n_seqs * len_i)`` with ``len_i`` the trained tokens of sample i
    and ``n_seqs`` the samples that have any. Untrained tokens get 0. ``weight_i`` is
    ``TrainSample.weight`` (0 drops a sample without changing the denominators).
    """
    masks = [np.asarray(s.loss_mask, dtype=np.float64) for s in samples]
    counts = [float(m.sum()) for m in masks]
    if aggregation == "token_mean":
        total = sum(counts)
        return [m * (s.weight / total if total else 0.0) for m, s in zip(masks, samples)]
    if aggregation == "seq_mean":
        n_seqs = sum(1 for c in counts if c > 0)
        return [m * (s.weight / (n_seqs * c) if c else 0.0) for m, s, c in zip(masks, samples, counts)]
    raise ValueError(f"loss_aggregation must be 'token_mean' or 'seq_mean', got {aggregation!r}")


def masked_metric(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(sum over masked tokens, number of masked tokens), detached."""
    values = values.detach().float()
    return (values * mask).sum(), mask.sum()


class SFTLoss:
    """Cross entropy on the trained tokens: per-token loss ``-logprob``."""

    needs_entropy = False
    required_fields: Sequence[str] = ()

    def __call__(self, ctx: LossContext) -> tuple[Tensor, Metrics]:
        nll = -ctx.logprobs
        loss = (ctx.token_weight * ctx.loss_mask * nll).sum()
        metrics: Metrics = {"nll": masked_metric(nll, ctx.loss_mask)}
        if ctx.entropy is not None:
            metrics["entropy"] = masked_metric(ctx.entropy, ctx.loss_mask)
        return loss, metrics
