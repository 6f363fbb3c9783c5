import torch
import torch.nn as nn


class Model(nn.Module):
    """2D batch normalization; the reference runs in training mode (batch statistics)."""

    def __init__(self, num_features: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(num_features=num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x)


batch_size = 8
features = 16
height = 32
width = 32


def get_inputs():
    x = torch.randn(batch_size, features, height, width)
    return [x]


def get_init_inputs():
    return [features]
