"""Several device-stage workers on one device: they share it, except while one of them is timing.

On one GPU the device stage is the farm's bottleneck, and most of it does not need the GPU alone: a child's
start-up (interpreter, torch import, device context), the candidate's import and its correctness trials
can run beside another candidate's. Timing cannot: another process's kernels on the same device slow the
timed calls. So every device-stage worker of a device (farm processes, threads, other farms of the same
user on the same host) takes this lock:

- ``shared`` for start-up, import and correctness (a warm spare's start-up too);
- ``exclusive`` for timing, and for a whole stage whose task is too large to share the device's memory.

It is two ``flock``-ed files per device. The first is a turnstile: a worker waiting for ``exclusive``
holds it, so no new ``shared`` holder comes in and a timing phase waits only for the holders already in.
Locks belong to open files, so they die with their process: a killed worker never wedges the device.
Waiting polls (a few ms) so that it can give up at a deadline.
"""
from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import tempfile
import time

_POLL_S = 0.002


class DeviceLockTimeout(TimeoutError):
    """The device stayed in other workers' hands past the deadline."""


def default_lock_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"verifier-device-locks-{os.getuid()}")


def lock_name(backend: str, index: int | None) -> str:
    """One name per physical device as this process sees it: the visible-devices list is part of it, so
    workers pinned to different GPUs through CUDA_VISIBLE_DEVICES (Ray, slurm) do not share a lock."""
    env = {"cuda": "CUDA_VISIBLE_DEVICES", "musa": "MUSA_VISIBLE_DEVICES"}.get(backend)
    visible = os.environ.get(env, "all") if env else "host"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{backend}{index or 0}-{visible}")[:120]


def _acquire(fd: int, mode: int, deadline: float, what: str) -> None:
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise DeviceLockTimeout(f"{what}: other device-stage workers held the device past the deadline")
            time.sleep(_POLL_S)


@dataclasses.dataclass
class DeviceUse:
    """One holder's claim on a device; ``release`` is idempotent."""

    mode: str
    fd: int | None
    waited_s: float

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)          # closing the open file drops its flock

    @property
    def held(self) -> bool:
        return self.fd is not None

    def __enter__(self) -> "DeviceUse":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class DeviceLock:
    def __init__(self, backend: str, index: int | None, lock_dir: str | None = None):
        d = lock_dir or default_lock_dir()
        os.makedirs(d, mode=0o700, exist_ok=True)
        base = os.path.join(d, lock_name(backend, index))
        self.turnstile_path, self.path = base + ".turnstile", base + ".lock"
        self.name = os.path.basename(base)

    def _open(self, path: str) -> int:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def shared(self, timeout_s: float) -> DeviceUse:
        return self._hold("shared", timeout_s)

    def exclusive(self, timeout_s: float) -> DeviceUse:
        return self._hold("exclusive", timeout_s)

    def _hold(self, mode: str, timeout_s: float) -> DeviceUse:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        gate, fd = self._open(self.turnstile_path), self._open(self.path)
        try:
            _acquire(gate, fcntl.LOCK_EX, deadline, f"device {self.name} ({mode})")
            if mode == "shared":       # pass the turnstile, then join the other holders
                os.close(gate)
                gate = -1
                _acquire(fd, fcntl.LOCK_SH, deadline, f"device {self.name} (shared)")
            else:                      # keep new holders out while the current ones finish
                _acquire(fd, fcntl.LOCK_EX, deadline, f"device {self.name} (exclusive)")
        except BaseException:
            os.close(fd)
            raise
        finally:
            if gate >= 0:
                os.close(gate)
        return DeviceUse(mode, fd, time.monotonic() - t0)
