"""Tiny random Qwen3.5 hybrid HF models (text-only and the released multimodal layout) for tests.

Shapes are small but keep every structural trait of the real models: GDN value heads a multiple of
key heads (2x), gated attention with GQA, partial RoPE (25 % of the head), every 4th layer attention
(layer_types), untied embeddings by default, a vocab that is not a multiple of 128. Every parameter
gets distinct random values, so a swapped or mis-laid tensor changes the logits.
"""
from __future__ import annotations

import torch

from tests.bridge.tiny_qwen3 import hf_tensors, tokens  # noqa: F401  (the same helpers serve both)


def tiny_config(*, layers: int = 4, vocab: int = 250, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                head_dim: int = 16, ffn: int = 96, key_heads: int = 2, value_heads: int = 4, key_dim: int = 8,
                value_dim: int = 12, conv: int = 4, tied: bool = False, layer_types=None, **extra):
    from transformers import Qwen3_5TextConfig

    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    rope.update(extra.pop("rope", {}))
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=key_heads, linear_num_value_heads=value_heads, linear_key_head_dim=key_dim,
        linear_value_head_dim=value_dim, linear_conv_kernel_dim=conv, tie_word_embeddings=tied,
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_parameters=rope,
        layer_types=layer_types, **extra)
    cfg._attn_implementation = "eager"
    return cfg


def multimodal_config(text_cfg, vision_depth: int = 1):
    """The hub's ``Qwen3_5Config`` around a text config, with a tiny vision tower."""
    from transformers import Qwen3_5Config

    cfg = Qwen3_5Config(text_config=text_cfg.to_dict(), vision_config={
        "depth": vision_depth, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
        "out_hidden_size": text_cfg.hidden_size, "patch_size": 4, "temporal_patch_size": 2,
        "spatial_merge_size": 2})
    cfg.tie_word_embeddings = text_cfg.tie_word_embeddings
    return cfg


@torch.no_grad()
def randomize(model, seed: int = 0):
    """Distinct values everywhere; norm gains near 1 (zero-centred ones near 0, so (1+w) is near 1), but for a
    quarter of the GDN output norm's gains near 3.7 and another quarter near 1e-3."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("linear_attn.norm.weight"):  # plain gain, some far from 1 (a checkpoint storing w - 1
            p.copy_(1.0 + 0.2 * noise)                 # cannot give 3.7 or 1e-3 back bit for bit)
            p[::4] *= 3.7
            p[1::4] = 1e-3 * noise[1::4]
        elif name.endswith("norm.weight"):  # zero-centred gains
            p.copy_(0.2 * noise)
        elif name.endswith("A_log"):
            p.copy_(torch.log(torch.empty(p.shape).uniform_(1, 16, generator=gen)))
        elif name.endswith("dt_bias"):
            p.copy_(1.0 + 0.3 * noise)
        else:
            p.copy_(0.08 * noise)
    return model


def tiny_model(cfg, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    return randomize(Qwen3_5ForCausalLM(cfg), seed).to(dtype).eval()


def multimodal_tensors(model, mm_cfg, seed: int = 7) -> dict[str, torch.Tensor]:
    """The tensors of the released multimodal checkpoint for `model`'s weights: the language model
    under ``model.language_model.``, a random vision tower (``model.visual.*``) and an MTP layer."""
    from transformers import Qwen3_5ForConditionalGeneration

    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        full = Qwen3_5ForConditionalGeneration(mm_cfg)
    out = {}
    for name, p in full.state_dict().items():
        if name.startswith("model.visual."):
            out[name] = (0.05 * torch.randn(p.shape, generator=gen)).to(torch.bfloat16)  # other dtype on purpose
    for name, t in hf_tensors(model).items():
        out[("lm_head.weight" if name == "lm_head.weight" else "model.language_model." + name[len("model."):])] = t
    h = mm_cfg.text_config.hidden_size
    out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen)
    out["mtp.norm.weight"] = torch.randn(h, generator=gen)
    out["mtp.layers.0.mlp.down_proj.weight"] = torch.randn(h, 8, generator=gen).to(torch.bfloat16)
    return out


def assert_megatron_matches_hf(chunks, hf, vocab_size: int, what: str, bridge=None, ref=None) -> None:
    """Megatron ``chunks`` give transformers' logits (max diff 1e-4) on fixed random ids; with ``bridge`` and
    ``ref``, their export is ``ref`` again, bit for bit. Runs on every rank of a spawned group."""
    import torch.distributed as dist

    from ckpt_tools.forward import megatron_logits

    for c in chunks:
        c.eval()
    ids = torch.randint(0, vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    got = megatron_logits(chunks, ids)[..., :vocab_size]
    with torch.no_grad():
        want = hf(ids, use_cache=False).logits
    diff = (got - want).abs().max().item()
    rank = dist.get_rank() if dist.is_initialized() else 0
    assert diff <= 1e-4, f"{what}: max logit diff {diff} (rank {rank})"
    if bridge is not None:
        exported = dict(bridge.export_hf(chunks))
        assert sorted(exported) == sorted(ref), what
        assert all(torch.equal(exported[n], t) for n, t in ref.items()), what
