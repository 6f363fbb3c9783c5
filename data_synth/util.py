"""Small shared helpers: seeded sub-generators, atomic file and folder writes, JSONL reading.

Every output of the package is written beside its destination and renamed into place, so a crash or
a bad input never leaves a half-written file or task set where a later stage would read it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
from typing import Any, Iterator

from megatron_rl.fsutil import current_umask, naming_write_problems, write_text_atomic


class DataSynthError(ValueError):
    """Bad input to a data_synth command; the message names the file, row or value that is wrong."""


def sub_rng(seed: int, *keys: Any) -> random.Random:
    """A generator that depends only on ``seed`` and ``keys``: item i of a run never depends on item i-1,
    so a task is reproducible alone and a larger run extends a smaller one."""
    text = "/".join([str(seed), *map(str, keys)])
    return random.Random(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big"))


def stable_hash(text: str, n: int = 16) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:n]


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` beside ``path`` and rename it into place (`megatron_rl.fsutil.write_text_atomic`: a unique
    temp, the umask's mode, nothing left by a failed write)."""
    write_text_atomic(path, text)


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False, default=str) + "\n")


def atomic_write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in rows))


@contextlib.contextmanager
def atomic_dir(path: str, force: bool = False) -> Iterator[str]:
    """Yield a temporary folder beside ``path``; on success it replaces ``path`` (an existing one only with
    ``force``), on failure it is removed and ``path`` is untouched. The temp and the replaced folder are hidden
    (``.name.*``): a process killed while writing leaves them beside the task sets, and a parent folder's task walk
    (`verifier.tasks.load_task_set`) skips hidden folders instead of loading half a task set. The folder gets the
    umask's mode, not mkdtemp's 0700."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):   # --force replaces an output folder, never a file
        raise DataSynthError(f"{path} is a file, not an output folder")
    if os.path.exists(path) and not force:
        raise DataSynthError(f"{path} already exists (pass --force to replace it)")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=parent)
    os.chmod(tmp, 0o777 & ~current_umask())
    try:
        with naming_write_problems(tmp, path):   # a full disk names the task set, not "[Errno 28]" alone
            yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(path):
        old = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".", suffix=".old", dir=parent)
        os.rmdir(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_jsonl(path: str, what: str = "rows") -> list[dict[str, Any]]:
    """Rows of a JSONL file; a malformed line is an error naming the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise DataSynthError(f"{what} file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataSynthError(f"cannot read {what} file {path}: {e}") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataSynthError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataSynthError(f"{path}:{i}: each line must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def read_json(path: str, what: str = "JSON") -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise DataSynthError(f"{what} file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise DataSynthError(f"{path}: {what} is not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataSynthError(f"cannot read {what} file {path}: {e}") from None
