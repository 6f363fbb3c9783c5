"""Atomic file and directory writes: nothing is ever half-written where a reader looks.

Files go to a temp name in the same directory, are fsynced, then renamed; directories are built
under a hidden temp name and renamed into place, so a crash leaves either the old state or the new
one (plus, at worst, a hidden temp to clean up).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


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
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
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
    ``target`` first, its copy is kept and ours is discarded (both were built from the same inputs)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _mkdtemp_beside(target)
    try:
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
        build(str(tmp))
        return replace_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
