"""Reading HF configs and writing HF releases (sharded safetensors + index + config + assets).

The writer is streaming: tensors arrive one at a time (from `Bridge.export_hf`) and are packed
into shards of at most `max_shard_bytes`; only the current shard is held in memory. Given a sharded source's
weight map it writes the source's shard files instead, each once its tensors have all arrived.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch

from megatron_rl.bridge import HFCheckpointError
from megatron_rl.bridge.hf_dir import check_model_type
from megatron_rl.bridge.hf_state import INDEX_NAME, SINGLE_NAME
from megatron_rl.checkpoint import HF_ASSET_FILES, copy_hf_asset_dirs
from megatron_rl.fsutil import current_umask

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # HF's default "5GB"

_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
#: the dtypes a Megatron model is built and exported in (what `parse_dtype` accepts)
PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(map(dtype_name, PARAMS_DTYPES))}")
    return _DTYPE_NAMES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_from_dict(d: dict):
    from transformers import AutoConfig

    d = dict(d)
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise HFCheckpointError("stored HF config has no model_type")
    check_model_type(model_type, "stored HF config")
    return AutoConfig.for_model(model_type, **d)


def config_dtype(hf_config) -> torch.dtype | None:
    """The dtype the HF config declares (``dtype`` or legacy ``torch_dtype``), if any."""
    for key in ("dtype", "torch_dtype"):
        v = getattr(hf_config, key, None) if not isinstance(hf_config, dict) else hf_config.get(key)
        if v is None:
            continue
        if isinstance(v, torch.dtype):
            return v
        try:
            return parse_dtype(str(v))
        except ValueError:
            continue
    return None


class ShardedSafetensorsWriter:
    """Packs a stream of (name, tensor) into ``model-0000i-of-0000N.safetensors`` + index.

    `single_file`: the source release was one ``model.safetensors`` without an index; when everything fits one
    shard it is written the same way, so an export reproduces the layout it was given.
    `weight_map` (tensor name -> file name, every tensor the stream will hold): the sharded source's layout, written
    again file for file with its index instead of packing by `max_shard_bytes`. A file is written once all of its
    tensors arrived; release shards follow the layer order an export streams in, so few are pending at a time."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 single_file: bool = False, weight_map: Mapping[str, str] | None = None):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_shard_bytes
        self.single_file = single_file
        self.weight_map = dict(weight_map) if weight_map else None
        self._expected: dict[str, int] = {}  # file -> how many tensors the weight map puts in it
        for f in (self.weight_map or {}).values():
            self._expected[f] = self._expected.get(f, 0) + 1
        self._by_file: dict[str, dict[str, torch.Tensor]] = {}  # weight-map files still waiting for tensors
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str], str | None]] = []  # temp name, tensor names, final name
        self._seen: set[str] = set()
        self.total_bytes = 0
        self.total_params = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise ValueError(f"tensor {name!r} written twice")
        t = tensor.detach().to("cpu").contiguous()
        size = t.numel() * t.element_size()
        if self.weight_map is not None:
            if name not in self.weight_map:
                raise ValueError(f"tensor {name!r} is in no file of the source's weight map")
            final = self.weight_map[name]
            group = self._by_file.setdefault(final, {})
            group[name] = t
            if len(group) == self._expected[final]:
                self._save(self._by_file.pop(final), final)
        else:
            if self._pending and self._pending_bytes + size > self.max_bytes:
                self._flush()
            self._pending[name] = t
            self._pending_bytes += size
        self._seen.add(name)
        self.total_bytes += size
        self.total_params += t.numel()

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in items:
            self.add(name, t)

    def _save(self, tensors: dict[str, torch.Tensor], final: str | None) -> None:
        from safetensors.torch import save_file

        tmp_name = f".shard-{len(self._files):05d}.safetensors.tmp"
        save_file(tensors, str(self.out / tmp_name), metadata={"format": "pt"})
        os.chmod(self.out / tmp_name, 0o666 & ~current_umask())  # safetensors creates files 0600
        self._files.append((tmp_name, list(tensors), final))

    def _flush(self) -> None:
        self._save(self._pending, None)
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Names the shards, writes the index (none for a `single_file` export in one file); returns the file
        names."""
        if self._pending:
            self._flush()
        if self.weight_map is not None:
            missing = sorted(n for n, f in self.weight_map.items() if n not in self._seen)
            if missing:
                raise ValueError(f"{len(missing)} tensors of the source's weight map were never written, e.g. "
                                 f"{missing[0]!r} of {self.weight_map[missing[0]]}")
        if not self._files:
            raise ValueError("no tensors were written")
        n = len(self._files)
        if n == 1 and self.single_file and self.weight_map is None:
            tmp_name, _, _ = self._files[0]
            _fsync_file(self.out / tmp_name)
            os.replace(self.out / tmp_name, self.out / SINGLE_NAME)
            return [SINGLE_NAME]
        if self.weight_map is None:
            self._files = [(tmp, names, f"model-{i + 1:05d}-of-{n:05d}.safetensors")
                           for i, (tmp, names, _) in enumerate(self._files)]
        weight_map, names = {}, []
        for tmp_name, tensor_names, final in self._files:
            _fsync_file(self.out / tmp_name)
            os.replace(self.out / tmp_name, self.out / final)
            names.append(final)
            for t in tensor_names:
                weight_map[t] = final
        index = {"metadata": {"total_parameters": self.total_params, "total_size": self.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return sorted(names)


def follow_weight_map(weight_map: Mapping[str, str] | None, names: Iterable[str]) -> dict[str, str] | None:
    """The source's `weight_map` when it places exactly the tensors an export writes (`names`) in plain shard files,
    else None (pack by size): a map that misses or adds a tensor no longer describes this release, and an index may
    name "./x" or "sub/x", which the export does not recreate."""
    if not weight_map:
        return None
    plain = all(Path(f).name == f and f.endswith(".safetensors") and f != SINGLE_NAME for f in weight_map.values())
    return dict(weight_map) if plain and set(weight_map) == set(names) else None


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_hf_config(out_dir: str | os.PathLike, config_dict: dict, dtype: torch.dtype,
                    architectures: tuple[str, ...]) -> None:
    """config.json as transformers itself saves it (non-default fields only; no local paths such as
    ``_name_or_path``), declaring the dtype the weights were written in (a multimodal config's ``text_config``
    too, where it declares one: it describes the language model's weights, not the source's).

    Two transformers-4 keys are added for older readers: ``torch_dtype`` (< 4.56 ignores ``dtype``)
    and, for plain RoPE, ``rope_theta`` (transformers 4 ignores ``rope_parameters`` and would
    silently fall back to theta 10000)."""
    config = config_from_dict(config_dict)
    config.dtype = dtype
    cfg = json.loads(config.to_json_string(use_diff=True))
    cfg["dtype"] = dtype_name(dtype)
    cfg["torch_dtype"] = dtype_name(dtype)
    text = cfg.get("text_config")
    if isinstance(text, dict):  # the language model is what was written in `dtype` (a vision tower keeps its own)
        for key in ("dtype", "torch_dtype"):
            if text.get(key) is not None:
                text[key] = dtype_name(dtype)
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_type", "default") == "default" and "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    if not cfg.get("architectures"):
        cfg["architectures"] = list(architectures)
    (Path(out_dir) / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def copy_assets(src_dir: str | os.PathLike | None, out_dir: str | os.PathLike) -> list[str]:
    """Tokenizer / generation files and asset folders (never config.json, which is regenerated)."""
    if src_dir is None or not Path(src_dir).is_dir():
        return []
    copied = []
    for name in HF_ASSET_FILES:
        if name == "config.json":
            continue
        src = Path(src_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(out_dir) / name)
            copied.append(name)
    return copied + copy_hf_asset_dirs(src_dir, out_dir)
