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


def flatten_outputs(out: Any) -> tuple[list[Any], Any]:
    """Flatten nested tuples/lists/dicts into a list of leaves plus a JSON-able structure spec."""
    if isinstance(out, (list, tuple)):
        leaves, spec = [], []
        for o in out:
            sub_leaves, sub_spec = flatten_outputs(o)
            leaves += sub_leaves
            spec.append(sub_spec)
        return leaves, {"seq": type(out).__name__, "items": spec}
    if isinstance(out, dict):
        leaves, spec = [], {}
        for k in sorted(out, key=str):
            sub_leaves, sub_spec = flatten_outputs(out[k])
            leaves += sub_leaves
            spec[str(k)] = sub_spec
        return leaves, {"dict": spec}
    return [out], "leaf"


def same_structure(a: Any, b: Any) -> bool:
    """Structure specs equal, treating list and tuple alike (a kernel may return either)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a == b == "leaf"
    ai, bi = a.get("items"), b.get("items")
    if "seq" in a and "seq" in b and isinstance(ai, list) and isinstance(bi, list):
        return len(ai) == len(bi) and all(same_structure(x, y) for x, y in zip(ai, bi))
    ad, bd = a.get("dict"), b.get("dict")
    if isinstance(ad, dict) and isinstance(bd, dict):
        return ad.keys() == bd.keys() and all(same_structure(ad[k], bd[k]) for k in ad)
    return False


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


def compare_outputs(got: Sequence[Any], expected: Sequence[Any], atol: float, rtol: float,
                    scale_floor: float = 1e-30) -> Comparison:
    """Compare flattened output lists; the first failing output decides, diffs are maxima over all."""
    if len(got) != len(expected):
        return Comparison(False, mismatch=Mismatch(0, None, None, None,
                                                   f"{len(got)} outputs, expected {len(expected)}"))
    total = Comparison(True)
    for i, (g, e) in enumerate(zip(got, expected)):
        if not isinstance(e, torch.Tensor):
            same = (not isinstance(g, torch.Tensor)) and g == e
            if not same:
                return Comparison(False, mismatch=Mismatch(i, None, None, None,
                                                           f"non-tensor output {g!r}, expected {e!r}"))
            continue
        c = compare_tensor(g, e, atol, rtol, scale_floor, output=i)
        total.max_abs_diff = max(total.max_abs_diff, c.max_abs_diff)
        total.max_rel_diff = max(total.max_rel_diff, c.max_rel_diff)
        total.ref_scale = max(total.ref_scale, c.ref_scale)
        total.mismatched_elements += c.mismatched_elements
        if not c.ok and total.ok:
            total.ok = False
            total.mismatch = c.mismatch
    return total
