"""Fallback detection: which PyTorch (``aten::``) ops ``ModelNew.forward`` ran, and whether own kernels ran.

The candidate's forward runs under ``torch.profiler`` in the sandboxed child. Every *outermost* ``aten::``
op (one with no ``aten::`` ancestor in the profiler's CPU call tree) must be on the allowlist; ops nested
inside an allowed op are its implementation (``to`` -> ``_to_copy`` -> ``copy_``, ``rand`` -> ``uniform_``)
and are not judged separately. ATen calls made from C++ (``at::relu``, ``at::addmm``, ``torch::matmul``
in the extension source) are dispatcher ops too, so they appear as outermost ``aten::`` events.

Allowlist = MusaCoder's Appendix J (42 ops, the MooreEval list) plus the allocation/view/metadata aliases
PyTorch 2.11 emits for them. On GPU backends at least one device kernel that is not a framework kernel
(``at::native``, memcpy/memset) must run: a candidate doing no device work of its own is cheating.

What the profiler saw is reported by the child, so these checks are advisory in the trust sense (native
code can hide from them); they decide the verdict when they fire.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Any, Iterable

# MusaCoder Appendix J (MooreEval), as copied by the KernelGYM reproduction.
APPENDIX_J_OPS = frozenset({
    "_assert_async", "_assert_scalar", "_assert_tensor_metadata",
    "_cast_Byte", "_cast_Char", "_cast_Double", "_cast_Float", "_cast_Half", "_cast_Int", "_cast_Long", "_cast_Short",
    "_local_scalar_dense", "alias", "allclose", "arange", "as_strided", "broadcast_to", "clone", "contiguous",
    "copy_", "empty", "empty_like", "equal", "expand", "flatten", "full", "item", "ones", "permute", "rand",
    "randint", "randn", "reshape", "select", "slice", "squeeze", "stride", "transpose", "unsqueeze", "view", "zeros",
})
# What torch 2.11 emits at top level for legal uses of the ops above (checked by tests/verifier_core).
TORCH_211_ALIASES = frozenset({
    # allocation
    "empty_strided", "new_empty", "new_empty_strided", "zeros_like", "ones_like", "full_like", "new_zeros",
    "new_ones", "new_full", "fill_", "zero_",
    # conversion / detaching (tensor.to(...), torch.tensor(...), .detach())
    "to", "_to_copy", "detach", "detach_", "lift_fresh", "lift_fresh_copy", "resolve_conj", "resolve_neg",
    # views
    "_reshape_alias", "_unsafe_view", "view_as", "reshape_as", "expand_as", "t", "narrow", "unflatten",
    # metadata
    "size", "sym_size", "sym_stride", "sym_numel", "numel", "dim", "is_contiguous",
})
ALLOWED_ATEN_OPS = APPENDIX_J_OPS | TORCH_211_ALIASES

_FRAMEWORK_KERNEL = re.compile(
    r"(\bat::|\bat_cuda_detail|\bc10::|\bMemcpy|\bMemset|\bmemcpy|\bmemset|\bcudaMemcpy|\bmusaMemcpy"
    r"|\bcudaMemset|\bmusaMemset|\bCUDA mem|\bmusa mem)", re.IGNORECASE)


def aten_name(event_name: str) -> str | None:
    """'aten::relu' -> 'relu'; other profiler events -> None."""
    return event_name[6:] if event_name.startswith("aten::") else None


def outermost_aten_ops(events: Iterable[Any]) -> Counter:
    """Count outermost aten ops among profiler ``FunctionEvent``s (uses ``cpu_parent`` links)."""
    counts: Counter = Counter()
    for e in events:
        name = aten_name(getattr(e, "name", ""))
        if name is None:
            continue
        parent = getattr(e, "cpu_parent", None)
        nested = False
        while parent is not None:
            if aten_name(getattr(parent, "name", "")) is not None:
                nested = True
                break
            parent = getattr(parent, "cpu_parent", None)
        if not nested:
            counts[name] += 1
    return counts


def device_kernel_names(events: Iterable[Any], device_types: set) -> Counter:
    counts: Counter = Counter()
    if not device_types:
        return counts
    for e in events:
        if getattr(e, "device_type", None) in device_types:
            counts[e.name] += 1
    return counts


def forbidden_ops(op_names: Iterable[str]) -> list[str]:
    """Outermost aten op names that are not allowed (sorted, unique)."""
    return sorted({n for n in op_names if n not in ALLOWED_ATEN_OPS})


def is_framework_kernel(name: str) -> bool:
    return bool(_FRAMEWORK_KERNEL.search(name))


def candidate_kernels(kernel_names: Iterable[str]) -> list[str]:
    """Device kernels that belong to the candidate (not ATen, not copies/fills)."""
    return sorted({k for k in kernel_names if not is_framework_kernel(k)})
