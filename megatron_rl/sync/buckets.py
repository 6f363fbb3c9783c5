"""Per-dtype flattened weight buckets: many named tensors -> one contiguous 1-D buffer per dtype.

Why: engines take weights fastest as a few large transfers (one CUDA IPC handle, one broadcast, one
shared-memory file per dtype) instead of one per tensor. A bucket is built from a stream of
``(hf_name, tensor)`` pairs and closed when the next tensor would push it past the byte cap (512 MiB
by default, slime's `--update-weight-buffer-size`); a single tensor larger than the cap gets a bucket
of its own. Rebuilding the named tensors from a bucket is exact (bitwise): the buffer holds the raw
elements in their own dtype, never a cast.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024

# dtype <-> wire name. Names match torch attribute names so SGLang's `getattr(torch, dtype)` accepts them.
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
                 "uint8", "bool", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot be sent in a weight bucket (supported: {sorted(_DTYPES)})")


def dtype_from_name(name: str) -> torch.dtype:
    key = name[len("torch."):] if name.startswith("torch.") else name
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} (supported: {sorted(_DTYPES)})")
    return _DTYPES[key]


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Where one named tensor lives inside its dtype's flat buffer (offset/numel in elements)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    numel: int

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": dtype_name(self.dtype), "shape": list(self.shape),
                "offset": self.offset, "numel": self.numel}

    @staticmethod
    def from_json(d: dict) -> "TensorMeta":
        try:
            shape = tuple(int(s) for s in d["shape"])
            meta = TensorMeta(name=str(d["name"]), dtype=dtype_from_name(str(d["dtype"])), shape=shape,
                              offset=int(d["offset"]), numel=int(d["numel"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed tensor metadata {d!r}: {e}") from None
        meta.check()
        return meta

    def check(self) -> None:
        expect = 1
        for s in self.shape:
            if s < 0:
                raise ValueError(f"tensor {self.name!r}: negative dimension in shape {self.shape}")
            expect *= s
        if expect != self.numel:
            raise ValueError(f"tensor {self.name!r}: shape {self.shape} has {expect} elements, metadata says {self.numel}")
        if self.offset < 0:
            raise ValueError(f"tensor {self.name!r}: negative offset {self.offset}")


@dataclasses.dataclass
class FlatBucket:
    """One contiguous 1-D buffer per dtype plus the metadata to cut it back into named tensors."""

    buffers: dict[torch.dtype, torch.Tensor]
    metas: list[TensorMeta]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    def metas_of(self, dtype: torch.dtype) -> list[TensorMeta]:
        return [m for m in self.metas if m.dtype == dtype]

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Views into the buffers (no copy), in the order the tensors were added."""
        return unflatten(self.buffers, self.metas)


def unflatten(buffers: dict[torch.dtype, torch.Tensor], metas: Iterable[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for m in metas:
        buf = buffers.get(m.dtype)
        if buf is None:
            raise ValueError(f"tensor {m.name!r}: no {m.dtype} buffer in the bucket")
        if buf.dim() != 1:
            raise ValueError(f"bucket buffer for {m.dtype} must be 1-D, got shape {tuple(buf.shape)}")
        if m.offset + m.numel > buf.numel():
            raise ValueError(f"tensor {m.name!r}: elements [{m.offset}, {m.offset + m.numel}) exceed the "
                             f"{m.dtype} buffer of {buf.numel()} elements")
        out.append((m.name, buf[m.offset:m.offset + m.numel].view(m.shape)))
    return out


Allocator = Callable[[torch.dtype, int], torch.Tensor]


def _default_allocator(device: torch.device | str | None) -> Allocator:
    def alloc(dtype: torch.dtype, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)
    return alloc


def flatten(named_tensors: list[tuple[str, torch.Tensor]], *, device=None,
            allocate: Allocator | None = None) -> FlatBucket:
    """Copy tensors into fresh per-dtype buffers (allocated by `allocate`, e.g. in shared memory)."""
    if not named_tensors:
        raise ValueError("cannot build an empty weight bucket")
    seen: set[str] = set()
    sizes: dict[torch.dtype, int] = {}
    metas: list[TensorMeta] = []
    for name, t in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one bucket")
        seen.add(name)
        dtype_name(t.dtype)  # reject unsupported dtypes early, with the name of the dtype
        off = sizes.get(t.dtype, 0)
        metas.append(TensorMeta(name, t.dtype, tuple(t.shape), off, t.numel()))
        sizes[t.dtype] = off + t.numel()
    if allocate is None:
        allocate = _default_allocator(device if device is not None else named_tensors[0][1].device)
    buffers = {dt: allocate(dt, n) for dt, n in sizes.items()}
    for (_, t), m in zip(named_tensors, metas):
        buffers[m.dtype][m.offset:m.offset + m.numel].view(m.shape).copy_(t)
    return FlatBucket(buffers, metas)


def bucketize(stream: Iterable[tuple[str, torch.Tensor]], *, cap_bytes: int = DEFAULT_BUCKET_BYTES,
              device=None, allocate: Allocator | None = None) -> Iterator[FlatBucket]:
    """Group a stream of named tensors into buckets of at most `cap_bytes` (all dtypes together).

    Tensors are held by reference until their bucket closes, so peak extra memory is one bucket.
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be positive, got {cap_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    pending_bytes = 0
    for name, t in stream:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(t).__name__}, not a torch.Tensor")
        nbytes = t.numel() * t.element_size()
        if pending and pending_bytes + nbytes > cap_bytes:
            yield flatten(pending, device=device, allocate=allocate)
            pending, pending_bytes = [], 0
        pending.append((name, t))
        pending_bytes += nbytes
    if pending:
        yield flatten(pending, device=device, allocate=allocate)
