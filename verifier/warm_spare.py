"""Device-stage children started ahead of their candidate ("warm spares").

Starting a sandboxed run child costs seconds before any candidate code runs: the interpreter, the torch
import, the device context, the profiler's first start. On one GPU that start-up is a large share of the
device stage, so a farm device worker keeps one spare child per (device, config) that has already paid
it: when a candidate takes the spare, the next spare starts at once and is ready by the time the next
candidate arrives.

Every candidate still gets a fresh process that no other candidate has touched: a spare has run only the
harness (isolation, imports, device init), and the task and candidate files are written into its working
directory after it is taken. A spare's start-up may overlap the current candidate's timing: it is one
mostly single-threaded process and an idle device context, while the farm's compile pool loads the CPUs
far more than that anyway. An orphaned spare exits on its own: its request pipe closes when the worker
that started it dies.
"""
from __future__ import annotations

import atexit
import dataclasses
import shutil
import threading
from typing import Any, Callable

from .sandbox import SandboxedChild


@dataclasses.dataclass
class StartedChild:
    """A run child and its private working directory."""

    child: SandboxedChild
    workdir: str

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
            stale = [k for k in self._spares if k[1:] == key[1:]]   # same device, another config
            for k in stale:
                self._spares.pop(k).discard()
        if spare is not None and not spare.child.exited():
            return spare
        if spare is not None:
            spare.discard()
        return start()

    def replenish(self, key: Any, start: Callable[[], StartedChild]) -> None:
        with self._lock:
            if key in self._spares:
                return
            self._spares[key] = start()

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
