"""Qwen3 dense (``model_type: qwen3``): its config mapping and layer spec (`spec`) and its
HF <-> Megatron parameter map (`bridge`), registered as one architecture."""
from __future__ import annotations

from ..spec import ModelSpec, register
from . import spec
from .bridge import Qwen3Bridge

QWEN3 = register(ModelSpec(
    name="qwen3",
    hf_model_types=("qwen3",),
    validate=spec.validate,
    transformer_config=spec.transformer_config,
    gpt_model_kwargs=spec.gpt_model_kwargs,
    layer_spec=spec.layer_spec,
    bridge_cls=Qwen3Bridge,
))
