"""Parent-side comparison of candidate outputs with reference outputs.

The rule (all must hold for every output tensor):

1. structure: same number of outputs, each a plain tensor; same shape; same dtype (no precision downgrade);
2. non-finite values agree exactly: NaN where the reference is NaN (and nowhere else), the same infinities;
3. elementwise, on finite reference entries: ``|a - b| <= atol + rtol * |b|`` (KernelBench's allclose);
4. scale-relative: ``max|a - b| <= tol * max(max|b|, scale_floor)`` over finite entries.

Rule 4 closes the absolute-tolerance loophole: a softmax over 393k columns has outputs ~2.5e-6, so an
all-zero output passes rule 3 with atol=1e-4, but its error equals the reference's own scale. Differences
are computed in float64, in chunks, on the reference's device.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from . import digest_kernel

_CHUNK = 1 << 24  # elements per comparison chunk (bounds float64 temporaries)


@dataclasses.dataclass
class Mismatch:
    output: int                 # which output (flattened structure)
    index: tuple[int, ...] | None
    expected: float | None
    got: float | None
    reason: str

    def describe(self) -> str:
        where = f"output {self.output}" + (f" at index {list(self.index)}" if self.index is not None else "")
        if self.expected is not None:
            return f"{where}: expected {self.expected:.6g}, got {self.got:.6g} ({self.reason})"
        return f"{where}: {self.reason}"


@dataclasses.dataclass
class Comparison:
    ok: bool
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0          # max|a-b| / max|b|
    ref_scale: float = 0.0             # max|b| over finite entries
    mismatch: Mismatch | None = None
    mismatched_elements: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.mismatch is not None:
            d["mismatch"]["describe"] = self.mismatch.describe()
        return d


MAX_OUTPUT_DEPTH = 32   # nesting of output containers (deeper is no kernel's output, and JSON/recursion limits)
_KEY_TYPES = (str, int, float, bool, type(None))


def flatten_outputs(out: Any, _depth: int = 0) -> tuple[list[Any], Any]:
    """Flatten nested tuples/lists/dicts into a list of leaves plus a JSON-able structure spec.

    Containers are walked with the base types' own iteration (``tuple.__iter__``, ``dict.keys``), so a
    subclass returned by a candidate cannot run code here (a lazy ``__iter__`` would compute outside the
    profiled and timed call). Dict keys must be plain scalars."""
    if _depth > MAX_OUTPUT_DEPTH:
        raise ValueError(f"outputs are nested more than {MAX_OUTPUT_DEPTH} levels deep")
    kind = type(out)
    if issubclass(kind, (list, tuple)):
        items = list.__iter__(out) if issubclass(kind, list) else tuple.__iter__(out)
        leaves, spec = [], []
        for o in items:
            sub_leaves, sub_spec = flatten_outputs(o, _depth + 1)
            leaves += sub_leaves
            spec.append(sub_spec)
        return leaves, {"seq": "list" if issubclass(kind, list) else "tuple", "items": spec}
    if issubclass(kind, dict):
        keys = list(dict.keys(out))
        if not all(type(k) in _KEY_TYPES for k in keys):
            raise TypeError("output dict keys must be str, int, float, bool or None")
        leaves, spec = [], {}
        for k in sorted(keys, key=str):
            sub_leaves, sub_spec = flatten_outputs(dict.__getitem__(out, k), _depth + 1)
            leaves += sub_leaves
            spec[str(k)] = sub_spec
        return leaves, {"dict": spec}
    return [out], "leaf"


def spec_depth(spec: Any, limit: int = MAX_OUTPUT_DEPTH + 2) -> int:
    """Nesting depth of a structure spec, counted without recursion (a spec from the child is untrusted)."""
    depth, stack = 0, [(spec, 0)]
    while stack:
        node, d = stack.pop()
        depth = max(depth, d)
        if d > limit:
            return d
        if isinstance(node, dict):
            children = node.get("items") if "items" in node else node.get("dict")
            if isinstance(children, list):
                stack += [(c, d + 1) for c in children]
            elif isinstance(children, dict):
                stack += [(c, d + 1) for c in children.values()]
    return depth


def spec_summary(spec: Any, limit: int = 200) -> str:
    """A bounded description of a structure spec (for feedback; the child's spec is untrusted)."""
    depth = spec_depth(spec)
    if depth > MAX_OUTPUT_DEPTH:
        return f"<nested {depth}+ levels deep>"
    text = str(spec)
    return text if len(text) <= limit else text[:limit] + "..."


def same_structure(a: Any, b: Any) -> bool:
    """Structure specs equal, treating list and tuple alike (a kernel may return either)."""
    if spec_depth(a) > MAX_OUTPUT_DEPTH + 1:
        return False
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a == b == "leaf"
    ai, bi = a.get("items"), b.get("items")
    if "seq" in a and "seq" in b and isinstance(ai, list) and isinstance(bi, list):
        return len(ai) == len(bi) and all(same_structure(x, y) for x, y in zip(ai, bi))
    ad, bd = a.get("dict"), b.get("dict")
    if isinstance(ad, dict) and isinstance(bd, dict):
        return ad.keys() == bd.keys() and all(same_structure(ad[k], bd[k]) for k in ad)
    return False


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes. Whether an input was written to: ``torch.equal`` calls a tensor holding a NaN
    unequal to its own copy, so every input with a NaN looked modified (by the reference too, which waived the
    input-mutation rule for the whole task)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(raw(a), raw(b.to(a.device)))


def _unravel(flat_index: int, shape: Sequence[int]) -> tuple[int, ...]:
    idx = []
    for dim in reversed(shape):
        idx.append(flat_index % dim if dim else 0)
        flat_index //= dim if dim else 1
    return tuple(reversed(idx))


def compare_tensor(got: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float,
                   scale_floor: float = 1e-30, output: int = 0) -> Comparison:
    if type(got) is not torch.Tensor:
        return Comparison(False, mismatch=Mismatch(output, None, None, None,
                                                   f"output is a {type(got).__name__}, expected a tensor"))
    if tuple(got.shape) != tuple(expected.shape):
        return Comparison(False, mismatch=Mismatch(output, None, None, None,
                                                   f"shape {list(got.shape)}, expected {list(expected.shape)}"))
    if got.dtype != expected.dtype:
        return Comparison(False, mismatch=Mismatch(output, None, None, None,
                                                   f"dtype {got.dtype}, expected {expected.dtype}"))
    if got.device != expected.device:
        got = got.to(expected.device)
    a = got.reshape(-1)
    b = expected.reshape(-1)
    if a.is_complex() or b.is_complex():
        a, b = torch.view_as_real(a).reshape(-1), torch.view_as_real(b).reshape(-1)
    if not (b.is_floating_point() or b.is_complex()):
        diff_idx = (a != b).nonzero()
        if diff_idx.numel():
            i = int(diff_idx[0])
            return Comparison(False, mismatch=Mismatch(output, _unravel(i, expected.shape), float(b[i]), float(a[i]),
                                                       "integer/bool values differ"),
                              mismatched_elements=int(diff_idx.numel()))
        return Comparison(True)

    max_abs = 0.0
    scale = 0.0
    bad_total = 0
    first: Mismatch | None = None
    for start in range(0, b.numel(), _CHUNK):
        fast = _finite_chunk(a[start:start + _CHUNK], b[start:start + _CHUNK], atol, rtol)
        if fast is not None:   # every entry finite and within tolerance: the same figures, in fewer passes
            max_abs, scale = max(max_abs, fast[0]), max(scale, fast[1])
            continue
        ac = a[start:start + _CHUNK].double()
        bc = b[start:start + _CHUNK].double()
        b_nan, a_nan = torch.isnan(bc), torch.isnan(ac)
        b_inf = torch.isinf(bc)
        finite = ~(b_nan | b_inf)
        nonfinite_bad = (b_nan != a_nan) | (b_inf & (ac != bc)) | (finite & ~torch.isfinite(ac))
        diff = torch.where(finite & torch.isfinite(ac), (ac - bc).abs(), torch.zeros_like(ac))
        elem_bad = finite & torch.isfinite(ac) & (diff > atol + rtol * bc.abs())
        bad = nonfinite_bad | elem_bad
        n_bad = int(bad.sum())
        if n_bad and first is None:
            i = int(bad.nonzero()[0])
            reason = "non-finite value differs" if bool(nonfinite_bad[i]) else \
                f"|diff| {float(diff[i]):.3g} > atol {atol:g} + rtol {rtol:g} * |expected|"
            first = Mismatch(output, _unravel(start + i, expected.shape), float(bc[i]), float(ac[i]), reason)
        bad_total += n_bad
        if finite.any():
            max_abs = max(max_abs, float(diff.max()))
            scale = max(scale, float(bc[finite].abs().max()))
    rel = max_abs / max(scale, scale_floor)
    tol = max(atol, rtol)
    if first is None and rel > tol:
        # every element within atol, but the error is of the order of the output itself
        diff_full_idx = None
        for start in range(0, b.numel(), _CHUNK):
            ac = a[start:start + _CHUNK].double()
            bc = b[start:start + _CHUNK].double()
            d = torch.where(torch.isfinite(bc) & torch.isfinite(ac), (ac - bc).abs(), torch.zeros_like(ac))
            if float(d.max()) >= max_abs:
                i = int(d.argmax())
                diff_full_idx = (start + i, float(bc[i]), float(ac[i]))
                break
        i, e, g = diff_full_idx if diff_full_idx else (0, None, None)
        first = Mismatch(output, _unravel(i, expected.shape), e, g,
                         f"max|diff| {max_abs:.3g} is {rel:.3g} of the reference scale max|expected| {scale:.3g} "
                         f"(limit {tol:g})")
    return Comparison(first is None, max_abs_diff=max_abs, max_rel_diff=rel, ref_scale=scale, mismatch=first,
                      mismatched_elements=bad_total)


def _finite_chunk(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[float, float] | None:
    """(max|a - b|, max|b|) of one chunk whose entries are all finite and within ``atol + rtol * |b|``, or None
    when any is not (the caller then finds the mismatch entry by entry). The same float64 arithmetic as the
    general path, in five passes over the chunk instead of about twenty: comparisons of outputs of several
    GB (KernelBench's full sizes) spend their time here."""
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return None
    ad, bd = a.to(torch.float64, copy=True), b.to(torch.float64, copy=True)   # never the callers' tensors
    diff = ad.sub_(bd).abs_()
    babs = bd.abs_()
    max_abs, scale = float(diff.max()), float(babs.max())
    if bool((diff > babs.mul_(rtol).add_(atol)).any()):
        return None
    return max_abs, scale


SAMPLE_BLOCK = 64   # entries of one sampled block (256 contiguous bytes of float32: cache lines, coalesced reads)


def sample_entries(numel: int, k: int) -> int:
    """The most entries ``sample_index`` picks of ``numel`` (all of them where it samples none)."""
    return numel if numel <= max(k, 3 * SAMPLE_BLOCK) else max(k // SAMPLE_BLOCK, 3) * SAMPLE_BLOCK


def sample_index(numel: int, k: int, seed: int, device: torch.device | str | None = None) -> torch.Tensor | None:
    """Flat indices (int64, sorted, on ``device``: the host by default) of a random sample of about ``k`` of
    ``numel`` entries, or None when ``numel <= max(k, 3 * SAMPLE_BLOCK)`` (every entry is compared). Blocks of
    ``SAMPLE_BLOCK`` consecutive entries at random block positions, plus the first and the last block (where
    off-by-one bounds fail), drawn on the host from ``seed`` alone: the parent and the child compute the same
    indices. The parent picks the seed only after the call whose output is sampled has returned, so no kernel can
    know which entries are compared. Only the block starts are drawn on the host; the indices (2^24 by default:
    128 MB) are expanded on ``device``, where they are used."""
    if numel <= max(k, 3 * SAMPLE_BLOCK):
        return None
    # whole blocks even for a small k: the commitment checks aligned blocks of COMMIT_BLOCK entries only, so a
    # shorter block would leave every sampled entry unchecked by it (a small k then samples a little more)
    block = SAMPLE_BLOCK
    gen = torch.Generator().manual_seed(int(seed) % (1 << 63))
    starts = torch.randint(0, numel // block, (max(k // block - 2, 1),), generator=gen) * block
    starts = torch.cat([torch.tensor([0, numel - block]), starts]).unique().to(device)   # sorted
    return (starts[:, None] + torch.arange(block, device=starts.device)).reshape(-1)


# ---------------------------------------------------------------------------------------------- commitments
#
# A sampled handover compares only the entries the parent's seed picks, and the child learns that seed after the
# call. So that native code cannot then fix up exactly those entries of a held output, the child commits to the
# whole output first: when the call returns, before any seed exists, it digests every aligned block of
# COMMIT_BLOCK entries on the output's device and hands the digests over in a sealed memfd; the parent checks each
# sampled block it receives against its digest.
#
# The digest must bind: the fix-up has the sample's seed, the committed digests and all the time of a handover to
# turn a block of wrong values into one of right values (within tolerance) with the same digest. The first digest
# was a keyed sum of the entries' bits; being linear, it did not bind (negating two float64 entries kept it, and a
# lattice reduction met any digest with a few ulps in 16 entries). A block's digest is now 128 bits, two
# independent lanes of a hash tree over the block's raw bytes as 64-bit words: each word is keyed by its lane and
# position and mixed with ``fmix`` (MurmurHash3's 64-bit finaliser, a bijection), then pairs are folded level by
# level with ``fmix(a * m + b)`` (``m`` odd, per lane and level). Every step is non-linear over the integers mod
# 2^64, and meeting both lanes of a chosen digest by splitting the block in halves (meet in the middle) costs about
# 2^64 work: out of reach in a handover's seconds. It is not a cryptographic hash (the keys are fixed and public); it runs as a few
# elementwise int64 passes over the output's words on its own device, cheap enough for every timed batch.

#: safetensors metadata key of a handover naming the outputs written as float64 (re, im) pairs (safetensors has no
#: complex128 dtype); the child writes them so, the parent reads them back as complex128
COMPLEX128_KEYS = "complex128"

COMMIT_BLOCK = 64
DIGEST_LANES = 2
_COMMIT_ENTRY_BYTES = (1, 2, 4, 8, 16)
_MAX_BLOCK_WORDS = COMMIT_BLOCK * 16 // 8           # complex128: 128 words a block
_MAX_LEVELS = _MAX_BLOCK_WORDS.bit_length() - 1     # 7


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_FMIX_MUL = (_signed64(0xFF51AFD7ED558CCD), _signed64(0xC4CEB9FE1A85EC53))
_keygen = torch.Generator().manual_seed(0x5EED)
_WORD_KEYS = torch.randint(-(2**62), 2**62, (DIGEST_LANES, 1, _MAX_BLOCK_WORDS), generator=_keygen, dtype=torch.int64)
_LEVEL_MULS = torch.randint(-(2**62), 2**62, (_MAX_LEVELS, DIGEST_LANES, 1, 1), generator=_keygen,
                            dtype=torch.int64) | 1
del _keygen


def committable(t: torch.Tensor) -> bool:
    return t.dtype == torch.bool or t.element_size() in _COMMIT_ENTRY_BYTES


def _fmix_(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's fmix64 on int64, in place (one temporary: the digest runs after every timed batch)."""
    tmp = torch.empty_like(x)
    for mul in (*_FMIX_MUL, None):
        torch.bitwise_right_shift(x, 33, out=tmp)
        tmp &= (1 << 31) - 1          # logical shift
        x ^= tmp
        if mul is not None:
            x *= mul
    return x


def _raw_bytes(flat: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous flat tensor's entries, as a uint8 view."""
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)


def _digest_words(words: torch.Tensor) -> torch.Tensor:
    """[blocks, W] int64 words (W a power of two, <= _MAX_BLOCK_WORDS) -> [blocks, DIGEST_LANES] digests."""
    width = words.shape[1]
    # each word mixed on its own first: a fold of raw words would let paired changes cancel in a * m + b (two sign
    # flips add 2^63 each, 0 mod 2^64)
    x = _fmix_(words.unsqueeze(0) ^ _WORD_KEYS[:, :, :width].to(words.device))      # [lanes, blocks, W]
    level = 0
    while x.shape[2] > 1:
        folded = x[:, :, 0::2] * _LEVEL_MULS[level].to(x.device)
        folded += x[:, :, 1::2]
        x = _fmix_(folded)
        level += 1
    return x[:, :, 0].t().contiguous()


def _digest_words_fused(words: torch.Tensor) -> torch.Tensor:
    """``_digest_words`` through the fused kernel; its torch form where the kernel cannot be built or launched
    here (no compiler, an unwritable Triton cache), which is slower and never different."""
    try:
        return digest_kernel.digest_words(words, _WORD_KEYS, _LEVEL_MULS, _FMIX_MUL)
    except Exception:
        return _digest_words(words)


def block_digests(t: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """[blocks, DIGEST_LANES] int64 digests of each block of COMMIT_BLOCK consecutive entries of ``t``
    (flattened; the last block zero-padded), computed on ``t``'s device. Equal on any device and for any chunking.
    On a CUDA device with Triton the digests come from one fused kernel (``verifier.digest_kernel``: the same
    function, bit for bit) launched once over every whole block: it keeps no temporaries, and per-chunk launches
    were most of a 6.4 GB output's commit on an H200. The torch form works in chunks of ``chunk`` entries (bounded
    int64 temporaries); its default keeps a CPU's temporaries in cache (4x faster than 2^24 entries on a 400 MB
    output) and a GPU's launches few. Only the partial last block is copied (to pad it)."""
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)   # lazy conj/neg views: their values
    entry = 1 if flat.dtype == torch.bool else flat.element_size()
    block_bytes = COMMIT_BLOCK * entry
    data = _raw_bytes(flat)
    fused = digest_kernel.available(data)
    if chunk is None:
        chunk = 1 << 18 if t.device.type == "cpu" else 1 << 24
    chunk = max(COMMIT_BLOCK, chunk - chunk % COMMIT_BLOCK) * entry
    whole = data.numel() - data.numel() % block_bytes
    if fused:
        chunk = max(whole, block_bytes)
    parts = [data[start:min(start + chunk, whole)] for start in range(0, whole, chunk)]
    if whole < data.numel():
        tail = data[whole:]
        parts.append(torch.cat([tail, tail.new_zeros(block_bytes - tail.numel())]))
    digests = []
    for part in parts:
        try:
            words = part.view(torch.int64)
        except RuntimeError:   # not 8-byte aligned in its storage
            words = part.clone().view(torch.int64)
        words = words.view(-1, block_bytes // 8)
        digests.append(_digest_words_fused(words) if fused else _digest_words(words))
    if not digests:
        return torch.zeros(0, DIGEST_LANES, dtype=torch.int64, device=flat.device)
    return torch.cat(digests) if len(digests) > 1 else digests[0]


_WARMED_DIGESTS: set[str] = set()   # devices whose digest kernels this process has built


def warm_block_digests(device: torch.device | str) -> None:
    """Build ``block_digests``' fused kernel for every entry size on ``device`` (a Triton build per size, a second
    or two each in a fresh cache), once per process. The child does it before it knows its candidate; the parent,
    which checks samples against the commitments with the same kernel, before it holds the device."""
    probe = torch.zeros(COMMIT_BLOCK * 17, dtype=torch.uint8, device=device)
    if str(probe.device) in _WARMED_DIGESTS or not digest_kernel.available(probe):
        return
    for dtype in (torch.uint8, torch.float16, torch.float32, torch.float64):
        block_digests(probe.to(dtype))
    _WARMED_DIGESTS.add(str(probe.device))


def uncommitted_entry(values: torch.Tensor, picks: torch.Tensor, numel: int, digests: torch.Tensor) -> int | None:
    """The first flat index whose sampled block differs from the digest committed for it, or None. ``values``
    are the handed-over entries at ``picks`` (``sample_index``: blocks of consecutive entries). Only picks that
    form whole aligned COMMIT_BLOCKs are checked (not the last block of an output whose size is no multiple of
    it); every pick is still compared with the reference. A malformed sample is left to that comparison."""
    if picks.numel() % COMMIT_BLOCK or values.numel() != picks.numel() or picks.numel() == 0:
        return None
    if digests.dtype != torch.int64 or tuple(digests.shape) != (-(-numel // COMMIT_BLOCK), DIGEST_LANES):
        return int(picks[0])   # a commitment of another size commits to nothing
    rows = picks.view(-1, COMMIT_BLOCK)
    starts = rows[:, 0]
    whole = ((rows == starts[:, None] + torch.arange(COMMIT_BLOCK, device=rows.device)).all(dim=1)
             & (starts % COMMIT_BLOCK == 0) & (starts + COMMIT_BLOCK <= numel))
    if not bool(whole.any()):
        return None
    got = block_digests(values.detach().reshape(-1, COMMIT_BLOCK)[whole.to(values.device)].reshape(-1)).cpu()
    committed = digests[(starts[whole] // COMMIT_BLOCK).to(digests.device)].cpu()   # no copy of all of them
    bad = (got != committed).any(dim=1).nonzero()
    return int(starts[whole][int(bad[0, 0])]) if bad.numel() else None


def squared_error(got: Any, expected: Any) -> tuple[float, int]:
    """(sum of squared differences, number of entries) over the entries where both are finite, in float64
    chunks; (0.0, 0) for anything that is not two floating tensors of one shape."""
    if not (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor)) or got.shape != expected.shape \
            or not (got.is_floating_point() and expected.is_floating_point()):
        return 0.0, 0
    a, b = got.reshape(-1), expected.to(got.device).reshape(-1)
    total, count = 0.0, 0
    for start in range(0, b.numel(), _CHUNK):
        ac, bc = a[start:start + _CHUNK].double(), b[start:start + _CHUNK].double()
        finite = torch.isfinite(ac) & torch.isfinite(bc)
        total += float(((ac - bc)[finite] ** 2).sum())
        count += int(finite.sum())
    return total, count


def compare_outputs(got: Sequence[Any], expected: Sequence[Any], atol: float, rtol: float,
                    scale_floor: float = 1e-30) -> Comparison:
    """Compare flattened output lists; the first failing output decides, diffs are maxima over all."""
    if len(got) != len(expected):
        return Comparison(False, mismatch=Mismatch(0, None, None, None,
                                                   f"{len(got)} outputs, expected {len(expected)}"))
    total = Comparison(True)
    for i, (g, e) in enumerate(zip(got, expected)):
        if type(e) is float and (type(g) is float or (type(g) is int and abs(g) < 2 ** 1023)):
            # a Python float the reference computed (``x.sum().item()``) is held to the tensors' rule: an honest
            # kernel that sums in another order differs in the last bits, which exact equality rejected
            c = compare_tensor(torch.tensor(float(g), dtype=torch.float64), torch.tensor(e, dtype=torch.float64),
                               atol, rtol, scale_floor, output=i)
        elif not isinstance(e, torch.Tensor):
            same = (not isinstance(g, torch.Tensor)) and g == e
            if not same:
                return Comparison(False, mismatch=Mismatch(
                    i, None, None, None, f"non-tensor output {repr(g)[:80]}, expected {repr(e)[:80]}"))
            continue
        else:
            c = compare_tensor(g, e, atol, rtol, scale_floor, output=i)
        total.max_abs_diff = max(total.max_abs_diff, c.max_abs_diff)
        total.max_rel_diff = max(total.max_rel_diff, c.max_rel_diff)
        total.ref_scale = max(total.ref_scale, c.ref_scale)
        total.mismatched_elements += c.mismatched_elements
        if not c.ok and total.ok:
            total.ok = False
            total.mismatch = c.mismatch
    return total
