"""Layout transforms between HF tensors and Megatron tensor-parallel shards.

Each transform answers two questions for one Megatron parameter:
- `shard`: which tensor does TP rank `r` of `tp` hold, built from the HF tensor(s)? It reads only
  the rows/columns that rank needs (through `HFSource.read`), so a rank never materialises the
  whole checkpoint.
- `to_hf`: given the TP shards concatenated along `tp_dim` (what an all-gather yields), what are
  the HF tensors?

They are pure torch functions of shapes and config numbers: no process groups, no modules. The
per-architecture bridge files combine them declaratively (`ParamMapping`).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Protocol, Sequence

import torch
from torch import Tensor


class LayoutError(ValueError):
    """An HF tensor cannot be laid out on the Megatron parameter (shape or divisibility)."""


class HFSource(Protocol):
    """Read access to full HF tensors, possibly lazy (safetensors slices)."""

    def __contains__(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, dim: int | None = None, start: int | None = None,
             stop: int | None = None) -> Tensor:
        """The whole tensor, or the range [start, stop) along `dim` (0 or 1)."""
        ...


def _split_range(total: int, tp_rank: int, tp_size: int, what: str) -> tuple[int, int]:
    if total % tp_size:
        raise LayoutError(f"{what}: size {total} is not divisible by tp={tp_size}")
    step = total // tp_size
    return tp_rank * step, (tp_rank + 1) * step


def _check_shape(t: Tensor, local_shape: Sequence[int], what: str) -> Tensor:
    if tuple(t.shape) != tuple(local_shape):
        raise LayoutError(f"{what}: built a shard of shape {tuple(t.shape)}, the Megatron "
                          f"parameter has shape {tuple(local_shape)}")
    return t


class Transform(abc.ABC):
    """One layout kind. `tp_dim` is the Megatron dim split over TP (None: replicated)."""

    tp_dim: int | None = None
    #: how many HF tensors this Megatron parameter is made of
    num_hf: int = 1

    @abc.abstractmethod
    def shard(self, src: HFSource, hf_names: Sequence[str], tp_rank: int, tp_size: int,
              local_shape: Sequence[int]) -> Tensor:
        """This TP rank's Megatron tensor."""

    @abc.abstractmethod
    def to_hf(self, full: Tensor, tp_size: int) -> tuple[Tensor, ...]:
        """HF tensors from the TP shards concatenated along `tp_dim` (one per HF name)."""

    def full_shape(self, local_shape: Sequence[int], tp_size: int) -> tuple[int, ...]:
        shape = list(local_shape)
        if self.tp_dim is not None:
            shape[self.tp_dim] *= tp_size
        return tuple(shape)


@dataclasses.dataclass(frozen=True)
class Replicated(Transform):
    """Same tensor on every TP rank (norm weights, q/k layernorm)."""

    tp_dim = None

    def shard(self, src, hf_names, tp_rank, tp_size, local_shape):
        return _check_shape(src.read(hf_names[0]), local_shape, hf_names[0])

    def to_hf(self, full, tp_size):
        return (full,)


@dataclasses.dataclass(frozen=True)
class ColumnParallel(Transform):
    """Output dim (weight dim 0) split into `tp` contiguous chunks."""

    tp_dim = 0

    def shard(self, src, hf_names, tp_rank, tp_size, local_shape):
        name = hf_names[0]
        lo, hi = _split_range(src.shape(name)[0], tp_rank, tp_size, name)
        return _check_shape(src.read(name, 0, lo, hi), local_shape, name)

    def to_hf(self, full, tp_size):
        return (full,)


@dataclasses.dataclass(frozen=True)
class RowParallel(Transform):
    """Input dim (weight dim 1) split into `tp` contiguous chunks."""

    tp_dim = 1

    def shard(self, src, hf_names, tp_rank, tp_size, local_shape):
        name = hf_names[0]
        shape = src.shape(name)
        if len(shape) < 2:
            raise LayoutError(f"{name}: row-parallel needs a 2-D weight, got shape {shape}")
        lo, hi = _split_range(shape[1], tp_rank, tp_size, name)
        return _check_shape(src.read(name, 1, lo, hi), local_shape, name)

    def to_hf(self, full, tp_size):
        return (full,)


@dataclasses.dataclass(frozen=True)
class VocabParallel(Transform):
    """Vocab rows padded with zeros to Megatron's padded vocab, then split over TP.

    The padded size is whatever the Megatron parameter has (local rows * tp): the padding rule
    belongs to the model builder, the bridge only fills and strips it.
    """

    vocab_size: int
    tp_dim = 0

    def shard(self, src, hf_names, tp_rank, tp_size, local_shape):
        name = hf_names[0]
        shape = src.shape(name)
        if shape[0] != self.vocab_size:
            raise LayoutError(f"{name}: has {shape[0]} rows, config vocab_size is {self.vocab_size}")
        rows = local_shape[0]
        if rows * tp_size < self.vocab_size:
            raise LayoutError(f"{name}: Megatron vocab {rows * tp_size} < HF vocab {self.vocab_size}")
        lo = tp_rank * rows
        hi = min(lo + rows, self.vocab_size)
        out = torch.zeros((rows, *shape[1:]), dtype=src_dtype(src, name))
        if hi > lo:
            out[: hi - lo] = src.read(name, 0, lo, hi)
        return _check_shape(out, local_shape, name)

    def to_hf(self, full, tp_size):
        return (full[: self.vocab_size],)


def src_dtype(src: HFSource, name: str) -> torch.dtype:
    dtype = getattr(src, "dtype", None)
    if callable(dtype):
        return dtype(name)
    return src.read(name, 0, 0, 0).dtype


@dataclasses.dataclass(frozen=True)
class QKVInterleave(Transform):
    """HF q/k/v projections -> Megatron fused `linear_qkv`, grouped per query group.

    Megatron rows, for each query group g: [q heads of g | (gate heads of g) | k_g | v_g].
    With `gated=True` (Qwen3.5/Qwen3-Next output gate) HF `q_proj` holds per head [q (hd); gate (hd)].
    The fused tensor is split over TP in contiguous row chunks. When tp <= num_groups each rank gets
    whole groups; when tp > num_groups Megatron splits groups across ranks and all-gathers the QKV
    activations itself, so the weight layout is still "contiguous chunk of the fused tensor".
    Works for biases (1-D) too.
    """

    num_heads: int
    num_groups: int
    head_dim: int
    gated: bool = False
    tp_dim = 0
    num_hf = 3

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_groups

    @property
    def q_rows_per_head(self) -> int:
        return self.head_dim * (2 if self.gated else 1)

    @property
    def rows_per_group(self) -> int:
        return (self.heads_per_group * self.q_rows_per_head) + 2 * self.head_dim

    def _check(self, src, hf_names):
        if self.num_heads % self.num_groups:
            raise LayoutError(f"num_heads={self.num_heads} is not a multiple of num_groups={self.num_groups}")
        q, k, v = hf_names
        want = {q: self.num_heads * self.q_rows_per_head, k: self.num_groups * self.head_dim,
                v: self.num_groups * self.head_dim}
        for name, rows in want.items():
            got = src.shape(name)[0]
            if got != rows:
                raise LayoutError(f"{name}: has {got} rows, expected {rows} from the head counts")

    def interleave(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Fuse q/k/v rows of n consecutive whole groups (n inferred from k)."""
        hd, hpg = self.head_dim, self.heads_per_group
        n = k.shape[0] // hd
        rest = tuple(q.shape[1:])
        if self.gated:
            qg = q.reshape(n, hpg, 2, hd, *rest)
            parts = [qg[:, :, 0].reshape(n, hpg * hd, *rest), qg[:, :, 1].reshape(n, hpg * hd, *rest)]
        else:
            parts = [q.reshape(n, hpg * hd, *rest)]
        parts += [k.reshape(n, hd, *rest), v.reshape(n, hd, *rest)]
        return torch.cat(parts, dim=1).reshape(n * self.rows_per_group, *rest)

    def shard(self, src, hf_names, tp_rank, tp_size, local_shape):
        self._check(src, hf_names)
        q_name, k_name, v_name = hf_names
        rpg = self.rows_per_group
        lo, hi = _split_range(self.num_groups * rpg, tp_rank, tp_size, f"fused QKV of {q_name}")
        g0, g1 = lo // rpg, -(-hi // rpg)  # the whole groups that cover [lo, hi)
        qph = self.heads_per_group * self.q_rows_per_head
        q = src.read(q_name, 0, g0 * qph, g1 * qph)
        k = src.read(k_name, 0, g0 * self.head_dim, g1 * self.head_dim)
        v = src.read(v_name, 0, g0 * self.head_dim, g1 * self.head_dim)
        block = self.interleave(q, k, v)
        return _check_shape(block[lo - g0 * rpg: hi - g0 * rpg], local_shape, q_name)

    def to_hf(self, full, tp_size):
        hd, hpg, ng = self.head_dim, self.heads_per_group, self.num_groups
        rest = tuple(full.shape[1:])
        grouped = full.reshape(ng, self.rows_per_group, *rest)
        if self.gated:
            q, gate, k, v = torch.split(grouped, [hpg * hd, hpg * hd, hd, hd], dim=1)
            q_proj = torch.stack([q.reshape(ng, hpg, hd, *rest), gate.reshape(ng, hpg, hd, *rest)], dim=2)
        else:
            q_proj, k, v = torch.split(grouped, [hpg * hd, hd, hd], dim=1)
        return (q_proj.reshape(self.num_heads * self.q_rows_per_head, *rest),
                k.reshape(ng * hd, *rest), v.reshape(ng * hd, *rest))


@dataclasses.dataclass(frozen=True)
class GatedMLP(Transform):
    """SwiGLU `linear_fc1`: each TP rank holds [gate_r; up_r] (not a slice of cat([gate, up]))."""

    tp_dim = 0
    num_hf = 2

    def shard(self, src, hf_names, tp_rank, tp_size, local_shape):
        gate, up = hf_names
        if src.shape(gate) != src.shape(up):
            raise LayoutError(f"{gate} {src.shape(gate)} and {up} {src.shape(up)} differ in shape")
        lo, hi = _split_range(src.shape(gate)[0], tp_rank, tp_size, gate)
        out = torch.cat([src.read(gate, 0, lo, hi), src.read(up, 0, lo, hi)], dim=0)
        return _check_shape(out, local_shape, gate)

    def to_hf(self, full, tp_size):
        gates, ups = [], []
        for shard in full.chunk(tp_size, dim=0):
            g, u = shard.chunk(2, dim=0)
            gates.append(g)
            ups.append(u)
        return torch.cat(gates, dim=0), torch.cat(ups, dim=0)


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetParts(Transform):
    """Gated DeltaNet tensors whose Megatron TP shard concatenates per-rank slices of several parts.

    megatron-core's ``GatedDeltaNet`` shards heads over TP: rank r holds key heads
    ``[r*nk/tp, (r+1)*nk/tp)`` and the value heads that use them (value head j uses key head
    ``j // (nv/nk)``, so those are contiguous too). Its fused tensors list, per rank,
    - ``in_proj.weight``: ``[q_r | k_r | v_r | z_r | beta_r | alpha_r]`` from HF ``in_proj_qkv`` (flat
      ``[Q_all; K_all; V_all]``), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` (`kind="in_proj"`);
    - ``conv1d.weight``: channels ``[q_r | k_r | v_r]`` of HF ``conv1d.weight`` (`kind="conv1d"`).
    So the concatenation over ranks is not HF's order, and depends on the TP size: every rank is
    built from the HF tensors, and `to_hf` splits the gathered tensor per rank first.
    """

    kind: str  # "in_proj" | "conv1d"
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    tp_dim = 0

    @property
    def num_hf(self) -> int:  # type: ignore[override]
        return 4 if self.kind == "in_proj" else 1

    def _rows(self, tp_size: int) -> list[tuple[int, int, int]]:
        """(hf tensor index, start row of part 0 in it, rows per rank) for each part of a rank."""
        nk, nv, dk, dv = self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim
        for what, n in (("linear_num_key_heads", nk), ("linear_num_value_heads", nv)):
            if n % tp_size:
                raise LayoutError(f"{what}={n} is not divisible by tp={tp_size}")
        qk, v = nk * dk, nv * dv
        parts = [(0, 0, qk // tp_size), (0, qk, qk // tp_size), (0, 2 * qk, v // tp_size)]
        if self.kind == "in_proj":
            parts += [(1, 0, v // tp_size), (2, 0, nv // tp_size), (3, 0, nv // tp_size)]
        return parts

    def _hf_rows(self) -> list[int]:
        qkv = 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
        if self.kind == "conv1d":
            return [qkv]
        v = self.num_value_heads * self.value_head_dim
        return [qkv, v, self.num_value_heads, self.num_value_heads]

    def shard(self, src, hf_names, tp_rank, tp_size, local_shape):
        for name, rows in zip(hf_names, self._hf_rows()):
            if src.shape(name)[0] != rows:
                raise LayoutError(f"{name}: has {src.shape(name)[0]} rows, expected {rows} from the GDN head counts")
        pieces = [src.read(hf_names[i], 0, start + tp_rank * n, start + (tp_rank + 1) * n)
                  for i, start, n in self._rows(tp_size)]
        return _check_shape(torch.cat(pieces, dim=0), local_shape, hf_names[0])

    def to_hf(self, full, tp_size):
        parts = self._rows(tp_size)
        per_rank = [torch.split(chunk, [n for _, _, n in parts], dim=0) for chunk in full.chunk(tp_size, dim=0)]
        out: list[list[Tensor]] = [[] for _ in self._hf_rows()]
        # HF order: every rank's piece of part 0, then of part 1, ... (parts of one HF tensor in order)
        for k, (i, _start, _n) in enumerate(parts):
            out[i].extend(pieces[k] for pieces in per_rank)
        return tuple(torch.cat(chunks, dim=0) for chunks in out)


class DictSource:
    """`HFSource` over an in-memory mapping of full tensors."""

    def __init__(self, tensors):
        self._t = tensors

    def __contains__(self, name):
        return name in self._t

    def keys(self):
        return self._t.keys()

    def _get(self, name) -> Tensor:
        try:
            return self._t[name]
        except KeyError:
            raise KeyError(f"HF tensor {name!r} is missing from the state dict") from None

    def shape(self, name):
        return tuple(self._get(name).shape)

    def dtype(self, name):
        return self._get(name).dtype

    def read(self, name, dim=None, start=None, stop=None):
        t = self._get(name)
        if dim is None:
            return t
        return t.narrow(dim, start, stop - start)


def as_source(hf_state) -> HFSource:
    if hasattr(hf_state, "read") and hasattr(hf_state, "shape"):
        return hf_state
    return DictSource(hf_state)


def megatron_full(transform: Transform, hf_tensors: dict[str, Tensor], hf_names: Sequence[str],
                  tp_size: int, local_shape: Sequence[int]) -> Tensor:
    """All TP shards concatenated along `tp_dim` (a pure helper for tests and offline tools)."""
    src = DictSource(hf_tensors)
    shards = [transform.shard(src, hf_names, r, tp_size, local_shape) for r in range(tp_size)]
    if transform.tp_dim is None:
        return shards[0]
    return torch.cat(shards, dim=transform.tp_dim)
