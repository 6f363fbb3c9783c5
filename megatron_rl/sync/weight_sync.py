"""Trainer -> engines weight sync: Megatron TP/PP shards -> HF tensors -> flat buckets -> engines.

Every rank of the training group constructs a `WeightSync` and calls `sync()` together:
* the ranks of data-parallel replica 0 iterate the bridge's streaming export (TP all-gather, PP
  broadcast, HF names and layouts; a collective over the model-parallel group), other replicas wait;
* global rank 0 alone talks to the engines: pause -> flush -> buckets -> continue. Buckets of one
  sync form one atomic update (`staged` ids, the weight version travels with the final bucket), so an
  engine's version changes only after the last bucket is acknowledged;
* if an engine errors or dies mid-sync, rank 0 keeps draining the export (the other ranks are inside
  collectives), resumes generation, relaunches dead engines through the `EngineManager` and the whole
  group retries with a fresh update id. An engine never serves a half-applied update under a new
  version: the embedded engine commits atomically, and SGLang only receives the version with the
  final bucket.

The report splits the time into gather (pulling tensors from the bridge: TP gathers, PP broadcasts,
HF conversion), bucket (flattening into per-dtype buffers) and send (requests, copies/broadcasts,
engine-side staging and commit), plus pause/flush/continue.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ..rollout.client import EngineError
from ..rollout.engine import BackgroundLoop, EngineGroupError, EngineManager
from .buckets import DEFAULT_BUCKET_BYTES, FlatBucket, bucketize
from .transport import ColocatedSender, DistributedSender

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A sync failed and could not be recovered; the engines keep serving their previous weights."""


@dataclasses.dataclass
class WeightSyncConfig:
    transport: str = "colocated"          # colocated (CUDA IPC / shared memory) | distributed (NCCL / gloo)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    export_dtype: str | None = None       # None: the actor's param dtype
    pause_mode: str = "abort"             # abort | in_place | retract (in_place skips the flush)
    flush_retries: int = 60
    max_attempts: int = 3
    master_address: str = "127.0.0.1"     # distributed: where engines reach trainer rank 0
    master_port: int | None = None        # None: a free port per attempt
    backend: str | None = None            # distributed: None = nccl on GPU, gloo on CPU
    group_name: str = "weight_update_group"
    group_timeout_s: float = 600.0
    sglang_native: bool = False           # colocated payloads built with SGLang's own classes

    def validate(self) -> None:
        if self.transport not in ("colocated", "distributed"):
            raise ValueError(f"weight_sync.transport={self.transport!r}: use 'colocated' or 'distributed'")
        if self.bucket_bytes <= 0:
            raise ValueError(f"weight_sync.bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.pause_mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"weight_sync.pause_mode={self.pause_mode!r}: use abort, in_place or retract")
        if self.max_attempts < 1:
            raise ValueError(f"weight_sync.max_attempts must be >= 1, got {self.max_attempts}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"weight_sync.backend={self.backend!r}: use gloo, nccl or null")
        if self.export_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"weight_sync.export_dtype={self.export_dtype!r}: use float32, bfloat16, float16 or null")


@dataclasses.dataclass
class SyncReport:
    weight_version: str
    attempts: int
    relaunched: list[str]
    num_tensors: int
    num_buckets: int
    bytes: int
    seconds: float           # whole sync, pause to continue
    gather_s: float
    bucket_s: float
    send_s: float
    control_s: float         # pause + flush + continue

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def send_gbps(self) -> float:
        return self.bytes / self.send_s / 1e9 if self.send_s > 0 else 0.0

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(gbps=round(self.gbps, 3), send_gbps=round(self.send_gbps, 3))
        return d


@dataclasses.dataclass
class _Attempt:
    ok: bool = True
    error: str | None = None
    failed_engines: list[str] = dataclasses.field(default_factory=list)
    refused: bool = False   # the engines answered that the bucket itself is wrong: retrying cannot help
    num_tensors: int = 0
    num_buckets: int = 0
    bytes: int = 0
    gather_s: float = 0.0
    bucket_s: float = 0.0
    send_s: float = 0.0
    control_s: float = 0.0


class _TimedStream:
    """Wraps the export iterator to measure the time spent producing tensors (gather + HF layout)."""

    def __init__(self, it: Iterable[tuple[str, torch.Tensor]]):
        self._it = iter(it)
        self.seconds = 0.0
        self.count = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        t = time.perf_counter()
        try:
            item = next(self._it)
        finally:
            self.seconds += time.perf_counter() - t
        self.count += 1
        return item


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class WeightSync:
    """See the module docstring. `export_fn(dtype)` streams (hf_name, full tensor) collectively
    (``MegatronActor.export_hf``); `engines` is needed on global rank 0 only."""

    def __init__(self, export_fn: Callable[[torch.dtype | None], Iterable[tuple[str, torch.Tensor]]],
                 engines: EngineManager | None, cfg: WeightSyncConfig | None = None, *,
                 device: torch.device | None = None,
                 progress: Callable[[int, int], None] | None = None):
        self.cfg = cfg or WeightSyncConfig()
        self.cfg.validate()
        self.export_fn = export_fn
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                 else torch.device("cpu"))
        self.progress = progress  # called on rank 0 after each bucket is acknowledged: (index, bytes)
        self.engines = engines
        self._loop: BackgroundLoop | None = None
        self._sender = None
        if self.rank == 0:
            if engines is None:
                raise ValueError("WeightSync on global rank 0 needs the engines")
            self._loop = BackgroundLoop("weight-sync")
            self._sender = self._make_sender()

    @classmethod
    def for_actor(cls, actor, engines: EngineManager | None, cfg: WeightSyncConfig | None = None, **kw) -> "WeightSync":
        return cls(actor.export_hf, engines, cfg, device=getattr(actor, "device", None), **kw)

    def _make_sender(self):
        if self.cfg.transport == "colocated":
            return ColocatedSender(self.device, sglang_native=self.cfg.sglang_native)
        backend = self.cfg.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        return DistributedSender(self.cfg.master_address, self.cfg.master_port, backend=backend,
                                 group_name=self.cfg.group_name, device=self.device if backend == "nccl" else "cpu",
                                 timeout_s=self.cfg.group_timeout_s)

    # ------------------------------------------------------------------ public

    def sync(self, weight_version: str | int | None = None) -> SyncReport:
        """Push the current weights to every engine. Collective over the training group; every rank
        returns the same report. Raises WeightSyncError when all attempts failed."""
        t0 = time.perf_counter()
        exporting = self._exports()
        target = self._broadcast(self._target_version(weight_version) if self.rank == 0 else None)
        relaunched: list[str] = []
        last_error = None
        for attempt in range(1, self.cfg.max_attempts + 1):
            state = self._attempt(target, exporting) if exporting else _Attempt()
            state = self._broadcast(state if self.rank == 0 else None)
            if state.ok:
                return SyncReport(weight_version=target, attempts=attempt, relaunched=relaunched,
                                  num_tensors=state.num_tensors, num_buckets=state.num_buckets, bytes=state.bytes,
                                  seconds=time.perf_counter() - t0, gather_s=state.gather_s,
                                  bucket_s=state.bucket_s, send_s=state.send_s, control_s=state.control_s)
            last_error = state.error
            if state.refused:
                raise WeightSyncError(f"weight sync refused by the engine (not retried: the same weights would be "
                                      f"refused again; the engine keeps serving its previous version): {last_error}")
            log.warning("weight sync attempt %d/%d failed: %s", attempt, self.cfg.max_attempts, state.error)
            if attempt < self.cfg.max_attempts:
                outcome = self._recover(state) if self.rank == 0 else None
                outcome = self._broadcast(outcome)
                if isinstance(outcome, str):  # recovery itself failed
                    raise WeightSyncError(f"weight sync failed and recovery failed: {outcome} "
                                          f"(sync error: {state.error})")
                relaunched += outcome
        raise WeightSyncError(f"weight sync failed after {self.cfg.max_attempts} attempts: {last_error}")

    def close(self) -> None:
        if self.rank == 0 and self._loop is not None:
            try:
                self._loop.run(self._sender.close(self.engines.engines), timeout=60)
            except Exception as e:
                log.warning("closing the weight-sync transport failed: %s", e)
            try:
                self._loop.run(self.engines.close(), timeout=30)  # this loop's HTTP sessions
            except Exception:
                pass
            self._loop.close()
            self._loop = None

    # ------------------------------------------------------------------ collective helpers

    def _exports(self) -> bool:
        """Only data-parallel replica 0 (the one holding global rank 0) runs the collective export."""
        try:
            from megatron.core import parallel_state as ps
            if ps.model_parallel_is_initialized():
                return ps.get_data_parallel_rank() == 0
        except ImportError:
            pass
        return True

    def _broadcast(self, obj):
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _target_version(self, requested) -> str:
        if requested is not None:
            return str(requested)
        versions = self._loop.run(self.engines.weight_versions(), timeout=120)
        nums = []
        for v in versions.values():
            try:
                nums.append(int(v))
            except (TypeError, ValueError):
                nums.append(0)
        return str(max(nums, default=0) + 1)

    # ------------------------------------------------------------------ one attempt

    def _attempt(self, version: str, exporting: bool) -> _Attempt:
        dtype = getattr(torch, self.cfg.export_dtype) if self.cfg.export_dtype else None
        stream = _TimedStream(self.export_fn(dtype))
        if self.rank != 0:
            for _ in stream:  # take part in the collectives
                pass
            return _Attempt()
        st = _Attempt()
        engines = self.engines.engines
        update_id = uuid.uuid4().hex
        t = time.perf_counter()
        try:
            self._loop.run(self._begin(engines), timeout=None)
        except Exception as e:
            st.ok, st.error = False, f"pause/flush/connect failed: {e}"
            st.failed_engines = _failed_names(e)
        st.control_s += time.perf_counter() - t

        buckets = bucketize(stream, cap_bytes=self.cfg.bucket_bytes, device=self.device,
                            allocate=self._sender.allocator)
        prev: FlatBucket | None = None
        index = 0
        try:
            while st.ok:
                t_b = time.perf_counter()
                gathered_before = stream.seconds
                bucket = next(buckets, None)
                _sync_device(self.device)
                st.bucket_s += (time.perf_counter() - t_b) - (stream.seconds - gathered_before)
                if prev is not None:
                    self._send(prev, index, update_id, last=bucket is None, total=None if bucket is not None
                               else stream.count, version=version, st=st)
                    index += 1
                if bucket is None:
                    break
                prev = bucket
        finally:
            for _ in stream:  # after a failure, drain so the other ranks' collectives complete
                pass
            self._sender.release_unsent()
            t = time.perf_counter()
            try:
                self._loop.run(self.engines.continue_generation(), timeout=300)
            except Exception as e:
                if st.ok:
                    st.ok, st.error = False, f"continue_generation failed: {e}"
                st.failed_engines = sorted(set(st.failed_engines) | set(_failed_names(e)))
            st.control_s += time.perf_counter() - t
        st.gather_s = stream.seconds
        st.num_tensors = stream.count
        return st

    async def _begin(self, engines) -> None:
        await self.engines.pause(self.cfg.pause_mode)
        if self.cfg.pause_mode == "abort":
            await self.engines.flush_cache(retries=self.cfg.flush_retries)
        if isinstance(self._sender, DistributedSender) and (self._sender.group is None or self._sender.broken):
            await self._sender.open(engines)

    def _send(self, bucket: FlatBucket, index: int, update_id: str, *, last: bool, total: int | None,
              version: str, st: _Attempt) -> None:
        t = time.perf_counter()
        try:
            self._loop.run(self._sender.send(self.engines.engines, bucket, update_id=update_id, last_bucket=last,
                                             total_tensors=total, weight_version=version), timeout=None)
        except Exception as e:
            st.ok = False
            st.error = f"bucket {index} ({len(bucket.metas)} tensors, {bucket.nbytes} bytes): {e}"
            st.failed_engines = _failed_names(e)
            st.refused = _is_refusal(e)
            if isinstance(self._sender, DistributedSender):
                self._sender.broken = True
        else:
            st.num_buckets += 1
            st.bytes += bucket.nbytes
            if self.progress is not None:
                self.progress(index, bucket.nbytes)
        finally:
            st.send_s += time.perf_counter() - t

    def _recover(self, st: _Attempt) -> list[str] | str:
        """Relaunch dead engines; returns their names, or an error string when recovery is impossible."""
        try:
            relaunched = self._loop.run(self.engines.ensure_healthy(), timeout=None)
            if isinstance(self._sender, DistributedSender):
                self._loop.run(self._sender.close(self.engines.engines), timeout=120)
            return relaunched
        except Exception as e:
            return f"{type(e).__name__}: {e}"


def _is_refusal(e: BaseException) -> bool:
    """Every engine that failed answered with a 4xx client error (names, shapes or dtypes that do not fit
    its model). Lost connections, timeouts, 5xx and conflicts (408/409/429) stay retryable."""
    errors = list(e.failures.values()) if isinstance(e, EngineGroupError) else [e]
    return bool(errors) and all(isinstance(x, EngineError) and x.status is not None and 400 <= x.status < 500
                                and x.status not in (408, 409, 429) for x in errors)


def _failed_names(e: BaseException) -> list[str]:
    if isinstance(e, EngineGroupError):
        return sorted(e.failures)
    return []
