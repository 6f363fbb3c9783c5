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
        if func is torch.Tensor.cuda:
            # ``tensor.cuda()`` -> the tensor itself (M1, bridge/checkpoints): e.g. GPTModel with
            # tied embeddings and PP>1 moves the last stage's embedding copy with ``.data.cuda()``
            # before all-reducing it over the embedding group.
            return args[0]
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


_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cuda_tensor_type_names():
    """Makes ``tensor.type()`` (no arguments) report CPU float tensors under their CUDA names.

    megatron-core's optimizers sort params by comparing ``param.type()`` with
    ``'torch.cuda.FloatTensor'`` etc. (DistributedOptimizer / Float16Optimizer param-group
    building, the fp32 check in ``clip_grad_by_total_norm_fp32``). Only active inside the wrapped
    megatron calls, so no other code ever sees the renamed types.
    """
    original = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_tensor_type_names(fn):
    def wrapper(*args, **kwargs):
        with _cuda_tensor_type_names():
            return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn
    return wrapper


def _patch_optimizer_type_checks() -> None:
    """DDP + distributed optimizer on CPU: see `_cuda_tensor_type_names` (M2, actor)."""
    from megatron.core.optimizer import distrib_optimizer, optimizer

    distrib_optimizer.DistributedOptimizer.__init__ = _with_cuda_tensor_type_names(
        distrib_optimizer.DistributedOptimizer.__init__)
    optimizer.Float16OptimizerWithFloat16Params.__init__ = _with_cuda_tensor_type_names(
        optimizer.Float16OptimizerWithFloat16Params.__init__)
    # optimizer.py calls the name it imported from clip_grads.
    optimizer.clip_grad_by_total_norm_fp32 = _with_cuda_tensor_type_names(
        optimizer.clip_grad_by_total_norm_fp32)



def _patch_recompute_rng() -> None:
    """Activation recomputation on CPU (M2, actor): megatron's checkpoint functions save and
    restore the CUDA RNG state around the recomputed forward; with no CUDA generator there is
    nothing to save (dropout is 0 in every CPU config), so the CUDA half becomes a no-op."""
    from megatron.core.tensor_parallel import random as mpu_random

    mpu_random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mpu_random._set_cuda_rng_state = lambda *a, **k: None


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
        _patch_optimizer_type_checks()
        _patch_recompute_rng()

        mode = _CudaToCpuMode()
        mode.__enter__()  # stays on this thread's mode stack for the life of the process
        _applied = True
        return True
