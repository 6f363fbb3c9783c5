import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """GELU(LayerNorm(x + bias)), with a learned bias vector added first."""

    def __init__(self, hidden: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(hidden) * 0.02)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(x + self.bias))


batch_size = 16
seq_len = 32
hidden = 256


def get_inputs():
    return [torch.randn(batch_size, seq_len, hidden)]


def get_init_inputs():
    return [hidden]
