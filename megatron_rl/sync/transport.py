"""How weight buckets travel from the trainer to the engines, and how the engines read them back.

Two transports, both speaking SGLang's HTTP API:

* colocated (engine on the trainer's host): ``/update_weights_from_tensor`` with
  ``load_format="flattened_bucket"``. The request carries a *handle*, never the bytes:
  - GPU: a CUDA IPC handle (``torch.multiprocessing`` reductions, pickled by ``ForkingPickler`` and
    base64-encoded -- the same wire format as SGLang's ``MultiprocessingSerializer``). For a real
    SGLang server the payload is built with SGLang's own ``FlattenedTensorBucket`` and
    ``MultiprocessingSerializer`` (imported lazily), one entry per engine TP rank.
  - CPU: a file in ``/dev/shm`` that the bucket was built in; the request carries its path, dtype and
    tensor metadata as base64 JSON. The sender unlinks the file once the engine has answered.
* disaggregated: ``/init_weights_update_group`` then, per dtype buffer,
  ``/update_weights_from_distributed`` (names, dtypes, shapes, ``load_format="flattened_bucket"``)
  while trainer rank 0 broadcasts the flat buffer over a process group of its own.

That extra group is *stateless*: a ``TCPStore`` + ``ProcessGroupGloo``/``ProcessGroupNCCL`` built
directly, so neither the trainer's default process group (Megatron's) nor the engine is disturbed.

Atomic updates: every bucket request may carry the extension field ``staged`` =
``{"update_id", "final", "total_tensors"}``. The embedded engine stages buckets of one update and
commits them (bumping the weight version) only on the final one; real SGLang ignores the field and
applies each bucket as it arrives, so the trainer sends ``weight_version`` with the final bucket only.
"""
from __future__ import annotations

import base64
import dataclasses
import datetime
import io
import json
import os
import pickle
import tempfile
import time
import uuid
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_rl.ports import free_port

from .buckets import Allocator, FlatBucket, TensorMeta, dtype_from_name, dtype_name, unflatten

SHM_PREFIX = "mrl-wsync-"
DEFAULT_GROUP_NAME = "weight_update_group"


# ----------------------------------------------------------------------------------------------
# Stateless process group (both sides)
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WeightGroupSpec:
    """What `/init_weights_update_group` carries. The trainer is rank 0 and hosts the TCPStore."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "gloo"
    timeout_s: float = 600.0

    def __post_init__(self):
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.world_size < 2:
            raise ValueError(f"world_size must be >= 2 (trainer + at least one engine rank), got {self.world_size}")
        if not (0 < int(self.master_port) < 65536):
            raise ValueError(f"master_port out of range: {self.master_port}")


class WeightUpdateGroup:
    """A process group created outside ``torch.distributed``'s global state (no ``init_process_group``).

    Construction blocks until all ``world_size`` ranks have joined (or the timeout expires).
    """

    def __init__(self, spec: WeightGroupSpec, rank: int, device: torch.device | str | None = None):
        if not (0 <= rank < spec.world_size):
            raise ValueError(f"rank {rank} outside world_size {spec.world_size}")
        self.spec = spec
        self.rank = rank
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        self._store = dist.TCPStore(spec.master_address, int(spec.master_port), spec.world_size,
                                    is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(f"mrl/{spec.group_name}", self._store)
        if spec.backend == "gloo":
            self.device = torch.device("cpu")
            self._pg = dist.ProcessGroupGloo(store, rank, spec.world_size, timeout)
        else:
            if not torch.cuda.is_available():
                raise RuntimeError("backend 'nccl' needs CUDA; use backend 'gloo' on CPU")
            self.device = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
            torch.cuda.set_device(self.device)
            self._pg = dist.ProcessGroupNCCL(store, rank, spec.world_size, timeout)

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Launch a broadcast; returns the Work (poll `is_completed()`, then call `finish(work)`)."""
        if self._pg is None:
            raise RuntimeError(f"weight update group {self.spec.group_name!r} was destroyed")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        if self.spec.backend == "nccl":
            torch.cuda.set_device(self.device)
        return self._pg.broadcast([tensor], opts)

    def finish(self, work) -> None:
        work.wait()
        if self.spec.backend == "nccl":
            torch.cuda.current_stream(self.device).synchronize()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if tensor.numel() == 0:
            return
        self.finish(self.start_broadcast(tensor, src))

    def destroy(self) -> None:
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:
                pass
        self._store = None


# ----------------------------------------------------------------------------------------------
# Colocated payloads: encode (trainer) / decode (engine)
# ----------------------------------------------------------------------------------------------

def default_shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class ShmAllocator:
    """Allocates bucket buffers directly inside files under /dev/shm, so sharing them costs no copy."""

    def __init__(self, shm_dir: str | None = None):
        self.dir = shm_dir or default_shm_dir()
        self.paths: dict[int, str] = {}  # storage data_ptr -> file
        # Files outlive a crashed or careless caller: unlink whatever is left at GC or interpreter exit.
        weakref.finalize(self, _unlink_all, self.paths)

    def __call__(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        path = os.path.join(self.dir, f"{SHM_PREFIX}{uuid.uuid4().hex}-{dtype_name(dtype)}")
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        with open(path, "wb") as f:
            f.truncate(nbytes)
        t = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        self.paths[t.untyped_storage().data_ptr()] = path
        return t

    def path_of(self, t: torch.Tensor) -> str:
        try:
            return self.paths[t.untyped_storage().data_ptr()]
        except KeyError:
            raise ValueError("tensor was not allocated by this ShmAllocator") from None

    def release(self, t: torch.Tensor) -> None:
        path = self.paths.pop(t.untyped_storage().data_ptr(), None)
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def release_all(self) -> None:
        _unlink_all(self.paths)


def _unlink_all(paths: dict[int, str]) -> None:
    for path in list(paths.values()):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    paths.clear()


def _meta_dict_for_pickle(m: TensorMeta) -> dict:
    # Key names and types follow SGLang's FlattenedTensorMetadata (its dict branch accepts these).
    return {"name": m.name, "shape": torch.Size(m.shape), "dtype": m.dtype,
            "start_idx": m.offset, "end_idx": m.offset + m.numel, "numel": m.numel}


def _forking_pickle_b64(obj: Any) -> str:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401  (registers the tensor reductions with ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_cuda_ipc(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> str:
    """One dtype buffer on a GPU -> SGLang-format flattened-bucket payload carrying a CUDA IPC handle."""
    if buffer.device.type != "cuda":
        raise ValueError("encode_cuda_ipc needs a CUDA buffer; CPU buckets travel through /dev/shm")
    return _forking_pickle_b64({"flattened_tensor": buffer, "metadata": [_meta_dict_for_pickle(m) for m in metas]})


def encode_sglang_native(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> str:
    """Same content, built with SGLang's own classes (what a real SGLang server unpickles)."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
    except ImportError as e:
        raise RuntimeError(f"sending weights to a real SGLang server needs the sglang package: {e}") from None
    meta = [FlattenedTensorMetadata(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype, start_idx=m.offset,
                                    end_idx=m.offset + m.numel, numel=m.numel) for m in metas]
    bucket = FlattenedTensorBucket(flattened_tensor=buffer, metadata=meta)
    return MultiprocessingSerializer.serialize(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}, output_str=True)


def encode_shm(path: str, buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> str:
    doc = {"shm_path": path, "dtype": dtype_name(buffer.dtype), "numel": buffer.numel(),
           "metadata": [m.to_json() for m in metas]}
    return base64.b64encode(json.dumps(doc).encode()).decode("ascii")


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles tensor-sharing payloads only: torch's rebuild functions, dtypes and sizes.

    A weight payload arrives over HTTP; a plain ``pickle.loads`` would run whatever it names.
    """

    _ALLOWED = {
        "torch.multiprocessing.reductions": {
            "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
            "rebuild_storage_fd", "rebuild_storage_filename", "rebuild_storage_empty",
        },
        "torch": {"Tensor", "Size", "device", "UntypedStorage", "TypedStorage"},
        "torch.storage": {"UntypedStorage", "TypedStorage"},
        "multiprocessing.resource_sharer": {"DupFd"},
    }

    def find_class(self, module: str, name: str):
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"weight payload refers to {module}.{name}, which is not allowed")


@dataclasses.dataclass
class DecodedBucket:
    """Named tensors read from one payload. `tensors` may alias sender memory: copy before acking."""

    tensors: list[tuple[str, torch.Tensor]]


def decode_payload(payload: str | bytes, *, shm_dir: str | None = None,
                   load_format: str | None = "flattened_bucket") -> DecodedBucket:
    """Engine side: one `serialized_named_tensors` entry -> named tensors."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except Exception as e:
        raise ValueError(f"serialized_named_tensors entry is not valid base64: {e}") from None
    if raw[:1] == b"{":
        return _decode_shm(raw, shm_dir or default_shm_dir())
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as e:
        raise ValueError(f"rejected weight payload: {e}") from None
    except Exception as e:
        raise ValueError(f"could not read weight payload ({type(e).__name__}: {e})") from None
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
            raise ValueError("flattened_bucket payload must be a dict with 'flattened_tensor' and 'metadata'")
        flat = obj["flattened_tensor"]
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
            raise ValueError("flattened_tensor must be a 1-D tensor")
        metas = [_meta_from_any(m, flat.dtype) for m in obj["metadata"]]
        return DecodedBucket(unflatten({flat.dtype: flat}, metas))
    if load_format in (None, "direct"):
        if not isinstance(obj, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
                for p in obj):
            raise ValueError("per-tensor payload must be a list of (name, tensor) pairs")
        return DecodedBucket([(n, t) for n, t in obj])
    raise ValueError(f"unsupported load_format {load_format!r} (supported: 'flattened_bucket', 'direct', null)")


def _meta_from_any(m: Any, buffer_dtype: torch.dtype) -> TensorMeta:
    get = (lambda k: m[k]) if isinstance(m, dict) else (lambda k: getattr(m, k))
    try:
        dtype = get("dtype")
        dtype = dtype if isinstance(dtype, torch.dtype) else dtype_from_name(str(dtype))
        meta = TensorMeta(name=str(get("name")), dtype=dtype, shape=tuple(int(s) for s in get("shape")),
                          offset=int(get("start_idx")), numel=int(get("numel")))
        end = int(get("end_idx"))
    except (KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"malformed flattened-bucket metadata entry: {e}") from None
    if dtype != buffer_dtype:
        raise ValueError(f"tensor {meta.name!r} is {dtype} but its flattened buffer is {buffer_dtype}; "
                         "send one bucket per dtype")
    if end != meta.offset + meta.numel:
        raise ValueError(f"tensor {meta.name!r}: end_idx {end} != start_idx + numel")
    meta.check()
    return meta


def _decode_shm(raw: bytes, shm_dir: str) -> DecodedBucket:
    try:
        doc = json.loads(raw)
        path, numel, dtype = str(doc["shm_path"]), int(doc["numel"]), dtype_from_name(str(doc["dtype"]))
        metas = [TensorMeta.from_json(m) for m in doc["metadata"]]
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed shared-memory payload: {e}") from None
    real, allowed = os.path.realpath(path), os.path.realpath(shm_dir)
    if os.path.dirname(real) != allowed or not os.path.basename(real).startswith(SHM_PREFIX):
        raise ValueError(f"shared-memory path {path!r} is not a weight-sync file under {shm_dir}")
    try:
        size = os.stat(real).st_size
    except FileNotFoundError:
        raise ValueError(f"shared-memory file {path!r} does not exist (sender released it?)") from None
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if size != numel * itemsize:
        raise ValueError(f"shared-memory file {path!r} has {size} bytes, payload says {numel} x {itemsize}")
    for m in metas:
        if m.dtype != dtype:
            raise ValueError(f"tensor {m.name!r} is {m.dtype} but the shared buffer is {dtype}")
    flat = torch.from_file(real, shared=False, size=numel, dtype=dtype) if numel else torch.empty(0, dtype=dtype)
    return DecodedBucket(unflatten({dtype: flat}, metas))


# ----------------------------------------------------------------------------------------------
# Trainer-side helpers shared by weight sync and tests
# ----------------------------------------------------------------------------------------------

def staged_field(update_id: str, final: bool, total_tensors: int | None) -> dict:
    d: dict[str, Any] = {"update_id": update_id, "final": bool(final)}
    if final and total_tensors is not None:
        d["total_tensors"] = int(total_tensors)
    return d


def distributed_request(bucket: FlatBucket, dtype: torch.dtype) -> dict:
    """The names/dtypes/shapes of one dtype buffer, in buffer order, for `/update_weights_from_distributed`."""
    metas = sorted(bucket.metas_of(dtype), key=lambda m: m.offset)
    return {"names": [m.name for m in metas], "dtypes": [dtype_name(m.dtype) for m in metas],
            "shapes": [list(m.shape) for m in metas]}


def receive_flattened(group: WeightUpdateGroup, names: Sequence[str], dtypes: Sequence[str],
                      shapes: Sequence[Sequence[int]]) -> list[tuple[str, torch.Tensor]]:
    """Engine side of a flattened-bucket broadcast: allocate, receive from rank 0, cut into tensors."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names/dtypes/shapes must be non-empty and equally long, got "
                         f"{len(names)}/{len(dtypes)}/{len(shapes)}")
    dts = {dtype_from_name(d) for d in dtypes}
    if len(dts) != 1:
        raise ValueError(f"a flattened bucket holds one dtype, got {sorted(map(str, dts))}")
    dtype = dts.pop()
    metas, off = [], 0
    for n, s in zip(names, shapes):
        shape = tuple(int(x) for x in s)
        numel = 1
        for x in shape:
            numel *= x
        metas.append(TensorMeta(str(n), dtype, shape, off, numel))
        metas[-1].check()
        off += numel
    flat = torch.empty(off, dtype=dtype, device=group.device)
    group.broadcast(flat, src=0)
    return unflatten({dtype: flat}, metas)


def receive_per_tensor(group: WeightUpdateGroup, names, dtypes, shapes) -> list[tuple[str, torch.Tensor]]:
    """Engine side of the per-tensor broadcast (load_format null): one broadcast per tensor, in order."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names/dtypes/shapes must be equally long")
    out = []
    for n, d, s in zip(names, dtypes, shapes):
        t = torch.empty(tuple(int(x) for x in s), dtype=dtype_from_name(d), device=group.device)
        group.broadcast(t, src=0)
        out.append((str(n), t))
    return out


def make_allocator(device: torch.device) -> tuple[Allocator | None, ShmAllocator | None]:
    """Colocated sender: on CPU build buckets straight in /dev/shm; on GPU plain device memory."""
    if device.type == "cpu":
        shm = ShmAllocator()
        return shm, shm
    return None, None


# ----------------------------------------------------------------------------------------------
# Trainer-side senders: one bucket -> every engine
# ----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class UpdateStep:
    """Where one request sits in an atomic update (see the module docstring)."""

    update_id: str
    final: bool
    total_tensors: int | None
    weight_version: str | None  # sent with the final request only

    def staged(self) -> dict:
        return staged_field(self.update_id, self.final, self.total_tensors)


def _dtype_steps(bucket: FlatBucket, update_id: str, last_bucket: bool, total: int | None,
                 version: str | None) -> list[tuple[torch.dtype, UpdateStep]]:
    dtypes = [dt for dt in bucket.buffers if bucket.metas_of(dt)]
    out = []
    for i, dt in enumerate(dtypes):
        final = last_bucket and i == len(dtypes) - 1
        out.append((dt, UpdateStep(update_id, final, total if final else None, version if final else None)))
    return out


class ColocatedSender:
    """Shares each bucket with engines on this host: CUDA IPC handles on GPU, /dev/shm files on CPU.

    `sglang_native=True` encodes with SGLang's own classes (required by real SGLang servers); the
    embedded engine reads the plain ForkingPickler format. Buffers are kept alive until every engine
    has answered (SGLang may still be copying from an IPC buffer when a request returns otherwise).
    """

    name = "colocated"

    def __init__(self, device: torch.device | str = "cpu", *, sglang_native: bool = False):
        self.device = torch.device(device)
        self.sglang_native = sglang_native
        self._shm = ShmAllocator() if self.device.type == "cpu" else None

    @property
    def allocator(self) -> Allocator | None:
        return self._shm

    async def open(self, engines) -> None:
        return None

    def _payload(self, bucket: FlatBucket, dt: torch.dtype) -> str:
        buf, metas = bucket.buffers[dt], bucket.metas_of(dt)
        if buf.device.type == "cuda":
            return (encode_sglang_native if self.sglang_native else encode_cuda_ipc)(buf, metas)
        if self._shm is None:
            raise ValueError("CPU bucket but the sender was created for a GPU device")
        return encode_shm(self._shm.path_of(buf), buf, metas)

    async def send(self, engines, bucket: FlatBucket, *, update_id: str, last_bucket: bool,
                   total_tensors: int | None, weight_version: str | None) -> None:
        import asyncio

        try:
            for dt, step in _dtype_steps(bucket, update_id, last_bucket, total_tensors, weight_version):
                payload = self._payload(bucket, dt)
                await _all(engines, lambda e: e.update_weights_from_tensor(
                    [payload] * getattr(e, "tp_size", 1), load_format="flattened_bucket",
                    weight_version=step.weight_version, staged=step.staged()))
            if self.device.type == "cuda":
                await asyncio.to_thread(torch.cuda.ipc_collect)
        finally:
            if self._shm is not None:
                for buf in bucket.buffers.values():
                    self._shm.release(buf)

    def release_unsent(self) -> None:
        """Free the shared-memory files of buckets that were built but never sent (after a failure)."""
        if self._shm is not None:
            self._shm.release_all()

    async def close(self, engines) -> None:
        self.release_unsent()


class DistributedSender:
    """Disaggregated engines: a stateless process group (trainer = rank 0) and one broadcast per dtype buffer."""

    name = "distributed"

    def __init__(self, master_address: str, master_port: int | None = None, *, backend: str = "gloo",
                 group_name: str = DEFAULT_GROUP_NAME, device: torch.device | str | None = None,
                 timeout_s: float = 600.0):
        self.master_address = master_address
        self.master_port = int(master_port) if master_port else None  # None: a free port per open()
        self.backend, self.group_name, self.timeout_s = backend, group_name, timeout_s
        self.device = torch.device(device) if device is not None else (
            torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device()))
        self.group: WeightUpdateGroup | None = None
        self.broken = False  # a failed broadcast poisons the group: close() and open() a new one

    @property
    def allocator(self) -> Allocator | None:
        return None

    def release_unsent(self) -> None:
        return None

    async def open(self, engines) -> None:
        """Create the group: engines join over HTTP while this rank (rank 0, store host) joins here.
        A fresh port per open, so a retry never collides with a half-dead previous group."""
        import asyncio

        if self.group is not None:
            await self.close(engines)
        port = self.master_port or free_port("")
        sizes = [getattr(e, "tp_size", 1) for e in engines]
        spec = WeightGroupSpec(self.master_address, port, 1 + sum(sizes), self.group_name, self.backend,
                               self.timeout_s)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        joins = [asyncio.ensure_future(e.init_weights_update_group(
            spec.master_address, spec.master_port, off, spec.world_size, spec.group_name, spec.backend))
            for e, off in zip(engines, offsets)]
        mine = _in_daemon_thread(WeightUpdateGroup, spec, 0, self.device)
        # If an engine refuses to join, stop waiting at once (the rendezvous would block until the timeout).
        done, _ = await asyncio.wait([mine, *joins], return_when=asyncio.FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if failed:
            for j in joins:
                j.cancel()
            mine.add_done_callback(lambda f: f.exception() is None and f.result().destroy())
            if mine in failed:
                raise mine.exception()
            await _gather_checked(joins, "init_weights_update_group", engines)
        self.group = await mine
        await _gather_checked(joins, "init_weights_update_group", engines)

    async def send(self, engines, bucket: FlatBucket, *, update_id: str, last_bucket: bool,
                   total_tensors: int | None, weight_version: str | None) -> None:
        import asyncio

        if self.group is None:
            raise RuntimeError("DistributedSender.open() was not called")
        for dt, step in _dtype_steps(bucket, update_id, last_bucket, total_tensors, weight_version):
            req = distributed_request(bucket, dt)
            posts = [asyncio.ensure_future(e.update_weights_from_distributed(
                req["names"], req["dtypes"], req["shapes"], group_name=self.group_name,
                load_format="flattened_bucket", weight_version=step.weight_version, staged=step.staged()))
                for e in engines]
            buf = bucket.buffers[dt]
            if buf.device != self.device:
                buf = buf.to(self.device)
            try:
                await self._broadcast_watching(buf, posts)
            except BaseException:
                for p in posts:
                    p.cancel()
                self.broken = True
                raise
            await _gather_checked(posts, "update_weights_from_distributed", engines)

    async def _broadcast_watching(self, buf: torch.Tensor, posts) -> None:
        """Broadcast while watching the engines' HTTP answers: an engine that fails before joining the
        collective would otherwise leave this rank blocked until the group timeout."""
        import asyncio

        if buf.numel() == 0:
            return
        # Launch off the event loop: NCCL creates its communicator on the first collective and blocks the
        # launching thread until every rank has joined, and the engines join only once their HTTP request
        # (sent by this very loop) has arrived. Launching here would deadlock the first sync on GPUs.
        launch = _in_daemon_thread(self.group.start_broadcast, buf, 0)
        deadline = time.monotonic() + self.timeout_s   # NCCL's communicator init is not bound by the pg timeout
        while not (launch.done() and launch.result().is_completed()):   # result() re-raises a failed launch
            failed = [p for p in posts if p.done() and (p.cancelled() or p.exception() is not None)]
            if failed:
                exc = failed[0].exception() if not failed[0].cancelled() else asyncio.CancelledError()
                raise RuntimeError(f"an engine failed while the bucket was being broadcast: {exc}") from exc
            if time.monotonic() > deadline:
                raise RuntimeError(f"the bucket broadcast did not complete within {self.timeout_s:.0f} s")
            await asyncio.sleep(0.002)
        await asyncio.to_thread(self.group.finish, launch.result())

    async def close(self, engines) -> None:
        """Destroy the group on the engines (best effort: a dead engine has nothing to destroy) and here."""
        import asyncio

        if self.group is None:
            return
        try:
            results = await asyncio.gather(*(e.destroy_weights_update_group(self.group_name) for e in engines),
                                           return_exceptions=True)
            for e, r in zip(engines, results):
                if isinstance(r, BaseException):
                    import logging
                    logging.getLogger(__name__).warning("destroying the weight group on %s failed: %s",
                                                        getattr(e, "name", e), r)
        finally:
            self.group.destroy()
            self.group = None
            self.broken = False


def _in_daemon_thread(fn, *args):
    """Run a blocking call on a daemon thread (an abandoned rendezvous must not block interpreter exit)."""
    import asyncio
    import threading

    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run():
        try:
            result = fn(*args)
        except BaseException as e:
            loop.call_soon_threadsafe(lambda exc=e: fut.done() or fut.set_exception(exc))
        else:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

    threading.Thread(target=run, name="weight-group-rendezvous", daemon=True).start()
    return fut


async def _all(engines, fn) -> list:
    import asyncio

    return await _gather_checked([asyncio.ensure_future(fn(e)) for e in engines], "weight update", engines)


async def _gather_checked(futures, call: str, engines) -> list:
    import asyncio

    results = await asyncio.gather(*futures, return_exceptions=True)
    failures = {getattr(e, "name", str(i)): r for i, (e, r) in enumerate(zip(engines, results))
                if isinstance(r, BaseException)}
    if failures:
        from ..rollout.engine import EngineGroupError

        raise EngineGroupError(call, failures)
    return results
