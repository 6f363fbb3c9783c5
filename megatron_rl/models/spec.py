"""What every architecture provides: HF config -> Megatron model, and its HF <-> Megatron map.

One `ModelSpec` per HF ``model_type`` family, registered by the architecture's folder
(`models/qwen3/`, `models/qwen3_5/`), which holds its config mapping, layer spec and bridge (the
parameter map used by both checkpoint conversion and live weight sync). Adding an architecture means
one more folder; the actor, bridge plumbing and tools only talk to this interface.
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
    """One architecture family. The callables take the HF config (the top-level one: a multimodal
    config is unwrapped by the architecture itself)."""

    name: str
    hf_model_types: tuple[str, ...]
    validate: Callable[[Any, ParallelSizes], None]
    transformer_config: Callable[[Any, ParallelSizes, BuildOptions], Any]
    gpt_model_kwargs: Callable[[Any, ParallelSizes, BuildOptions], dict]
    #: (config, use_te, vp_stage, pp_rank) -> a layer spec or a per-stage TransformerBlockSubmodules
    layer_spec: Callable[[Any, bool, int | None, int | None], Any]
    #: the `megatron_rl.bridge.Bridge` subclass holding this architecture's HF <-> Megatron map
    bridge_cls: type | None = None
    #: parameter names (last component) kept in fp32 whatever ``params_dtype`` is
    fp32_params: tuple[str, ...] = ()
    #: parameter name suffixes that are replicated over TP but applied to this rank's heads only, so each TP
    #: rank's gradient is a part of the whole and the parts must be summed (megatron does that for q/k
    #: layernorms by name and nothing else); `build_model` marks them `TP_PARTIAL_GRAD`
    tp_partial_grad_params: tuple[str, ...] = ()
    #: the model cannot separate packed samples with an attention mask (recurrent layers), so
    #: packed micro-batches must use ``thd`` with ``cu_seqlens``
    needs_thd_packing: bool = False
    #: the language model's config inside a multimodal one (identity for text-only architectures)
    text_config: Callable[[Any], Any] = lambda hf: hf


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    for t in spec.hf_model_types:
        _REGISTRY[t] = spec
    return spec


def spec_for(hf_config) -> ModelSpec:
    """The architecture of an HF config (or of a ``model_type`` string)."""
    model_type = hf_config if isinstance(hf_config, str) else getattr(hf_config, "model_type", None)
    if model_type not in _REGISTRY:
        raise ConfigMismatchError(
            f"model_type={model_type!r} is not supported; supported: {sorted(_REGISTRY)}"
        )
    return _REGISTRY[model_type]


def text_config(hf_config):
    """The language model's HF config (vocab_size, hidden_size, ...) of any supported HF config."""
    return spec_for(hf_config).text_config(hf_config)


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron pads the vocab so that every TP shard has the same, aligned size."""
    step = multiple * tp
    return ((vocab_size + step - 1) // step) * step
