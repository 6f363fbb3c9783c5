"""Qwen3.5 / Qwen3.6 hybrid Gated DeltaNet models (``qwen3_5_text`` and the multimodal ``qwen3_5``): the
config mapping and layer spec (`spec`) and the HF <-> Megatron parameter map (`bridge`), registered as
one architecture."""
from __future__ import annotations

from ..spec import ModelSpec, register
from . import spec
from .bridge import Qwen35Bridge

QWEN3_5 = register(ModelSpec(
    name="qwen3_5",
    hf_model_types=Qwen35Bridge.hf_model_types,
    validate=spec.validate,
    transformer_config=spec.transformer_config,
    gpt_model_kwargs=spec.gpt_model_kwargs,
    layer_spec=spec.layer_spec,
    bridge_cls=Qwen35Bridge,
    fp32_params=("A_log", "dt_bias"),
    # the GDN output norm: one gain of the value-head width, applied to each of this rank's value heads
    tp_partial_grad_params=("self_attention.out_norm.weight",),
    needs_thd_packing=True,
    text_config=spec.text_config,
))
