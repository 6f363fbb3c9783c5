"""Lazy, read-only access to an HF safetensors checkpoint directory.

Why lazy: every rank of an 8B/32B load only needs its TP slice of its PP stage's tensors.
safetensors memory-maps the files and `get_slice` reads just the requested rows/columns, so a rank
touches a fraction of the checkpoint and nothing is materialised whole unless asked for.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import Tensor

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class HFCheckpointError(ValueError):
    """A missing, unreadable or inconsistent HF checkpoint file (the message names the file)."""


def _missing_file(fp: Path, listed: bool) -> str:
    """Why weights file `fp` cannot be opened: a link to nothing (a download or copy cut short, an unmounted disk),
    or a file its index names that is not there."""
    if fp.is_symlink():
        return f"{fp}: a symbolic link to {os.readlink(fp)}, which does not exist (an interrupted download?)"
    if fp.exists():
        return f"{fp}: not a regular file"
    return f"{fp}: listed in {INDEX_NAME} but missing" if listed else f"{fp}: missing"


#: how a Git LFS pointer file starts: what a clone without ``git lfs`` leaves in place of each weights file
_LFS_POINTER = b"version https://git-lfs"


def _lfs_hint(fp: Path) -> str:
    """A hint when `fp` is a Git LFS pointer rather than the weights (safetensors only says its header is bad)."""
    try:
        with open(fp, "rb") as f:
            head = f.read(len(_LFS_POINTER))
    except OSError:
        return ""
    if head != _LFS_POINTER:
        return ""
    return ("; it is a Git LFS pointer, not the weights: the repository was cloned without Git LFS "
            "(run `git lfs pull` in it, or download it with `huggingface-cli download`)")


class LazyHFState:
    """`HFSource` over ``model.safetensors`` or a sharded set with ``model.safetensors.index.json``.

    All files are opened (headers parsed, contents mapped) at construction so a corrupt file or an
    index that points at missing tensors fails here with the file's name, before any rank writes.
    Without either file, every ``*.safetensors`` in the directory is read.
    """

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_dir():
            raise HFCheckpointError(f"HF checkpoint directory {self.path} does not exist")
        index = self.path / INDEX_NAME
        declared: dict[str, str] | None = None
        if (self.path / SINGLE_NAME).exists():
            # transformers' own order: a single model.safetensors wins over an index, so the
            # tools convert exactly the weights `from_pretrained` (and `verify`) would load
            files = [SINGLE_NAME]
        elif index.exists():
            try:
                declared = json.loads(index.read_text())["weight_map"]
                if not isinstance(declared, dict):
                    raise TypeError("weight_map is not an object")
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise HFCheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            if not declared:
                raise HFCheckpointError(f"{index}: its weight_map is empty (it names no tensors)")
            bad = next((n for n, f in declared.items() if not (isinstance(f, str) and f)), None)
            if bad is not None:
                raise HFCheckpointError(f"{index}: weight_map[{bad!r}] is {declared[bad]!r}, not a safetensors "
                                        f"file name")
            files = sorted(set(declared.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            bins = sorted(p.name for p in self.path.glob("*.bin"))
            hint = (f"; found {bins[:2]}: only safetensors are read (re-save with transformers' "
                    f"save_pretrained, which writes safetensors)") if bins else ""
            raise HFCheckpointError(f"{self.path}: no safetensors weights ({SINGLE_NAME} or {INDEX_NAME}){hint}")

        self._handles = {}
        self._where: dict[str, str] = {}
        for f in files:
            fp = self.path / f
            if not fp.is_file():
                raise HFCheckpointError(_missing_file(fp, listed=declared is not None))
            try:
                handle = safe_open(str(fp), framework="pt", device="cpu")
                names = list(handle.keys())
            except Exception as e:  # safetensors raises its own error types for bad headers/sizes
                raise HFCheckpointError(f"{fp}: not a readable safetensors file ({e}){_lfs_hint(fp)}") from None
            self._handles[f] = handle
            for n in names:
                if n in self._where:
                    raise HFCheckpointError(f"{fp}: tensor {n!r} also appears in {self._where[n]}")
                self._where[n] = f
        #: tensors a shard holds that its index does not list (transformers loads them too)
        self.unlisted: list[str] = []
        if declared is not None:
            for n, f in declared.items():
                if self._where.get(n) != f:
                    elsewhere = f" (it is in {self._where[n]})" if n in self._where else ""
                    raise HFCheckpointError(f"{self.path / f}: {INDEX_NAME} lists {n!r} in it, but it is not "
                                            f"there{elsewhere}")
            self.unlisted = sorted(n for n in self._where if n not in declared)

    def keys(self):
        return self._where.keys()

    @property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> the file holding it, sorted by name as an index's ``weight_map`` lists them."""
        return dict(sorted(self._where.items()))

    @property
    def files(self) -> list[str]:
        """The safetensors files read, in order (``[SINGLE_NAME]`` for an unsharded checkpoint)."""
        return list(self._handles)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def file_of(self, name: str) -> Path:
        return self.path / self._file(name)

    def _file(self, name: str) -> str:
        try:
            return self._where[name]
        except KeyError:
            raise KeyError(f"HF tensor {name!r} is not in {self.path}") from None

    def _slice(self, name: str):
        return self._handles[self._file(name)].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._slice(name).get_dtype()
        if code not in _DTYPES:
            raise HFCheckpointError(f"{self.file_of(name)}: tensor {name!r} has unsupported dtype {code}")
        return _DTYPES[code]

    def read(self, name: str, dim: int | None = None, start: int | None = None,
             stop: int | None = None) -> Tensor:
        try:
            if dim is None:
                return self._handles[self._file(name)].get_tensor(name)
            sl = self._slice(name)
            if dim == 0:
                return sl[start:stop]
            if dim == 1:
                return sl[:, start:stop]
        except KeyError:
            raise
        except Exception as e:
            raise HFCheckpointError(f"{self.file_of(name)}: cannot read {name!r} ({e})") from None
        raise ValueError(f"read: dim must be None, 0 or 1, got {dim}")

    def __getitem__(self, name: str) -> Tensor:
        return self.read(name)
