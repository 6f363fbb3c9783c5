import torch
import torch.nn as nn


class Model(nn.Module):
    """ReLU on a tiny input (fast tests of per-element tricks)."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(8, 16)]


def get_init_inputs():
    return []
