import torch
import torch.nn as nn


class Model(nn.Module):
    """Two outputs: ReLU and a shift (a tuple-returning task)."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x), x + 1.0


def get_inputs():
    return [torch.randn(16, 256)]


def get_init_inputs():
    return []
