"""Running one packed micro-batch through a megatron GPTModel chunk.

Packed samples must not see each other, and each must see RoPE positions starting at 0, exactly
as if it ran alone (the HF model and the rollout engine see it alone). Two layouts:

- ``thd`` (attention backends ``te`` and ``sdpa``): megatron's own packed path,
  ``PackedSeqParams(qkv_format='thd', cu_seqlens...)``; the cu_seqlens bound attention per sample
  and restart RoPE positions (TransformerEngine attention, or `attention.SDPACoreAttention`).
- ``mask`` (backend ``local``: megatron's DotProductAttention, which rejects packed params): a
  block-diagonal causal mask keeps samples apart and the chunk's rotary embedding is pointed at
  the per-token positions for the duration of the forward (`restart_rope_positions`).

The model's output processor (`logprobs.output_processor`) returns per-row logprobs (and
entropy) instead of logits; the schedule's loss function gets those rows.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from .batching import MicroBatch
from .logprobs import LogprobRequest, output_processor

PackedMode = Literal["mask", "thd"]


def unwrap_model(module):
    """DDP / Float16Module wrappers -> the GPTModel underneath."""
    while hasattr(module, "module"):
        module = module.module
    return module


def block_causal_mask(mb: MicroBatch) -> torch.Tensor | None:
    """``[1, 1, S, S]`` bool, True = masked: causal within each packed segment, nothing across."""
    if not mb.needs_attention_mask:
        return None
    seg = mb.segment_ids
    s = seg.shape[0]
    causal = torch.ones(s, s, dtype=torch.bool, device=seg.device).triu_(1)
    return (causal | (seg[:, None] != seg[None, :]))[None, None]


def thd_packed_seq_params(mb: MicroBatch):
    from megatron.core.packed_seq_params import PackedSeqParams

    lens = torch.tensor([0] + list(mb.segment_lengths), dtype=torch.int32)
    cu = torch.cumsum(lens, 0, dtype=torch.int32).to(mb.input_ids.device)
    longest = max(mb.segment_lengths)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


@contextlib.contextmanager
def restart_rope_positions(model_chunk, mb: MicroBatch):
    """Have the chunk's RoPE return embeddings for ``mb.position_ids`` instead of 0..S-1.

    RotaryEmbedding.forward is shadowed on the instance (nothing else changes; the state dict is
    untouched) and restored on exit. The embedding for position p is the standard one, so each
    packed sample gets bitwise the angles it would get alone.
    """
    gpt = unwrap_model(model_chunk)
    rope = getattr(gpt, "rotary_pos_emb", None)
    if rope is None or mb.num_segments <= 1:
        yield
        return
    positions = mb.position_ids.reshape(-1)
    table_len = mb.max_position + 1

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        if max_seq_len != positions.shape[0]:
            raise RuntimeError(f"packed RoPE: model asked for {max_seq_len} positions, "
                               f"micro-batch has {positions.shape[0]}")
        return rope.get_emb(table_len).index_select(0, positions)

    rope.forward = forward
    try:
        yield
    finally:
        del rope.forward


@dataclass(frozen=True)
class ForwardSpec:
    vocab_size: int                  # real (unpadded) vocabulary size
    chunk_size: int                  # rows per output-layer chunk
    with_entropy: bool
    packed_mode: PackedMode = "mask"
    recompute_chunks: bool = True    # activation-checkpoint each output-layer chunk in training
    fp32_logits: bool = False        # the output GEMM's fp32 result, not its bf16 rounding (ActorConfig.fp32_lm_head)


OutputHandler = Callable[..., object]


def make_forward_step(spec: ForwardSpec, on_output: OutputHandler):
    """A megatron ``forward_step_func``; ``on_output(mb, output_tensor, non_loss_data=False)``
    becomes the schedule's loss function for that micro-batch (called on the last stage only)."""

    def forward_step(data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        req = LogprobRequest(rows=mb.rows, labels=mb.row_labels, vocab_size=spec.vocab_size,
                             chunk_size=spec.chunk_size, with_entropy=spec.with_entropy,
                             recompute=spec.recompute_chunks, fp32_logits=spec.fp32_logits)
        if spec.packed_mode == "thd":
            mask, extra, rope_ctx = None, {"packed_seq_params": thd_packed_seq_params(mb)}, \
                contextlib.nullcontext()
        else:
            mask, extra, rope_ctx = block_causal_mask(mb), {}, restart_rope_positions(model, mb)
        with rope_ctx:
            out = model(mb.input_ids, mb.position_ids, mask, output_processor=output_processor,
                        output_processor_context=req, **extra)
        return out, functools.partial(on_output, mb)

    return forward_step
