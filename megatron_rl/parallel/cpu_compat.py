"""Narrow patches that let megatron-core 0.19 run on CPU with gloo.

megatron-core assumes CUDA in a handful of places (``torch.cuda.current_device()`` for buffer and
RoPE placement, ``torch.cuda.synchronize()`` in the checkpoint writer, the CUDA RNG tracker fork in
attention, ``device="cuda"`` literals in the pipeline schedules, CUDA streams in DDP). CI and the
CPU tests run the real megatron-core code through these patches, so TP/PP/DP logic, checkpoints
and losses are exercised without a GPU.

`apply()` is a no-op when CUDA is available: on GPU machines megatron-core runs unpatched.
Dropout RNG isolation across TP ranks is lost on CPU; every CPU config uses dropout 0.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_lock = threading.Lock()
_applied = False


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrites ``device="cuda..."`` keyword arguments of torch calls to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and _is_cuda(dev):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class _NullStream:
    """Stands in for torch.cuda.Stream/Event on CPU (everything runs synchronously)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NullStream()

    def record(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *a, **k):
        pass


def is_cpu_mode() -> bool:
    return _applied


def apply() -> bool:
    """Install the patches once per process when CUDA is unavailable. Returns True if active."""
    global _applied
    if torch.cuda.is_available():
        return False
    with _lock:
        if _applied:
            return True
        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.Stream = _NullStream
        torch.cuda.Event = _NullStream
        torch.cuda.current_stream = lambda *a, **k: _NullStream()
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

        from megatron.core.tensor_parallel import random as mpu_random

        mpu_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()

        mode = _CudaToCpuMode()
        mode.__enter__()  # stays on this thread's mode stack for the life of the process
        _applied = True
        return True
