import torch
import torch.nn as nn


class Model(nn.Module):
    """Exercises every way get_inputs can draw: sized factories, *_like, in-place random ops, ints."""

    def __init__(self):
        super().__init__()

    def forward(self, a, idx, u, like, k, r, z):
        return a.sum() + u.sum() + like.sum() + idx.float().sum() * k + r.float().sum() + z.sum()


def get_inputs():
    a = torch.randn(16, 32)
    idx = torch.randint(0, 10, (8,))
    u = torch.empty(64).uniform_(-1.0, 1.0)
    like = torch.randn_like(torch.empty(5, 5))
    r = torch.arange(10)
    z = torch.zeros(3) + torch.rand(3)
    return [a, idx, u, like, 3, r, z]


def get_init_inputs():
    return []
