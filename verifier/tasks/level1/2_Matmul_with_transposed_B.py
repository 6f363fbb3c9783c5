import torch
import torch.nn as nn


class Model(nn.Module):
    """C = A @ B.T, with B stored as (N, K)."""

    def __init__(self):
        super().__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return torch.matmul(A, B.T)


M = 64
K = 96
N = 80


def get_inputs():
    A = torch.rand(M, K)
    B = torch.rand(N, K)
    return [A, B]


def get_init_inputs():
    return []
