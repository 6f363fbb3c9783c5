import torch
import torch.nn as nn


class Model(nn.Module):
    """Linear layer, sigmoid, then a sum over features (one scalar per row, kept as (B, 1))."""

    def __init__(self, in_features: int, hidden: int):
        super().__init__()
        self.linear = nn.Linear(in_features, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.sigmoid(self.linear(x))
        return torch.sum(x, dim=1, keepdim=True)


batch_size = 32
in_features = 128
hidden = 256


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, hidden]
