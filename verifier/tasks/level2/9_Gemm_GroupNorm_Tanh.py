import torch
import torch.nn as nn


class Model(nn.Module):
    """Linear layer -> GroupNorm over feature groups -> tanh."""

    def __init__(self, in_features: int, out_features: int, num_groups: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.group_norm(self.linear(x)))


batch_size = 32
in_features = 128
out_features = 256
num_groups = 8


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups]
