import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """LeNet-style classifier: two conv+relu+pool stages, then two linear layers."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 8, 5, padding=2)
        self.conv2 = nn.Conv2d(8, 16, 5, padding=2)
        flat = 16 * (image_size // 4) * (image_size // 4)
        self.fc1 = nn.Linear(flat, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


batch_size = 8
in_channels = 3
num_classes = 10
image_size = 32


def get_inputs():
    return [torch.randn(batch_size, in_channels, image_size, image_size)]


def get_init_inputs():
    return [in_channels, num_classes, image_size]
