import math

import torch
import torch.nn as nn


class Model(nn.Module):
    """Multi-head self-attention (non-causal) with fused QKV and output projections."""

    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        assert embed_dim % num_heads == 0
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, e = x.shape
        q, k, v = self.qkv(x).split(e, dim=2)
        q = q.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = torch.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, s, e)
        return self.proj(y)


batch_size = 2
seq_len = 64
embed_dim = 128
num_heads = 4


def get_inputs():
    return [torch.randn(batch_size, seq_len, embed_dim)]


def get_init_inputs():
    return [embed_dim, num_heads]
