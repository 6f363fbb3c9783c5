"""Task-set manifests and size profiles: the same KernelBench task at CPU-test or realistic GPU shapes.

A bundled task file keeps its small (CPU) sizes as module-level constants, so it is an ordinary
KernelBench problem that runs in milliseconds anywhere. Its ``manifest.json`` entry carries the
metadata (level, op family, backend) and other size profiles (``"gpu"``: realistic shapes).
Applying a profile rewrites those constant assignments in the task *source*, so the parent, the
build and the sandboxed child all see one consistent program (an environment variable would be
scrubbed from the sandbox, and the two sides would disagree).

Manifest format (``manifest.json`` in a task-set folder)::

    {"format_version": 1, "profiles": ["cpu", "gpu"],
     "tasks": [{"path": "level1/12_Softmax.py", "task_id": "12_Softmax", "level": 1,
                "op_family": "softmax", "backend": "any", "precisions": ["float32", ...],
                "sizes": {"cpu": {"batch_size": 16, "dim": 4096}, "gpu": {...}}}]}

``path`` is relative to the manifest's folder; ``backend`` is cpu | cuda | musa | any. A ``.jsonl``
manifest holds one entry per line; an entry may also be a bare path string.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

MANIFEST_NAMES = ("manifest.json", "manifest.jsonl")
BACKENDS = ("cpu", "cuda", "musa", "any")


class ManifestError(ValueError):
    """A manifest file is malformed; the message names the file and the entry."""


@dataclasses.dataclass(frozen=True)
class ManifestEntry:
    path: str                     # absolute path of the task file
    task_id: str
    level: int | None
    op_family: str | None
    backend: str
    precisions: tuple[str, ...]
    sizes: Mapping[str, Mapping[str, Any]]   # profile name -> {constant name: value}


def _entry_from_json(raw: Any, base_dir: str, where: str) -> ManifestEntry:
    if isinstance(raw, str):
        raw = {"path": raw}
    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: a task entry must be a JSON object, got {type(raw).__name__}")
    rel = raw.get("path") or raw.get("file")
    if not isinstance(rel, str) or not rel:
        raise ManifestError(f"{where}: task entry has no 'path'")
    path = os.path.normpath(os.path.join(base_dir, rel))
    level = raw.get("level")
    if level is not None and not isinstance(level, int):
        raise ManifestError(f"{where} ({rel}): 'level' must be an integer, got {level!r}")
    backend = raw.get("backend", "any")
    if backend not in BACKENDS:
        raise ManifestError(f"{where} ({rel}): 'backend' must be one of {BACKENDS}, got {backend!r}")
    sizes = raw.get("sizes", {})
    if not isinstance(sizes, dict) or not all(isinstance(v, dict) for v in sizes.values()):
        raise ManifestError(f"{where} ({rel}): 'sizes' must map profile names to objects")
    precisions = raw.get("precisions", ["float32"])
    if not isinstance(precisions, list) or not all(isinstance(p, str) for p in precisions):
        raise ManifestError(f"{where} ({rel}): 'precisions' must be a list of dtype names")
    task_id = raw.get("task_id") or os.path.splitext(os.path.basename(rel))[0]
    return ManifestEntry(path=path, task_id=str(task_id), level=level, op_family=raw.get("op_family"),
                         backend=backend, precisions=tuple(precisions), sizes=sizes)


def read_manifest(path: str) -> list[ManifestEntry]:
    """Parse a manifest (``.json`` object with ``tasks``, a bare JSON list, or ``.jsonl``)."""
    if os.path.isdir(path):
        for name in MANIFEST_NAMES:
            if os.path.isfile(os.path.join(path, name)):
                path = os.path.join(path, name)
                break
        else:
            raise ManifestError(f"{path}: no manifest.json or manifest.jsonl in this folder")
    base = os.path.dirname(os.path.abspath(path))
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ManifestError(f"{path}: cannot read manifest ({e})") from e
    try:
        if path.endswith(".jsonl"):
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            doc = json.loads(text)
            rows = doc.get("tasks") if isinstance(doc, dict) else doc
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(rows, list):
        raise ManifestError(f"{path}: expected a 'tasks' list")
    return [_entry_from_json(r, base, f"{path} entry {i}") for i, r in enumerate(rows)]


def find_manifest_entry(task_path: str, max_up: int = 3) -> ManifestEntry | None:
    """The manifest entry for a task file, searching its folder and up to ``max_up`` parents."""
    task_path = os.path.normpath(os.path.abspath(task_path))
    d = os.path.dirname(task_path)
    for _ in range(max_up + 1):
        for name in MANIFEST_NAMES:
            m = os.path.join(d, name)
            if os.path.isfile(m):
                for e in read_manifest(m):
                    if e.path == task_path:
                        return e
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return None


def module_constants(source: str) -> dict[str, Any]:
    """Top-level constants of a task source (never executes it): ``N = <literal>``, and the forms
    KernelBench uses, ``height = width = 128`` and ``depth, height, width = 16, 32, 32``.
    A name assigned twice keeps its last value, as when the module runs."""
    out: dict[str, Any] = {}
    for node in ast.parse(source).body:
        for name, value in _assigned_names(node):
            try:
                out[name] = ast.literal_eval(value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                out.pop(name, None)   # a later non-literal assignment hides an earlier literal
    return out


def _assigned_names(node: ast.stmt) -> list[tuple[str, ast.expr]]:
    """``(name, value expression)`` for every name a top-level assignment binds. Chained targets share
    one value; a tuple target is matched element by element against a tuple/list display of the same
    length (other unpackings bind nothing we can rewrite)."""
    if isinstance(node, ast.AnnAssign):
        return [(node.target.id, node.value)] if isinstance(node.target, ast.Name) and node.value else []
    if not isinstance(node, ast.Assign):
        return []
    out = []
    for target in node.targets:
        if isinstance(target, ast.Name):
            out.append((target.id, node.value))
        elif isinstance(target, (ast.Tuple, ast.List)) and isinstance(node.value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(node.value.elts) and all(isinstance(t, ast.Name) for t in target.elts):
            out += [(t.id, v) for t, v in zip(target.elts, node.value.elts)]
    return out


def rewrite_constants(source: str, values: Mapping[str, Any]) -> str:
    """Replace the values of top-level constant assignments, keeping every other byte of the source.

    Every assignment of a name is rewritten (a module may assign it twice). A chained assignment
    (``height = width = 128``) whose names now get different values becomes one tuple assignment
    (``height, width = 64, 128``) when its value is a literal. Raises ``KeyError`` naming constants
    the source does not assign, and ``ValueError`` for values that are not plain literals (they must
    round-trip through ``repr``/``ast.literal_eval``) or a chain from an expression that would split.
    """
    for name, v in values.items():
        try:
            ok = ast.literal_eval(repr(v)) == v
        except (ValueError, SyntaxError):
            ok = False
        if not ok:
            raise ValueError(f"size {name}={v!r} is not a plain literal")
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln.encode("utf-8")))
    data = source.encode("utf-8")

    def span(node: ast.AST) -> tuple[int, int]:
        return offsets[node.lineno - 1] + node.col_offset, offsets[node.end_lineno - 1] + node.end_col_offset

    spans: list[tuple[int, int, str]] = []
    seen: set[str] = set()
    for node in ast.parse(source).body:
        bound = _assigned_names(node)
        hits = [(n, v) for n, v in bound if n in values]
        if not hits:
            continue
        seen.update(n for n, _ in hits)
        if isinstance(node, ast.Assign) and len(node.targets) > 1:   # a = b = <value>: one value node
            names = [n for n, _ in bound]
            if not all(isinstance(t, ast.Name) for t in node.targets):
                raise ValueError(f"line {node.lineno}: cannot rewrite {', '.join(n for n, _ in hits)} in a chained "
                                 f"assignment with an unpacking target")
            if len({repr(values[n]) for n, _ in hits}) == 1 and len(hits) == len(names):
                spans.append((*span(node.value), repr(values[hits[0][0]])))
                continue
            try:
                old = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                raise ValueError(f"line {node.lineno}: {', '.join(names)} are assigned together from an "
                                 f"expression; cannot change {', '.join(n for n, _ in hits)} alone") from None
            new = ", ".join(repr(values[n]) if n in values else repr(old) for n in names)
            spans.append((*span(node), f"{', '.join(names)} = {new}"))
            continue
        spans += [(*span(v), repr(values[n])) for n, v in hits]
    missing = sorted(set(values) - seen)
    if missing:
        raise KeyError(f"the task source assigns no module-level constant named {', '.join(missing)}")
    for start, end, text in sorted(spans, reverse=True):
        data = data[:start] + text.encode("utf-8") + data[end:]
    return data.decode("utf-8")


def apply_size_profile(task: Any, profile: str | None, entry: ManifestEntry | None = None) -> Any:
    """The task with the manifest's ``profile`` sizes written into its source.

    ``task`` is a ``verifier.tasks.Task`` (any dataclass with ``path`` and ``source``). Tasks with no
    manifest entry, or no sizes for ``profile``, are returned unchanged: a plain KernelBench
    problem already carries the shapes it means. ``None`` or ``"cpu"`` keeps the module constants.
    """
    if profile in (None, "", "cpu", "default"):
        return task
    entry = entry if entry is not None else find_manifest_entry(task.path)
    if entry is None or profile not in entry.sizes:
        return task
    sizes = dict(entry.sizes[profile])
    current = module_constants(task.source)
    changed = {k: v for k, v in sizes.items() if current.get(k, object()) != v}
    if not changed:
        return task
    return dataclasses.replace(task, source=rewrite_constants(task.source, changed))


def apply_size_profile_all(tasks: Sequence[Any], profile: str | None) -> list[Any]:
    return [apply_size_profile(t, profile) for t in tasks]


def manifest_path_for(spec: str) -> str | None:
    """The manifest a task-set argument refers to: the file itself, or one inside the folder."""
    if os.path.isdir(spec):
        for name in MANIFEST_NAMES:
            if os.path.isfile(os.path.join(spec, name)):
                return os.path.join(spec, name)
        return None
    return spec if spec.endswith((".json", ".jsonl")) and os.path.isfile(spec) else None


def load_manifest_tasks(path: str) -> list[Any]:
    """Tasks of a manifest, each loaded (and statically validated) by ``verifier.tasks.load_task``.

    The manifest's metadata is applied; ``backend: any`` becomes ``None`` (no restriction).
    """
    from .tasks import load_task
    entries = read_manifest(path)
    if not entries:
        raise ManifestError(f"{path}: the manifest lists no tasks")
    seen: dict[str, str] = {}
    tasks = []
    for e in entries:
        if e.task_id in seen:
            raise ManifestError(f"{path}: duplicate task_id {e.task_id!r} ({seen[e.task_id]} and {e.path})")
        seen[e.task_id] = e.path
        tasks.append(load_task(e.path, task_id=e.task_id, level=e.level, op_family=e.op_family,
                               backend=None if e.backend == "any" else e.backend))
    return tasks


def load_tasks(spec: str) -> list[Any]:
    """A task set from a folder, manifest, list file, or task file.

    Manifests (given directly or found in the folder) are read here, so their size profiles and
    extra keys are understood; anything else goes to ``verifier.tasks.load_task_set``.
    """
    manifest = manifest_path_for(spec)
    if manifest is not None:
        return load_manifest_tasks(manifest)
    from .tasks import load_task_set
    return load_task_set(spec)
