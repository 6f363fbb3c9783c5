import torch
import torch.nn as nn


class Model(nn.Module):
    """One GRU step; the hidden state is an explicit input (no state carried across calls)."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.cell = nn.GRUCell(input_size, hidden_size)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.cell(x, h)


batch_size = 32
input_size = 128
hidden_size = 256


def get_inputs():
    x = torch.randn(batch_size, input_size)
    h = torch.randn(batch_size, hidden_size)
    return [x, h]


def get_init_inputs():
    return [input_size, hidden_size]
