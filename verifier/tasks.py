"""Loading KernelBench-format tasks: one ``.py`` file with ``class Model``, ``get_inputs``, ``get_init_inputs``.

Loading only validates the file statically (AST) so a task set can be listed and checked without running
any of it. ``load_task_module`` executes a task; tasks are trusted inputs of the farm (the parent process
computes references from them), candidates never are.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import sys
import types
from typing import Any, Iterable

from .config import BACKENDS

# Layers whose KernelBench reference output depends on training mode (batch statistics, active dropout).
TRAIN_MODE_LAYERS = ("BatchNorm", "InstanceNorm", "Dropout", "batch_norm", "instance_norm", "dropout",
                     "SyncBatchNorm", "LazyBatchNorm", "AlphaDropout", "FeatureAlphaDropout")
_LEVEL_RE = re.compile(r"^level[_-]?(\d+)$", re.IGNORECASE)


class TaskError(ValueError):
    """A task file or task set is malformed; the message names the file and what is wrong."""


@dataclasses.dataclass
class Task:
    task_id: str
    path: str
    source: str
    level: int | None = None
    op_family: str | None = None
    backend: str | None = None
    train_mode_layers: tuple[str, ...] = ()   # BatchNorm/InstanceNorm/Dropout-style layers the reference uses
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # other manifest fields (sizes, precisions..)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d


def _validate(source: str, path: str) -> tuple[str, ...]:
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise TaskError(f"{path}: task does not parse: line {e.lineno}: {e.msg}") from None
    except ValueError as e:
        raise TaskError(f"{path}: task does not parse: {e}") from None
    top = {n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    model = top.get("Model")
    if not isinstance(model, ast.ClassDef):
        raise TaskError(f"{path}: no module-level `class Model(nn.Module)`")
    if not any(isinstance(n, ast.FunctionDef) and n.name == "forward" for n in model.body):
        raise TaskError(f"{path}: class Model has no forward method")
    for fn in ("get_inputs", "get_init_inputs"):
        if not isinstance(top.get(fn), ast.FunctionDef):
            raise TaskError(f"{path}: no module-level `def {fn}()`")
    found = []
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name:
            for layer in TRAIN_MODE_LAYERS:
                if name.startswith(layer) and name not in found:
                    found.append(name)
    return tuple(found)


def _level_from_path(path: str) -> int | None:
    for part in reversed(os.path.normpath(path).split(os.sep)[:-1]):
        m = _LEVEL_RE.match(part)
        if m:
            return int(m.group(1))
    return None


def load_task(path: str, *, task_id: str | None = None, level: int | None = None, op_family: str | None = None,
              backend: str | None = None, meta: dict[str, Any] | None = None) -> Task:
    """Read and statically validate one task file (nothing of it runs). ``backend`` None or "any": any backend."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(path):
        raise TaskError(f"{path}: task file not found")
    if backend == "any":
        backend = None
    if backend is not None and backend not in BACKENDS:
        raise TaskError(f"{path}: backend must be one of {BACKENDS} or 'any', got {backend!r}")
    if level is not None and (not isinstance(level, int) or isinstance(level, bool)):
        raise TaskError(f"{path}: level must be an integer, got {level!r}")
    try:
        with open(path, "rb") as f:
            source = f.read().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: task is not UTF-8 ({e.reason} at byte {e.start})") from None
    layers = _validate(source, path)
    return Task(task_id=task_id or os.path.splitext(os.path.basename(path))[0], path=path, source=source,
                level=level if level is not None else _level_from_path(path), op_family=op_family,
                backend=backend, train_mode_layers=layers, meta=dict(meta or {}))


def _natural_key(path: str) -> list:
    return [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", path)]


def _id_for(path: str, root: str) -> str:
    rel = os.path.splitext(os.path.relpath(path, root))[0].replace(os.sep, "/")
    base = os.path.basename(os.path.normpath(root))
    return f"{base}/{rel}" if _LEVEL_RE.match(base) else rel


def _from_manifest(path: str) -> list[Task]:
    root = os.path.dirname(path)
    try:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".jsonl"):
                entries = [json.loads(line) for line in f if line.strip()]
            else:
                data = json.load(f)
                entries = data.get("tasks") if isinstance(data, dict) else data
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TaskError(f"{path}: manifest is not valid JSON: {e}") from None
    if not isinstance(entries, list):
        raise TaskError(f"{path}: manifest must be a list of entries or {{\"tasks\": [...]}}")
    tasks = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            entry = {"path": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise TaskError(f"{path}: entry {i} needs a string `path`, got {entry!r}")
        known = {"path", "task_id", "level", "op_family", "backend"}
        task_path = os.path.join(root, entry["path"])
        tasks.append(load_task(task_path, task_id=entry.get("task_id") or _id_for(os.path.abspath(task_path), root),
                               level=entry.get("level"), op_family=entry.get("op_family"),
                               backend=entry.get("backend"),
                               meta={k: v for k, v in entry.items() if k not in known}))
    return tasks


def _from_dir(path: str) -> list[Task]:
    for name in ("manifest.json", "manifest.jsonl"):
        if os.path.isfile(os.path.join(path, name)):
            return _from_manifest(os.path.join(path, name))
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__")))
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py") and not f.startswith(("_", "."))]
    if not files:
        raise TaskError(f"{path}: no task files (*.py) in this folder")
    return [load_task(f, task_id=_id_for(f, path)) for f in sorted(files, key=_natural_key)]


def _from_list_file(path: str) -> list[Task]:
    root = os.path.dirname(path)
    tasks = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                tasks += _expand(os.path.join(root, line))
    return tasks


def _expand(item: str) -> list[Task]:
    path = os.path.abspath(os.path.expanduser(str(item)))
    if os.path.isdir(path):
        return _from_dir(path)
    if not os.path.isfile(path):
        raise TaskError(f"{path}: no such task file, folder, manifest or list")
    if path.endswith((".json", ".jsonl")):
        return _from_manifest(path)
    if path.endswith(".py"):
        return [load_task(path)]
    return _from_list_file(path)


def load_task_set(dir_or_list: str | os.PathLike | Iterable[str]) -> list[Task]:
    """Tasks from a folder (recursive; a manifest.json/.jsonl inside it wins), a manifest, a text file of
    paths (one per line, relative to the file, ``#`` comments), a single task file, or a list of those."""
    if isinstance(dir_or_list, (str, os.PathLike)):
        tasks = _expand(os.fspath(dir_or_list))
    else:
        tasks = [t for item in dir_or_list for t in _expand(os.fspath(item))]
    seen: dict[str, str] = {}
    for t in tasks:
        if t.task_id in seen and seen[t.task_id] != t.path:
            raise TaskError(f"duplicate task_id {t.task_id!r}: {seen[t.task_id]} and {t.path}")
        seen[t.task_id] = t.path
    return tasks


def load_task_module(task: Task, module_name: str = "kernel_task", register: bool = False) -> types.ModuleType:
    """Execute a (trusted) task file as a fresh module."""
    module = types.ModuleType(module_name)
    module.__file__ = task.path
    if register:
        sys.modules[module_name] = module
    code = compile(task.source, task.path, "exec")
    exec(code, module.__dict__)  # noqa: S102 - tasks are trusted inputs
    for name in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(module, name):
            raise TaskError(f"{task.path}: `{name}` is missing after executing the task")
    return module
