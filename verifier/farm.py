"""The verifier farm: many candidates through a CPU compile pool and one worker per device.

MooreEval's split (musacoder.md §1.5): compiling is CPU/IO work and takes tens of seconds per
CUDA extension; checking and timing needs the device for milliseconds to seconds. Running both in
one loop leaves the device idle while code compiles. The farm instead runs

    submit -> [precheck: extract + static rules, in the caller]  -> cheap rejects resolve here
           -> [result cache / in-flight dedup]                     -> repeats resolve here
           -> compile queue -> N compile slots   (build_candidate, cached by code hash)
           -> device queue  -> one slot per device (run_candidate pinned to that device)
           -> exactly one VerifyResult per submission

Guarantees: every ``submit`` returns a future that resolves to exactly one ``VerifyResult`` (it
never raises); farm-side failures (a slot raised, crashed or hung) are ``infra``, retried up to
``FarmConfig.max_retries`` times on a fresh worker and then returned as ``infra`` with
``attempts`` set; a bounded number of submissions is in flight (``submit`` blocks, or raises
``FarmFull``). The same pipeline runs on Ray actors in ``verifier.ray_farm``.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import dataclasses
import itertools
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Sequence

from .farm_workers import ProcessSlot, SlotCrashed, SlotError, SlotWedged, ThreadSlot
from .pch import BUILD_TIMEOUT_S
from .result_cache import ResultCache, cache_key, config_fingerprint, sha256_text
from .size_profiles import apply_size_profile, parse_fit_profile
from .types import TASK_FAULT_RULES, Category, VerifyResult

BuildFn = Callable[[Any, str, Any], Any]                 # (task, code, cfg) -> BuildResult
RunFn = Callable[[Any, str, Any, Any, "int | None"], VerifyResult]  # (task, code, build, cfg, device_index)
PrecheckFn = Callable[[Any, str, Any], "str | VerifyResult"]  # (task, response, cfg) -> code or verdict


class FarmFull(queue.Full):
    """``submit(block=False)`` found ``max_in_flight`` submissions already in flight."""


class FarmClosed(RuntimeError):
    pass


@dataclasses.dataclass
class FarmConfig:
    """How the farm is laid out. The verdict itself is configured by ``VerifierConfig``."""

    compile_workers: int | None = None        # None: os.cpu_count()
    device_workers: int | None = None         # None: one per device (GPU) / cpu_device_workers (CPU)
    cpu_device_workers: int = 1               # execution workers when the backend is "cpu"
    # device-stage workers per GPU: they share the device for start-up and correctness and take turns to
    # time (verifier.device_lock), so one GPU is not left idle while a worker starts its next child
    workers_per_device: int = 3
    device_indices: Sequence[int] | None = None  # GPUs to use; None: all visible
    max_in_flight: int = 512                  # backpressure bound on unfinished submissions
    block_when_full: bool = True              # submit blocks (True) or raises FarmFull (False)
    max_retries: int = 2                      # infra retries after the first attempt
    # build_candidate already runs every import and compiler in its own sandboxed processes, so by
    # default compile slots are threads driving those processes (no torch import per slot); "process"
    # also isolates the build harness itself. Device slots are processes: the reference runs in the
    # worker and flips process-global torch flags, and a wedged device worker must be killable.
    compile_mode: str = "thread"              # "thread" | "process" (spawned workers)
    device_mode: str = "process"              # "process" (one spawned worker per device) | "thread"
    compile_deadline_s: float | None = None   # hang watchdog; None: compile_timeout_s + 120 (+ a PCH build)
    device_deadline_s: float | None = None    # hang watchdog; None: from the run, start-up and device-wait limits
    recycle_after: int = 200                  # restart a process worker after this many calls
    # device workers keep one sandboxed run child started ahead of the next candidate (its interpreter,
    # torch import and device init overlap the current candidate; never its timing)
    warm_spare: bool = True
    result_cache: bool = True                 # in-memory verdict cache + in-flight dedup
    result_cache_path: str | None = None      # also persist verdicts to this SQLite file
    size_profile: str | None = None           # a manifest size profile (e.g. "gpu") or fit[:MiB[:GFLOP]] for tasks
    device_type: str | None = None            # cache-key device type; None: detected
    build_fn: BuildFn | None = None           # default verifier.build.build_candidate
    run_fn: RunFn | None = None               # default verifier.evaluate.run_candidate
    precheck_fn: PrecheckFn | None = None     # default: extract_candidate + static checks

    def validate(self) -> None:
        for name in ("compile_mode", "device_mode"):
            if getattr(self, name) not in ("process", "thread"):
                raise ValueError(f"FarmConfig.{name} must be 'process' or 'thread', got {getattr(self, name)!r}")
        for name in ("compile_workers", "device_workers", "workers_per_device"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"FarmConfig.{name} must be >= 1, got {v}")
        if self.max_in_flight < 1:
            raise ValueError(f"FarmConfig.max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_retries < 0:
            raise ValueError(f"FarmConfig.max_retries must be >= 0, got {self.max_retries}")
        try:
            parse_fit_profile(self.size_profile)
        except ValueError as e:
            raise ValueError(f"FarmConfig.size_profile: {e}") from None


# ----------------------------------------------------------------------------- default stage fns

def default_build_fn(task: Any, code: str, cfg: Any) -> Any:
    from .build import build_candidate
    return build_candidate(task, code, cfg)


def default_run_fn(task: Any, code: str, build: Any, cfg: Any, device_index: int | None) -> VerifyResult:
    from .evaluate import run_candidate
    return run_candidate(task, code, build, cfg, device_index=device_index)


def warm_run_fn(task: Any, code: str, build: Any, cfg: Any, device_index: int | None) -> VerifyResult:
    """``default_run_fn`` with a warm spare child per device in this worker (``verifier.warm_spare``)."""
    from .evaluate import run_candidate
    from .warm_spare import process_spares
    return run_candidate(task, code, build, cfg, device_index=device_index, spares=process_spares())


def default_precheck(task: Any, response: str, cfg: Any) -> "str | VerifyResult":
    """Extraction and static rules of the verifier core (the first steps of ``verify``), run in the
    submitting thread so cheap rejects never occupy the compile pool."""
    from .evaluate import precheck
    return precheck(task, response, cfg)


def build_failure_result(task: Any, build: Any, cfg: Any, code: str) -> VerifyResult:
    """The core's verdict for a build that produced no loadable extension (compile error / timeout)."""
    from .evaluate import build_failure_result as core_build_failure
    return core_build_failure(task, cfg, build, code)


# ----------------------------------------------------------------------------- pipeline internals

_STOP_PRIO = 2  # queue priority of the stop sentinel: after every queued job


@dataclasses.dataclass(eq=False)
class _Job:
    seq: int
    task: Any
    code: str
    key: str | None
    future: cf.Future
    followers: list = dataclasses.field(default_factory=list)   # deduplicated identical submissions
    attempts: int = 1
    build: Any = None
    infra_reasons: list = dataclasses.field(default_factory=list)


class _Stage:
    """A priority queue (retries first) served by slots, one supervisor thread per slot."""

    def __init__(self, name: str, slots: list, deadline_s: float | None, groups: list | None = None):
        self.name = name
        self.slots = slots
        self.deadline_s = deadline_s
        # slots that share one device: how long each device had at least one of its slots busy
        self.group_of = list(groups) if groups is not None else list(range(len(slots)))
        self.occupied_s: dict[Any, float] = {g: 0.0 for g in self.group_of}
        self._group_busy: dict[Any, int] = {g: 0 for g in self.group_of}
        self._occupied_since: dict[Any, float] = {}
        self.queue: queue.PriorityQueue = queue.PriorityQueue()
        self.busy_s = 0.0
        self.busy_since: dict[int, float] = {}
        self.calls = 0
        self.restarts = 0
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self._order = itertools.count()

    def put(self, job: _Job | None, retry: bool = False) -> None:
        """Retries go first, then new work in submission order; ``None`` (stop) goes last."""
        prio = _STOP_PRIO if job is None else (0 if retry else 1)
        self.queue.put((prio, next(self._order), job))

    def busy_total(self, now: float) -> float:
        with self.lock:
            return self.busy_s + sum(now - t for t in self.busy_since.values())

    def occupied_total(self, now: float) -> float:
        """Seconds summed over devices during which a device had at least one busy slot."""
        with self.lock:
            return sum(self.occupied_s.values()) + sum(now - t for t in self._occupied_since.values())

    def mark_busy(self, index: int, t: float) -> None:
        """Slot ``index`` starts a call (caller holds ``lock``)."""
        self.busy_since[index] = t
        g = self.group_of[index]
        if self._group_busy[g] == 0:
            self._occupied_since[g] = t
        self._group_busy[g] += 1

    def mark_idle(self, index: int, t: float) -> None:
        """Slot ``index`` finished its call (caller holds ``lock``)."""
        self.busy_s += t - self.busy_since.pop(index, t)
        g = self.group_of[index]
        self._group_busy[g] -= 1
        if self._group_busy[g] == 0:
            self.occupied_s[g] += t - self._occupied_since.pop(g, t)


_LIVE_FARMS: "weakref.WeakSet[VerifierFarm]" = weakref.WeakSet()


@atexit.register
def _close_live_farms() -> None:
    for farm in list(_LIVE_FARMS):
        try:
            farm.close(drain=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown: best effort
            pass


class VerifierFarm:
    """In-process farm. Thread-safe: any thread may submit."""

    def __init__(self, cfg: Any, farm: FarmConfig | None = None):
        farm = farm if farm is not None else FarmConfig()
        farm.validate()
        self.farm = farm
        self.cfg = cfg
        self.backend = getattr(cfg, "backend", "cpu")
        self._device_indices = self._resolve_devices()
        self.device_type = farm.device_type or self._detect_device_type()
        self._cache = ResultCache(farm.result_cache_path) if farm.result_cache else None
        self._owned_build_dir: str | None = None
        if getattr(cfg, "build_cache_dir", None) is None and dataclasses.is_dataclass(cfg):
            # one build cache shared by every compile and device worker of this farm
            self._owned_build_dir = tempfile.mkdtemp(prefix="verifier-builds-")
            self.cfg = cfg = dataclasses.replace(cfg, build_cache_dir=self._owned_build_dir)
        self._build_fn = farm.build_fn or default_build_fn
        self._run_fn = farm.run_fn or (warm_run_fn if farm.warm_spare else default_run_fn)
        self._precheck = farm.precheck_fn or default_precheck
        self._cfg_fp = config_fingerprint(cfg)
        self._inflight: dict[str, _Job] = {}
        self._lock = threading.RLock()
        self._slots_free = threading.BoundedSemaphore(farm.max_in_flight)
        self._seq = itertools.count()
        self._closed = False      # no new submissions
        self._stopping = False    # no more retries: close() is resolving what is left
        self._shut = False
        self._profiled: dict[tuple, Any] = {}
        self._counters = {"submitted": 0, "completed": 0, "cache_hits": 0, "dedup_hits": 0,
                          "precheck_rejects": 0, "retries": 0, "infra_final": 0}
        self._categories: dict[str, int] = {}
        self._t_start = time.monotonic()
        self._t_first_build: float | None = None      # any build back, a failed one included
        self._t_first_device_job: float | None = None  # the first successful build: the devices have work
        self._unfinished: set[_Job] = set()

        n_compile = farm.compile_workers or os.cpu_count() or 1
        # a build may also make its flag set's precompiled header (verifier.pch), outside its compile budget
        compile_deadline = farm.compile_deadline_s or (getattr(cfg, "compile_timeout_s", 600.0) + 120.0
                                                       + (BUILD_TIMEOUT_S if getattr(cfg, "pch_after_compiles", 0) else 0))
        # a stage may also wait for the device twice (shared, then exclusive) and for its warm spare
        device_deadline = farm.device_deadline_s or (2 * getattr(cfg, "run_timeout_s", 180.0) + 120.0
                                                     + 2 * getattr(cfg, "device_wait_timeout_s", 0.0)
                                                     + getattr(cfg, "startup_timeout_s", 0.0))
        self._compile = _Stage("compile", [self._make_compile_slot(i) for i in range(n_compile)], compile_deadline)
        self._device = _Stage("device", [self._make_device_slot(i, d) for i, d in enumerate(self._device_indices)],
                              device_deadline, groups=self._device_groups())
        for stage in (self._compile, self._device):
            for i, slot in enumerate(stage.slots):
                t = threading.Thread(target=self._supervise, args=(stage, i, slot), daemon=True,
                                     name=f"farm-{stage.name}-{i}")
                stage.threads.append(t)
                t.start()
        _LIVE_FARMS.add(self)

    # ------------------------------------------------------------------ layout (overridden by Ray)
    def _resolve_devices(self) -> list[int | None]:
        f = self.farm
        if self.backend == "cpu":
            return [None] * (f.device_workers or f.cpu_device_workers)
        if f.device_indices is not None:
            idx = list(f.device_indices)
        else:
            idx = list(range(_device_count(self.backend)))
        if not idx:
            raise RuntimeError(f"backend {self.backend!r}: no devices visible to the farm")
        if f.device_workers is not None:
            return [idx[i % len(idx)] for i in range(f.device_workers)]
        return [i for i in idx for _ in range(f.workers_per_device)]

    def _device_groups(self) -> list:
        """Which device each device slot runs on (slots of one device share it; see ``device_lock``)."""
        return list(self._device_indices)

    def _detect_device_type(self) -> str:
        if self.backend == "cpu":
            import platform
            return f"cpu:{platform.machine()}"
        return _device_name(self.backend, next((i for i in self._device_indices if i is not None), 0))

    def _make_compile_slot(self, i: int) -> Any:
        name = f"compile-{i}"
        if self.farm.compile_mode == "thread":
            return ThreadSlot(self._build_fn, name)
        return ProcessSlot(self._build_fn, name, recycle_after=self.farm.recycle_after)

    def _make_device_slot(self, i: int, device_index: int | None) -> Any:
        name = f"device-{i}" if device_index is None else f"device-{i}-{self.backend}{device_index}"
        if self.farm.device_mode == "thread":
            return ThreadSlot(self._run_fn, name)
        return ProcessSlot(self._run_fn, name, recycle_after=self.farm.recycle_after)

    def _device_args(self, job: _Job, slot_index: int) -> tuple:
        return (job.task, job.code, job.build, self.cfg, self._device_indices[slot_index])

    # ------------------------------------------------------------------ public API
    def submit(self, task: Any, response: str, block: bool | None = None,
               timeout: float | None = None) -> cf.Future:
        """Queue one candidate; the future resolves to exactly one VerifyResult (never an exception)."""
        if self._closed:
            raise FarmClosed("the farm is closed")
        block = self.farm.block_when_full if block is None else block
        if not self._slots_free.acquire(blocking=block, timeout=timeout if block else None):
            raise FarmFull(f"{self.farm.max_in_flight} submissions already in flight")
        fut: cf.Future = cf.Future()
        fut.set_running_or_notify_cancel()
        fut.add_done_callback(lambda _f: self._slots_free.release())
        with self._lock:
            self._counters["submitted"] += 1
        try:
            self._admit(task, response, fut)
        except BaseException as e:  # noqa: BLE001 - a farm bug must still produce one verdict
            self._resolve(fut, self._infra(task, f"farm error at submit: {type(e).__name__}: {e}", 1, "submit"))
        return fut

    def submit_batch(self, items: Iterable[tuple[Any, str]]) -> list[cf.Future]:
        """Submit in order, blocking for room as needed (never raises FarmFull)."""
        return [self.submit(t, r, block=True) for t, r in items]

    def verify_batch(self, items: Sequence[tuple[Any, str]], progress: bool = False) -> list[VerifyResult]:
        """Blocking; results in the order of ``items``."""
        items = list(items)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(items), desc="verify", unit="cand", dynamic_ncols=True)
        futs: list[cf.Future] = []
        for t, r in items:
            f = self.submit(t, r, block=True)
            if bar is not None:
                f.add_done_callback(lambda _f: bar.update(1))
            futs.append(f)
        try:
            return [f.result() for f in futs]
        finally:
            if bar is not None:
                bar.close()

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            counters = dict(self._counters)
            categories = dict(self._categories)
            in_flight = len(self._unfinished)
        since = self._t_first_build
        first_job = self._t_first_device_job
        n_dev = max(1, len(self._device.slots))
        n_devices = max(1, len(set(self._device.group_of)))
        dev_busy = self._device.busy_total(now)
        dev_occupied = self._device.occupied_total(now)
        comp_busy = self._compile.busy_total(now)
        wall = now - self._t_start
        return {
            **counters,
            "in_flight": in_flight,
            "categories": categories,
            "queues": {"compile": self._compile.queue.qsize(), "device": self._device.queue.qsize()},
            "compile": {"workers": len(self._compile.slots), "calls": self._compile.calls,
                        "restarts": self._compile.restarts, "busy_s": comp_busy,
                        "busy_fraction": comp_busy / (wall * len(self._compile.slots)) if wall > 0 else 0.0},
            "device": {"workers": len(self._device.slots), "calls": self._device.calls,
                       "restarts": self._device.restarts, "busy_s": dev_busy,
                       "busy_fraction": (dev_busy / ((now - since) * n_dev)) if since and now > since else 0.0,
                       # the share of time each device had a candidate on it (any of its workers busy)
                       "device_occupied_fraction": (dev_occupied / ((now - since) * n_devices))
                       if since and now > since else 0.0,
                       # the same once compiles flow: from the first build that gave the devices work
                       "device_occupied_fraction_since_first_job": (dev_occupied / ((now - first_job) * n_devices))
                       if first_job and now > first_job else 0.0,
                       "workers_per_device": round(n_dev / n_devices, 2),
                       "device_type": self.device_type},
            "cache_entries": len(self._cache) if self._cache is not None else 0,
            "wall_s": wall,
        }

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the farm. ``drain`` waits for in-flight work; anything left resolves as ``infra``."""
        if self._shut:
            return
        self._closed = True
        if drain:
            with self._lock:
                pending = [j.future for j in self._unfinished]
            cf.wait(pending, timeout=timeout)
        self._stopping = True
        self._shut = True
        with self._lock:
            leftovers = list(self._unfinished)
        for job in leftovers:
            self._finish(job, self._infra(job.task, "farm closed before the verdict", job.attempts, "closed"))
        for stage in (self._compile, self._device):
            for _ in stage.slots:
                stage.put(None)
        for stage in (self._compile, self._device):
            for t in stage.threads:
                t.join(timeout=5 if drain else 1)
            for slot in stage.slots:
                try:
                    slot.close()
                except Exception:  # noqa: BLE001
                    pass
        if self._run_fn is warm_run_fn and self.farm.device_mode == "thread":
            from .warm_spare import process_spares
            process_spares().close()   # the spares of thread slots live in this process
        if self._cache is not None:
            self._cache.close()
        if self._owned_build_dir:
            shutil.rmtree(self._owned_build_dir, ignore_errors=True)
            self._owned_build_dir = None
        _LIVE_FARMS.discard(self)

    def __enter__(self) -> "VerifierFarm":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ pipeline
    def _profiled_task(self, task: Any) -> Any:
        if not self.farm.size_profile:
            return task
        k = (getattr(task, "path", None), sha256_text(task.source), self.farm.size_profile)
        if k not in self._profiled:
            self._profiled[k] = apply_size_profile(task, self.farm.size_profile)
        return self._profiled[k]

    def _admit(self, task: Any, response: str, fut: cf.Future) -> None:
        task = self._profiled_task(task)
        checked = self._precheck(task, response, self.cfg)
        if isinstance(checked, VerifyResult):
            checked.details.setdefault("farm_stage", "precheck")
            with self._lock:
                self._counters["precheck_rejects"] += 1
            self._resolve(fut, checked)
            return
        code = checked
        key = None
        if self._cache is not None:
            key = cache_key(task.task_id, task.source, code, self.backend, self.device_type, self._cfg_fp)
            hit = self._cache.get(key)
            if hit is not None:
                with self._lock:
                    self._counters["cache_hits"] += 1
                self._resolve(fut, hit)
                return
        job = _Job(seq=next(self._seq), task=task, code=code, key=key, future=fut)
        with self._lock:
            leader = self._inflight.get(key) if key is not None else None
            if leader is not None:
                leader.followers.append(fut)
                self._counters["dedup_hits"] += 1
                return
            if key is not None:
                self._inflight[key] = job
            self._unfinished.add(job)
        self._compile.put(job)

    def _supervise(self, stage: _Stage, index: int, slot: Any) -> None:
        while True:
            _, _, job = stage.queue.get()
            if job is None:
                return
            if job.future.done():
                continue  # resolved by close()
            t0 = time.monotonic()
            with stage.lock:
                stage.mark_busy(index, t0)
            try:
                args = ((job.task, job.code, self.cfg) if stage is self._compile
                        else self._device_args(job, index))
                try:
                    out = slot.call(args, stage.deadline_s)
                except (SlotCrashed, SlotWedged) as e:
                    with stage.lock:
                        stage.restarts += 1
                    slot.restart()
                    self._retry_or_fail(stage, job, str(e))
                    continue
                except SlotError as e:
                    self._retry_or_fail(stage, job, str(e))
                    continue
                finally:
                    t1 = time.monotonic()
                    with stage.lock:
                        stage.mark_idle(index, t1)
                        stage.calls += 1
                if stage is self._compile:
                    self._after_build(job, out)
                else:
                    self._after_run(job, out)
            except BaseException as e:  # noqa: BLE001 - never lose a job to a farm bug
                self._finish(job, self._infra(job.task, f"farm error in {stage.name}: {type(e).__name__}: {e}",
                                              job.attempts, stage.name))

    def _after_build(self, job: _Job, build: Any) -> None:
        if self._t_first_build is None:
            self._t_first_build = time.monotonic()
        if not hasattr(build, "ok"):
            raise TypeError(f"build_fn returned {type(build).__name__}, expected a BuildResult")
        if build.ok:
            job.build = build
            if self._t_first_device_job is None:
                self._t_first_device_job = time.monotonic()
            self._device.put(job)
            return
        if getattr(build, "error", None) == "infra":  # the build harness failed, not the code
            self._retry_or_fail(self._compile, job, f"build infra: {build.log_tail[-1000:]}")
            return
        result = build_failure_result(job.task, build, self.cfg, job.code)
        if result.category == Category.INFRA:
            self._retry_or_fail(self._compile, job, result.feedback or "infra during build")
            return
        result.details.setdefault("farm_stage", "compile")
        self._finish(job, result)

    def _after_run(self, job: _Job, result: Any) -> None:
        if not isinstance(result, VerifyResult):
            raise TypeError(f"run_fn returned {type(result).__name__}, expected a VerifyResult")
        if result.category == Category.INFRA and result.rule not in TASK_FAULT_RULES:
            self._retry_or_fail(self._device, job, result.feedback or "infra on device", result)
            return
        result.details.setdefault("farm_stage", "device")
        self._finish(job, result)

    def _retry_or_fail(self, stage: _Stage, job: _Job, reason: str, last: VerifyResult | None = None) -> None:
        job.infra_reasons.append(f"attempt {job.attempts} ({stage.name}): {reason[-500:]}")
        if job.attempts <= self.farm.max_retries and not self._stopping:
            job.attempts += 1
            with self._lock:
                self._counters["retries"] += 1
            stage.put(job, retry=True)
            return
        result = last if last is not None else self._infra(job.task, reason, job.attempts, stage.name)
        self._finish(job, result)

    def _infra(self, task: Any, reason: str, attempts: int, stage: str) -> VerifyResult:
        return VerifyResult(task_id=getattr(task, "task_id", "?"), category=Category.INFRA, reward=None,
                            feedback="verifier infrastructure failure (not a verdict on the code)",
                            backend=self.backend, attempts=attempts,
                            details={"farm_stage": stage, "infra_reason": reason[-2000:]})

    def _finish(self, job: _Job, result: VerifyResult) -> None:
        with self._lock:
            if job not in self._unfinished:
                return  # already resolved (close() raced a worker): exactly one verdict
            self._unfinished.discard(job)
            if job.key is not None and self._inflight.get(job.key) is job:
                del self._inflight[job.key]
            followers = list(job.followers)
        result.attempts = job.attempts
        if job.infra_reasons:
            result.details.setdefault("infra_history", job.infra_reasons)
        if not result.code_hash:
            result.code_hash = sha256_text(job.code)[:16]
        if result.category == Category.INFRA:
            with self._lock:
                self._counters["infra_final"] += 1
        elif self._cache is not None and job.key is not None:
            self._cache.put(job.key, result)
        self._resolve(job.future, result)
        for f in followers:
            self._resolve(f, dataclasses.replace(result, cached=True, details=dict(result.details)))

    def _resolve(self, fut: cf.Future, result: VerifyResult) -> None:
        try:
            fut.set_result(result)  # done-callbacks (slot release, progress) run here
        except cf.InvalidStateError:
            return  # already resolved: exactly one verdict per submission
        with self._lock:
            self._counters["completed"] += 1
            self._categories[result.category.value] = self._categories.get(result.category.value, 0) + 1


# ----------------------------------------------------------------------------- device discovery

def _device_count(backend: str) -> int:
    try:
        from . import devices
        fn = getattr(devices, "device_count", None)
        if fn is not None:
            return int(fn(backend))
    except ImportError:
        pass
    if backend == "cuda":
        import torch
        return torch.cuda.device_count()  # driver query, creates no CUDA context
    if backend == "musa":
        import torch_musa  # noqa: F401  (lazy: MUSA machines only)
        import torch
        return torch.musa.device_count()
    raise ValueError(f"unknown backend {backend!r}")


def _device_name(backend: str, index: int) -> str:
    """Device model for the cache key, read without creating a device context where possible."""
    if backend == "cuda":
        try:
            import pynvml
            pynvml.nvmlInit()
            try:
                name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
            finally:
                pynvml.nvmlShutdown()
            return f"cuda:{name.decode() if isinstance(name, bytes) else name}"
        except Exception:  # noqa: BLE001 - NVML missing: fall back to the backend name
            return "cuda"
    return backend
