import torch
import torch.nn as nn


class Model(nn.Module):
    """Conv2d -> BatchNorm2d (training mode: batch statistics) -> ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


batch_size = 4
in_channels = 8
out_channels = 16
kernel_size = 3
height = 32
width = 32


def get_inputs():
    return [torch.randn(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size]
