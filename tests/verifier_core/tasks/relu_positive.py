import torch
import torch.nn as nn


class Model(nn.Module):
    """ReLU of positive inputs (KernelBench draws its ReLU inputs with torch.rand): an in-place kernel leaves
    them as they were."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.rand(16, 512)]


def get_init_inputs():
    return []
