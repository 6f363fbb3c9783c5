"""HF config -> the bridge of its architecture (`megatron_rl.models` owns the one registry)."""
from __future__ import annotations

from megatron_rl.models.spec import ConfigMismatchError


def get_bridge(hf_config, hf_names=None, layout=None):
    """The bridge for this HF config (a transformers config, or its dict), chosen by ``model_type``.

    `hf_names` (a checkpoint's tensor names) or `layout` (what `save_source_layout` recorded of them) fix how
    the checkpoint names its tensors where the config leaves it open (`Bridge.layout_for`); without either, the
    config's own class's names."""
    from megatron_rl.models.spec import _REGISTRY

    if isinstance(hf_config, dict):
        from transformers import AutoConfig

        fields = dict(hf_config)
        model_type = fields.pop("model_type", None)
        if model_type not in _REGISTRY:
            raise ConfigMismatchError(f"model_type={model_type!r} has no bridge; supported: {bridge_names()}")
        hf_config = AutoConfig.for_model(model_type, **fields)
    model_type = getattr(hf_config, "model_type", None)
    spec = _REGISTRY.get(model_type)
    if spec is None or spec.bridge_cls is None:
        raise ConfigMismatchError(f"model_type={model_type!r} has no bridge; supported: {bridge_names()}")
    bridge = spec.bridge_cls(hf_config, layout=layout)
    return bridge if hf_names is None else bridge.for_names(hf_names)


def bridge_names() -> list[str]:
    """HF model types that have a bridge."""
    from megatron_rl.models.spec import _REGISTRY

    return sorted(t for t, s in _REGISTRY.items() if s.bridge_cls is not None)


def bridge_name_for(model_type: str | None) -> str | None:
    from megatron_rl.models.spec import _REGISTRY

    spec = _REGISTRY.get(model_type)
    return spec.bridge_cls.name if spec is not None and spec.bridge_cls is not None else None
