"""Device-stage children started ahead of their candidate ("warm spares").

Starting a sandboxed run child costs seconds before any candidate code runs: the interpreter, the torch
import, the device context, the profiler's first start. On one GPU that start-up is a large share of the
device stage, so a farm device worker keeps one spare child per (device, config): when a candidate takes
the spare, the next spare starts and comes up while this candidate is imported and checked.

- Every candidate still gets a fresh process that no other candidate has touched. A spare has run only
  the harness (isolation, imports, device init). The task and candidate files are written into its working
  directory after it is taken.
- A spare's device start-up never overlaps a timing phase. The child starts in two steps: its imports (torch and
  the harness, seconds of CPU on a host busy compiling) need no device and run without any lock, beside other
  workers' timing, as the compile workers' compilers do; it then reports `imported` and waits. Its device
  context, profiler start and digest kernels come only after the parent grants the device (`device`), holding
  the device's shared lock until the child has reported ready (`verifier.device_lock`). Before timing the device
  stage waits until its own next spare is up (`wait_started`), so that spare's CPU work is over when the clock
  runs. (Until session 41 the lock covered the imports too: a timing phase then waited for them, and a spare
  for others' timing before it could import.) On the cpu backend the host's CPU is the device, and the lock still
  covers the imports (`lease_imports`); so it does for the next spare of a stage that has the device alone (a task
  too large to share it), which holds the device from before its candidate loads through its timing.
- Starting a spare is best effort. If it fails, the next candidate starts its own child, as without spares.
- An orphaned spare exits on its own: its request pipe closes when the worker that started it dies, and
  it then empties its own working directory (the sandbox may keep it from unlinking the directory
  itself).
- The harness's own Triton kernels (the output commitment's digests, four builds of a second or two each, which
  every run child made again in its fresh private cache, under the device's shared lock) are built once per stage
  key: the cache of the first child to report ready, read into this process's memory before any candidate file
  reaches its directory (`keep_child_caches`), is written into each later child's private cache before it starts
  (`seed_child_caches`). Triton's group files name their files by absolute path: they are kept as names and written
  back as paths into the new child's own cache, so that no child reads another's files. A copy per child: what a
  candidate leaves in its own cache reaches no other child.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from typing import Any, Callable

from .sandbox import ChildFailed, ChildTimeout, ProtocolError, SandboxedChild

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StartedChild:
    """A run child, its private working directory, and the start-up messages already read from it."""

    child: SandboxedChild
    workdir: str
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    failed: bool = False
    device_granted: bool = False   # ``grant_device`` sent: the child may initialise its device
    arrived: dict[str, float] = dataclasses.field(default_factory=dict)   # op -> when its first message was read
    granted_at: float | None = None
    lease_wait_s: float | None = None   # a spare's wait for the device's shared lock before its grant
    _discarded: bool = dataclasses.field(default=False, repr=False)
    _discard_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def imported(self) -> bool:
        """The child's CPU-only start-up is over (``imported``), or it ended in an error."""
        return any(m.get("op") in ("imported", "ready", "error") for m in self.messages)

    @property
    def ready(self) -> bool:
        return any(m.get("op") in ("ready", "error") for m in self.messages)

    def read_until_imported(self, deadline: float) -> None:
        """Read ``hello`` and ``imported`` (or a start-up error): the part of the start-up that needs no device."""
        self._read_until(lambda: self.imported, deadline)

    def grant_device(self) -> None:
        """Let the child initialise its device (``device``); the caller holds the device's shared lock for it."""
        self.child.send({"op": "device"})
        self.device_granted, self.granted_at = True, time.monotonic()

    def note_arrival(self, msg: dict[str, Any]) -> None:
        """When ``msg`` came: the child's own clock where it says (``at``: CLOCK_MONOTONIC, one for the host; sent
        before any candidate code exists), so that a message read late (a stage's own child, read once the stage
        holds the device) is not charged the wait; else now."""
        now, at = time.monotonic(), msg.get("at")
        if type(at) is not float or not self.child.started_at <= at <= now:
            at = now
        self.arrived.setdefault(str(msg.get("op")), at)

    def startup_seconds(self) -> dict[str, float | None]:
        """Where its start-up went: the interpreter and imports (to ``imported``), the wait for the device's lock (a
        spare's), and the device start-up after the grant (to ``ready``); None where a step did not happen."""
        def span(a: float | None, b: float | None) -> float | None:
            return round(b - a, 3) if a is not None and b is not None else None
        return {"imports": span(self.child.started_at, self.arrived.get("imported")),
                "lock_wait": None if self.lease_wait_s is None else round(self.lease_wait_s, 3),
                "device": span(self.granted_at, self.arrived.get("ready"))}

    def read_until_ready(self, deadline: float) -> None:
        """Read up to ``ready`` (or a start-up error). The messages stay queued in ``messages`` for the device stage
        that takes this child. No candidate code has run in it, so they are trusted."""
        self._read_until(lambda: self.ready, deadline)

    def _read_until(self, done: Callable[[], bool], deadline: float) -> None:
        try:
            while not done() and not self.failed:
                self.messages.append(self.child.recv(deadline))
                self.note_arrival(self.messages[-1])
        except ChildTimeout:
            pass
        except (ChildFailed, ProtocolError):
            self.failed = True

    @property
    def errored(self) -> bool:
        """Its start-up ended in an error report (no use to a candidate: the stage starts a child of its own)."""
        return any(m.get("op") == "error" for m in self.messages)

    def discard(self) -> None:
        """End the child, reap it and close its pipes, remove its directory; once, whoever calls it."""
        with self._discard_lock:
            if self._discarded:
                return
            self._discarded = True
        try:
            self.child.close(grace_s=0.0, timed_out=True)
        except Exception:  # noqa: BLE001 - best effort: the child may never have started
            pass
        shutil.rmtree(self.workdir, ignore_errors=True)

    def end_now(self) -> None:
        """Kill the child and remove its directory, from any thread; its pipes stay for the thread that reads them
        to close (``discard``): a descriptor closed under another thread's read could be one reused meanwhile."""
        try:
            self.child.kill()
        except Exception:  # noqa: BLE001 - best effort: the child may never have started
            pass
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclasses.dataclass(eq=False)
class _Pending:
    """A spare being started on a background thread; ``spare`` is set (or left None) when ``done``."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    spare: StartedChild | None = None
    starting: StartedChild | None = None   # the child while it starts (``_discard`` ends it if cancelled meanwhile)
    cancelled: bool = False
    # ``cancelled`` and ``spare`` change together under it: a spare is published only if not cancelled, and one
    # cancelled after it was published is taken back by the canceller (never left unreaped)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class WarmSpares:
    """At most one started-but-unused run child per key; thread-safe.

    A spare is started on a background thread. Its imports run without a lock; from the device grant until it
    has reported ready it is under ``lease`` (the device's shared lock, see ``verifier.device_lock``): its device
    context and profiler start never overlap another worker's timing, and nobody blocks on a lock while starting
    one."""

    def __init__(self) -> None:
        self._spares: dict[Any, _Pending] = {}
        self._lock = threading.Lock()

    def take(self, key: Any, timeout_s: float = 3600.0) -> StartedChild | None:
        """The spare for ``key`` once it is up and alive (waiting for its start-up to finish), else None."""
        with self._lock:
            pending = self._spares.pop(key, None)
            stale = [self._spares.pop(k) for k in list(self._spares) if k[1:] == key[1:]]  # same device, other config
        for p in stale:
            self._discard(p)
        if pending is None:
            return None
        if not pending.done.wait(timeout_s):
            self._discard(pending, wait_s=0.0)   # its thread discards it when it is done
            return None
        spare = pending.spare
        if spare is not None and not spare.failed and not spare.child.exited():
            return spare
        if spare is not None:
            spare.discard()
        return None

    def replenish(self, key: Any, start: Callable[[], StartedChild], timeout_s: float = 180.0,
                  lease: Callable[[], Any] | None = None, lease_imports: bool = False) -> None:
        """Start the spare for ``key`` unless one exists, on a background thread. A failure to start is
        logged, never raised (the next candidate then starts its own child). ``timeout_s`` bounds its imports, and
        again its device start-up once ``lease`` is held (the wait for the lease is the lease's own). With
        ``lease_imports`` the lease covers the imports too (a cpu backend: there the host's CPU is the device)."""
        with self._lock:
            if key in self._spares:
                return
            pending = self._spares[key] = _Pending()

        def usable(spare: StartedChild) -> bool:
            return spare.ready and not spare.errored and not spare.failed and not pending.cancelled

        def work() -> None:
            spare, ok = None, False
            held_early = lease is not None and lease_imports
            try:
                with (lease() if held_early else contextlib.nullcontext()) as early_use:
                    if not pending.cancelled:
                        spare = pending.starting = start()
                        spare.lease_wait_s = getattr(early_use, "waited_s", None)
                        if not pending.cancelled:   # (cancelled while it was being started: dropped below)
                            spare.read_until_imported(time.monotonic() + timeout_s)   # CPU only: no lease of its own
                    if spare is not None and spare.imported and not spare.ready and not spare.failed \
                            and not pending.cancelled:
                        with (lease() if lease is not None and not held_early else contextlib.nullcontext()) as use:
                            if use is not None:
                                spare.lease_wait_s = use.waited_s
                            if not pending.cancelled:
                                spare.grant_device()
                                spare.read_until_ready(time.monotonic() + timeout_s)
                            if not usable(spare):
                                # still starting (or broken): gone before the lease ends, so that it never
                                # initialises its device beside another worker's timing
                                spare.discard()
                                spare = None
                ok = True   # a spare still importing at the deadline, or broken, is dropped below
            except Exception as e:  # noqa: BLE001 - e.g. EAGAIN/ENOMEM/EMFILE from fork, a lock deadline
                log.warning("could not start a warm spare child: %s: %s", type(e).__name__, e)
            finally:
                with pending.lock:
                    dropped = spare if spare is not None and (not ok or not usable(spare)) else None
                    pending.spare = None if dropped is not None else spare
                pending.done.set()
                if dropped is not None:
                    dropped.discard()

        try:
            threading.Thread(target=work, name="warm-spare-start", daemon=True).start()
        except Exception as e:  # noqa: BLE001 - no thread to start it (EAGAIN): no spare this time
            log.warning("could not start a warm spare child: %s: %s", type(e).__name__, e)
            with self._lock:
                if self._spares.get(key) is pending:
                    del self._spares[key]
            pending.done.set()

    def wait_started(self, key: Any, timeout_s: float) -> None:
        """Block until the spare for ``key`` has finished starting (or ``timeout_s`` passed)."""
        with self._lock:
            pending = self._spares.get(key)
        if pending is not None:
            pending.done.wait(timeout_s)

    def started(self, timeout_s: float = 180.0) -> list[StartedChild]:
        """The spares there are, once their start-ups are over (for inspection)."""
        with self._lock:
            pendings = list(self._spares.values())
        for p in pendings:
            p.done.wait(timeout_s)
        return [p.spare for p in pendings if p.spare is not None]

    @staticmethod
    def _discard(pending: _Pending, wait_s: float = 5.0) -> None:
        """Cancel a spare. One still starting after ``wait_s`` (its thread waiting for the device's lock, for up
        to the lock's deadline) is ended here: its thread finds it cancelled and discards what is left."""
        with pending.lock:
            pending.cancelled = True
        if not pending.done.wait(wait_s) and pending.starting is not None:
            pending.starting.end_now()
        with pending.lock:
            spare, pending.spare = pending.spare, None
        if spare is not None:
            spare.discard()

    def close(self) -> None:
        with self._lock:
            pendings, self._spares = list(self._spares.values()), {}
        for p in pendings:
            self._discard(p)


_PROCESS_SPARES: WarmSpares | None = None
_PROCESS_LOCK = threading.Lock()


def process_spares() -> WarmSpares:
    """The spares of this process (a farm device worker), closed when it exits."""
    global _PROCESS_SPARES
    with _PROCESS_LOCK:
        if _PROCESS_SPARES is None:
            _PROCESS_SPARES = WarmSpares()
            atexit.register(_PROCESS_SPARES.close)
        return _PROCESS_SPARES


#: the cache under a run child's working directory that ``keep_child_caches`` keeps (``sandbox.child_env``)
SEEDED_CACHE = "triton"
#: a cache larger than this is not kept (the digests' builds take a few hundred KB)
SEED_MAX_BYTES = 64 << 20
#: Triton's group files (``FileCacheManager.put_group``): JSON naming the group's files by absolute path
_GROUP_PREFIX = "__grp__"
_SEEDS: dict[Any, dict[str, bytes]] = {}
_SEEDS_LOCK = threading.Lock()


def _regular_files(root: str) -> list[tuple[str, int]]:
    """Regular files under ``root`` (relative path, size); links and anything else are left out."""
    found = []
    for here, _, files in os.walk(root):   # os.walk follows no directory link by default
        for name in files:
            path = os.path.join(here, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                found.append((os.path.relpath(path, root), st.st_size))
    return found


def _group_to_names(rel: str, data: bytes, root: str) -> bytes | None:
    """A group file's absolute paths as bare file names of its own entry directory, or None where one lies elsewhere
    (kept as written, a seeded child would read the files of the child that built them: its candidate's to change)."""
    entry = os.path.realpath(os.path.join(root, os.path.dirname(rel)))
    try:
        group = json.loads(data)["child_paths"]
        names = {}
        for name, path in group.items():
            if not isinstance(path, str) or os.path.dirname(os.path.realpath(path)) != entry:
                return None
            names[name] = os.path.basename(path)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return json.dumps({"child_paths": names}).encode()


def _group_to_paths(rel: str, data: bytes, root: str) -> bytes:
    """The inverse of ``_group_to_names`` for the cache at ``root`` (a new child's)."""
    entry = os.path.join(root, os.path.dirname(rel))
    names = json.loads(data)["child_paths"]
    return json.dumps({"child_paths": {n: os.path.join(entry, f) for n, f in names.items()}}).encode()


def keep_child_caches(key: Any, workdir: str) -> bool:
    """Keep the Triton cache of a run child that has reported ready and has been given no candidate yet (only the
    harness has run in it, so what it built is the harness's) as the seed of later children for ``key``, once per key,
    in this process's memory (no file a child could reach). Returns whether it was kept now. Best effort."""
    with _SEEDS_LOCK:
        if key in _SEEDS:
            return False
    root = os.path.join(workdir, SEEDED_CACHE)
    try:
        files = _regular_files(root)
        if not files or sum(size for _, size in files) > SEED_MAX_BYTES:
            return False
        seed: dict[str, bytes] = {}
        for rel, _ in files:
            if any(part.startswith("tmp.pid_") for part in rel.split(os.sep)):
                continue   # a write Triton left unfinished (``FileCacheManager.put``'s staging directory)
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
            if os.path.basename(rel).startswith(_GROUP_PREFIX):
                data = _group_to_names(rel, data, root)
                if data is None:
                    continue   # that entry is rebuilt by the child that needs it
            seed[rel] = data
    except OSError as e:
        log.warning("could not keep a run child's caches: %s", e)
        return False
    with _SEEDS_LOCK:
        if key in _SEEDS:
            return False
        _SEEDS[key] = seed
    return True


def seed_child_caches(key: Any, workdir: str) -> bool:
    """Write the cache kept for ``key`` into a new run child's working directory before it starts: a copy of its own,
    made in full under a temporary name and then renamed into place (a partial seed is none). Returns whether there
    was one."""
    with _SEEDS_LOCK:
        seed = _SEEDS.get(key)
    if not seed:
        return False
    root, staging = os.path.join(workdir, SEEDED_CACHE), None
    try:
        staging = tempfile.mkdtemp(prefix=".seed-", dir=workdir)
        for rel, data in seed.items():
            if os.path.basename(rel).startswith(_GROUP_PREFIX):
                data = _group_to_paths(rel, data, root)
            path = os.path.join(staging, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        os.rename(staging, root)
    except OSError as e:
        log.warning("could not seed a run child's caches: %s", e)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        return False
    return True
