"""Create a task's inputs directly on the target device, reproducibly from a seed.

KernelBench inputs can be several GB; creating them on the host and copying is slow. ``get_inputs()`` is
run under a ``TorchFunctionMode`` that sends tensor factories (``rand``, ``randn``, ``zeros``, ``arange``,
``tensor``, ...) to the target device and gives every random op a generator seeded from the trial seed,
so the parent (reference) and the sandboxed child (candidate) produce bitwise-identical inputs for the
same seed on the same device type. Floating inputs are then cast to the configured precision
(KernelBench semantics). The global RNGs (torch, numpy, random) are seeded too, for tasks that draw
through other paths. Task code that moves tensors to another accelerator (``.cuda()``, ``device="cuda"``)
gets the target device instead: the verifier, not the task, picks the device.

``estimate_footprint`` sizes a task's inputs, outputs and parameters on meta tensors, so that a task too
large for the backend (KernelBench's GPU shapes on a CPU host) gets a clear verdict before anything is
allocated (``memory_problem``).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import random
import secrets
import threading
import weakref
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

try:   # bound here, before any candidate code runs, so a timed call's reseed neither imports nor looks it up
    import numpy as np
except ImportError:  # pragma: no cover - torch installs numpy
    np = None

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


def _other_accelerator(device: Any, target: torch.device) -> bool:
    """Whether ``device`` (a str or torch.device) names an accelerator other than ``target`` (another type,
    or the current/another index of its type: a worker pinned to one GPU must not use the current one)."""
    if not isinstance(device, (str, torch.device)):
        return False
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return False
    return dev.type not in ("cpu", "meta") and dev != target


def _retarget_move(func, args: tuple, kwargs: dict, target: torch.device) -> tuple[tuple, dict] | None:
    """Arguments of ``Tensor.to`` for a ``x.cuda()`` / ``x.to("cuda")`` that task code makes for another
    accelerator, sent to ``target`` instead (KernelBench-style task sets create inputs with ``.cuda()`` or
    ``device="cuda"``; the verifier, not the task, chooses the device). None when ``func`` is not such a move."""
    if func is torch.Tensor.cuda:
        return (args[0], target), {k: v for k, v in kwargs.items() if k == "non_blocking"}
    if func is torch.Tensor.to:
        if _other_accelerator(kwargs.get("device"), target):
            return args, dict(kwargs, device=target)
        if len(args) > 1 and _other_accelerator(args[1], target):
            return (args[0], target, *args[2:]), kwargs
    return None


class DeviceFactoryMode(TorchFunctionMode):
    """Redirect tensor factories (and task-made moves to another accelerator) to ``device``, and random
    ops to ``generator``."""

    def __init__(self, device: torch.device, generator: torch.Generator | None):
        super().__init__()
        self.device = device
        self.generator = generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        moved = _retarget_move(func, args, kwargs, self.device)
        if moved is not None:
            return torch.Tensor.to(*moved[0], **moved[1])
        if self.generator is None:   # shapes only (estimate_footprint, on meta): nothing to draw from
            kwargs.pop("generator", None)
            if func in _LIKE or func is torch.randint_like:
                return func(*args, **kwargs)
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
        if func in _RANDOM and kwargs.get("generator") is None and self.generator is not None:
            kwargs["generator"] = self.generator
        if func is torch.normal and not any(isinstance(a, torch.Tensor) for a in args):
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def _seed_all(seed: int) -> None:
    """Seed torch (the CPU and the accelerator), ``random`` and numpy. Once CUDA is up its generators are seeded
    directly: ``torch.manual_seed`` also walks every other backend in Python (50-150 us), which a timed batch pays
    before each call (`reseed_unpredictably`), and a device left waiting for the host charges that wait to the call
    (a 4 us kernel was timed at 32-51 us on an H200, bench/results/verifier_dispatch_timing_h200.md)."""
    if torch.cuda.is_initialized():
        torch.default_generator.manual_seed(seed)
        for generator in torch.cuda.default_generators:
            generator.manual_seed(seed)
    else:   # (before CUDA starts torch.manual_seed queues its seeding; other accelerators, e.g. MUSA, go this way)
        torch.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % (2 ** 32))


def reseed_unpredictably() -> None:
    """Seed the global RNGs from fresh entropy. ``generate`` leaves them seeded by the input set's seed, so right
    after a correctness trial's inputs ``torch.randn(x.shape)`` replays ``x`` and ``torch.initial_seed()`` names the
    set, while a timed batch draws all its sets first: a candidate could tell whether it is being checked. The
    child calls this right before every call of a model, so the RNG state carries nothing of the inputs or the
    phase (a forward that draws random numbers gets different ones than the parent's reference run)."""
    _seed_all(secrets.randbits(63))


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


def reference_error_on_meta(task_module, precision: str = "float32",
                            construct_only: bool = False) -> tuple[str, Exception] | None:
    """Where and what the task's reference raises when run again on meta tensors (nothing allocated, no device, no
    generator): ``(stage, exception)`` with stage ``get_inputs``, ``get_init_inputs``, ``Model`` or ``forward``, or None
    when all of it runs. The verifier's parent runs this where its own run of the reference failed: the same exception
    at the same stage again, in a process no candidate code ever ran in and with no memory at stake, shows the failure
    is the task's. (A task that cannot run on meta tensors at all, a data-dependent one, fails here at some stage for
    that reason; the caller compares the exception's type and stage.) ``construct_only``: ``get_init_inputs`` and
    ``Model`` alone (a forward on meta tensors takes seconds for a long RNN: not for a question about construction)."""
    meta = torch.device("meta")
    stage = "get_inputs"
    try:
        if not construct_only:
            with DeviceFactoryMode(meta, None):
                args = _to_device(task_module.get_inputs(), meta, precision_dtype(precision))
        stage = "get_init_inputs"
        with DeviceFactoryMode(meta, None):
            init = task_module.get_init_inputs()
        if not isinstance(init, (list, tuple)):
            raise TypeError(f"get_init_inputs() must return a list or tuple, got {type(init).__name__}")
        stage = "Model"
        with meta, torch.no_grad():
            model = task_module.Model(*init)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{getattr(task_module.Model, '__name__', 'Model')} did not construct an nn.Module")
        if construct_only:
            return None
        model = model.to(dtype=precision_dtype(precision))
        stage = "forward"
        with DeviceFactoryMode(meta, None), torch.no_grad():
            model(*args)
    except Exception as e:   # noqa: BLE001 - the task's own code
        return stage, e
    return None


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


# ------------------------------------------------------------------------------------ memory footprint
GiB = 1 << 30
CHILD_BASE_BYTES = 4 * GiB   # address space of a run child before any task data (interpreter, torch, profiler)


@dataclasses.dataclass
class Footprint:
    """Bytes of one call of a task at the verified precision, from shapes alone (nothing allocated)."""

    input_bytes: int
    output_bytes: int | None      # None: the forward does not run on shape-only (meta) tensors
    param_bytes: int | None       # parameters and buffers of one Model; None: it does not build on meta
    # the most the reference's forward holds at once beyond its inputs and parameters (its intermediates and
    # outputs: HingeLoss's ``mean(clamp(1 - p * t))`` holds two input-sized temporaries); None: not measured
    work_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(o) for o in obj.values())
    return 0


class _PeakBytes(TorchDispatchMode):
    """The peak bytes of the tensors that ops under this mode create and keep alive (views and in-place results
    share an input's storage and count nothing). On meta tensors nothing is allocated; a tensor counts until its
    last Python reference is gone."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not any(torch._C._is_alias_of(t, a) for a in ins):
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, nbytes)
        return out


def estimate_footprint(task_module, precision: str) -> Footprint | None:
    """Sizes of a task's inputs, outputs and parameters, by running ``get_inputs``, ``Model(...)`` and its
    forward on meta tensors: KernelBench's GPU-sized problems (several GB per input) are measured in
    milliseconds, before any process allocates them. None when ``get_inputs`` itself cannot run on meta
    tensors (data-dependent code); the unknown parts of a partial answer are None."""
    meta = torch.device("meta")
    dtype = precision_dtype(precision)
    try:
        with DeviceFactoryMode(meta, None):
            args = _to_device(task_module.get_inputs(), meta, dtype)
    except Exception:
        return None
    fp = Footprint(_tensor_bytes(args), None, None)
    try:
        with DeviceFactoryMode(meta, None):
            init = task_module.get_init_inputs()
        with meta, torch.no_grad():
            model = task_module.Model(*init).to(dtype=dtype)
        fp.param_bytes = sum(_tensor_bytes(t) for t in (*model.parameters(), *model.buffers()))
        peak: _PeakBytes | None = _PeakBytes()
        try:
            with DeviceFactoryMode(meta, None), torch.no_grad(), peak:
                out = model(*args)
        except Exception:   # an op the dispatch mode cannot follow: the sizes without the working memory
            peak = None
            with DeviceFactoryMode(meta, None), torch.no_grad():
                out = model(*args)
        fp.output_bytes = _tensor_bytes(out)
        fp.work_bytes = max(peak.peak, fp.output_bytes) if peak is not None else None
    except Exception:
        pass
    return fp


# estimate_footprint per (sha256 of the executed source, path, precision), in the process that computes it
FOOTPRINT_CACHE_SIZE = 1024
_footprints: collections.OrderedDict[tuple[str, str, str], Footprint | None] = collections.OrderedDict()
_footprints_lock = threading.Lock()
footprint_cache_stats = {"hits": 0, "misses": 0}


def task_footprint(task, precision: str, module=None) -> Footprint | None:
    """``estimate_footprint`` of a ``verifier.tasks.Task``, cached in this process (an LRU of
    ``FOOTPRINT_CACHE_SIZE``). The meta-tensor run costs milliseconds for most tasks but 5-16 s for KernelBench's long
    LSTM/GRU references, and every verification's memory gate asks for it. The key is the sha256 of the source the
    verifier executes (``Task.source``: a size profile rewrites it, and an edited task file is read as a new source, so
    neither is served a stale footprint), the task's path and the precision. ``module``: the task already executed
    (spares a load on a miss). A task that fails to load raises (nothing is cached); a task without a text ``source``
    is not cached. Returns a copy: callers may change it."""
    source = getattr(task, "source", None)
    key = (hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest(), str(getattr(task, "path", "")),
           precision) if isinstance(source, str) else None
    if key is not None:
        with _footprints_lock:
            if key in _footprints:
                _footprints.move_to_end(key)
                footprint_cache_stats["hits"] += 1
                fp = _footprints[key]
                return dataclasses.replace(fp) if fp is not None else None
    if module is None:
        from .tasks import load_task_module
        module = load_task_module(task)
    fp = estimate_footprint(module, precision)
    if key is not None:
        with _footprints_lock:
            footprint_cache_stats["misses"] += 1
            _footprints[key] = fp
            _footprints.move_to_end(key)
            while len(_footprints) > FOOTPRINT_CACHE_SIZE:
                _footprints.popitem(last=False)
    return dataclasses.replace(fp) if fp is not None else None


def clear_footprint_cache() -> None:
    with _footprints_lock:
        _footprints.clear()
        footprint_cache_stats.update(hits=0, misses=0)


_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),   # v2: limit, usage
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None   # "max" (v2, no limit) is None


def _cgroup_memory() -> tuple[int, int | None] | None:
    """(limit, usage) of this process's cgroup memory (v2 or v1), if it has a limit; usage None if unreadable."""
    for limit_f, usage_f in _CGROUP_FILES:
        limit = _read_int(limit_f)
        if limit is not None and limit < (1 << 60):   # v1 writes "no limit" as a huge number
            return limit, _read_int(usage_f)
    return None


def _meminfo_bytes(field: str) -> int | None:
    """A ``/proc/meminfo`` field (``MemAvailable``, ``MemTotal``) in bytes; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _smallest_known(*values: int | None) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def host_available_bytes() -> int | None:
    """Memory the host can still give (``MemAvailable``, capped by what is left under a cgroup limit); None if
    unknown."""
    cg = _cgroup_memory()
    left = max(0, cg[0] - cg[1]) if cg is not None and cg[1] is not None else None
    return _smallest_known(_meminfo_bytes("MemAvailable"), left)


def host_total_bytes() -> int | None:
    """The host's whole memory (``MemTotal``, capped by a cgroup limit); None if unknown. What a task must fit
    whatever else runs: more than this is the task's fault here (``memory_problem``'s ``task_too_large``)."""
    cg = _cgroup_memory()
    return _smallest_known(_meminfo_bytes("MemTotal"), cg[0] if cg is not None else None)


def device_free_bytes(backend_name: str, index: int = 0) -> int | None:
    """Free memory of a GPU backend's device (``torch.<backend>.mem_get_info``); None if unknown."""
    return _mem_info(backend_name, index, 0)


def device_total_bytes(backend_name: str, index: int = 0) -> int | None:
    """Total memory of a GPU backend's device, from its properties (no device context is created, so it
    can be read while another worker times); None if unknown."""
    mod = getattr(torch, backend_name, None)
    try:
        return int(mod.get_device_properties(index).total_memory)
    except Exception:
        return None


def _mem_info(backend_name: str, index: int, which: int) -> int | None:
    mod = getattr(torch, backend_name, None)
    fn = getattr(mod, "mem_get_info", None)
    if fn is None:
        return None
    try:
        return int(fn(index)[which])
    except Exception:
        return None


def memory_taken_by_others(fp_dict: dict | None, free_bytes: int | None, margin_bytes: int = 1 << 30) -> bool:
    """Whether the device's free memory, read by the parent once its own child is gone, is too little for
    one correctness trial of this task: then other processes hold the memory an out-of-memory error ran
    short of. Parent-side evidence only (a candidate can print "out of memory" but cannot free others')."""
    if not fp_dict or free_bytes is None:
        return False
    try:
        fp = Footprint(int(fp_dict["input_bytes"]), fp_dict.get("output_bytes"), fp_dict.get("param_bytes"),
                       fp_dict.get("work_bytes"))
    except (KeyError, TypeError, ValueError):
        return False
    return free_bytes < sum(trial_bytes(fp)) + margin_bytes


def shares_device(fp: Footprint | None, limit_bytes: int, capacity_bytes: int | None) -> bool:
    """Whether one verification of this task is small enough to run beside others on its device: at most
    ``limit_bytes`` per correctness trial and an eighth of the device's (or host's) memory. A task that
    cannot be sized never shares."""
    if fp is None:
        return False
    cap = limit_bytes if capacity_bytes is None else min(limit_bytes, capacity_bytes // 8)
    return sum(trial_bytes(fp)) <= cap


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def trial_bytes(fp: Footprint) -> tuple[int, int]:
    """Bytes the parent and the sandboxed child hold during one correctness trial (see ``memory_problem``)."""
    i = fp.input_bytes
    o = fp.output_bytes if fp.output_bytes is not None else i
    p = fp.param_bytes or 0
    extra = max(0, (fp.work_bytes or 0) - o)   # the reference's intermediates, in the parent and in timing
    return 2 * i + 2 * o + p + extra, max(i + 2 * o, 3 * i + 2 * o) + 2 * p + extra


def precision_probe_bytes(fp: Footprint) -> int:
    """Bytes the parent's precision probe adds on top of a trial: the inputs again, rounded to float16 and back, the
    float16 reference's output, and a float64 copy of the model, the inputs and the reference's working memory."""
    i = fp.input_bytes
    o = fp.output_bytes if fp.output_bytes is not None else i
    w = max(fp.work_bytes or 0, o)
    return 4 * i + o + 2 * (fp.param_bytes or 0) + 2 * w


class MemoryProblem(str):
    """Why one verification of a task cannot fit in memory (the text, as a ``str``), and whose fault that is.

    ``rule`` is ``task_too_large`` (``verifier.types.TASK_TOO_LARGE``, one of ``verifier.farm.TASK_FAULT_RULES``) when the
    task does not fit the device's or host's whole memory, or the child's configured limit (``memory_limit_bytes``): the
    task's fault on this machine, never retried. It is None when the task fits the whole memory but not what is free
    right now (other work holds the rest): transient, retried. ``scope`` is ``"capacity"`` or ``"free_now"``."""

    rule: str | None
    scope: str

    def __new__(cls, text: str, rule: str | None, scope: str):
        obj = super().__new__(cls, text)
        obj.rule, obj.scope = rule, scope
        return obj


def memory_problem(fp: Footprint | None, *, is_gpu: bool, backend_name: str, host_free: int | None,
                   child_limit: int | None, device_free: int | None = None, host_total: int | None = None,
                   device_total: int | None = None) -> MemoryProblem | None:
    """Why one verification of this task cannot fit in memory (a ``MemoryProblem``), or None when it fits (or is
    unknown).

    During a correctness trial the parent holds the inputs, a copy of them (to see whether forward wrote
    to them), the reference output and the candidate's output read back; the sandboxed child holds its
    own inputs, the candidate's output and the copy it serialises, and two models (reference and
    candidate) besides the parent's one. On the cpu backend all of that is host memory; timing (three
    input sets, two outputs) stays below it. The reference's intermediates (``Footprint.work_bytes``) come on
    top in the parent, which runs it, and in the child, which times it. Outputs that cannot be sized are taken
    as large as the inputs (elementwise).

    ``host_free`` / ``device_free`` are what is free right now (None: not checked), ``host_total`` / ``device_total``
    the whole memory (None: unknown) and ``child_limit`` the child's configured limit. A task over a whole memory or
    the limit is the task's fault on this machine (``rule="task_too_large"``); one over only what is free now is not
    (``rule=None``: retried)."""
    from .types import TASK_TOO_LARGE
    if fp is None:
        return None
    i = fp.input_bytes
    o = fp.output_bytes if fp.output_bytes is not None else i
    p = fp.param_bytes or 0
    sizes = (f"inputs {_gib(i)}, outputs {_gib(o)}{'' if fp.output_bytes is not None else ' (assumed)'}, "
             f"parameters {_gib(p)}")
    if (fp.work_bytes or 0) - o >= GiB // 20:   # named where they show at this precision
        sizes += f", the reference's intermediates {_gib(fp.work_bytes - o)}"
    parent, child = trial_bytes(fp)
    hint = ("; verify it at smaller shapes (size profile `fit`, or a manifest profile, rewrites its size constants) "
            "or on a GPU backend" if not is_gpu else
            "; verify it at smaller shapes (size profile `fit:<MiB>`) or on a device with more memory")
    now = " right now (the rest is in use: retried later)"
    found: list[tuple[str, bool]] = []   # (reason, the task's fault); the first named leads, as before
    if not is_gpu:
        need = parent + child
        if host_free is not None and need > host_free:
            found.append((f"the task needs about {_gib(need)} of host memory for one correctness trial "
                          f"({sizes}; the parent and the sandboxed child each hold copies), but only "
                          f"{_gib(host_free)} is available on the {backend_name} backend", False))
        if host_total is not None and need > host_total:
            found.append((f"the task needs about {_gib(need)} of host memory for one correctness trial "
                          f"({sizes}; the parent and the sandboxed child each hold copies), more than the "
                          f"{_gib(host_total)} this host has in all", True))
        if child_limit is not None and child + CHILD_BASE_BYTES > child_limit:
            found.append((f"the sandboxed child would need about {_gib(child + CHILD_BASE_BYTES)} of address space "
                          f"({sizes}), more than its limit memory_limit_bytes={_gib(child_limit)}", True))
    else:
        if device_free is not None and parent + child > device_free:
            found.append((f"the task needs about {_gib(parent + child)} of {backend_name} device memory for one "
                          f"correctness trial ({sizes}; the parent and the sandboxed child each hold copies), but only "
                          f"{_gib(device_free)} is free", False))
        if device_total is not None and parent + child > device_total:
            found.append((f"the task needs about {_gib(parent + child)} of {backend_name} device memory for one "
                          f"correctness trial ({sizes}; the parent and the sandboxed child each hold copies), more "
                          f"than the {_gib(device_total)} the device has in all", True))
        host = 2 * o + 2 * p     # outputs travel through host memory; models are built on the host
        if host_free is not None and host > host_free:
            found.append((f"the task needs about {_gib(host)} of host memory to move its outputs and build its "
                          f"models ({sizes}), but only {_gib(host_free)} is available", False))
        if host_total is not None and host > host_total:
            found.append((f"the task needs about {_gib(host)} of host memory to move its outputs and build its "
                          f"models ({sizes}), more than the {_gib(host_total)} this host has in all", True))
    if not found:
        return None
    faults = [text for text, fault in found if fault]
    if faults:   # the task's fault whatever is free
        text = found[0][0] if found[0][0] == faults[0] else f"{found[0][0]}; besides, {faults[0]}"
        return MemoryProblem(text + hint, TASK_TOO_LARGE, "capacity")
    return MemoryProblem(found[0][0] + now + hint, None, "free_now")


def large_data_note(footprint: dict[str, Any] | None, backend_name: str) -> str:
    """A sentence for a timeout verdict when the task's data alone is large (1 GiB or more per call): on a
    CPU backend, creating, fingerprinting, saving and timing data of KernelBench's GPU sizes takes much of
    the time limit, so the model (and the user) should know that the shapes, not only the code, are slow."""
    if not footprint:
        return ""
    i = int(footprint.get("input_bytes") or 0)
    o = footprint.get("output_bytes")
    o = i if o is None else int(o)
    if i + o < GiB:
        return ""
    return (f" The task moves {_gib(i + o)} per call (inputs {_gib(i)}, outputs {_gib(o)}); on the {backend_name} "
            f"backend handling data of this size takes much of the time limit.")
