"""A core-attention module for megatron's local layer spec built on PyTorch's fused attention.

Why: without TransformerEngine, megatron's local spec computes attention with
``DotProductAttention`` (explicit [b*h, s, s] scores, unfused softmax) and rejects packed
(``thd``) micro-batches. On the GPU machines without TE that is both slow and memory-hungry at
RL sequence lengths. `SDPACoreAttention` is a drop-in replacement (same constructor and forward
signature, no parameters, so state dicts and checkpoints are unchanged) that:

- runs packed ``thd`` micro-batches (``PackedSeqParams``) with ``torch.nn.attention.varlen``
  flash attention on CUDA, or one causal SDPA call per packed sample elsewhere, so samples never
  attend across boundaries and megatron's own thd RoPE restarts positions per sample;
- runs unpacked ``[s, b, h, d]`` inputs with ``scaled_dot_product_attention`` (flash kernel for the
  causal case, GQA without materialising repeated K/V).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except Exception:  # pragma: no cover - older torch
    varlen_attn = None


def _megatron_module_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class SDPACoreAttention(_megatron_module_base()):
    """Core attention (after QKV projection and RoPE, before the output projection)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        from megatron.core.transformer.enums import AttnMaskType

        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SDPACoreAttention supports softmax_type='vanilla', got {config.softmax_type!r}")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention is for causal self-attention, got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("SDPACoreAttention does not implement attention dropout (RL/SFT use 0)")
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self._native_gqa_varlen = True

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not take an attention bias")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: only thd")
            out = self._thd(query, key, value, packed_seq_params)        # [t, np, hn]
            return out.reshape(out.shape[0], -1)
        # [s, b, np, hn] -> [b, np, s, hn]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=k.shape[1] != q.shape[1])
        else:  # megatron masks are True where attention is NOT allowed
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _thd(self, q, k, v, p):
        cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_kv
        if getattr(p, "cu_seqlens_q_padded", None) is not None and not torch.equal(p.cu_seqlens_q_padded, cu_q):
            raise ValueError("padded thd sequences (cu_seqlens_q_padded) are not supported")
        if q.is_cuda and varlen_attn is not None and q.dtype in (torch.float16, torch.bfloat16):
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            if self._native_gqa_varlen:
                try:
                    return varlen_attn(q, k, v, cu_q, cu_k, int(p.max_seqlen_q), int(p.max_seqlen_kv),
                                       scale=self.softmax_scale, window_size=(-1, 0))
                except RuntimeError:
                    self._native_gqa_varlen = False  # kernel without GQA: expand K/V from now on
            rep = q.shape[1] // k.shape[1]
            return varlen_attn(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), cu_q, cu_k,
                               int(p.max_seqlen_q), int(p.max_seqlen_kv), scale=self.softmax_scale,
                               window_size=(-1, 0))
        # Reference path (CPU, fp32): one causal SDPA per packed sample.
        bounds = cu_q.tolist()
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (x[a:b].permute(1, 0, 2)[None] for x in (q, k, v))  # [1, h, len, d]
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.softmax_scale,
                                               enable_gqa=ks.shape[1] != qs.shape[1])
            outs.append(o[0].permute(1, 0, 2))
        return torch.cat(outs, dim=0)


def install_sdpa_attention(model_chunks) -> int:
    """Swap every layer's local ``DotProductAttention`` for `SDPACoreAttention`; returns the count.

    Done after construction because the layer spec belongs to the model builder; the swapped
    module has no parameters, so nothing else (state dict, checkpoints, DDP buckets) changes.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from .forward import unwrap_model

    swapped = 0
    for chunk in model_chunks:
        for module in unwrap_model(chunk).modules():
            core = getattr(module, "core_attention", None)
            if isinstance(core, DotProductAttention):
                if any(True for _ in core.parameters()):
                    raise ValueError("cannot replace a core attention that has parameters")
                module.core_attention = SDPACoreAttention(
                    config=core.config, layer_number=core.layer_number, attn_mask_type=core.attn_mask_type,
                    attention_type=getattr(core, "attention_type", "self"),
                    softmax_scale=getattr(module.config, "softmax_scale", None),
                ).to(next(iter(chunk.parameters())).device)
                swapped += 1
    return swapped


# --------------------------------------------------------------------------- packed (thd) RoPE

def thd_rope_without_host_sync(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, *,
                               rotary_interleaved: bool = False, mscale: float = 1.0) -> torch.Tensor:
    """megatron's unfused thd RoPE (one context-parallel rank), computed for all packed tokens at once.

    megatron-core's ``_apply_rotary_pos_emb_thd`` reads the sequence lengths to the host
    (``.tolist()``, ``.item()``) and rotates one sequence at a time: four host-device syncs per layer for
    q and k, each of which drains the GPU queue. Here every token's position comes from ``cu_seqlens`` on
    the device (``searchsorted``), and one bshd call rotates all tokens: the same elementwise operations
    on the same values, so the result is bitwise identical. ``freqs`` is either per packed token
    (``freqs.size(0) == t.size(0)``, megatron's exact-mapping case) or per position within a sequence.
    """
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    n = t.shape[0]
    if freqs.size(0) == n:
        per_token = freqs
    else:  # positions restart at 0 in every packed sequence
        idx = torch.arange(n, device=t.device, dtype=torch.int64)
        bounds = cu_seqlens.to(torch.int64)
        seg = torch.searchsorted(bounds[1:].contiguous(), idx, right=True)
        per_token = freqs.index_select(0, idx - bounds.index_select(0, seg))
    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), per_token, rotary_interleaved=rotary_interleaved,
                                      mscale=mscale).squeeze(1)


def install_sync_free_thd_rope() -> None:
    """Route megatron attention's unfused packed-sequence RoPE through `thd_rope_without_host_sync`.

    Process-wide (megatron's ``Attention.forward`` looks the function up in its module), exact, and
    limited to the case it reproduces: cu_seqlens given, no fused RoPE, no context parallelism, no
    MLA interleaving. Everything else goes to megatron's own function unchanged.
    """
    import megatron.core.transformer.attention as attention_module

    original = attention_module.apply_rotary_pos_emb
    if getattr(original, "stock", None) is not None:
        return

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                             mla_rotary_interleaved=False):
        cp_size = cp_group.size() if cp_group is not None else 1
        if (cu_seqlens is None or config.apply_rope_fusion or cp_size != 1 or mla_rotary_interleaved
                or (mla_rotary_interleaved is None and config.multi_latent_attention)):
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group,
                            mla_rotary_interleaved=mla_rotary_interleaved)
        return thd_rope_without_host_sync(t, cu_seqlens, freqs, rotary_interleaved=config.rotary_interleaved,
                                          mscale=mscale)

    apply_rotary_pos_emb.stock = original
    attention_module.apply_rotary_pos_emb = apply_rotary_pos_emb


def uninstall_sync_free_thd_rope() -> None:
    """Back to megatron's own function (benchmarks compare the two side by side)."""
    import megatron.core.transformer.attention as attention_module

    stock = getattr(attention_module.apply_rotary_pos_emb, "stock", None)
    if stock is not None:
        attention_module.apply_rotary_pos_emb = stock
