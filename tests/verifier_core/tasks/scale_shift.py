import torch
import torch.nn as nn


class Model(nn.Module):
    """y = x * weight + bias with learned per-feature parameters."""

    def __init__(self, features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features))
        self.bias = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return x * self.weight + self.bias


features = 1024


def get_inputs():
    return [torch.randn(8, features)]


def get_init_inputs():
    return [features]
