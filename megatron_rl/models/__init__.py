"""HF config -> megatron-core model, one folder per architecture (spec + HF <-> Megatron map).

`spec.ModelSpec` is the interface; `qwen3/` (dense) and `qwen3_5/` (hybrid Gated DeltaNet) register
themselves here, and `megatron_rl.bridge.get_bridge` finds a config's parameter map through the
same registry, so conversion and live sync read one table per architecture.
"""
from __future__ import annotations

from .spec import (BuildOptions, ConfigMismatchError, ModelSpec, ParallelSizes, padded_vocab_size, spec_for,
                   supported_model_types, text_config)
from . import qwen3, qwen3_5  # noqa: F401  (register the architectures)
from .build import build_model, te_available

__all__ = [
    "BuildOptions", "ConfigMismatchError", "ModelSpec", "ParallelSizes", "build_model",
    "padded_vocab_size", "spec_for", "supported_model_types", "te_available", "text_config",
]
