"""One device abstraction for the three backends, used by the parent and by the sandboxed child.

Everything backend-specific lives here: which ``torch.device`` to use, how a child is pinned to one device
(``CUDA_VISIBLE_DEVICES`` / ``MUSA_VISIBLE_DEVICES``), the event API the timer captures, the L2 size for
the flush buffer, the profiler, which ``load_inline`` builds extensions, the arch variable for
GPU-less builds, the TF32-off reference flags, and device health (pynvml / pymtml).

MUSA (Moore Threads) cannot run on the development machines: that backend is written against the
documented torch_musa / pymtml APIs (``torch.musa.*``, ``torch_musa.utils.musa_extension.load_inline``,
``ProfilerActivity.PrivateUse1``, ``mtmlLibraryInit`` ...), imports them lazily, and is untested here.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator


class DeviceUnavailable(RuntimeError):
    """The backend's device (or its runtime) is not usable here: an infra failure, never the model's."""


class DeviceBackend:
    name = "base"
    visible_devices_var: str | None = None
    arch_env_var: str | None = None
    # load_inline functions the harness routes through the build service (qualified names; see EXTENSION_APIS)
    extension_apis: tuple[str, ...] = ("torch.utils.cpp_extension.load_inline",)
    is_gpu = False

    # --- parent side --------------------------------------------------------------------------
    def physical_id(self, device_index: int | None) -> str | None:
        """The id to put in the child's *_VISIBLE_DEVICES for the parent's logical ``device_index``."""
        if self.visible_devices_var is None:
            return None
        index = device_index or 0
        if index < 0:
            raise ValueError(f"device_index must be >= 0, got {device_index}")
        visible = os.environ.get(self.visible_devices_var)
        if visible is None and self.name == "musa":
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            if index >= len(ids):
                raise DeviceUnavailable(f"device_index {index} but {self.visible_devices_var}={visible}")
            return ids[index]
        return str(index)

    def pinning_env(self, device_index: int | None) -> dict[str, str]:
        """Environment that pins a child to exactly one device (or hides all GPUs on cpu)."""
        return {"CUDA_VISIBLE_DEVICES": "", "MUSA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}

    def health(self, device_index: int | None) -> dict[str, Any]:
        return {}

    # --- both sides ---------------------------------------------------------------------------
    def torch_device(self, index: int = 0):
        import torch
        return torch.device("cpu")

    def is_available(self) -> bool:
        return True

    def ensure_available(self, index: int = 0) -> None:
        if not self.is_available():
            raise DeviceUnavailable(f"backend {self.name!r} has no usable device here")

    def device_name(self, index: int = 0) -> str:
        import platform
        return platform.processor() or platform.machine() or "cpu"

    def synchronize_fn(self) -> Callable[[], None]:
        return lambda: None

    def event_api(self) -> tuple[Any, Callable, Callable] | None:
        """(Event class, record, elapsed_time) captured by the timer; None: host timer only."""
        return None

    def l2_cache_bytes(self, index: int = 0) -> int | None:
        return None

    def warp_size(self, index: int = 0) -> int | None:
        return None

    profiler_device: str | None = None  # use_device of the Kineto profiler (None: CPU activity only)

    def profiler(self):
        """Kineto profiler with CPU activity (+ this backend's device activity). Built with
        ``torch.autograd.profiler.profile`` (what ``torch.profiler.profile`` wraps) because the wrapper's first
        use imports torch._inductor (seconds per fresh child) for a cudagraphs flag we do not need."""
        import torch.autograd.profiler as autograd_profiler
        return autograd_profiler.profile(use_cpu=True, use_device=self.profiler_device, use_kineto=True)

    def device_event_types(self) -> set:
        """``DeviceType`` values of profiler events that are device kernels."""
        return set()

    @contextlib.contextmanager
    def reference_precision(self) -> Iterator[None]:
        """Reference semantics: fp32 matmuls/convs in full precision (TF32 off)."""
        import torch
        old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
               torch.get_float32_matmul_precision())
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old[0], old[1]
            torch.set_float32_matmul_precision(old[2])

    def empty_cache(self) -> None:
        pass

    def info(self, index: int = 0) -> dict[str, Any]:
        return {"backend": self.name, "device_name": self.device_name(index), "l2_bytes": self.l2_cache_bytes(index),
                "warp_size": self.warp_size(index)}


class CpuBackend(DeviceBackend):
    name = "cpu"


class CudaBackend(DeviceBackend):
    name = "cuda"
    visible_devices_var = "CUDA_VISIBLE_DEVICES"
    arch_env_var = "TORCH_CUDA_ARCH_LIST"
    is_gpu = True

    def pinning_env(self, device_index):
        return {"CUDA_VISIBLE_DEVICES": self.physical_id(device_index), "MUSA_VISIBLE_DEVICES": "",
                "HIP_VISIBLE_DEVICES": ""}

    def torch_device(self, index=0):
        import torch
        return torch.device("cuda", index)

    def is_available(self):
        import torch
        return torch.cuda.is_available()

    def ensure_available(self, index=0):
        import torch
        if not torch.cuda.is_available():
            raise DeviceUnavailable("backend 'cuda' but torch.cuda.is_available() is False here")
        if index >= torch.cuda.device_count():
            raise DeviceUnavailable(f"cuda device {index} requested, {torch.cuda.device_count()} visible")

    def device_name(self, index=0):
        import torch
        return torch.cuda.get_device_name(index)

    def synchronize_fn(self):
        import torch
        return torch.cuda.synchronize

    def event_api(self):
        import torch
        return torch.cuda.Event, torch.cuda.Event.record, torch.cuda.Event.elapsed_time

    def l2_cache_bytes(self, index=0):
        import torch
        return int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0)) or None

    def warp_size(self, index=0):
        import torch
        return int(getattr(torch.cuda.get_device_properties(index), "warp_size", 32))

    profiler_device = "cuda"

    def device_event_types(self):
        from torch.autograd import DeviceType
        return {DeviceType.CUDA}

    def empty_cache(self):
        import torch
        torch.cuda.empty_cache()

    def health(self, device_index):
        """NVML view of the physical device: memory, temperature, clocks, processes (best effort)."""
        try:
            import pynvml
            pynvml.nvmlInit()
            try:
                pid = self.physical_id(device_index)
                handle = (pynvml.nvmlDeviceGetHandleByUUID(pid) if pid and not pid.isdigit()
                          else pynvml.nvmlDeviceGetHandleByIndex(int(pid or 0)))
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
                return {
                    "memory_used_bytes": int(mem.used), "memory_total_bytes": int(mem.total),
                    "temperature_c": int(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
                    "sm_clock_mhz": int(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
                    "compute_processes": len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle)),
                }
            finally:
                pynvml.nvmlShutdown()
        except Exception as e:  # health is telemetry: never fail a verdict on it
            return {"error": f"{type(e).__name__}: {e}"}


class MusaBackend(DeviceBackend):
    """Moore Threads MUSA through torch_musa (PrivateUse1 backend named "musa"). Untested here (no MUSA)."""

    name = "musa"
    visible_devices_var = "MUSA_VISIBLE_DEVICES"
    arch_env_var = "TORCH_MUSA_ARCH_LIST"
    extension_apis = ("torch.utils.cpp_extension.load_inline", "torch_musa.utils.musa_extension.load_inline",
                      "torchada.utils.cpp_extension.load_inline")
    is_gpu = True

    @staticmethod
    def _musa():
        try:
            import torch
            import torch_musa  # noqa: F401  registers torch.musa
            return torch.musa
        except Exception as e:
            raise DeviceUnavailable(f"torch_musa is not importable: {e}") from None

    def pinning_env(self, device_index):
        pid = self.physical_id(device_index)
        # torchada mirrors MUSA_VISIBLE_DEVICES into CUDA_VISIBLE_DEVICES; keep them consistent
        return {"MUSA_VISIBLE_DEVICES": pid, "CUDA_VISIBLE_DEVICES": pid, "MTHREADS_VISIBLE_DEVICES": pid}

    def torch_device(self, index=0):
        import torch
        self._musa()
        return torch.device("musa", index)

    def is_available(self):
        try:
            return bool(self._musa().is_available())
        except DeviceUnavailable:
            return False

    def ensure_available(self, index=0):
        musa = self._musa()
        if not musa.is_available():
            raise DeviceUnavailable("backend 'musa' but torch.musa.is_available() is False here")
        if index >= musa.device_count():
            raise DeviceUnavailable(f"musa device {index} requested, {musa.device_count()} visible")

    def device_name(self, index=0):
        return self._musa().get_device_name(index)

    def synchronize_fn(self):
        return self._musa().synchronize

    def event_api(self):
        musa = self._musa()
        return musa.Event, musa.Event.record, musa.Event.elapsed_time

    def l2_cache_bytes(self, index=0):
        props = self._musa().get_device_properties(index)
        for field in ("L2_cache_size", "l2_cache_size", "l2CacheSize"):
            if getattr(props, field, None):
                return int(getattr(props, field))
        return None  # unknown field name: the timer falls back to a 256 MiB flush

    def warp_size(self, index=0):
        """128 on mp_21/mp_22 (S80/S3000/S4000), 32 on mp_31 (S5000) (torch_musa inductor GPUTarget)."""
        props = self._musa().get_device_properties(index)
        if getattr(props, "warp_size", None):
            return int(props.warp_size)
        major, minor = self._musa().get_device_capability(index)
        return 128 if major * 10 + minor < 31 else 32

    profiler_device = "musa"  # the PrivateUse1 backend name: profiles ProfilerActivity.PrivateUse1

    def device_event_types(self):
        from torch.autograd import DeviceType
        return {DeviceType.PrivateUse1}

    @contextlib.contextmanager
    def reference_precision(self):
        import torch
        mudnn = getattr(torch.backends, "mudnn", None)
        old = getattr(mudnn, "allow_tf32", None) if mudnn is not None else None
        if mudnn is not None and old is not None:
            mudnn.allow_tf32 = False
        try:
            with super().reference_precision():
                yield
        finally:
            if mudnn is not None and old is not None:
                mudnn.allow_tf32 = old

    def empty_cache(self):
        self._musa().empty_cache()

    def health(self, device_index):
        """MTML (mthreads-ml-py) view: memory, temperature, clock. Process listing is unsupported in MTML."""
        try:
            import pymtml
            pymtml.mtmlLibraryInit()
            try:
                dev = pymtml.mtmlLibraryInitDeviceByIndex(int(self.physical_id(device_index) or 0))
                mem = pymtml.mtmlDeviceInitMemory(dev)
                gpu = pymtml.mtmlDeviceInitGpu(dev)
                return {"name": pymtml.mtmlDeviceGetName(dev),
                        "memory_used_bytes": int(pymtml.mtmlMemoryGetUsed(mem)),
                        "memory_total_bytes": int(pymtml.mtmlMemoryGetTotal(mem)),
                        "temperature_c": int(pymtml.mtmlGpuGetTemperature(gpu)),
                        "clock_mhz": int(pymtml.mtmlGpuGetClock(gpu))}
            finally:
                pymtml.mtmlLibraryShutDown()
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"}


# qualified name -> (module, attribute) of every load_inline the harness knows how to route
EXTENSION_APIS = {
    "torch.utils.cpp_extension.load_inline": ("torch.utils.cpp_extension", "load_inline"),
    "torch_musa.utils.musa_extension.load_inline": ("torch_musa.utils.musa_extension", "load_inline"),
    "torchada.utils.cpp_extension.load_inline": ("torchada.utils.cpp_extension", "load_inline"),
}


def resolve_extension_api(api: str) -> tuple[Any, str]:
    """(module object, attribute name) of a routed load_inline; imported lazily (MUSA modules may be absent)."""
    import importlib
    if api not in EXTENSION_APIS:
        raise ValueError(f"unknown extension API {api!r}")
    module_name, attr = EXTENSION_APIS[api]
    return importlib.import_module(module_name), attr


_BACKENDS = {"cpu": CpuBackend, "cuda": CudaBackend, "musa": MusaBackend}


def get_backend(name: str) -> DeviceBackend:
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; one of {sorted(_BACKENDS)}") from None
