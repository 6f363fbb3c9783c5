import torch
import torch.nn as nn


class Model(nn.Module):
    """y = A @ x for a (M, K) matrix and a (K, 1) column vector."""

    def __init__(self):
        super().__init__()

    def forward(self, A: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(A, x)


M = 256
K = 512


def get_inputs():
    A = torch.rand(M, K)
    x = torch.rand(K, 1)
    return [A, x]


def get_init_inputs():
    return []
