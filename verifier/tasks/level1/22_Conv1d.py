import torch
import torch.nn as nn


class Model(nn.Module):
    """1D convolution over a sequence, stride 1, no padding."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


batch_size = 8
in_channels = 16
out_channels = 32
kernel_size = 5
length = 256


def get_inputs():
    x = torch.randn(batch_size, in_channels, length)
    return [x]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size]
