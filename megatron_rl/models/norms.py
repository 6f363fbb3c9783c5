"""RMSNorm for megatron's local (non-TransformerEngine) layer specs.

Why ours: megatron-core's local norm (``WrappedTorchNorm``) refuses ``layernorm_zero_centered_gamma``
and sequence parallelism, and its fused one needs apex. Qwen3.5 stores every norm but the GDN output
norm as zero-centred gains (the layer computes ``x_hat * (1 + w)``), and megatron's hybrid spec applies
``layernorm_zero_centered_gamma`` to all of its norms, as TransformerEngine's ``TENorm`` does. This
module gives the local spec the same semantics, so a checkpoint means the same under both specs.

Numerics follow HF's Qwen RMSNorms: normalise and scale in fp32, cast the product back to the input
dtype at the end.
"""
from __future__ import annotations

import copy

import torch


class RMSNorm(torch.nn.Module):
    """``y = x / rms(x) * g`` with ``g = 1 + w`` when ``config.layernorm_zero_centered_gamma`` else ``w``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        self.eps = float(eps)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype, device=device))
        # megatron's finalize_model_grads all-reduces the grads of SP-replicated weights over TP
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        gain = self.weight.float()
        return (normed * (1.0 + gain if self.zero_centered else gain)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered={self.zero_centered}"


class PlainGain:
    """Builds ``norm`` with a plain gain (``x_hat * w``) whatever ``layernorm_zero_centered_gamma`` says.

    Why: megatron builds every norm of a hybrid layer from the one TransformerConfig, so Qwen3.5's GDN output
    norm, plain in HF, would be zero-centred too and its checkpoint would hold ``w - 1``, which loses bits for
    gains outside [0.5, 2] (a bf16 gain of 1e-3 came back as 0 and changed the model). With this the checkpoint
    holds HF's ``w`` itself. ``norm`` is our `RMSNorm` or TransformerEngine's ``TENorm`` (a spec's ``params``);
    a class, not a function, because megatron's ``build_module`` returns functions uncalled."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-6, norm=RMSNorm, **kwargs):
        plain = copy.copy(config)   # a shallow copy: TransformerConfig's __post_init__ is not run again
        plain.layernorm_zero_centered_gamma = False
        return norm(config=plain, hidden_size=hidden_size, eps=eps, **kwargs)
