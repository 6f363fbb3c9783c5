"""CUDA -> MUSA source port: a rule table applied to task files and to candidate responses.

The day MUSA hardware is available, the CUDA task set and the CUDA answers collected so far should run on
the ``musa`` backend without hand edits. ``port_source`` rewrites one Python file (a task, or a candidate
whose native sources are string literals in it) with the table below, in order, on word boundaries (a naive
``cu`` -> ``mu`` would turn "Accumulate" into "Acmumulate"), and lists what it could not port safely as
flags for a human or the model to fix: 32-lane warp assumptions (a MUSA warp has 128 lanes on mp_21/mp_22,
S80/S3000/S4000, and 32 on mp_31, S5000), inline PTX, ``__CUDA_ARCH__`` thresholds, tensor-core intrinsics,
nvcc-only flags, cuDNN/CUTLASS.

The names follow torch_musa's porting mappings and its extension API (``musa_sources=`` in
``torch_musa.utils.musa_extension.load_inline``) as documented; this module has only been checked
structurally (tests/verifier_core/test_musa_port.py). Nothing ported by it has been compiled or run on
MUSA hardware.
"""
from __future__ import annotations

import dataclasses
import re

from .static_checks import _LANE_PATTERNS


@dataclasses.dataclass(frozen=True)
class PortRule:
    name: str
    pattern: re.Pattern
    replacement: str


def _rule(name: str, pattern: str, replacement: str) -> PortRule:
    return PortRule(name, re.compile(pattern), replacement)


# Applied in this order: specific spellings before the generic cuda*/cu* identifier rules.
RULES: tuple[PortRule, ...] = (
    # -- headers
    _rule("header_aten_context", r"#\s*include\s*[<\"]ATen/cuda/CUDAContext\.h[>\"]",
          '#include "torch_musa/csrc/aten/musa/MUSAContext.h"'),
    _rule("header_c10_guard", r"#\s*include\s*[<\"]c10/cuda/CUDAGuard\.h[>\"]",
          '#include "torch_musa/csrc/core/MUSAGuard.h"'),
    _rule("header_c10_stream", r"#\s*include\s*[<\"]c10/cuda/CUDAStream\.h[>\"]",
          '#include "torch_musa/csrc/core/MUSAStream.h"'),
    _rule("header_runtime", r"(#\s*include\s*[<\"])cuda_runtime(_api)?\.h([>\"])", r"\1musa_runtime\2.h\3"),
    _rule("header_driver", r"(#\s*include\s*[<\"])cuda\.h([>\"])", r"\1musa.h\2"),
    _rule("header_fp16_bf16", r"(#\s*include\s*[<\"])cuda_(fp16|bf16)\.h([>\"])", r"\1musa_\2.h\3"),
    _rule("header_cublas", r"(#\s*include\s*[<\"])cublas(_v2|Lt)?\.h([>\"])", r"\1mublas\2.h\3"),
    _rule("header_curand", r"(#\s*include\s*[<\"])curand(_kernel)?\.h([>\"])", r"\1murand\2.h\3"),
    # -- torch C++ API
    _rule("torch_stream", r"\bat::cuda::getCurrentCUDAStream\b", "c10::musa::getCurrentMUSAStream"),
    _rule("torch_cuda_names", r"\b(get(?:Current|Default)?|Optional)?CUDA(Stream|Guard|StreamGuard|Event|"
                              r"CachingAllocator)\b", r"\1MUSA\2"),
    _rule("torch_namespaces", r"\b(at|c10)::cuda::", r"\1::musa::"),
    _rule("torch_checks", r"\b(AT|C10)_CUDA_(CHECK|KERNEL_LAUNCH_CHECK|ERROR_HANDLED)\b", r"\1_MUSA_\2"),
    _rule("torch_is_cuda", r"\.is_cuda\(\)", ".is_privateuseone()"),
    _rule("torch_device_type", r"\b(?:torch::|at::|c10::)k?CUDA\b|\bDeviceType::CUDA\b",
          "c10::DeviceType::PrivateUse1"),
    # -- compiler macros
    _rule("macro_arch_800", r"__CUDA_ARCH__\s*>=\s*800\b", "__MUSA_ARCH__ >= 220"),
    _rule("macro_arch_900", r"__CUDA_ARCH__\s*>=\s*900\b", "__MUSA_ARCH__ >= 310"),
    _rule("macro_arch", r"\b__CUDA_ARCH__\b", "__MUSA_ARCH__"),
    _rule("macro_compiler", r"\b__(NVCC|CUDACC)__\b", "__MUSACC__"),
    # -- runtime, driver and library APIs (identifiers: cudaMalloc, cudaStream_t, CUresult, cublasSgemm ...)
    _rule("runtime_api", r"\bcuda([A-Z]\w*)", r"musa\1"),
    _rule("runtime_macros", r"\bCUDA_(R_\w+|SUCCESS|VERSION|ERROR_\w+)\b", r"MUSA_\1"),
    _rule("blas_api", r"\bcublas(\w*)", r"mublas\1"),
    _rule("blas_macros", r"\bCUBLAS_(\w+)", r"MUBLAS_\1"),
    _rule("rand_api", r"\bcurand(\w*)", r"murand\1"),
    _rule("driver_api", r"\bcu([A-Z][a-z]\w*)\(", r"mu\1("),
    _rule("driver_types", r"\bCU(result|stream|event|function|module|context|deviceptr|device)\b", r"MU\1"),
    # -- Python: the extension API and its arguments
    _rule("py_load_inline_import", r"\bfrom\s+torch\.utils\.cpp_extension\s+import\s+load_inline\b",
          "from torch_musa.utils.musa_extension import load_inline"),
    _rule("py_load_inline_call", r"\btorch\.utils\.cpp_extension\.load_inline\b",
          "torch_musa.utils.musa_extension.load_inline"),
    # keyword and any variable of the same name alike, so `cuda_sources=cuda_sources` stays consistent
    _rule("py_load_inline_args", r"\b(extra_)?cuda_(sources|cflags)\b", r"\1musa_\2"),
    _rule("py_with_cuda", r"\bwith_cuda\b", "with_musa"),
    _rule("py_arch_env", r"\bTORCH_CUDA_ARCH_LIST\b", "TORCH_MUSA_ARCH_LIST"),
    # -- Python: device calls and names
    _rule("py_torch_cuda", r"\btorch\.cuda\b", "torch.musa"),
    _rule("py_tensor_cuda", r"\.cuda\(", ".musa("),
    _rule("py_device_string", r"([\"'])cuda(:\d+)?\1", r"\1musa\2\1"),
    _rule("py_is_cuda", r"\.is_cuda\b", ".is_musa"),
)

# nvcc-only flags: mcc has no such options (the arch comes from TORCH_MUSA_ARCH_LIST)
_NVCC_FLAG = re.compile(r"[\"'](-arch=sm_\d+\w*|-gencode[= ]\S+|--gpu-architecture\S*|-Xptxas\S*|--ptxas-options\S*"
                        r"|--expt-relaxed-constexpr|--expt-extended-lambda|-lineinfo|--use_fast_math)[\"']")

_FLAGS: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"\b(asm|__asm__)\s*(volatile\s*)?\("), "inline PTX (asm) does not run on MUSA: rewrite it in C++"),
    (re.compile(r"__MUSA_ARCH__\s*[<>=!]=?\s*\d+"),
     "an architecture threshold (__CUDA_ARCH__ ported to __MUSA_ARCH__): check it against mp_21/mp_22/mp_31"),
    (re.compile(r"\bnvcuda::wmma\b|\bwmma::|\bmma\.sync\b|\bldmatrix\b|\bcp\.async\b|\bwgmma\b"),
     "tensor-core intrinsics (wmma/mma/ldmatrix/cp.async) have no 1:1 MUSA equivalent"),
    (re.compile(r"\bcudnn\w*|\bcutlass::|\bcute::"), "cuDNN/CUTLASS/CuTe calls are not ported (muDNN differs)"),
    (re.compile(r"\bcooperative_groups\b|\bcg::"), "cooperative groups: check their support in the MUSA toolkit"),
    (re.compile(r"\bimport\s+triton\b|\bfrom\s+triton\b"), "Triton kernels need Moore Threads' Triton build on MUSA"),
)


@dataclasses.dataclass
class PortResult:
    code: str
    changes: dict[str, int]      # rule name -> replacements made
    flags: list[str]             # what needs a human (or the model) before it can run on MUSA

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def port_source(code: str) -> PortResult:
    """Port one Python source (task or candidate) from CUDA to MUSA; see the module docstring."""
    changes: dict[str, int] = {}
    for rule in RULES:
        code, n = rule.pattern.subn(rule.replacement, code)
        if n:
            changes[rule.name] = n
    if "torch_musa" in code or changes.keys() & {"py_torch_cuda", "py_tensor_cuda", "py_device_string"}:
        code, n = _import_torch_musa(code)
        if n:
            changes["py_import_torch_musa"] = n
    flags = [msg for pattern, msg in _FLAGS if pattern.search(code)]
    if _NVCC_FLAG.search(code):
        flags.append("nvcc-only compiler flags (" + ", ".join(sorted({m.group(1) for m in _NVCC_FLAG.finditer(code)}))
                     + "): mcc does not take them")
    lanes = [what for pattern, what in _LANE_PATTERNS if pattern.search(code)]
    if lanes:
        flags.append("32-lane warp assumptions (" + ", ".join(lanes) + "): a MUSA warp has 128 lanes on mp_21/mp_22 "
                     "(S80/S3000/S4000) and 32 on mp_31 (S5000); use warpSize")
    return PortResult(code, changes, flags)


_IMPORT_TORCH = re.compile(r"^import torch\s*$", re.MULTILINE)


def _import_torch_musa(code: str) -> tuple[str, int]:
    """``import torch_musa`` right after the first ``import torch`` (it registers the musa device)."""
    if re.search(r"^\s*import torch_musa\b", code, re.MULTILINE):
        return code, 0
    m = _IMPORT_TORCH.search(code)
    if not m:
        return "import torch_musa  # registers the musa device\n" + code, 1
    return code[:m.end()] + "\nimport torch_musa  # registers the musa device" + code[m.end():], 1
