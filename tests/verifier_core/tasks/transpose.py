import torch
import torch.nn as nn


class Model(nn.Module):
    """Matrix transpose (pure data movement: every op it needs is on the allocation/view allowlist)."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x.t().contiguous()


def get_inputs():
    return [torch.randn(48, 80)]


def get_init_inputs():
    return []
