"""Atomic file and directory writes: nothing is ever half-written where a reader looks.

Files go to a temp name in the same directory, are fsynced, then renamed; directories are built
under a hidden temp name and renamed into place, so a crash leaves either the old state or the new
one (plus, at worst, a hidden temp to clean up). A run holds `output_lock` on what it writes, so a second run on
the same output is refused instead of interleaving with it; `LineLog` appends whole JSONL lines only; `write_problem`
names what a library's failed write hid (a full disk, a quota, a read-only or vanished folder).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

log = logging.getLogger(__name__)


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a unique hidden sibling and rename it over ``path``: a reader sees the old file or the new
    one, two writers (threads, ranks) never share a temp name, and a failed write leaves no temp behind. The file
    gets the umask's mode, as a plain open gives (not mkstemp's 0600): the next stage's job may be another user's."""
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))   # not a str: AttributeError, the temp removed


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """`write_text_atomic` for any content: ``write`` fills the binary temp file (an image's ``save``, bytes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:
            raise named_os_error(e, path) from e   # a full disk's write names no file: say which one
        raise
    fsync_dir(path.parent)


def current_umask() -> int:
    """The process's umask. Files and dirs that tempfile creates 0600/0700 and that are renamed into place get
    ``0o666 & ~umask`` / ``0o777 & ~umask``, as a plain open or mkdir would: the next stage's job, perhaps another
    user's, reads them. Read from /proc/self/status where Linux shows it: the portable way (set it, set it back) changes
    the umask of the whole process for a moment, and a file another thread creates then gets the wrong mode."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _mkdtemp_beside(target: Path) -> Path:
    """A fresh hidden temp dir beside ``target``, with the mode a plain mkdir gives (`current_umask`), not mkdtemp's
    0700: it is renamed into place, and an export or model dir readable only by its writer is unreadable to the
    evaluation job or container of another user that the chain hands it to."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~current_umask())
    return tmp


def publish_dir(build: Callable[[str], object], target: str | os.PathLike) -> Path:
    """Run ``build(tmp_dir)`` and rename the result to ``target``. If another process published
    ``target`` first, its copy is kept and ours is discarded (both were built from the same inputs). A build that
    fails on a full disk says so, naming ``target`` (`naming_write_problems`)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _mkdtemp_beside(target)
    try:
        with naming_write_problems(tmp, target):
            build(str(tmp))
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Rename the finished dir ``tmp`` over ``final``: an older ``final`` is moved aside first and removed after,
    so a reader sees the old dir or the new one, never a mix."""
    tmp, final = Path(tmp), Path(final)
    old = final.parent / f".{final.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(final.parent)
    return final


def rebuild_dir(build: Callable[[str], object], target: str | os.PathLike) -> Path:
    """Like `publish_dir`, but a ``target`` that exists is replaced (`replace_dir`) instead of kept."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _mkdtemp_beside(target)
    try:
        with naming_write_problems(tmp, target):
            build(str(tmp))
        return replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def named_os_error(e: OSError, path: str | os.PathLike) -> OSError:
    """``e`` with ``path`` as its file name: a write on an open file raises ENOSPC/EIO without one, and "No space
    left on device" alone does not say which run's disk is full."""
    return OSError(e.errno, e.strerror, str(path))


def describe_os_error(e: OSError) -> str:
    """One line for a failed file operation: ``PATH: No space left on device`` (``SRC -> DST: ...`` for a copy or a
    rename, whose ``filename`` is the source)."""
    if e.filename is not None and e.strerror:
        return f"{e.filename}{f' -> {e.filename2}' if e.filename2 is not None else ''}: {e.strerror}"
    return str(e) or type(e).__name__


def dir_problem(path: str | os.PathLike) -> str | None:
    """Why the output folder ``path`` cannot be made or written (it, or the nearest existing folder above it, is a
    file or not writable), checked before a run starts rather than at its first save; None when it can."""
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return None
    if not existing.is_dir():
        return f"cannot create {path}: {existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot create {path}: {existing} is not writable"
    return None


_PROBE_BYTES = 1 << 20


def write_problem(folder: str | os.PathLike) -> OSError | None:
    """The OSError that a small write in ``folder`` meets now (a full disk, a quota, a read-only or vanished
    folder), named by the folder; None when it can be written. torch's checkpoint writer and safetensors report a
    full disk without the errno or the path ("unexpected pos 704 vs 598", "I/O error"): a failed save asks this
    while its partial files still fill the disk, and says why by name."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".write-probe.", dir=folder)
    except OSError as e:
        return named_os_error(e, folder)
    try:
        view = memoryview(bytes(_PROBE_BYTES))
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as e:
        return named_os_error(e, folder)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return None


@contextlib.contextmanager
def naming_write_problems(folder: str | os.PathLike, name: str | os.PathLike | None = None) -> Iterator[None]:
    """Re-raise a failure of the block as the OSError that a write in ``folder`` meets now (`write_problem`), when
    it meets one, named ``name`` (the output a temp ``folder`` becomes): safetensors' ``I/O error`` or torch's
    ``unexpected pos`` becomes ``NAME: No space left on device``. Wrap the writing itself, inside the cleanup that
    frees the space."""
    try:
        yield
    except Exception as e:
        if isinstance(e, OSError) and e.filename is not None:
            raise
        problem = write_problem(folder)
        if problem is None:
            raise
        raise named_os_error(problem, name or folder) from e


class LineLog:
    """A JSONL file appended one whole line at a time (a run's ``metrics.jsonl``, `evaluate`'s progress file). A torn
    last line that a kill or a full disk left is cut off when the file is opened again, and a line that cannot be
    written whole is taken back, so a resumed run's rows are never glued to half a row (a reader such as
    `megatron_rl.report` refuses the file then). A file removed while open (its run dir deleted) is created again,
    with a warning, instead of taking the rows with it. A failed write raises an OSError that names the file.

    ``fresh``: the file is emptied when first opened (a new run over an old file). ``header``: the first line of the
    file whenever it starts empty (created, emptied or created again). ``fsync``: every line is on disk before
    `write` returns (a progress file a kill must not lose)."""

    def __init__(self, path: str | os.PathLike, *, fresh: bool = False, header: str | None = None,
                 fsync: bool = False):
        self.path = Path(path)
        self._fd: int | None = None
        self._fresh, self._header, self._fsync = fresh, header, fsync

    def _open(self) -> int:
        if self._fd is not None and os.fstat(self._fd).st_nlink > 0:
            return self._fd
        if self._fd is not None:
            log.warning("%s was removed while the run wrote it: writing the next rows to a new one", self.path)
            self.close()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if self._fresh else 0)
            self._fd = os.open(self.path, flags, 0o666)
            self._fresh = False
            self._trim_torn_tail(self._fd)
            if self._header is not None and os.fstat(self._fd).st_size == 0:
                self._append(self._fd, self._header)
        except OSError as e:
            self.close()
            if e.filename is None:
                raise named_os_error(e, self.path) from e
            raise
        return self._fd

    def _trim_torn_tail(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        keep, end = 0, size
        with open(self.path, "rb") as f:
            while end > 0:
                start = max(0, end - 65536)
                f.seek(start)
                i = f.read(end - start).rfind(b"\n")
                if i >= 0:
                    keep = start + i + 1
                    break
                end = start
        if keep < size:
            log.warning("%s: its last line was cut off (a kill or a full disk while it was written): removed",
                        self.path)
            os.ftruncate(fd, keep)

    def write(self, line: str) -> None:
        """Append ``line`` (one JSON row; a newline is added) whole, or raise with the file as it was."""
        self._append(self._open(), line)

    def _append(self, fd: int, line: str) -> None:
        start = os.fstat(fd).st_size
        try:
            view = memoryview((line.rstrip("\n") + "\n").encode("utf-8"))
            while view:
                view = view[os.write(fd, view):]
            if self._fsync:
                os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise named_os_error(e, self.path) from e

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


class OutputBusyError(RuntimeError):
    """Another live process writes the same output: it holds the output's `output_lock`."""


def lock_file(target: str | os.PathLike) -> Path:
    """The lock file of an output: hidden, beside it (so locking needs no output folder yet)."""
    target = Path(target)
    return target.parent / f".{target.name}.lock"


#: flock's answers on a filesystem without locks (Lustre mounted without ``-o flock``, some FUSE mounts)
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


@contextlib.contextmanager
def output_lock(target: str | os.PathLike, what: str, wait_s: float = 0.0) -> Iterator[Path]:
    """Hold an advisory lock on the output ``target`` (a run dir, a checkpoint root, an OUT file) while a run writes
    it: `fcntl.flock` on `lock_file(target)`. A second run on the same output gets `OutputBusyError` at once, naming
    the holder (pid, host, start, command), instead of interleaving appends or checkpoint saves with it. The kernel
    drops a flock when its process dies, however it dies, so a killed run leaves no stale lock (its file stays and is
    taken over); a released lock's file is removed. A filesystem without flock runs unlocked, with a warning. The
    descriptor is not inherited by exec'd children (ranks, engines), whose lifetime would otherwise hold it. With
    ``wait_s``, a held lock is waited for that long before the refusal: a requeued slurm job whose previous node died
    finds that node's lock on a shared filesystem until its lease runs out (NFS: about 90 s). A run that fails
    under the lock leaves none of the folders the lock file needed that are still empty (bad input found after the
    lock leaves nothing written)."""
    target = Path(target).resolve()   # `--out .`, `--out link` and the absolute path are one output: one lock
    made = [d for d in (lock_file(target).parent, *lock_file(target).parent.parents) if not d.exists()]
    try:
        with _held_lock(target, what, wait_s) as path:
            yield path
    except BaseException:
        for d in made:   # deepest first; one that holds anything stays
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise


@contextlib.contextmanager
def _held_lock(target: Path, what: str, wait_s: float) -> Iterator[Path]:
    path = lock_file(target)
    deadline = time.monotonic() + wait_s
    waited = False
    with contextlib.suppress(FileExistsError):   # a file there: the open below says "Not a directory"
        path.parent.mkdir(parents=True, exist_ok=True)
    stale = 0
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            if e.errno == errno.ENOENT and stale < 5:   # a run that failed removed the folder it had made: again
                stale += 1
                with contextlib.suppress(FileExistsError):
                    path.parent.mkdir(parents=True, exist_ok=True)
                continue
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise named_os_error(e, path) from e
            # the output's folder is not writable (a provisioned output under a read-only parent): a lock file
            # inside an existing output folder instead, else no lock
            inside = target / ".lock"
            if target.is_dir() and path != inside:
                path = inside
                continue
            log.warning("%s: cannot create a lock file (%s): a second run on %s would not be refused", path,
                        e.strerror, target)
            yield path
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            if time.monotonic() < deadline:
                if not waited:
                    log.warning("%s is in use by another %s (%s): waiting up to %.0f s for it to end", target, what,
                                holder, wait_s)
                    waited = True
                time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
                continue
            raise OutputBusyError(f"{target} is in use by another {what} ({holder}); wait for it to end or choose "
                                  f"another output (if that process is gone, e.g. its node died and a shared "
                                  f"filesystem still holds its lock, remove {path})") from None
        except OSError as e:
            os.close(fd)
            if e.errno == errno.ESTALE and stale < 5:   # NFS: the holder removed the file as we locked it
                stale += 1
                continue
            if e.errno not in _NO_FLOCK:
                raise named_os_error(e, path) from e
            log.warning("%s: this filesystem has no file locks (%s): a second run on %s would not be refused",
                        path, e.strerror, target)
            with contextlib.suppress(OSError):   # nothing to hold: leave no file (a folder we made can go again)
                os.unlink(path)
            fd = None
            break
        # a holder that released the lock removed the file we opened: lock the file now at the path instead
        with contextlib.suppress(OSError):
            st, ours = os.stat(path), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino):
                break
        os.close(fd)
    if fd is None:
        yield path
        return
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join([os.path.basename(sys.executable), *sys.argv])[:400]}
        with contextlib.suppress(OSError):   # the lock holds without them (a full disk)
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(info) + "\n").encode())
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)   # still locked: a process that opened it now finds it gone and opens a new one
        os.close(fd)


def _lock_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "null")
        return f"pid {info['pid']} on {info['host']} since {info['since']}: {info['command']}"
    except (OSError, ValueError, TypeError, KeyError):
        return "its details are not written yet"
