import torch
import torch.nn as nn


class Model(nn.Module):
    """BatchNorm2d (training-mode statistics, KernelBench semantics)."""

    def __init__(self, num_features):
        super().__init__()
        self.bn = nn.BatchNorm2d(num_features)

    def forward(self, x):
        return self.bn(x)


def get_inputs():
    return [torch.randn(4, 8, 6, 6)]


def get_init_inputs():
    return [8]
