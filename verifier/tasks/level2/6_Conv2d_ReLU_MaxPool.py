import torch
import torch.nn as nn


class Model(nn.Module):
    """Conv2d -> ReLU -> 2x2 max pool."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.conv(x)))


batch_size = 4
in_channels = 3
out_channels = 16
kernel_size = 3
height = 34
width = 34


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size]
