import torch
import torch.nn as nn


class Model(nn.Module):
    """Mean squared error over 2^18 entries reduced to one scalar: an honest kernel summing them in one float32
    accumulator errs more than rounding the inputs to float16 does (the precision probe must stay silent)."""

    def __init__(self):
        super().__init__()

    def forward(self, predictions, targets):
        return torch.mean((predictions - targets) ** 2)


def get_inputs():
    return [torch.randn(64, 4096), torch.randn(64, 4096)]


def get_init_inputs():
    return []
