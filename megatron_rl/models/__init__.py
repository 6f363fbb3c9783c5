"""HF config -> megatron-core model. One module per architecture registers a `ModelSpec`."""
from __future__ import annotations

from .spec import BuildOptions, ConfigMismatchError, ModelSpec, ParallelSizes, padded_vocab_size, spec_for
from . import qwen3  # noqa: F401  (registers the qwen3 spec)
from .build import build_model, te_available

__all__ = [
    "BuildOptions", "ConfigMismatchError", "ModelSpec", "ParallelSizes", "build_model",
    "padded_vocab_size", "spec_for", "te_available",
]
