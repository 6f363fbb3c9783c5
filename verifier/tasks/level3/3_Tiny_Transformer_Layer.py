import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """Upper-triangular -inf mask so position i attends to positions <= i."""
    return torch.triu(torch.full((seq_len, seq_len), float("-inf"), device=device), diagonal=1)


class Model(nn.Module):
    """Pre-norm decoder layer: x + CausalAttn(LN(x)), then + MLP(LN(x)) with GELU."""

    def __init__(self, hidden: int, num_heads: int, ffn_mult: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn_mult * hidden)
        self.fc2 = nn.Linear(ffn_mult * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q = q.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim) + causal_mask(s, x.device)
        attn = torch.softmax(scores, dim=-1) @ v
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


batch_size = 2
seq_len = 32
hidden = 128
num_heads = 4
ffn_mult = 4


def get_inputs():
    return [torch.randn(batch_size, seq_len, hidden)]


def get_init_inputs():
    return [hidden, num_heads, ffn_mult]
