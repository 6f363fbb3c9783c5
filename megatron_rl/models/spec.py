"""What every architecture provides to build a Megatron model from an HF config.

One `ModelSpec` per HF ``model_type`` family. Adding an architecture (e.g. the Qwen3.5 hybrid) means
one more module that registers a spec; the actor, bridge and tools only talk to this interface.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


class ConfigMismatchError(ValueError):
    """The HF config asks for something the Megatron spec cannot represent exactly."""


@dataclasses.dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False

    def __post_init__(self):
        for name in ("tp", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """Numerics and kernels; independent of the architecture."""

    params_dtype: torch.dtype = torch.float32
    use_te: bool | None = None  # None: use TransformerEngine when it imports and CUDA is present
    recompute_granularity: str | None = None  # None | "selective" | "full"
    recompute_num_layers: int | None = None
    use_cpu_initialization: bool = False
    perform_initialization: bool = True
    init_method_std: float = 0.02
    vocab_pad_multiple: int = 128  # padded vocab = ceil(V / (multiple * tp)) * multiple * tp
    # Extra TransformerConfig fields passed through verbatim (the config's `megatron:` section).
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ModelSpec:
    name: str
    hf_model_types: tuple[str, ...]
    validate: Callable[[Any, ParallelSizes], None]
    transformer_config: Callable[[Any, ParallelSizes, BuildOptions], Any]
    gpt_model_kwargs: Callable[[Any, ParallelSizes, BuildOptions], dict]
    layer_spec: Callable[[Any, bool], Any]


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    for t in spec.hf_model_types:
        _REGISTRY[t] = spec
    return spec


def spec_for(hf_config) -> ModelSpec:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _REGISTRY:
        raise ConfigMismatchError(
            f"model_type={model_type!r} is not supported; supported: {sorted(_REGISTRY)}"
        )
    return _REGISTRY[model_type]


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron pads the vocab so that every TP shard has the same, aligned size."""
    step = multiple * tp
    return ((vocab_size + step - 1) // step) * step
