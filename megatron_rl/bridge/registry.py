"""HF ``model_type`` -> bridge class."""
from __future__ import annotations

from megatron_rl.models import ConfigMismatchError

_BRIDGES: dict[str, type] = {}


def register(cls):
    for t in cls.hf_model_types:
        _BRIDGES[t] = cls
    return cls


def get_bridge(hf_config):
    """The bridge for this HF config (a transformers config, or its dict), chosen by ``model_type``."""
    if isinstance(hf_config, dict):
        from transformers import AutoConfig

        fields = dict(hf_config)
        model_type = fields.pop("model_type", None)
        if model_type not in _BRIDGES:
            raise ConfigMismatchError(f"model_type={model_type!r} has no bridge; supported: {sorted(_BRIDGES)}")
        hf_config = AutoConfig.for_model(model_type, **fields)
    model_type = getattr(hf_config, "model_type", None)
    cls = _BRIDGES.get(model_type)
    if cls is None:
        raise ConfigMismatchError(f"model_type={model_type!r} has no bridge; supported: {sorted(_BRIDGES)}")
    return cls(hf_config)


def bridge_names() -> list[str]:
    return sorted(_BRIDGES)


def bridge_name_for(model_type: str | None) -> str | None:
    cls = _BRIDGES.get(model_type)
    return cls.name if cls else None
