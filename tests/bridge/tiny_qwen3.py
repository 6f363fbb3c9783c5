"""Tiny random Qwen3 HF models for bridge / checkpoint tests (vocab 250: not a multiple of 128).

Every parameter, norms included, gets distinct random values, so a swapped or mis-laid tensor
changes the logits.
"""
from __future__ import annotations

import torch


def tiny_config(*, tied: bool = False, layers: int = 2, vocab: int = 250, heads: int = 4, kv_heads: int = 2,
                head_dim: int = 16, hidden: int = 64, ffn: int = 96, **extra):
    """`extra`: further Qwen3Config fields (e.g. ``rope_parameters``)."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      tie_word_embeddings=tied, max_position_embeddings=512, rms_norm_eps=1e-6, **extra)
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def tiny_model(cfg, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        else:
            p.copy_(0.08 * noise)
    return model.to(dtype).eval()


def hf_tensors(model) -> dict[str, torch.Tensor]:
    """The tensors an HF checkpoint of this model holds (tied: no lm_head.weight)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def tokens(vocab: int, batch: int = 2, seq: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def read_weights(hf_dir) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory (all its safetensors shards)."""
    import glob
    import os

    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        out.update(load_file(f))
    return out
