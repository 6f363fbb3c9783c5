"""Speed-of-light floor: the fastest time a device allows for one call of a task.

One call must at least move its inputs in and its outputs out of device memory, and do the reference's
matrix arithmetic: ``floor = max(bytes / memory bandwidth, FLOPs / peak FLOP rate)``. Bytes are the task's
input and output tensors (what the reference reads and writes at the verified precision); FLOPs are what
``torch.utils.flop_counter`` counts for the reference's forward in the parent (matmuls, convolutions,
attention; elementwise work is not counted, so the compute bound is a lower bound too). A measured time
far below the floor was not measured honestly (work hidden from the timer, a forged report, a cache that
survived the flush): ``cheating`` with the bound in the feedback.

The peaks are the vendors' published figures, chosen so the floor is never too high: the dense tensor-core
rate of the fastest format that can still meet the task's precision (TF32 for float32 tasks, which bounds
every float32-exact method such as 3xTF32), and for the MTT S5000, whose FP32/BF16 peaks are unpublished,
its FP8 headline for every precision. ``VerifierConfig.sol_margin`` (0.5 by default) keeps a further factor
of slack for tasks whose reference reads only part of an input. None of the MUSA figures has been checked
on MUSA hardware here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    kind: str
    name_patterns: tuple[str, ...]      # lowercase substrings of the device name that select this spec
    memory_bytes_per_s: float
    flops_per_s: dict[str, float]       # by the task's precision (float32 / float16 / bfloat16)
    source: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_T = 1e12
DEVICE_SPECS: tuple[DeviceSpec, ...] = (
    DeviceSpec("h200", ("h200",), 4.8 * _T, {"float32": 494.7 * _T, "float16": 989.4 * _T, "bfloat16": 989.4 * _T},
               "NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e; TF32 tensor 989 and FP16/BF16 1979 TFLOPS with "
               "sparsity, halved for dense"),
    DeviceSpec("s4000", ("s4000",), 0.768 * _T, {"float32": 50 * _T, "float16": 100 * _T, "bfloat16": 100 * _T},
               "Moore Threads MTT S4000 launch figures (2023-12): 48 GB GDDR6 at 768 GB/s; FP32 25, TF32 50, "
               "FP16/BF16 100 TFLOPS"),
    DeviceSpec("s5000", ("s5000",), 1.6 * _T, {"float32": 1000 * _T, "float16": 1000 * _T, "bfloat16": 1000 * _T},
               "Moore Threads MTT S5000 disclosure (2026-02): 80 GB at 1.6 TB/s, 1 PFLOPS FP8; FP32/BF16 peaks "
               "unpublished, so the FP8 figure bounds every precision"),
)


def device_spec(device_name: str | None, override: dict[str, Any] | None = None) -> DeviceSpec | None:
    """The spec of a device by its name (``torch.cuda.get_device_name``), or ``override``
    (``VerifierConfig.sol_device_spec``: ``memory_bytes_per_s`` and ``flops_per_s``, a number or a mapping
    by precision) for any device; None for a device without published figures (no floor there)."""
    if override:
        flops = override.get("flops_per_s")
        bw = override.get("memory_bytes_per_s")
        if not isinstance(bw, (int, float)) or bw <= 0:
            raise ValueError(f"sol_device_spec.memory_bytes_per_s must be a positive number, got {bw!r}")
        if isinstance(flops, (int, float)):
            flops = {p: float(flops) for p in ("float32", "float16", "bfloat16")}
        if not isinstance(flops, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in flops.values()):
            raise ValueError(f"sol_device_spec.flops_per_s must be a positive number or a mapping of them, got "
                             f"{flops!r}")
        return DeviceSpec(str(override.get("kind", "configured")), (), float(bw), dict(flops),
                          str(override.get("source", "VerifierConfig.sol_device_spec")))
    name = (device_name or "").lower()
    for spec in DEVICE_SPECS:
        if any(p in name for p in spec.name_patterns):
            return spec
    return None


@dataclasses.dataclass(frozen=True)
class Floor:
    spec: DeviceSpec
    nbytes: int
    flops: int
    precision: str

    @property
    def memory_ms(self) -> float:
        return self.nbytes / self.spec.memory_bytes_per_s * 1e3

    @property
    def compute_ms(self) -> float:
        peak = self.spec.flops_per_s.get(self.precision) or max(self.spec.flops_per_s.values())
        return self.flops / peak * 1e3

    @property
    def floor_ms(self) -> float:
        return max(self.memory_ms, self.compute_ms)

    def describe(self) -> str:
        bound = "memory" if self.memory_ms >= self.compute_ms else "compute"
        return (f"{self.spec.kind} cannot run one call in less than {self.floor_ms:.4g} ms ({bound}-bound: "
                f"{self.nbytes / 1e6:.4g} MB at {self.spec.memory_bytes_per_s / 1e12:.3g} TB/s, "
                f"{self.flops / 1e9:.4g} GFLOP at "
                f"{(self.spec.flops_per_s.get(self.precision) or max(self.spec.flops_per_s.values())) / 1e12:.4g} "
                "TFLOP/s)")

    def to_dict(self) -> dict[str, Any]:
        return {"device_kind": self.spec.kind, "bytes": self.nbytes, "flops": self.flops,
                "memory_ms": self.memory_ms, "compute_ms": self.compute_ms, "floor_ms": self.floor_ms,
                "source": self.spec.source}


def tensor_bytes(values) -> int:
    """Bytes a kernel must read or write for these tensors: each tensor's elements, once per storage (an
    expanded view is read from its smaller storage)."""
    import torch
    seen: dict[tuple[int, int], int] = {}
    for v in values:
        if isinstance(v, torch.Tensor) and v.numel():
            storage = v.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            seen[key] = max(seen.get(key, 0), min(v.numel() * v.element_size(), storage.nbytes()))
    return sum(seen.values())


def count_work(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """``fn()``'s result, the FLOPs ``torch.utils.flop_counter`` counts for it, and the ATen ops it dispatches
    (views excluded; factories and copies count): for an eager reference, about the kernels it launches one after
    another. 0 ops where the op count cannot run (a higher-order operator such as ``torch.cond``)."""
    try:
        return _count_work(fn)
    except NotImplementedError:   # the op counter has no rule for a higher-order operator: FLOPs only
        from torch.utils.flop_counter import FlopCounterMode
        with FlopCounterMode(display=False) as counter:
            out = fn()
        return out, int(counter.get_total_flops()), 0


def _count_work(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += not func.is_view
            return func(*args, **(kwargs or {}))

    with FlopCounterMode(display=False) as counter, OpCounter() as ops:
        out = fn()
    return out, int(counter.get_total_flops()), ops.count
