import torch
import torch.nn as nn


class Model(nn.Module):
    """Cross-entropy over 4096 classes reduced to one scalar: rounding the logits to float16 changes it less
    than one float32 ulp, so no precision can be told apart here (the probe must stay silent)."""

    def __init__(self):
        super().__init__()

    def forward(self, logits, target):
        return torch.nn.functional.cross_entropy(logits, target)


def get_inputs():
    return [torch.randn(128, 4096), torch.randint(0, 4096, (128,))]


def get_init_inputs():
    return []
