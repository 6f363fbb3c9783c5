import torch
import torch.nn as nn


class Model(nn.Module):
    """Linear layer, division by a constant, then clamp to [min_value, max_value]."""

    def __init__(self, in_features: int, out_features: int, divisor: float,
                 min_value: float, max_value: float):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.divisor = divisor
        self.min_value = min_value
        self.max_value = max_value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x) / self.divisor
        return torch.clamp(x, min=self.min_value, max=self.max_value)


batch_size = 32
in_features = 256
out_features = 256
divisor = 2.0
min_value = -0.5
max_value = 0.5


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, divisor, min_value, max_value]
