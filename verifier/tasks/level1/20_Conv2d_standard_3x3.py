import torch
import torch.nn as nn


class Model(nn.Module):
    """Standard 2D convolution with a square kernel, stride 1, padding 1, with bias."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, padding: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


batch_size = 4
in_channels = 8
out_channels = 16
kernel_size = 3
height = 32
width = 32


def get_inputs():
    x = torch.randn(batch_size, in_channels, height, width)
    return [x]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size]
