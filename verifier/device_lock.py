"""Several device-stage workers on one device: they share it, except while one of them is timing.

On one GPU the device stage is the farm's bottleneck, and most of it does not need the GPU alone: a child's
start-up (interpreter, torch import, device context), the candidate's import and its correctness trials
can run beside another candidate's. Timing cannot: another process's kernels on the same device slow the
timed calls. So every device-stage worker of a device (farm processes, threads, other farms of the same
user on the same host) takes this lock:

- ``shared`` for a child's device start-up (context, profiler; a warm spare's too: its interpreter start and
  torch import need no lock, ``verifier.warm_spare``), the candidate's import and correctness;
- ``exclusive`` for timing, and for a whole stage whose task is too large to share the device's memory.

It is two ``flock``-ed files per device. The first is a turnstile: a worker waiting for ``exclusive``
holds it, so no new ``shared`` holder comes in and a timing phase waits only for the holders already in.
Locks belong to open files, so they die with their process: a killed worker never wedges the device.
Waiting polls (a few ms) so that it can give up at a deadline. The sandboxed children of candidates cannot
take the lock themselves: the files are write-only for their owner, Landlock keeps children from opening
them for writing, and a child that chmods one (Landlock does not cover chmod) and opens it still cannot
lock it, because the children's syscall filter turns ``flock`` into a no-op (``verifier.syscall_filter``).
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
    """One place per user and host, whatever TMPDIR says: workers of different jobs (per-job slurm temp
    dirs) must meet on the same files, and TMPDIR may point into the children's writable paths."""
    base = "/tmp" if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"verifier-device-locks-{os.getuid()}")


def lock_name(backend: str, index: int | None) -> str:
    """One name per physical device: the id the device has outside this process's visible-devices mask,
    so workers that see the same GPU under different logical indices (Ray, slurm) share its lock."""
    from .devices import DeviceUnavailable, get_backend
    try:
        physical = get_backend(backend).physical_id(index)
    except (DeviceUnavailable, ValueError, KeyError):
        physical = None
    ident = physical if physical is not None else ("host" if backend == "cpu" else f"index{index or 0}")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{backend}-{ident}")[:120]


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
        self.dir = lock_dir or default_lock_dir()
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        base = os.path.join(self.dir, lock_name(backend, index))
        self.turnstile_path, self.path = base + ".turnstile", base + ".lock"
        self.name = os.path.basename(base)

    def _open(self, path: str) -> int:
        """Write-only for the owner: a sandboxed candidate (same uid, no capabilities) cannot simply open
        it for reading, and Landlock keeps it from opening it for writing. If it chmods the file and opens
        it, its ``flock`` is a no-op under the syscall filter; a file or directory it made unusable for us
        is put right here, as its owner may."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o200)
        except PermissionError:
            for p, mode in ((self.dir, 0o700), (path, 0o200)):
                try:
                    os.chmod(p, mode)
                except FileNotFoundError:
                    pass
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o200)
        try:
            os.fchmod(fd, 0o200)
        except OSError:
            pass
        return fd

    def shared(self, timeout_s: float) -> DeviceUse:
        return self._hold("shared", timeout_s)

    def exclusive(self, timeout_s: float) -> DeviceUse:
        return self._hold("exclusive", timeout_s)

    def _hold(self, mode: str, timeout_s: float) -> DeviceUse:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        gate = self._open(self.turnstile_path)
        try:
            fd = self._open(self.path)
        except BaseException:
            os.close(gate)
            raise
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
