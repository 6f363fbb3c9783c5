import torch
import torch.nn as nn


class Model(nn.Module):
    """Inclusive prefix sum (scan) along one dimension."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, dim=self.dim)


batch_size = 16
length = 1024
scan_dim = 1


def get_inputs():
    x = torch.rand(batch_size, length)
    return [x]


def get_init_inputs():
    return [scan_dim]
