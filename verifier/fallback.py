"""Fallback detection: which PyTorch (``aten::``) ops ``ModelNew.forward`` ran, and whether own kernels ran.

The candidate's forward runs under ``torch.profiler`` in the sandboxed child. Every *outermost* ``aten::``
op (one with no ``aten::`` ancestor in the profiler's CPU call tree) must be on the allowlist; ops nested
inside an allowed op are its implementation (``to`` -> ``_to_copy`` -> ``copy_``, ``rand`` -> ``uniform_``)
and are not judged separately. ATen calls made from C++ (``at::relu``, ``at::addmm``, ``torch::matmul``
in the extension source) are dispatcher ops too, so they appear as outermost ``aten::`` events.

Allowlist = MusaCoder's Appendix J (42 ops, the MooreEval list) plus the allocation/view/metadata aliases
PyTorch 2.11 emits for them. On GPU backends at least one device kernel that is not a framework kernel
(``at::native``, memcpy/memset) must run: a candidate doing no device work of its own is cheating.

Dispatcher ops of torch's other namespaces (``mkldnn::_linear_pointwise``, ``prims::``, ``quantized::``)
compute too: they are forbidden like aten compute ops (the child names the namespaces torch registered
before the candidate loaded; the candidate's own ``TORCH_LIBRARY`` ops are its kernels). On the cpu backend,
where the profiler sees no device kernels, a correct output must come with at least one call into the
candidate's own extension, and per-element readbacks (``item`` in a Python loop) are host computation.

What the profiler saw is reported by the child, so these checks are advisory in the trust sense (native
code can hide from them); they decide the verdict when they fire. ``runtime_violations`` turns the child's
reports into rule violations; it can only make a verdict stricter.
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
# Views that are only other names for Appendix J views: torch 2.11 reports them as the outermost op, with
# nothing but slice/narrow/select/permute/transpose/expand/as_strided nested (checked by tests/verifier_core).
# Honest candidates use them to prepare kernel arguments (qkv.chunk(3, -1), x.T, x.movedim(1, -1)).
TORCH_211_VIEW_ALIASES = frozenset({
    "chunk", "split", "split_with_sizes", "tensor_split", "unbind", "movedim", "moveaxis", "swapaxes", "swapdims",
    "numpy_T", "mT", "broadcast_tensors",
})
ALLOWED_ATEN_OPS = APPENDIX_J_OPS | TORCH_211_ALIASES | TORCH_211_VIEW_ALIASES

_FRAMEWORK_KERNEL = re.compile(
    r"(\bat::|\bat_cuda_detail|\bc10::|\bMemcpy|\bMemset|\bmemcpy|\bmemset|\bcudaMemcpy|\bmusaMemcpy"
    r"|\bcudaMemset|\bmusaMemset|\bCUDA mem|\bmusa mem)", re.IGNORECASE)


_OP_NAME = re.compile(r"^([A-Za-z_]\w*)::([A-Za-z_]\w*)(\.\w+)?$")
# non-op namespaces the profiler may show (record_function markers)
_NON_COMPUTE_NAMESPACES = frozenset({"profiler"})
# scalar readbacks to Python: a per-element loop over item() computes on the host
_READBACK_OPS = ("item", "_local_scalar_dense", "equal", "allclose", "is_nonzero")
_MIN_READBACKS = 64
_READBACK_FRACTION = 0.05
# CPU time of threads other than the harness's one, since the candidate loaded (honest runs: ~±2 ms of clock
# skew between the process and thread clocks)
BACKGROUND_CPU_LIMIT_MS = 10.0


def op_namespace(event_name: str) -> str | None:
    """'mkldnn::_linear_pointwise' -> 'mkldnn'; events that are not dispatcher ops -> None."""
    m = _OP_NAME.match(event_name)
    return m.group(1) if m else None


def outermost_ops(events: Iterable[Any], builtin_namespaces: Iterable[str]) -> tuple[Counter, Counter]:
    """(torch ops, candidate ops) among profiler events. Torch ops (namespaces torch registered, as the
    child recorded before the candidate loaded) count when no torch-op ancestor contains them: aten ops by
    bare name, other namespaces as ``ns::name``. Ops of other namespaces are the candidate's own (counted
    as native calls); an aten op nested inside one is still judged, since the candidate's op is no torch
    implementation."""
    builtin = set(builtin_namespaces) - _NON_COMPUTE_NAMESPACES
    ops: Counter = Counter()
    custom: Counter = Counter()
    for e in events:
        name = getattr(e, "name", "")
        ns = op_namespace(name)
        if ns is None or ns in _NON_COMPUTE_NAMESPACES:
            continue
        if ns not in builtin:
            custom[name] += 1
            continue
        parent = getattr(e, "cpu_parent", None)
        nested = False
        while parent is not None:
            pns = op_namespace(getattr(parent, "name", ""))
            if pns is not None and pns in builtin:
                nested = True
                break
            parent = getattr(parent, "cpu_parent", None)
        if not nested:
            ops[name[6:] if ns == "aten" else name.split(".")[0]] += 1
    return ops, custom


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
    """Outermost op names that are not allowed (sorted, unique): aten ops off the allowlist and every op of
    torch's other namespaces (reported as ``ns::name``)."""
    return sorted({n for n in op_names if n not in ALLOWED_ATEN_OPS or "::" in n})


def host_readbacks(op_counts: dict[str, int], output_elements: int) -> int | None:
    """The number of scalar readbacks of one forward when they amount to computing elementwise on the host
    (at least ``_MIN_READBACKS`` and ``_READBACK_FRACTION`` of the output's elements), else None."""
    n = sum(int(op_counts.get(op, 0)) for op in _READBACK_OPS)
    return n if n >= _MIN_READBACKS and n >= _READBACK_FRACTION * max(int(output_elements), 1) else None


# rule -> what it means, for runtime findings reported by the child (feedback.cheating shows both)
RUNTIME_RULES = {
    "harness_patch": "replaced functions or classes the verifier's harness relies on (profiler, timer, outputs)",
    "global_state": "changed global torch state or installed module-wide hooks",
    "background_work": "ran work on other threads (outside the measured call, or in parallel with it)",
    "host_compute": "computed on the host element by element instead of in a kernel",
    "no_native_kernel": "produced the output without calling its own compiled kernel",
    "reference_tampering": "changed the weights or buffers of the reference timed in its process (a slower "
                           "reference is no faster kernel)",
    # judged by the parent (verifier.evaluate): an ablation trial, and a precision probe of a correctness trial
    "decoy_kernel": "the output stays right when everything your kernels produced is overwritten: it comes from "
                    "elsewhere (allowed data-movement ops, a cache), not from your kernel",
    "precision_downgrade": "computed in lower precision than the reference (the error matches rounding the inputs "
                           "to float16 or coarser)",
    "sample_fixup": "changed an output after its call returned (the entries handed over for comparison differ "
                    "from the output the call produced)",
}


def runtime_violations(report: dict[str, Any], *, host_backend: bool = False, correct: bool = False,
                       output_elements: int = 0) -> list[tuple[str, str]]:
    """(rule, message) for each problem in one child report (a correctness trial or a timed call).

    ``violations`` are the child's own integrity findings; readback counts, thread counts, other threads'
    CPU time and ``native_calls`` are judged here. On a host backend (cpu: the profiler shows no device
    kernels, and a thread could compute while, or after, the call is timed) a correct output (``correct``)
    must have called into the candidate's extension, and no thread of the candidate's may run."""
    found: list[tuple[str, str]] = []
    for v in report.get("violations") or []:
        if isinstance(v, dict) and v.get("rule") in RUNTIME_RULES:
            found.append((v["rule"], str(v.get("message", ""))[:300]))
    ops = report.get("aten_ops") or {}
    readbacks = host_readbacks(ops, output_elements) if isinstance(ops, dict) else None
    if readbacks is not None:
        found.append(("host_compute", f"ModelNew.forward read {readbacks} scalars back to Python (item() in a loop "
                                      "computes on the host); compute the result in your kernel"))
    if host_backend:
        threads, cpu_ms = report.get("threads_started"), report.get("background_cpu_ms")
        if isinstance(threads, int) and threads > 0:
            found.append(("background_work", f"{threads} thread(s) started by the candidate are running"))
        elif isinstance(cpu_ms, (int, float)) and cpu_ms > BACKGROUND_CPU_LIMIT_MS:
            found.append(("background_work", f"other threads used {cpu_ms:.1f} ms of CPU time"))
        calls = report.get("native_calls")
        if correct and isinstance(calls, int) and calls <= 0:
            found.append(("no_native_kernel", "ModelNew.forward returned the right output without calling any "
                                              "function of your compiled extension"))
    return found


def is_framework_kernel(name: str) -> bool:
    return bool(_FRAMEWORK_KERNEL.search(name))


def candidate_kernels(kernel_names: Iterable[str]) -> list[str]:
    """Device kernels that belong to the candidate (not ATen, not copies/fills)."""
    return sorted({k for k in kernel_names if not is_framework_kernel(k)})
