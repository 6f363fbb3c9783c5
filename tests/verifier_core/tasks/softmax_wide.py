import torch
import torch.nn as nn


class Model(nn.Module):
    """Softmax over 393216 columns: every output is about 2.5e-6 (below atol=1e-4)."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.softmax(x, dim=1)


def get_inputs():
    return [torch.rand(2, 393216)]


def get_init_inputs():
    return []
