import torch
import torch.nn as nn


class Model(nn.Module):
    """Embedding lookup for a (batch, seq) tensor of token ids."""

    def __init__(self, vocab_size: int, embed_dim: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(ids)


vocab_size = 1000
embed_dim = 64
batch_size = 8
seq_len = 64


def get_inputs():
    ids = torch.randint(0, vocab_size, (batch_size, seq_len))
    return [ids]


def get_init_inputs():
    return [vocab_size, embed_dim]
