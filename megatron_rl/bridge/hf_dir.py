"""Reading an HF model directory for conversion, live sync or training: config.json and the
safetensors tensors, checked against the bridge before any rank, engine or Ray cluster starts.

One home for these checks: `ckpt_tools` (hf-to-mcore, verify), `check_sync` and the trainer's
config validation all call them, so bad input gives the same message naming the file or field.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megatron_rl.fsutil import write_text_atomic

from .base import BridgeError
from .hf_state import INDEX_NAME, SINGLE_NAME, HFCheckpointError, LazyHFState
from .registry import bridge_names, get_bridge


def load_hf_config(hf_dir: str | os.PathLike):
    """The transformers config of an HF model directory (clear errors naming config.json)."""
    from transformers import AutoConfig

    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise HFCheckpointError(f"HF checkpoint directory {hf_dir} "
                                + ("is a file, not a directory" if Path(hf_dir).exists() else "does not exist"))
    if not path.is_file():
        raise HFCheckpointError(f"{path}: missing{_hub_cache_hint(Path(hf_dir))}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise HFCheckpointError(f"{path}: has no 'model_type'")
    check_model_type(raw["model_type"], path)
    try:
        cfg = AutoConfig.from_pretrained(str(hf_dir))
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError/KeyError/OSError
        raise HFCheckpointError(f"{path}: transformers cannot read it ({type(e).__name__}: {e})") from None
    check_architectures(cfg, path)
    return cfg


def _hub_cache_hint(hf_dir: Path) -> str:
    """Where the model is when `hf_dir` is a Hugging Face hub cache entry (``models--org--name``, which holds
    ``snapshots/<revision>/``) rather than a model directory."""
    snapshots = hf_dir / "snapshots"
    if not snapshots.is_dir():
        return ""
    revisions = sorted(p for p in snapshots.iterdir() if (p / "config.json").is_file())
    if not revisions:
        return f"; {hf_dir} is a Hugging Face hub cache entry with no complete snapshot under {snapshots}"
    main = hf_dir / "refs" / "main"   # the revision the hub's "main" pointed at when it was downloaded
    current = snapshots / main.read_text().strip() if main.is_file() else None
    pick = current if current in revisions else revisions[-1]
    return (f"; {hf_dir} is a Hugging Face hub cache entry: pass a snapshot directory, e.g. {pick}"
            + (f" ({len(revisions)} snapshots)" if len(revisions) > 1 else ""))


def check_model_type(model_type, where) -> None:
    """Refuse an architecture without a bridge before transformers parses the config: its own error
    for a type it does not know says nothing about what this tool converts."""
    if model_type not in bridge_names():
        raise HFCheckpointError(f"{where}: model_type={model_type!r} is not supported; "
                                f"supported: {bridge_names()}")


def check_architectures(hf_config, where) -> None:
    """Refuse ``architectures`` naming another class than the one the bridge exports for this ``model_type``
    (``LlamaForCausalLM`` on a qwen3 config). transformers' Auto classes go by model_type and ignore the field,
    but serving engines (vLLM, SGLang) pick the model class by it, and an export copies it: a mismatch would pass
    every check here and break the release. No ``architectures`` is fine (an export writes the bridge's)."""
    archs = getattr(hf_config, "architectures", None)
    if not archs:
        return
    expected = list(get_bridge(hf_config).hf_architectures)
    if isinstance(archs, str) or any(a not in expected for a in archs):
        raise HFCheckpointError(f"{where}: architectures={archs!r} does not match "
                                f"model_type={hf_config.model_type!r}; expected {expected}")


def _tie_flag_hint(cfg, missing: list[str], bridge, names) -> str:
    """Why an output layer or embedding may be missing: a multimodal config whose top-level ``tie_word_embeddings``
    says tied (its class saved no lm_head) while ``text_config``'s, which the language model reads, says untied; a
    config that says untied over a checkpoint saved tied; a tied checkpoint that stores the shared matrix only as its
    copy (``lm_head.weight``)."""
    copies = [(dup, orig) for dup, orig in bridge.duplicate_hf_names().items() if orig in missing and dup in names]
    if copies:
        dup, orig = copies[0]
        return (f"; the checkpoint holds {dup!r}, the tied copy of {orig!r} ({_tie_field(cfg)}=true), but not {orig!r} "
                f"itself: store the matrix under {orig!r}")
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if not any(n.endswith("lm_head.weight") for n in missing):
        return ""
    top, inner = getattr(cfg, "tie_word_embeddings", None), getattr(text, "tie_word_embeddings", None)
    if text is not cfg and top and inner is False:
        return ("; tie_word_embeddings=true but text_config.tie_word_embeddings=false: the multimodal class ties "
                "the output layer to the embedding and saved none, the language model reads text_config's flag; "
                "set text_config.tie_word_embeddings to true")
    if not inner:
        return (f"; {_tie_field(cfg)}=false: an untied output layer is stored as 'lm_head.weight' (a model saved "
                f"with tied embeddings has none: set {_tie_field(cfg)} to true)")
    return ""


def _tie_field(cfg) -> str:
    """The config.json field the language model reads ``tie_word_embeddings`` from."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return "tie_word_embeddings" if text is cfg else "text_config.tie_word_embeddings"


#: files quantization tools write beside config.json, some of them instead of its ``quantization_config`` (NVIDIA
#: ModelOpt's hf_quant_config.json, AutoGPTQ's quantize_config.json, AutoAWQ's quant_config.json)
QUANT_CONFIG_FILES = ("hf_quant_config.json", "quantize_config.json", "quant_config.json")
#: tensor-name endings of quantized weights' companions (fp8 block and per-tensor scales, GPTQ/AWQ packed weights)
QUANT_TENSOR_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale", ".qweight", ".qzeros", ".g_idx")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantized_weights_problem(hf_dir: str | os.PathLike, state: LazyHFState) -> str | None:
    """Why a checkpoint whose config.json has no ``quantization_config`` (the spec refuses that field by name) holds
    quantized weights anyway, or None: an fp8 tensor, or the scale / packed tensors quantized weights come with
    (with the quantization tool's own config file, when there is one). Said so, rather than as tensors the config
    does not use or a dtype to convert from: fp8 values are not the weights without their scales."""
    for n in state.keys():
        if n.endswith(QUANT_TENSOR_SUFFIXES):
            why = f"tensor {n!r} belongs to a quantized weight"
        elif _dtype_or_none(state, n) in _FP8_DTYPES:
            why = f"tensor {n!r} is {str(state.dtype(n)).removeprefix('torch.')}"
        else:
            continue
        files = [f for f in QUANT_CONFIG_FILES if (Path(hf_dir) / f).is_file()]
        return (f"{state.file_of(n)}: {why}" + (f" (and {', '.join(files)} describes the quantization)" if files
                                                  else "")
                + "; quantized weights are not supported; convert the unquantized (bf16/fp16/fp32) release")
    return None


def _dtype_or_none(state: LazyHFState, name: str):
    """`name`'s dtype, None for one torch has no name for here (a tensor carried byte for byte may hold any)."""
    try:
        return state.dtype(name)
    except HFCheckpointError:
        return None


def check_hf_input(hf_dir: str, par):
    """(config, bridge, state) after validating everything a conversion needs from `hf_dir`."""
    cfg = load_hf_config(hf_dir)
    bridge = get_bridge(cfg)
    bridge.validate(par)
    state = LazyHFState(hf_dir)
    quantized = quantized_weights_problem(hf_dir, state)
    if quantized:
        raise HFCheckpointError(quantized)
    try:
        bridge = bridge.for_names(state.keys())  # the weights' prefix, whichever model_type config.json names
    except BridgeError as e:
        raise HFCheckpointError(f"{hf_dir}: {e}") from None
    missing, unexpected = bridge.check_hf_names(list(state.keys()))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise HFCheckpointError(f"{hf_dir}: tensors missing for this config: {missing[:5]}{more}"
                                f"{_tie_flag_hint(cfg, missing, bridge, state)}")
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        unlisted = [n for n in unexpected if n in state.unlisted]  # left in a shard, missing from the index
        where = (f"; {unlisted[0]!r} is in {state.file_of(unlisted[0]).name}, which {INDEX_NAME} does not list"
                 if unlisted else "")
        raise HFCheckpointError(f"{hf_dir}: tensors this {bridge.name} config does not use: "
                                f"{unexpected[:5]}{more}{where}")
    bad = bridge.check_hf_tensors(state)
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise HFCheckpointError(f"{hf_dir}: tensors that do not fit config.json: " + "; ".join(bad[:5]) + more)
    for dup, orig in bridge.duplicate_hf_names().items():
        if dup in state and not torch.equal(state.read(dup), state.read(orig)):
            raise HFCheckpointError(f"{state.file_of(dup)}: {dup!r} differs from {orig!r}, but config.json "
                                    f"ties them ({_tie_flag(cfg)})")
    return cfg, bridge, state


def _tie_flag(cfg) -> str:
    """The config.json field that ties the output layer to the embedding: ``text_config``'s in a multimodal config
    (the language model reads it), named with the top-level flag when that one says untied."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if text is not cfg and getattr(cfg, "tie_word_embeddings", None) is False:
        return ("text_config.tie_word_embeddings=true, while the top-level tie_word_embeddings=false: the "
                "multimodal class keeps the stored lm_head.weight, the language model reads text_config's flag; "
                "set text_config.tie_word_embeddings to false")
    return f"{_tie_field(cfg)}=true"


#: file in a checkpoint's HF assets holding the HF tensors the Megatron model does not hold (a vision tower,
#: an MTP head), byte for byte, so an export reproduces the checkpoint's layout
PASSTHROUGH_FILE = "passthrough.safetensors"


def save_passthrough(hf_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> list[str]:
    """Copy `hf_dir`'s passthrough tensors (`Bridge.passthrough_hf_names`) into ``dst_dir/PASSTHROUGH_FILE``
    in their own dtypes; returns their names (none: no file)."""
    from safetensors.torch import save_file

    cfg = load_hf_config(hf_dir)
    state = LazyHFState(hf_dir)
    names = get_bridge(cfg).passthrough_hf_names(list(state.keys()))
    if not names:
        return []
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / (PASSTHROUGH_FILE + ".tmp")
    save_file({n: state.read(n).contiguous() for n in names}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, dst / PASSTHROUGH_FILE)
    return names


#: file in a checkpoint's HF assets naming the source dtype of each tensor the model keeps in fp32 (GDN's
#: ``A_log``), so an export writes a checkpoint that stored them in its weights' dtype back unchanged
FP32_SOURCE_DTYPES_FILE = "fp32_source_dtypes.json"


def fp32_source_dtypes(bridge, state: LazyHFState) -> dict[str, str]:
    """The dtype the checkpoint `state` stores each tensor in that `bridge`'s model keeps in fp32 (GDN's
    ``A_log``), by HF name.

    Why: the actor holds them in fp32 whatever the params dtype, and an export cannot tell a release that
    stored them in fp32 (kept as such) from one that stored them in bf16 like everything else."""
    bridge = bridge.for_names(state.keys())  # names under the prefix the checkpoint uses
    return {n: str(state.dtype(n)).removeprefix("torch.") for u in bridge.export_units() if bridge.keeps_fp32(u)
            for n in u.hf_names if n in state}


def follow_source_dtypes(stream, source_dtypes: dict[str, str], out_dtype: torch.dtype):
    """An export's (name, tensor) stream with the fp32-kept tensors that the source stored in `out_dtype` cast
    back to it (byte-identical to the source when the weights did not change); the rest as they come."""
    name = str(out_dtype).removeprefix("torch.")
    follow = {n for n, d in source_dtypes.items() if d == name}
    for n, t in stream:
        yield n, (t.to(out_dtype) if n in follow else t)


def save_fp32_source_dtypes(hf_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> dict[str, str]:
    """Record `fp32_source_dtypes` of `hf_dir` in ``dst_dir/FP32_SOURCE_DTYPES_FILE`` (no file when there are
    none), so a checkpoint's later export can follow them; returns the map."""
    dtypes = fp32_source_dtypes(get_bridge(load_hf_config(hf_dir)), LazyHFState(hf_dir))
    if dtypes:
        dst = Path(dst_dir)
        dst.mkdir(parents=True, exist_ok=True)
        write_text_atomic(dst / FP32_SOURCE_DTYPES_FILE, json.dumps(dtypes, indent=1, sort_keys=True) + "\n")
    return dtypes


def load_fp32_source_dtypes(assets_dir: str | os.PathLike) -> dict[str, str]:
    """What `save_fp32_source_dtypes` recorded in `assets_dir` (empty when nothing was)."""
    path = Path(assets_dir) / FP32_SOURCE_DTYPES_FILE
    if not path.is_file():
        return {}
    try:
        dtypes = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(dtypes, dict):
        raise HFCheckpointError(f"{path}: expected an object of tensor name -> dtype")
    return dtypes


def load_passthrough(assets_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors `save_passthrough` wrote into `assets_dir` (empty when it wrote none)."""
    from safetensors.torch import load_file

    path = Path(assets_dir) / PASSTHROUGH_FILE
    if not path.is_file():
        return {}
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise HFCheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


#: file in a checkpoint's HF assets recording how the source checkpoint stored its weights, so an export
#: reproduces the layout it was given: ``{"single_file": true}`` for one ``model.safetensors`` without an index,
#: plus the bridge's naming facts where they differ from the config's defaults (`Bridge.layout_for`: the language
#: model's prefix, a tied ``lm_head.weight`` stored anyway)
SOURCE_LAYOUT_FILE = "source_layout.json"
#: file beside it for a sharded source: which shard file held each tensor (its index's ``weight_map``), so an export
#: writes the same shard files and index rather than repacking the tensors by size
SOURCE_WEIGHT_MAP_FILE = "source_weight_map.json"


def save_source_layout(hf_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> dict:
    """Record `hf_dir`'s weights layout in ``dst_dir/SOURCE_LAYOUT_FILE`` (and a sharded source's weight map in
    ``SOURCE_WEIGHT_MAP_FILE``); returns the layout. Single file means what transformers (and `LazyHFState`) read
    is ``model.safetensors`` alone."""
    state = LazyHFState(hf_dir)
    layout = {"single_file": state.files == [SINGLE_NAME],
              **get_bridge(load_hf_config(hf_dir), hf_names=state.keys()).layout}
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = state.weight_map
    # only plain shard names beside the config can be written again (an index may name "./x" or "sub/x")
    if not layout["single_file"] and all(Path(f).name == f != SINGLE_NAME for f in weight_map.values()):
        write_text_atomic(dst / SOURCE_WEIGHT_MAP_FILE, json.dumps(weight_map, indent=1) + "\n")
    write_text_atomic(dst / SOURCE_LAYOUT_FILE, json.dumps(layout, sort_keys=True) + "\n")
    return layout


def load_source_layout(assets_dir: str | os.PathLike) -> dict:
    """What `save_source_layout` recorded in `assets_dir`; ``{"single_file": False}`` (shards and an index, the
    layout of exports before it was recorded) when nothing was. The bridge checks its own keys
    (`get_bridge(cfg, layout=...)`)."""
    path = Path(assets_dir) / SOURCE_LAYOUT_FILE
    if not path.is_file():
        return {"single_file": False}
    try:
        layout = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(layout, dict) or not isinstance(layout.get("single_file"), bool):
        raise HFCheckpointError(f"{path}: expected an object with a boolean 'single_file'")
    return layout


def load_source_weight_map(assets_dir: str | os.PathLike) -> dict[str, str] | None:
    """The sharded source's tensor name -> shard file map `save_source_layout` recorded in `assets_dir` (None when
    it recorded none: a single-file source, or a checkpoint saved before it was recorded)."""
    path = Path(assets_dir) / SOURCE_WEIGHT_MAP_FILE
    if not path.is_file():
        return None
    try:
        weight_map = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{path}: not valid JSON ({e})") from None
    # the export creates these files: plain shard names only, never a path out of its directory
    if not (isinstance(weight_map, dict) and weight_map and all(
            isinstance(f, str) and f.endswith(".safetensors") and Path(f).name == f and f != SINGLE_NAME
            for f in weight_map.values())):
        raise HFCheckpointError(f"{path}: expected an object of tensor name -> shard file name "
                                f"(*.safetensors, no directories)")
    return weight_map
