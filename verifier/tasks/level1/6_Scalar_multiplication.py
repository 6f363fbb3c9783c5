import torch
import torch.nn as nn


class Model(nn.Module):
    """Multiplies a matrix by a scalar given at construction."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, A: torch.Tensor) -> torch.Tensor:
        return A * self.scale


M = 256
N = 512
scale = 3.14


def get_inputs():
    A = torch.randn(M, N)
    return [A]


def get_init_inputs():
    return [scale]
