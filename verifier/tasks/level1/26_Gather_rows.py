import torch
import torch.nn as nn


class Model(nn.Module):
    """Selects rows of a table by integer index (index_select along dim 0)."""

    def __init__(self):
        super().__init__()

    def forward(self, table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return torch.index_select(table, 0, idx)


num_rows = 1024
row_dim = 64
num_indices = 512


def get_inputs():
    table = torch.randn(num_rows, row_dim)
    idx = torch.randint(0, num_rows, (num_indices,))
    return [table, idx]


def get_init_inputs():
    return []
