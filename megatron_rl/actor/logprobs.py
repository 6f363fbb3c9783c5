"""Per-token logprobs and entropy from vocab-parallel logits, in chunks of tokens.

The full-vocab logits of a long packed micro-batch do not fit in memory (16k tokens x 152k vocab
in fp32 is ~10 GB, twice that with the softmax kept for backward), so the output projection runs
over chunks of rows. In training each chunk is activation-checkpointed by default: only the chunk's
logprob/entropy survive the forward, and its logits are recomputed during backward (``recompute=False``
keeps them instead, trading memory for one fewer output-layer pass). The logits
stay sharded over the tensor-parallel vocab split throughout: logprobs go through megatron's
``vocab_parallel_cross_entropy`` and the entropy through all-reduced partial sums; the full
vocabulary is never gathered.

Padded vocabulary entries (megatron pads the vocab to a multiple of 128*tp) are masked out, so
results match the unpadded HF model exactly.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from megatron_rl.models.fp32_logits import fp32_output_linear

# exp(MASKED - max) underflows to exactly 0 in fp32, and 0 * MASKED stays finite (unlike -inf).
_MASKED_LOGIT = -1.0e9


@dataclass
class LogprobRequest:
    """What the model's output processor should compute for one micro-batch.

    ``rows`` index the (sequence-parallel-gathered) packed positions; ``labels[k]`` is the token
    whose logprob row ``rows[k]`` yields.
    """

    rows: Tensor
    labels: Tensor
    vocab_size: int                  # the real (unpadded) vocabulary size
    chunk_size: int = 4096
    with_entropy: bool = False
    recompute: bool = True           # in training: checkpoint each chunk (recompute its logits in backward)
    fp32_logits: bool = False        # keep the output GEMM's fp32 result (`megatron_rl.models.fp32_logits`)


def vocab_parallel_entropy(logits: Tensor, tp_group) -> Tensor:
    """Entropy of softmax(logits) over the full vocabulary from this rank's vocab shard.

    ``H = log S - (sum_v e_v z_v) / S`` with ``z = logits - max`` and ``e = exp(z)``, where the
    sums over the vocabulary are all-reduced across the TP group (identity backward, the usual
    megatron convention for a loss replicated over TP ranks).
    """
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    sharded = tp_group is not None and tp_group.size() > 1

    def vocab_sum(x: Tensor) -> Tensor:
        return reduce_from_tensor_model_parallel_region(x, group=tp_group) if sharded else x

    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    with torch.no_grad():
        m = logits.max(dim=-1, keepdim=True).values
        if sharded:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    z = logits - m
    e = torch.exp(z)
    s = vocab_sum(e.sum(dim=-1))
    ez = vocab_sum((e * z).sum(dim=-1))
    return torch.log(s) - ez / s


def _mask_padded_vocab(logits: Tensor, vocab_size: int, tp_group) -> Tensor:
    """Fill logits of megatron's vocabulary padding (ids >= vocab_size) on this shard."""
    shard = logits.shape[-1]
    rank = tp_group.rank() if tp_group is not None else 0
    start = rank * shard
    if start + shard <= vocab_size:
        return logits
    keep = max(vocab_size - start, 0)
    pad = torch.zeros(shard, dtype=torch.bool, device=logits.device)
    pad[keep:] = True
    return logits.masked_fill(pad, _MASKED_LOGIT)


@contextlib.contextmanager
def _plain_output_layer(output_layer):
    """The output layer as `chunked_logprobs` calls it: sequence parallelism and wgrad fusion off.

    The rows given to the output layer are already gathered over the sequence-parallel split. With
    ``sequence_parallel`` off the layer copies its (replicated) input into the TP region, whose backward
    all-reduces the input gradient; megatron toggles the same flag for inference. The weight enters
    through an alias (see `chunked_logprobs`) that has no ``main_grad``, so megatron's gradient-accumulation
    fusion must not write one: this layer's gradient takes the ordinary path into the parameter.
    """
    saved = {k: getattr(output_layer, k, False) for k in ("sequence_parallel", "gradient_accumulation_fusion")}
    for k in saved:
        setattr(output_layer, k, False)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(output_layer, k, v)


def _output_logits(hidden: Tensor, weight: Tensor | None, output_layer, fp32: bool) -> Tensor:
    """This rank's vocab shard of the logits of [c, 1, h] hidden rows, as the output layer computes them, or with
    ``fp32`` the same GEMM's fp32 result (the layer has no bias; its input enters the TP region as it does)."""
    # megatron features that change how the output layer computes or holds its weight gradient: left to the layer
    own_forward = (getattr(output_layer, "bias", None) is not None
                   or getattr(output_layer, "defer_embedding_wgrad_compute", False))
    if not fp32 or own_forward:
        with _plain_output_layer(output_layer):
            logits, _ = output_layer(hidden, weight=weight, runtime_gather_output=False)
        return logits
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    tp_group = output_layer.tp_group
    if tp_group is not None and tp_group.size() > 1:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    return fp32_output_linear(hidden, weight if weight is not None else output_layer.weight)


def _chunk_logprob_entropy(hidden: Tensor, labels: Tensor, weight: Tensor | None, output_layer,
                           vocab_size: int, with_entropy: bool, fp32_logits: bool = False) -> Tensor:
    """[c, 1, h] hidden rows -> [c, 1 or 2] (logprob, entropy)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    tp_group = output_layer.tp_group
    logits = _output_logits(hidden, weight, output_layer, fp32_logits)
    logits = _mask_padded_vocab(logits.float(), vocab_size, tp_group)  # [c, 1, V/tp]
    cols = []
    if with_entropy:
        entropy = vocab_parallel_entropy(logits, tp_group)
        # vocab_parallel_cross_entropy subtracts the max in place; keep the entropy's inputs intact.
        logits = logits.clone() if torch.is_grad_enabled() else logits
    logprob = -vocab_parallel_cross_entropy(logits, labels[:, None], tp_group=tp_group)
    cols.append(logprob)
    if with_entropy:
        cols.append(entropy)
    return torch.cat(cols, dim=-1)  # [c, k]


def chunked_logprobs(hidden_states: Tensor, output_layer, output_weight: Tensor | None,
                     req: LogprobRequest) -> Tensor:
    """Hidden states of one packed row -> ``[T, 1 or 2]`` (logprob, entropy) at ``req.rows``.

    ``hidden_states`` is ``[s, 1, h]`` (``[s/tp, 1, h]`` under sequence parallelism). The output
    weight enters every chunk through one alias so that its gradient is accumulated into the
    parameter once per micro-batch (DDP's overlapped grad reduction counts grad hooks per param).
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    if hidden_states.dim() != 3 or hidden_states.shape[1] != 1:
        raise ValueError(f"expected packed hidden states [s, 1, h], got {tuple(hidden_states.shape)}")
    if getattr(output_layer, "sequence_parallel", False):
        # Backward just slices: the output layer's input copy all-reduces the gradient already.
        hidden_states = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=False, group=output_layer.tp_group)
    weight = output_weight if output_weight is not None else output_layer.weight
    if torch.is_grad_enabled() and weight.requires_grad:
        weight = weight.view_as(weight)
    rows = hidden_states.index_select(0, req.rows)
    chunk = max(int(req.chunk_size), 1)
    outs = []
    for a in range(0, rows.shape[0], chunk):
        h = rows[a:a + chunk]
        lab = req.labels[a:a + chunk]
        if torch.is_grad_enabled() and req.recompute:
            out = checkpoint(_chunk_logprob_entropy, h, lab, weight, output_layer, req.vocab_size,
                             req.with_entropy, req.fp32_logits, use_reentrant=False)
        else:
            out = _chunk_logprob_entropy(h, lab, weight, output_layer, req.vocab_size, req.with_entropy,
                                         req.fp32_logits)
        outs.append(out)
    return torch.cat(outs, dim=0)


def output_processor(*, hidden_states, output_layer, output_weight, context: LogprobRequest, **_):
    """`GPTModel.forward(output_processor=...)` hook: replaces the full-logit output."""
    return chunked_logprobs(hidden_states, output_layer, output_weight, context)
