import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """Llama/Qwen-style MLP sublayer: x + down(silu(gate(n)) * up(n)), n = RMSNorm(x)."""

    def __init__(self, hidden: int, intermediate: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(hidden))
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return x + self.down(F.silu(self.gate(n)) * self.up(n))


batch_size = 4
seq_len = 32
hidden = 128
intermediate = 384


def get_inputs():
    return [torch.randn(batch_size, seq_len, hidden)]


def get_init_inputs():
    return [hidden, intermediate]
