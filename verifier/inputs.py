"""Create a task's inputs directly on the target device, reproducibly from a seed.

KernelBench inputs can be several GB; creating them on the host and copying is slow. ``get_inputs()`` is
run under a ``TorchFunctionMode`` that sends tensor factories (``rand``, ``randn``, ``zeros``, ``arange``,
``tensor``, ...) to the target device and gives every random op a generator seeded from the trial seed,
so the parent (reference) and the sandboxed child (candidate) produce bitwise-identical inputs for the
same seed on the same device type. Floating inputs are then cast to the configured precision
(KernelBench semantics). The global RNGs (torch, numpy, random) are seeded too, for tasks that draw
through other paths.
"""
from __future__ import annotations

import random
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# factories whose `device=` we set
_FACTORIES = {
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.zeros, torch.ones, torch.empty, torch.full,
    torch.arange, torch.range, torch.linspace, torch.logspace, torch.eye, torch.tensor, torch.as_tensor,
    torch.empty_strided, torch.scalar_tensor, torch.tril_indices, torch.triu_indices, torch.hann_window,
    torch.hamming_window, torch.blackman_window, torch.bartlett_window, torch.kaiser_window,
}
# random ops that take `generator=`
_RANDOM = {
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal, torch.bernoulli, torch.multinomial,
    torch.poisson, torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_, torch.Tensor.exponential_,
    torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.bernoulli_,
    torch.Tensor.bernoulli,
}
# *_like random ops have no generator argument: rewritten to the sized op with the input's properties
_LIKE = {torch.rand_like: torch.rand, torch.randn_like: torch.randn}


def precision_dtype(precision: str) -> torch.dtype:
    try:
        return _DTYPES[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; one of {sorted(_DTYPES)}") from None


class DeviceFactoryMode(TorchFunctionMode):
    """Redirect tensor factories to ``device`` and random ops to ``generator``."""

    def __init__(self, device: torch.device, generator: torch.Generator):
        super().__init__()
        self.device = device
        self.generator = generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _LIKE:
            ref = args[0]
            kwargs.setdefault("dtype", ref.dtype)
            kwargs["device"] = ref.device
            kwargs["generator"] = self.generator
            return _LIKE[func](ref.shape, **kwargs)
        if func is torch.randint_like:
            ref, rest = args[0], args[1:]
            kwargs.setdefault("dtype", ref.dtype)
            kwargs["device"] = ref.device
            kwargs["generator"] = self.generator
            return torch.randint(*rest, ref.shape, **kwargs)
        if func in _FACTORIES:
            kwargs["device"] = self.device
        if func in _RANDOM and kwargs.get("generator") is None:
            kwargs["generator"] = self.generator
        if func is torch.normal and not any(isinstance(a, torch.Tensor) for a in args):
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % (2 ** 32))
    except ImportError:  # pragma: no cover
        pass


def _to_device(obj: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device != device:
            t = t.to(device)
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        return t
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device, dtype) for o in obj)
    return obj


def generate(fn: Callable[[], Any], seed: int, device: torch.device | str, precision: str | None) -> Any:
    """Call ``fn`` (get_inputs / get_init_inputs) with factories on ``device`` and RNG seeded by ``seed``."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, 0)
    seed = int(seed) % (2 ** 63)
    _seed_all(seed)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    with DeviceFactoryMode(device, generator):
        out = fn()
    return _to_device(out, device, precision_dtype(precision) if precision else None)


def make_inputs(task_module, seed: int, device: torch.device | str, precision: str) -> list:
    """The forward inputs of one trial: ``get_inputs()`` on ``device``, floating tensors in ``precision``."""
    inputs = generate(task_module.get_inputs, seed, device, precision)
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"get_inputs() must return a list or tuple, got {type(inputs).__name__}")
    return list(inputs)


def make_init_inputs(task_module, seed: int, device: torch.device | str) -> list:
    """Constructor arguments (``get_init_inputs()``) under the construction seed; tensors moved, not cast."""
    init = generate(task_module.get_init_inputs, seed, device, None)
    if not isinstance(init, (list, tuple)):
        raise TypeError(f"get_init_inputs() must return a list or tuple, got {type(init).__name__}")
    return list(init)


def build_model(cls, init_inputs: list, seed: int, device: torch.device, precision: str) -> torch.nn.Module:
    """Construct under ``seed`` on the host (KernelBench convention), then move and cast to the precision."""
    torch.manual_seed(int(seed) % (2 ** 63))
    with torch.no_grad():
        model = cls(*init_inputs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{getattr(cls, '__name__', cls)} did not construct an nn.Module")
    return model.to(device=device, dtype=precision_dtype(precision))


def load_matching_state(target: torch.nn.Module, source: torch.nn.Module) -> dict[str, list[str]]:
    """Copy ``source``'s parameters/buffers into ``target`` where names and shapes match.

    A candidate that creates its parameters in a different order than the reference gets the reference
    weights anyway (KernelBench relies on identical RNG order only)."""
    src = source.state_dict()
    dst = target.state_dict()
    matched = {k: v for k, v in src.items() if k in dst and dst[k].shape == v.shape}
    with torch.no_grad():
        target.load_state_dict(matched, strict=False)
    return {"loaded": sorted(matched), "unmatched": sorted(set(dst) - set(matched))}
