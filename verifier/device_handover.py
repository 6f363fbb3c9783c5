"""Full output handovers that stay on a CUDA device.

A full handover through a sealed memfd (``_child._save``) costs two host copies of the output: on one H200 the
child wrote KernelBench's 6.4 GB ReLU output into the memfd in 8.1 s and the parent read it back in 1.6 s, most of
a check's 15 s of exclusive device time (``bench/results/verifier_fullsize_h200.md``). On a CUDA device the parent
now offers a buffer instead: it allocates it with the driver (``cuMemAlloc``, outside torch's caching allocator, so
the exported allocation holds nothing else of the parent's) and sends its CUDA IPC handle with the trial; the child
copies its outputs into it (``write_outputs``) and replies with their layout; on that reply the parent copies the
whole buffer into memory of its own (``ExportedBuffer.snapshot``) and compares that copy. What is compared is then
what the buffer held when the parent took it, in memory no other process can reach; the child can still write the
buffer afterwards, which changes nothing. The memfd path stays for other devices, small outputs, a parent short of
memory, and any failure here (the child then reports why and uses it).

The layout is the child's word: ``read_outputs`` accepts only known dtypes, sane shapes and aligned offsets inside
the buffer, and a tensor whose dtype or shape differs from the reference's comes back as an empty meta tensor (the
comparison names the difference), as in the memfd path.

Driver calls go through ctypes on ``libcuda.so.1`` because torch exposes no IPC export of a dedicated allocation
(its own ``_share_cuda_`` exports a whole caching-allocator segment and needs a shared-memory ref counter).
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any, Callable

import torch

#: offsets of the outputs in the buffer are multiples of this (any dtype's alignment; CUDA's own allocations use 256)
ALIGN = 256
_HANDLE_BYTES = 64   # sizeof(CUipcMemHandle)
_IPC_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    """CUipcMemHandle, passed by value to cuIpcOpenMemHandle."""
    _fields_ = [("reserved", ctypes.c_char * _HANDLE_BYTES)]


#: dtypes an output may have in a device handover, by the name the layout carries
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64") if hasattr(torch, n)))}


class DeviceHandoverError(RuntimeError):
    """The device handover cannot be used here (no driver, no memory, a bad handle, outputs that do not fit)."""


class _Driver:
    """The few CUDA driver calls the handover needs. The calling thread must have the device's primary context
    current, which any torch CUDA work on that device has made it."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise DeviceHandoverError(f"no CUDA driver library: {e}") from None
        lib = self.lib
        for name, args in (("cuMemAlloc_v2", [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]),
                           ("cuMemFree_v2", [ctypes.c_uint64]),
                           ("cuIpcGetMemHandle", [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]),
                           ("cuIpcOpenMemHandle_v2", [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]),
                           ("cuIpcCloseMemHandle", [ctypes.c_uint64]),
                           ("cuMemGetAddressRange_v2", [ctypes.POINTER(ctypes.c_uint64),
                                                        ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]),
                           ("cuGetErrorName", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])):
            fn = getattr(lib, name, None)
            if fn is None:
                raise DeviceHandoverError(f"the CUDA driver has no {name}")
            fn.argtypes, fn.restype = args, ctypes.c_int

    def _check(self, rc: int, what: str) -> None:
        if rc:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise DeviceHandoverError(f"{what}: {(name.value or b'CUDA error').decode()} ({rc})")

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), nbytes), f"cuMemAlloc of {nbytes} bytes")
        return ptr.value

    def free(self, ptr: int) -> None:
        self._check(self.lib.cuMemFree_v2(ptr), "cuMemFree")

    def export(self, ptr: int) -> bytes:
        handle = _IpcHandle()
        self._check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), ptr), "cuIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(handle), _HANDLE_BYTES)

    def open(self, handle: bytes) -> tuple[int, int]:
        """Map another process's exported allocation: (pointer, size of the allocation as mapped here)."""
        ptr = ctypes.c_uint64()
        raw = _IpcHandle.from_buffer_copy(handle)
        self._check(self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, _IPC_LAZY_ENABLE_PEER_ACCESS),
                    "cuIpcOpenMemHandle")
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        try:
            self._check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr.value),
                        "cuMemGetAddressRange")
        except DeviceHandoverError:
            self.close(ptr.value)
            raise
        return ptr.value, size.value - (ptr.value - base.value)

    def close(self, ptr: int) -> None:
        self._check(self.lib.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")


@functools.cache
def _driver() -> _Driver:
    return _Driver()


class _Raw:
    """A device byte range as ``__cuda_array_interface__``, so torch can view it without owning it."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def _bytes_at(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(_Raw(ptr, nbytes), device=device)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def buffer_bytes(ref_leaves: list) -> int:
    """The buffer the reference's tensor outputs need, laid out as ``pack`` lays them out."""
    return sum(aligned(t.numel() * t.element_size()) for t in ref_leaves if isinstance(t, torch.Tensor))


class ExportedBuffer:
    """Parent side: a device allocation of ``nbytes`` that one child may write through the handle in ``message``."""

    def __init__(self, nbytes: int, device: torch.device):
        if nbytes <= 0:
            raise DeviceHandoverError("nothing to hand over")
        torch.cuda.synchronize(device)   # binds the device's primary context to this thread for the driver calls
        self.driver, self.nbytes, self.device = _driver(), nbytes, device
        self.ptr = self.driver.alloc(nbytes)
        try:
            self.handle = self.driver.export(self.ptr)
        except DeviceHandoverError:
            self.close()
            raise

    def message(self) -> dict[str, Any]:
        return {"handle": self.handle.hex(), "bytes": self.nbytes}

    def snapshot(self) -> torch.Tensor:
        """A private copy of the whole buffer, taken now (after the child's reply)."""
        copy = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        copy.copy_(_bytes_at(self.ptr, self.nbytes, self.device))
        torch.cuda.synchronize(self.device)
        return copy

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self.driver.free(ptr)


def pack(tensors: dict[str, torch.Tensor], dest: torch.Tensor, tb: Any = torch._C.TensorBase) -> dict[str, dict]:
    """Copy ``tensors`` (on ``dest``'s device) into the byte tensor ``dest`` at aligned offsets, in order; their
    layout for ``read_outputs``. ``tb``: the tensor methods to use (the child passes the ones it saved before the
    candidate was imported)."""
    layout, offset = {}, 0
    for key, t in tensors.items():
        name = str(t.dtype).removeprefix("torch.")
        if DTYPES.get(name) != t.dtype:
            raise DeviceHandoverError(f"output {key} has dtype {t.dtype}, which a device handover does not carry")
        nbytes = tb.numel(t) * tb.element_size(t)
        if offset + nbytes > tb.numel(dest):
            raise DeviceHandoverError(f"the outputs take more than the {tb.numel(dest)} bytes offered")
        if nbytes:
            src = tb.view(tb.reshape(tb.contiguous(t), (-1,)), torch.uint8)
            tb.copy_(tb.narrow(dest, 0, offset, nbytes), src)
        layout[key] = {"dtype": name, "shape": list(tb.size(t)), "offset": offset}
        offset = aligned(offset + nbytes)
    return layout


def write_outputs(message: Any, tensors: dict[str, torch.Tensor], device: torch.device,
                  tb: Any = torch._C.TensorBase) -> dict[str, dict]:
    """Child side: copy ``tensors`` into the buffer the parent exported (``message``: its handle and size) and
    return their layout; the mapping is closed again before returning."""
    if not (isinstance(message, dict) and isinstance(message.get("handle"), str)
            and isinstance(message.get("bytes"), int) and message["bytes"] > 0):
        raise DeviceHandoverError("malformed device handover offer")
    if any(tb.device.__get__(t) != device for t in tensors.values()):
        raise DeviceHandoverError("an output is not on the device")
    try:
        handle = bytes.fromhex(message["handle"])
    except ValueError:
        raise DeviceHandoverError("malformed device handover handle") from None
    if len(handle) != _HANDLE_BYTES:
        raise DeviceHandoverError("malformed device handover handle")
    torch.cuda.synchronize(device)   # the outputs are complete, and the context is current for the driver
    driver = _driver()
    ptr, size = driver.open(handle)
    try:
        if size < message["bytes"]:
            raise DeviceHandoverError(f"the offered buffer maps {size} bytes, not {message['bytes']}")
        layout = pack(tensors, _bytes_at(ptr, message["bytes"], device), tb)
        torch.cuda.synchronize(device)
    finally:
        driver.close(ptr)
    return layout


def output_index(key: Any) -> int:
    """N of an output's key ``outN``; -1 for anything else."""
    return int(key[3:]) if isinstance(key, str) and key.startswith("out") and key[3:].isdigit() else -1


def read_layout(snapshot: torch.Tensor, layout: Any, valid_key: Callable[[Any], bool]) -> dict[str, torch.Tensor]:
    """Parent side: the tensors a child laid out in ``snapshot`` (``ExportedBuffer.snapshot``), as views of it.
    The layout is checked entry by entry (``DeviceHandoverError`` names what is wrong): keys ``valid_key``
    accepts, known dtypes, sane shapes, aligned offsets, every tensor inside the buffer."""
    if not isinstance(layout, dict) or len(layout) > 10000:
        raise DeviceHandoverError("malformed output layout")
    total = snapshot.numel()
    out = {}
    for key, entry in layout.items():
        if not valid_key(key) or not isinstance(entry, dict):
            raise DeviceHandoverError(f"malformed output layout entry {str(key)[:40]!r}")
        dtype, shape, offset = DTYPES.get(entry.get("dtype")), entry.get("shape"), entry.get("offset")
        if dtype is None:
            raise DeviceHandoverError(f"output {key}: unknown dtype {str(entry.get('dtype'))[:40]!r}")
        if not (isinstance(shape, list) and len(shape) <= 64 and all(
                type(d) is int and 0 <= d < 1 << 62 for d in shape)):
            raise DeviceHandoverError(f"output {key}: malformed shape")
        if type(offset) is not int or offset < 0 or offset % ALIGN:
            raise DeviceHandoverError(f"output {key}: malformed offset")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if offset + nbytes > total:
            raise DeviceHandoverError(f"output {key}: {nbytes} bytes at {offset} run past the {total}-byte buffer")
        out[key] = snapshot.narrow(0, offset, nbytes).view(dtype).reshape(shape)
    return out


def read_outputs(snapshot: torch.Tensor, layout: Any, ref_leaves: list) -> dict[str, torch.Tensor]:
    """``read_layout`` of a trial's outputs (keys ``outN``); an output whose dtype or shape differs from the
    reference leaf at its position is an empty meta tensor of what the child claimed, as in the memfd path."""
    out = read_layout(snapshot, layout, lambda key: output_index(key) >= 0)
    for key, t in out.items():
        index = output_index(key)
        ref = ref_leaves[index] if index < len(ref_leaves) else None
        if not isinstance(ref, torch.Tensor) or ref.shape != t.shape or ref.dtype != t.dtype:
            out[key] = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return out
