import torch
import torch.nn as nn


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round a channel count to a multiple of `divisor`, never dropping below 90% of it."""
    new_value = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if new_value < 0.9 * value:
        new_value += divisor
    return new_value


class Model(nn.Module):
    """MobileNetV2 inverted residual: 1x1 expand -> 3x3 depthwise -> 1x1 project, + skip."""

    def __init__(self, channels: int, expand_ratio: int):
        super().__init__()
        hidden = make_divisible(channels * expand_ratio)
        self.block = nn.Sequential(
            nn.Conv2d(channels, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, channels, 1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


batch_size = 2
channels = 16
expand_ratio = 6
height = 32
width = 32


def get_inputs():
    return [torch.randn(batch_size, channels, height, width)]


def get_init_inputs():
    return [channels, expand_ratio]
