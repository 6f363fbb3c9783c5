"""Worker slots: where one stage of the farm runs one call, and how a dead or hung worker is replaced.

A slot runs ``fn(*args)`` for one item at a time and turns every way that can go wrong into an
exception the farm treats as ``infra`` (retried, never scored):

- ``SlotError``: ``fn`` raised (a harness bug or an unusable device);
- ``SlotCrashed``: the worker process died (segfault, OOM kill, ``os._exit``);
- ``SlotWedged``: no answer before the deadline; the worker and its process tree are killed.

``ProcessSlot`` is the production kind (KernelGYM-style: one long-lived spawned process per slot,
recycled after N calls, replaced on crash/hang). ``ThreadSlot`` runs in-process for callers whose
``fn`` already isolates its work in a subprocess, and for tests; a hung thread cannot be killed,
only abandoned. ``verifier.ray_farm`` adds a Ray-actor slot with the same contract.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from typing import Any, Callable

_POLL_S = 0.5


class SlotError(RuntimeError):
    """The call failed for a reason that is the farm's, not the candidate's."""


class SlotCrashed(SlotError):
    pass


class SlotWedged(SlotError):
    pass


class ThreadSlot:
    """Runs each call on a fresh daemon thread so a deadline can be enforced (by abandoning it)."""

    kind = "thread"

    def __init__(self, fn: Callable[..., Any], name: str):
        self.fn = fn
        self.name = name
        self.calls = 0
        self.abandoned = 0

    def call(self, args: tuple, deadline_s: float | None) -> Any:
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = self.fn(*args)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the farm
                box["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
            finally:
                done.set()

        t = threading.Thread(target=run, name=f"{self.name}-call{self.calls}", daemon=True)
        self.calls += 1
        t.start()
        if not done.wait(deadline_s):
            self.abandoned += 1
            raise SlotWedged(f"{self.name}: no answer within {deadline_s:.0f}s (thread abandoned)")
        if "error" in box:
            raise SlotError(f"{self.name}: {box['error']}")
        return box["value"]

    def restart(self) -> None:
        pass

    def close(self) -> None:
        pass


def _process_slot_main(conn: Any, fn: Callable[..., Any]) -> None:
    """Worker loop: one request at a time until the parent closes the pipe or sends None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns shutdown
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        if args is None:
            return
        try:
            msg = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001
            msg = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")
        try:
            conn.send(msg)
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
            conn.send(("error", f"worker could not send its result: {type(e).__name__}: {e}"))


def kill_process_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (sandbox children in their own sessions too)."""
    try:
        import psutil
        try:
            root = psutil.Process(pid)
            procs = root.children(recursive=True) + [root]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=5)
    except ImportError:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ProcessSlot:
    """A long-lived spawned worker process (never forked: the parent may hold a device context)."""

    kind = "process"

    def __init__(self, fn: Callable[..., Any], name: str, recycle_after: int = 0):
        self.fn = fn
        self.name = name
        self.recycle_after = recycle_after
        self.calls = 0           # calls served by the current process
        self.starts = 0
        self._proc: Any = None
        self._conn: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_process_slot_main, args=(child_conn, self.fn), name=self.name)
        proc.start()
        child_conn.close()
        self._proc, self._conn = proc, parent_conn
        self.calls = 0
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def call(self, args: tuple, deadline_s: float | None) -> Any:
        if self._proc is not None and not self._proc.is_alive():
            self._reap()
        elif self._proc is not None and self.recycle_after and self.calls >= self.recycle_after:
            self.close()  # recycle a healthy worker: bounds leaks across many candidates
        if self._proc is None:
            self._start()
        self.calls += 1
        try:
            self._conn.send(args)
        except (BrokenPipeError, EOFError, OSError) as e:
            self.restart()
            raise SlotCrashed(f"{self.name}: worker gone before the request was sent ({e})") from e
        t_end = None if deadline_s is None else time.monotonic() + deadline_s
        while True:
            wait = _POLL_S if t_end is None else max(0.0, min(_POLL_S, t_end - time.monotonic()))
            try:
                ready = self._conn.poll(wait)
            except (EOFError, OSError):
                ready = True
            if ready:
                try:
                    status, value = self._conn.recv()
                except (EOFError, OSError) as e:
                    code = self._reap()
                    raise SlotCrashed(f"{self.name}: worker died mid-call (exit code {code})") from e
                if status == "ok":
                    return value
                raise SlotError(f"{self.name}: {value}")
            if not self._proc.is_alive():
                code = self._reap()
                raise SlotCrashed(f"{self.name}: worker died mid-call (exit code {code})")
            if t_end is not None and time.monotonic() >= t_end:
                self._reap(kill=True)
                raise SlotWedged(f"{self.name}: no answer within {deadline_s:.0f}s; worker killed")

    def _reap(self, kill: bool = False) -> int | None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is None:
            return None
        if kill or proc.is_alive():
            kill_process_tree(proc.pid)
        proc.join(timeout=10)
        if conn is not None:
            conn.close()
        return proc.exitcode

    def restart(self) -> None:
        self._reap(kill=True)

    def close(self) -> None:
        proc, conn = self._proc, self._conn
        if proc is None:
            return
        try:
            conn.send(None)
            proc.join(timeout=5)
        except (BrokenPipeError, EOFError, OSError):
            pass
        self._reap(kill=proc.is_alive())
