"""Device-stage children started ahead of their candidate ("warm spares").

Starting a sandboxed run child costs seconds before any candidate code runs: the interpreter, the torch
import, the device context, the profiler's first start. On one GPU that start-up is a large share of the
device stage, so a farm device worker keeps one spare child per (device, config): when a candidate takes
the spare, the next spare starts and comes up while this candidate is imported and checked.

- Every candidate still gets a fresh process that no other candidate has touched. A spare has run only
  the harness (isolation, imports, device init). The task and candidate files are written into its working
  directory after it is taken.
- A spare's start-up never overlaps a timing phase. Before timing, the device stage waits until the next
  spare has reported ready (`wait_started`), so its CPU work, device context and profiler initialisation
  are over when the clock runs.
- Starting a spare is best effort. If it fails, the next candidate starts its own child, as without spares.
- An orphaned spare exits on its own: its request pipe closes when the worker that started it dies, and
  it then empties its own working directory (the sandbox may keep it from unlinking the directory
  itself).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import shutil
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

    @property
    def ready(self) -> bool:
        return any(m.get("op") in ("ready", "error") for m in self.messages)

    def read_until_ready(self, deadline: float) -> None:
        """Read ``hello`` and then ``ready`` (or a start-up error); they stay queued in ``messages`` for the
        device stage that takes this child. No candidate code has run in it, so they are trusted."""
        try:
            while not self.ready and not self.failed:
                self.messages.append(self.child.recv(deadline))
        except ChildTimeout:
            pass
        except (ChildFailed, ProtocolError):
            self.failed = True

    def discard(self) -> None:
        try:
            self.child.close(grace_s=0.0, timed_out=True)
        except Exception:  # noqa: BLE001 - best effort: the child may never have started
            pass
        shutil.rmtree(self.workdir, ignore_errors=True)


class WarmSpares:
    """At most one started-but-unused run child per key; thread-safe."""

    def __init__(self) -> None:
        self._spares: dict[Any, StartedChild] = {}
        self._lock = threading.Lock()

    def take(self, key: Any, start: Callable[[], StartedChild]) -> StartedChild:
        """The spare for ``key`` when it is alive, else a child started now."""
        with self._lock:
            spare = self._spares.pop(key, None)
            stale = [self._spares.pop(k) for k in list(self._spares) if k[1:] == key[1:]]  # same device, other config
        for s in stale:
            s.discard()
        if spare is not None and not spare.failed and not spare.child.exited():
            return spare
        if spare is not None:
            spare.discard()
        return start()

    def replenish(self, key: Any, start: Callable[[], StartedChild]) -> None:
        """Start the spare for ``key`` unless one exists; a failure to start is logged, never raised (the
        next candidate then starts its own child)."""
        with self._lock:
            if key in self._spares:
                return
        try:
            spare = start()
        except Exception as e:  # noqa: BLE001 - e.g. EAGAIN/ENOMEM/EMFILE from fork or mkdtemp
            log.warning("could not start a warm spare child: %s: %s", type(e).__name__, e)
            return
        with self._lock:
            if key not in self._spares:
                self._spares[key] = spare
                return
        spare.discard()

    def wait_started(self, key: Any, timeout_s: float) -> None:
        """Block until the spare for ``key`` has finished starting (or ``timeout_s`` passed)."""
        with self._lock:
            spare = self._spares.get(key)
        if spare is not None:
            spare.read_until_ready(time.monotonic() + timeout_s)

    def close(self) -> None:
        with self._lock:
            spares, self._spares = list(self._spares.values()), {}
        for s in spares:
            s.discard()


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
