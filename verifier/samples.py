"""Samples JSONL in, verdict rows JSONL out.

Input rows: ``{"task_id" | "task": ..., "response" | "code": ..., "sample_id"?: ...}``; any other
keys are carried through to the output row under ``meta``. Output rows are written one per sample,
flushed to ``OUT.partial`` as they complete (a crash loses nothing) and renamed into place at the
end (readers never see a half-written file).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence


class SamplesError(ValueError):
    """Malformed samples file or unknown task; the message names the file, line, and value."""


@dataclasses.dataclass(frozen=True)
class Sample:
    task_ref: str          # task id, file stem, or path, as written in the row
    response: str          # raw model response or plain Python source
    sample_id: str
    line_no: int
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


_TASK_KEYS = ("task_id", "task")
_CODE_KEYS = ("response", "code")


def read_samples(path: str) -> list[Sample]:
    """Parse a samples JSONL file; every problem is reported with its line number."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise SamplesError(f"samples file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SamplesError(f"cannot read samples file {path}: {e}") from e
    out: list[Sample] = []
    per_task: dict[str, int] = {}
    seen_ids: set[str] = set()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SamplesError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise SamplesError(f"{path}:{i}: each line must be a JSON object")
        task_ref = next((row[k] for k in _TASK_KEYS if k in row), None)
        if not isinstance(task_ref, str) or not task_ref:
            raise SamplesError(f"{path}:{i}: missing 'task_id' (or 'task') string")
        response = next((row[k] for k in _CODE_KEYS if k in row), None)
        if not isinstance(response, str):
            raise SamplesError(f"{path}:{i}: missing 'response' (or 'code') string")
        n = per_task.get(task_ref, 0)
        per_task[task_ref] = n + 1
        sample_id = row.get("sample_id")
        sample_id = f"{task_ref}#{n}" if sample_id is None else str(sample_id)
        if sample_id in seen_ids:
            raise SamplesError(f"{path}:{i}: duplicate sample_id {sample_id!r}")
        seen_ids.add(sample_id)
        meta = {k: v for k, v in row.items() if k not in (*_TASK_KEYS, *_CODE_KEYS, "sample_id")}
        out.append(Sample(task_ref=task_ref, response=response, sample_id=sample_id, line_no=i, meta=meta))
    return out


def _task_keys(task: Any, root: str | None) -> set[str]:
    path = os.path.abspath(task.path)
    stem = os.path.splitext(os.path.basename(path))[0]
    keys = {task.task_id, stem, path, os.path.basename(path)}
    if root:
        rel = os.path.relpath(path, os.path.abspath(root))
        keys |= {rel, os.path.splitext(rel)[0]}
    return keys


def match_samples(samples: Sequence[Sample], tasks: Sequence[Any], root: str | None = None) -> list[Any]:
    """The task of every sample, matched by task id, file stem, file name, or path.

    Raises ``SamplesError`` naming every unknown or ambiguous reference at once.
    """
    index: dict[str, list[Any]] = {}
    for t in tasks:
        for k in _task_keys(t, root):
            bucket = index.setdefault(k, [])
            if not any(x is t for x in bucket):
                bucket.append(t)
    unknown: dict[str, int] = {}
    ambiguous: dict[str, list[str]] = {}
    out = []
    for s in samples:
        ref = s.task_ref
        cands = index.get(ref) or index.get(os.path.abspath(ref)) or []
        if len(cands) == 1:
            out.append(cands[0])
            continue
        if not cands:
            unknown.setdefault(ref, s.line_no)
        else:
            ambiguous[ref] = [c.path for c in cands]
        out.append(None)
    problems = []
    if unknown:
        known = sorted({t.task_id for t in tasks})
        hint = ", ".join(known[:8]) + (" ..." if len(known) > 8 else "")
        problems.append("unknown task ids: " + ", ".join(f"{r!r} (line {ln})" for r, ln in unknown.items())
                        + f"; known ids include: {hint}")
    if ambiguous:
        problems.append("ambiguous task references (use a path): "
                        + "; ".join(f"{r!r} -> {ps}" for r, ps in ambiguous.items()))
    if problems:
        raise SamplesError(". ".join(problems))
    return out


def result_row(sample: Sample, task: Any, result: Any) -> dict[str, Any]:
    """One output row: sample identity, the task's level/op family, then the verdict fields."""
    row: dict[str, Any] = {"sample_id": sample.sample_id, "task_id": task.task_id,
                           "level": getattr(task, "level", None), "op_family": getattr(task, "op_family", None)}
    row.update(result.to_dict())
    row["task_id"] = task.task_id
    if sample.meta:
        row["meta"] = sample.meta
    return row


class ResultsWriter:
    """Append to ``OUT.partial`` while running, one whole fsynced line per row; atomically publish ``OUT`` at the end.

    Rows land in the partial file in completion order; ``finish`` writes them in the order given. A row that cannot
    be written whole (a full disk) is taken back and the OSError names the file, so the next row never lands glued to
    half a line, which a resume would drop with it.
    """

    def __init__(self, out_path: str):
        self.out_path = out_path
        self.partial_path = out_path + ".partial"
        parent = os.path.dirname(os.path.abspath(out_path))
        os.makedirs(parent, exist_ok=True)
        self._fd: int | None = os.open(self.partial_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)

    def append(self, row: dict[str, Any]) -> None:
        data = memoryview((json.dumps(row, default=str) + "\n").encode("utf-8"))
        start = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[os.write(self._fd, data):]
            os.fsync(self._fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise OSError(e.errno, e.strerror, self.partial_path) from e

    def finish(self, rows: Iterable[dict[str, Any]]) -> None:
        """Write ``OUT`` through a unique temp beside it (two writers never share one), then drop the partial file."""
        out = Path(self.out_path)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        try:
            with contextlib.suppress(OSError):   # a plain open's mode, not mkstemp's 0600 (vfat, CIFS: no chmod)
                os.fchmod(fd, 0o666 & ~_umask())
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r, default=str) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.out_path)
        except BaseException as e:   # the finished rows stay in the .partial file; no stray temp file beside them
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, OSError) and e.filename is None:
                raise OSError(e.errno, e.strerror, self.out_path) from e
            raise
        self.close()
        with contextlib.suppress(FileNotFoundError):   # removed by hand meanwhile: OUT is written all the same
            os.unlink(self.partial_path)

    def close(self) -> None:
        """Stop writing but keep the partial file (used when the run did not finish)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _umask() -> int:
    """The process umask, read without setting it (``os.umask`` sets it: a race with other threads' files)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    return 0o022


def output_file_problem(path: str) -> str | None:
    """Why an output file cannot be written at ``path`` (an existing folder, or a file where a parent folder
    should be), checked before any work; None when it can. The command-line tools that write results files
    (``verifier eval``, ``data_synth``) name their flag in front of it."""
    if os.path.isdir(path):
        return "is a folder (give a file path)"
    above = next((d for d in Path(os.path.abspath(path)).parents if d.exists()), None)
    if above is not None and not above.is_dir():
        return f"{above} is a file, not a folder"
    return None


def read_result_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a results (or ``.partial``) file; a torn last line from a crash is skipped."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
