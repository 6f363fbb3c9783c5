"""The Megatron actor: packed micro-batches, vocab-parallel logprobs, DDP + distributed Adam.

- `actor`: `ActorConfig`, `MegatronActor` (compute_logprobs, train_step, save/load, offload)
- `losses`: the loss interface (`LossContext`, `LossFn`, token weights) and `SFTLoss`
- `batching`: DP split, first-fit-decreasing micro-batching, packing
- `forward`: packed forward through a GPTModel chunk (block-diagonal mask / thd, RoPE restarts)
- `logprobs`: chunked vocab-parallel logprobs and entropy
- `optim`: megatron DDP, optimizer, LR schedule, offload helpers
"""
from .actor import ActorConfig, MegatronActor
from .losses import LossContext, LossFn, SFTLoss, token_weights

__all__ = ["ActorConfig", "LossContext", "LossFn", "MegatronActor", "SFTLoss", "token_weights"]
