"""The architecture-independent half of the bridge: mapping tables and the TP/PP plumbing.

An architecture file lists `ParamMapping`s (Megatron name pattern <-> HF name pattern + transform).
`Bridge` turns that list into
- `load_hf_into`: fill this rank's model chunks from full HF tensors (lazily read),
- `export_hf`: a stream of full HF tensors gathered over TP and broadcast over PP,
- `hf_param_names`: the HF names in export order.
The same tables serve checkpoint conversion and live weight sync, so a layout is written once.

Layer names: inside a model chunk Megatron numbers layers locally (`decoder.layers.{i}` with
i = 0..n_local-1); the global index is the PP/VPP offset
(`get_transformer_layer_offset`) plus i. Patterns use `{layer}` for the global index.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .transforms import HFSource, LayoutError, Transform, as_source, src_dtype

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class BridgeError(ValueError):
    """A model or an HF state does not fit the bridge's mapping table."""


@dataclasses.dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter <-> one or more HF tensors.

    `megatron`: the name pattern; further patterns are aliases for the same parameter under
    other layer specs (the local spec's `input_layernorm.weight` is the TE spec's
    `self_attention.linear_qkv.layer_norm_weight`). Layer mappings are relative to
    `decoder.layers.{layer}.`; `hf` patterns are absolute and may use `{layer}`.
    `export=False`: load-only (a tied output layer is a copy of the embedding).
    `hf_shapes`: the full shape of each HF tensor that the config implies. Checked before any slicing,
    so a wrong tensor is reported by name with both shapes rather than as a reshape failure
    deep inside a transform.
    """

    megatron: str | tuple[str, ...]
    hf: str | tuple[str, ...]
    transform: Transform

    export: bool = True
    hf_shapes: tuple[tuple[int, ...], ...] | None = None

    @property
    def megatron_names(self) -> tuple[str, ...]:
        return (self.megatron,) if isinstance(self.megatron, str) else tuple(self.megatron)

    @property
    def hf_patterns(self) -> tuple[str, ...]:
        return (self.hf,) if isinstance(self.hf, str) else tuple(self.hf)

    def hf_names(self, layer: int | None = None) -> tuple[str, ...]:
        return tuple(p.format(layer=layer) for p in self.hf_patterns)

    def __post_init__(self):
        if len(self.hf_patterns) != self.transform.num_hf:
            raise ValueError(f"{self.megatron_names[0]}: transform {type(self.transform).__name__} "
                             f"takes {self.transform.num_hf} HF tensors, got {self.hf_patterns}")
        if self.hf_shapes is not None and len(self.hf_shapes) != len(self.hf_patterns):
            raise ValueError(f"{self.megatron_names[0]}: {len(self.hf_shapes)} hf_shapes for "
                             f"{len(self.hf_patterns)} HF tensors")


@dataclasses.dataclass(frozen=True)
class _Unit:
    """A resolved parameter: mapping + global layer (None outside the decoder layers)."""

    mapping: ParamMapping
    layer: int | None

    @property
    def key(self) -> str:
        """Canonical global Megatron name (first alias, global layer index)."""
        name = self.mapping.megatron_names[0]
        return name if self.layer is None else f"decoder.layers.{self.layer}.{name}"

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.mapping.hf_names(self.layer)


def unwrap(chunk):
    """The GPTModel inside DDP / Float16Module wrappers."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def _is_skipped(name: str) -> bool:
    return name.endswith("_extra_state")


class Bridge:
    """Base class; an architecture subclass provides the three mapping lists.

    Subclasses set `name`, `hf_model_types`, `hf_architectures` and implement `pre_mappings`
    (before the decoder layers: embeddings), `layer_mappings(layer)` (per global layer; may depend
    on the layer type) and `post_mappings` (final norm, output layer).
    """

    name: str = "base"
    hf_model_types: tuple[str, ...] = ()
    hf_architectures: tuple[str, ...] = ()
    #: where a checkpoint may keep the language model's HF names: the text class's layout, the multimodal
    #: one's, and a base model's (``Qwen3Model.save_pretrained``, as Qwen3-Embedding ships: no prefix, which
    #: transformers' causal-LM classes load too). Conversions ship any of them under either model_type, so the
    #: weights decide (`for_names`).
    lm_prefixes: tuple[str, ...] = ("model.", "model.language_model.", "")
    #: the `layout` facts a bridge reads; `save_source_layout` records them beside ``single_file``
    LAYOUT_KEYS = ("lm_prefix", "duplicates")

    def __init__(self, hf_config, num_layers: int | None = None, layout: Mapping[str, Any] | None = None):
        """`layout`: how the source checkpoint names its tensors where the config leaves it open (`layout_for`);
        other keys are ignored. Subclasses take it as a keyword and build their names from `lm_prefix`."""
        self.hf_config = hf_config
        self.num_layers = int(hf_config.num_hidden_layers if num_layers is None else num_layers)
        self.layout = {k: layout[k] for k in self.LAYOUT_KEYS if k in (layout or {})}
        self._layer_tables: dict[int, dict[str, ParamMapping]] = {}

    # ----- the source checkpoint's naming ---------------------------------------------------
    def default_lm_prefix(self) -> str:
        """The prefix the config's own transformers class saves the language model under."""
        return self.lm_prefixes[0]

    @property
    def lm_prefix(self) -> str:
        prefix = self.layout.get("lm_prefix", self.default_lm_prefix())
        if prefix not in self.lm_prefixes:
            raise BridgeError(f"{self.name} bridge: recorded lm_prefix {prefix!r} is not one of "
                              f"{list(self.lm_prefixes)}")
        return prefix

    def layout_for(self, names: Iterable[str]) -> dict[str, Any]:
        """The naming facts of a checkpoint holding `names` that differ from the config's defaults: the prefix its
        language model is under, and the redundant copies it stores (a tied ``lm_head.weight``), which an export
        writes back. Raises BridgeError naming the expected and found names when no prefix fits."""
        have = set(names)
        rel = [n[len(self.lm_prefix):] for u in self.export_units() for n in u.hf_names if n.startswith(self.lm_prefix)]
        hits = {p: sum(p + r in have for r in rel) for p in self.lm_prefixes}
        prefix = max(self.lm_prefixes, key=lambda p: (hits[p], p == self.default_lm_prefix()))
        if not hits[prefix]:
            raise BridgeError(f"{self.name} bridge: the checkpoint holds none of its language model's tensors under "
                              f"{' or '.join(map(repr, self.lm_prefixes))} (expected e.g. "
                              f"{[p + rel[0] for p in self.lm_prefixes]}); found {_name_summary(have)}")
        layout: dict[str, Any] = {} if prefix == self.default_lm_prefix() else {"lm_prefix": prefix}
        bridge = self if prefix == self.lm_prefix else type(self)(self.hf_config, layout={"lm_prefix": prefix})
        duplicates = sorted(d for d in bridge.duplicate_hf_names() if d in have)
        if duplicates:
            layout["duplicates"] = duplicates
        return layout

    def for_names(self, names: Iterable[str]) -> "Bridge":
        """This bridge for a checkpoint holding `names` (itself when the names fit its `layout`)."""
        layout = self.layout_for(names)
        return self if layout == self.layout else type(self)(self.hf_config, layout=layout)

    def _exported_duplicates(self) -> dict[str, list[str]]:
        """Original HF name -> the recorded copies an export writes after it (`layout_for`)."""
        copies = self.layout.get("duplicates", [])
        known = self.duplicate_hf_names()
        if not isinstance(copies, list) or any(d not in known for d in copies):
            raise BridgeError(f"{self.name} bridge: recorded duplicates {copies!r} are not copies this config "
                              f"stores (it ties {sorted(known) or 'nothing'})")
        out: dict[str, list[str]] = {}
        for dup in copies:
            out.setdefault(known[dup], []).append(dup)
        return out

    # ----- per-architecture hooks -----------------------------------------------------------
    def pre_mappings(self) -> list[ParamMapping]:
        raise NotImplementedError

    def layer_mappings(self, layer: int) -> list[ParamMapping]:
        raise NotImplementedError

    def post_mappings(self) -> list[ParamMapping]:
        raise NotImplementedError

    def duplicate_hf_names(self) -> dict[str, str]:
        """HF names that may appear in a checkpoint as copies of another (e.g. a tied lm_head).

        `load_hf_into` checks they are equal to the original instead of ignoring them silently.
        """
        return {}

    def passthrough_hf_names(self, names: Sequence[str]) -> list[str]:
        """Names in an HF checkpoint the Megatron model does not hold but an export must reproduce
        verbatim (a vision tower, an MTP head). Checkpoints carry them as files beside the weights.
        The base class carries the `ignorable_hf_names` (stale rotary buffers): accepted, so an export gives
        back the tensors it was given; an architecture adds its own."""
        return self.ignorable_hf_names(names)

    def ignorable_hf_names(self, names: Sequence[str]) -> list[str]:
        """Names in an HF checkpoint that carry no weights (e.g. stale rotary buffers)."""
        return [n for n in names if n.endswith("rotary_emb.inv_freq")]

    def validate(self, par) -> None:
        """Raise ConfigMismatchError when this config cannot be laid out at `par` (ParallelSizes)."""
        from megatron_rl.models import spec_for

        spec_for(self.hf_config).validate(self.hf_config, par)

    def keeps_fp32(self, unit: "_Unit") -> bool:
        """The architecture keeps this parameter in fp32 whatever the params dtype (`ModelSpec.fp32_params`)."""
        from megatron_rl.models import spec_for

        return unit.mapping.megatron_names[0].rsplit(".", 1)[-1] in spec_for(self.hf_config).fp32_params

    # ----- name tables ----------------------------------------------------------------------
    def export_units(self) -> list[_Unit]:
        units = [_Unit(m, None) for m in self.pre_mappings()]
        for layer in range(self.num_layers):
            units += [_Unit(m, layer) for m in self.layer_mappings(layer)]
        units += [_Unit(m, None) for m in self.post_mappings()]
        return [u for u in units if u.mapping.export]

    def hf_param_names(self, hf_config=None) -> list[str]:
        """Expected HF tensor names, in `export_hf` order (a recorded copy right after its original)."""
        bridge = (self if hf_config is None or hf_config is self.hf_config
                  else type(self)(hf_config, layout=self.layout))
        copies = bridge._exported_duplicates()
        return [m for u in bridge.export_units() for n in u.hf_names for m in (n, *copies.get(n, ()))]

    def hf_shapes(self) -> dict[str, tuple[int, ...] | None]:
        """Every HF tensor name this config reads (tied copies included) -> the shape the config
        implies (None where the table gives none)."""
        want: dict[str, tuple[int, ...] | None] = {}
        units = [_Unit(m, None) for m in self.pre_mappings() + self.post_mappings()]
        units += [_Unit(m, layer) for layer in range(self.num_layers) for m in self.layer_mappings(layer)]
        for unit in units:
            shapes = unit.mapping.hf_shapes or (None,) * len(unit.hf_names)
            for name, shape in zip(unit.hf_names, shapes):
                want.setdefault(name, None if shape is None else tuple(shape))
        for dup, orig in self.duplicate_hf_names().items():
            want.setdefault(dup, want.get(orig))
        return want

    def check_hf_tensors(self, hf_state: Mapping[str, Tensor] | HFSource) -> list[str]:
        """One line per HF tensor present in `hf_state` whose shape or dtype cannot be loaded
        (wrong shape for this config, or not floating point). Missing names are `check_hf_names`' job."""
        src = as_source(hf_state)
        problems = []
        for name, shape in self.hf_shapes().items():
            if name in src:
                problem = _tensor_problem(src, name, shape)
                if problem:
                    problems.append(problem)
        return problems

    def check_hf_names(self, names: Sequence[str]) -> tuple[list[str], list[str]]:
        """(missing, unexpected) HF names of a checkpoint against this config."""
        expected = self.hf_param_names()
        have = set(names)
        missing = [n for n in expected if n not in have]
        allowed = (set(expected) | set(self.duplicate_hf_names()) | set(self.ignorable_hf_names(names))
                   | set(self.passthrough_hf_names(names)))
        unexpected = sorted(n for n in have if n not in allowed)
        return missing, unexpected

    def _layer_table(self, layer: int) -> dict[str, ParamMapping]:
        table = self._layer_tables.get(layer)
        if table is None:
            table = {}
            for m in self.layer_mappings(layer):
                for alias in m.megatron_names:
                    table[alias] = m
            self._layer_tables[layer] = table
        return table

    def _resolve(self, local_name: str, layer_offset: int, num_local_layers: int) -> _Unit:
        match = _LAYER_RE.match(local_name)
        if match:
            local, rest = int(match.group(1)), match.group(2)
            if local >= num_local_layers:
                raise BridgeError(f"{local_name}: local layer {local} >= {num_local_layers} layers in chunk")
            layer = layer_offset + local
            mapping = self._layer_table(layer).get(rest)
            if mapping is None:
                raise BridgeError(f"Megatron parameter {local_name!r} (global layer {layer}) has no "
                                  f"mapping in the {self.name} bridge")
            return _Unit(mapping, layer)
        for m in self.pre_mappings() + self.post_mappings():
            if local_name in m.megatron_names:
                return _Unit(m, None)
        raise BridgeError(f"Megatron parameter {local_name!r} has no mapping in the {self.name} bridge")

    # ----- model inventory ------------------------------------------------------------------
    def local_params(self, model_chunks) -> list[tuple[_Unit, Tensor]]:
        """Every parameter of this rank's chunks with its resolved mapping and global layer."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        pp_rank = ps.get_pipeline_model_parallel_rank()
        out = []
        for chunk in model_chunks:
            model = unwrap(chunk)
            layers = model.decoder.layers if hasattr(model, "decoder") else []
            offset = get_transformer_layer_offset(model.config, vp_stage=getattr(model, "vp_stage", None),
                                                  pp_rank=pp_rank)
            for i, layer in enumerate(layers):
                if getattr(layer, "layer_number", offset + i + 1) != offset + i + 1:
                    raise BridgeError(f"layer {i} of a chunk has layer_number {layer.layer_number}, "
                                      f"expected offset {offset} + {i} + 1")
            for name, param in model.named_parameters():
                if _is_skipped(name):
                    continue
                out.append((self._resolve(name, offset, len(layers)), param))
        return out

    # ----- import ---------------------------------------------------------------------------
    @torch.no_grad()
    def load_hf_into(self, model_chunks, hf_state: Mapping[str, Tensor] | HFSource,
                     on_param: Callable[[str], None] | None = None) -> None:
        """Fill this rank's model chunks from full HF tensors.

        Reads only the slices this TP rank holds for the layers this PP stage owns, so a lazy
        source (`LazyHFState`) never materialises the whole checkpoint on one rank. `on_param`
        is called with each Megatron parameter's global name once it is filled (progress bars).
        """
        from megatron.core import parallel_state as ps

        src = as_source(hf_state)
        if hasattr(src, "keys"):  # the names the source holds decide its prefix, whatever the config says
            bridge = self.for_names(src.keys())
            if bridge is not self:
                return bridge.load_hf_into(model_chunks, src, on_param)
        tp_rank = ps.get_tensor_model_parallel_rank()
        tp_size = ps.get_tensor_model_parallel_world_size()
        duplicates = self.duplicate_hf_names()
        for unit, param in self.local_params(model_chunks):
            names = unit.hf_names
            for n, shape in zip(names, unit.mapping.hf_shapes or (None,) * len(names)):
                if n not in src:
                    raise BridgeError(f"HF tensor {n!r} (for Megatron {unit.key}) is missing")
                problem = _tensor_problem(src, n, shape)
                if problem:
                    raise BridgeError(f"{problem} (for Megatron {unit.key})")
            try:
                shard = unit.mapping.transform.shard(src, names, tp_rank, tp_size, tuple(param.shape))
            except LayoutError as e:
                raise BridgeError(f"{unit.key}: {e}") from None
            if unit.mapping.export:
                for dup, orig in duplicates.items():
                    if orig in names and dup in src:
                        problem = _tensor_problem(src, dup, tuple(src.shape(orig)))
                        if problem:
                            raise BridgeError(f"{problem} (a copy of {orig!r}: tie_word_embeddings=True)")
                        alt = unit.mapping.transform.shard(
                            src, tuple(dup if n == orig else n for n in names), tp_rank, tp_size,
                            tuple(param.shape))
                        if not torch.equal(alt, shard):
                            raise BridgeError(f"{dup!r} is present and differs from {orig!r}, but the "
                                              f"config ties them (tie_word_embeddings=True)")
            param.data.copy_(shard)
            if on_param is not None:
                on_param(unit.key)

    # ----- export ---------------------------------------------------------------------------
    @torch.no_grad()
    def export_hf(self, model_chunks, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """Yield (hf_name, full tensor) for the whole model, in `hf_param_names` order.

        Collective: every rank of the model-parallel group must iterate it to the end, and all of
        them yield the same sequence. Shards are all-gathered over TP on the owning stage and
        broadcast over PP; one parameter is in flight at a time. Tensors are in the model's param
        dtype unless `dtype` is given (parameters the architecture keeps in fp32, such as GDN's
        ``A_log``, stay fp32, as released checkpoints store them), on the params' device, and never
        alias a parameter.
        """
        from megatron.core import parallel_state as ps

        tp_size = ps.get_tensor_model_parallel_world_size()
        pp_size = ps.get_pipeline_model_parallel_world_size()
        pp_rank = ps.get_pipeline_model_parallel_rank()
        tp_group = ps.get_tensor_model_parallel_group()
        pp_group = ps.get_pipeline_model_parallel_group()

        local: dict[str, tuple[_Unit, Tensor]] = {}
        for unit, param in self.local_params(model_chunks):
            if unit.mapping.export:
                local[unit.key] = (unit, param)
        if not local and pp_size == 1:
            raise BridgeError("export_hf: the model chunks hold no parameters")
        device = next(iter(local.values()))[1].device if local else _default_device()
        owners = self._owners(local, pp_group, pp_size, pp_rank)
        copies = self._exported_duplicates()
        pp_ranks = dist.get_process_group_ranks(pp_group) if pp_size > 1 else None

        for unit in self.export_units():
            if unit.key not in owners:
                raise BridgeError(f"export_hf: Megatron parameter {unit.key} is on no pipeline stage")
            owner, local_shape, dtype_name = owners[unit.key]
            transform = unit.mapping.transform
            param = local[unit.key][1].detach() if owner == pp_rank else None
            if param is not None and transform.tp_dim is not None and tp_size > 1:
                parts = [torch.empty_like(param) for _ in range(tp_size)]
                dist.all_gather(parts, param.contiguous(), group=tp_group)
                full = torch.cat(parts, dim=transform.tp_dim)
            elif param is not None:
                full = param.contiguous()
            else:
                full = torch.empty(transform.full_shape(local_shape, tp_size),
                                   dtype=getattr(torch, dtype_name), device=device)
            if pp_size > 1:
                dist.broadcast(full, src=pp_ranks[owner], group=pp_group)
            cast = dtype if dtype is not None and not self.keeps_fp32(unit) else None
            for name, tensor in zip(unit.hf_names, transform.to_hf(full, tp_size)):
                out = (tensor.to(cast) if cast is not None else tensor).contiguous()
                if param is not None and _shares_storage(out, param):
                    out = out.clone()
                yield name, out
                for dup in copies.get(name, ()):  # own storage: safetensors refuses shared tensors
                    yield dup, out.clone()

    def _owners(self, local, pp_group, pp_size, pp_rank) -> dict[str, tuple[int, tuple, str]]:
        """Which PP stage holds each exported parameter, with its local shape and dtype."""
        mine = {k: (pp_rank, tuple(p.shape), str(p.dtype).removeprefix("torch."))
                for k, (_, p) in local.items()}
        if pp_size == 1:
            return mine
        gathered: list[Any] = [None] * pp_size
        dist.all_gather_object(gathered, mine, group=pp_group)
        owners: dict[str, tuple[int, tuple, str]] = {}
        for stage in gathered:
            for k, v in stage.items():
                owners.setdefault(k, v)
        return owners


def _tensor_problem(src: HFSource, name: str, shape: tuple[int, ...] | None) -> str | None:
    """Why HF tensor `name` cannot be loaded (wrong shape for the config, not floating), or None."""
    got = tuple(src.shape(name))
    if shape is not None and got != tuple(shape):
        return f"HF tensor {name!r} has shape {got}, the config implies {tuple(shape)}"
    dtype = src_dtype(src, name)
    if not dtype.is_floating_point:
        return f"HF tensor {name!r} has dtype {str(dtype).removeprefix('torch.')}, expected a floating-point weight"
    if dtype.itemsize == 1:   # float8: quantized codes, meaningless without their scales (train/sft --model load here)
        return (f"HF tensor {name!r} is {str(dtype).removeprefix('torch.')}: quantized weights are not supported; "
                f"use the unquantized (bf16/fp16/fp32) release")
    return None


def _name_summary(names, limit: int = 5) -> str:
    """A few distinct name patterns (layer indices as ``*``) of a checkpoint, for error messages."""
    patterns = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in names})
    more = f" and {len(patterns) - limit} more patterns" if len(patterns) > limit else ""
    return f"{len(names)} tensors such as {patterns[:limit]}{more}" if names else "no tensors"


def _shares_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
