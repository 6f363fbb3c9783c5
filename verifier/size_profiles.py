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

The profile ``fit`` (``fit:<MiB>`` or ``fit:<MiB>:<GFLOP>``; default 64 MiB, 2 GFLOP) needs no manifest: it shrinks a
plain KernelBench task until one call of its reference moves at most that many bytes (inputs, outputs and
parameters) and does at most that many FLOPs, so KernelBench's GPU-sized problems (a 6.4 GB ReLU input) can be
evaluated on a CPU. It halves the task's largest integer constants (elements of integer tuples and lists included)
one at a time (never one below ``FIT_MIN_VALUE``: kernel sizes, strides and head counts stay), each step sized on
meta tensors (nothing allocated) and kept only when the reference still builds and runs on the new shapes and gets
cheaper.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import math
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
    ``fit[:MiB[:GFLOP]]`` shrinks any task to that budget (``fit_sizes``; the module docstring).
    """
    if profile in (None, "", "cpu", "default"):
        return task
    budget = parse_fit_profile(profile)
    if budget is not None:
        return fit_sizes(task, *budget)[0]
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


# ------------------------------------------------------------------------------------ the ``fit`` profile
FIT = "fit"
FIT_DEFAULT_BYTES = 64 << 20
FIT_DEFAULT_FLOPS = 2 * 10**9
FIT_MIN_VALUE = 16           # a constant is halved only while it is at least this (16 -> 8 is the last step)
_FIT_MAX_STEPS = 256


def parse_fit_profile(profile: str | None) -> tuple[int, int] | None:
    """``(max_bytes, max_flops)`` of a ``fit``, ``fit:<MiB>`` or ``fit:<MiB>:<GFLOP>`` profile; None for any
    other profile name. A malformed budget raises ValueError naming the profile."""
    if not profile or profile.split(":", 1)[0] != FIT:
        return None
    parts = profile.split(":")[1:]
    if len(parts) > 2:
        raise ValueError(f"size profile {profile!r}: expected fit, fit:<MiB> or fit:<MiB>:<GFLOP>")
    try:
        mib = float(parts[0]) if parts and parts[0] else FIT_DEFAULT_BYTES / (1 << 20)
        gflop = float(parts[1]) if len(parts) > 1 and parts[1] else FIT_DEFAULT_FLOPS / 1e9
    except ValueError:
        raise ValueError(f"size profile {profile!r}: the budget must be numbers (fit:<MiB>:<GFLOP>)") from None
    if not (math.isfinite(mib) and math.isfinite(gflop) and mib > 0 and gflop > 0):
        raise ValueError(f"size profile {profile!r}: the budget must be positive and finite")
    return int(mib * (1 << 20)), int(gflop * 1e9)


def _int_expr(node: ast.expr) -> int | None:
    """The value of an integer literal or of integer arithmetic on literals (KernelBench writes ``N = 2048 * 2``);
    None for anything else (bools, floats, names, calls)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _int_expr(node.operand)
        return -v if v is not None else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Pow)):
        a, b = _int_expr(node.left), _int_expr(node.right)
        if a is None or b is None or (isinstance(node.op, ast.FloorDiv) and b == 0):
            return None
        if isinstance(node.op, ast.Pow) and not 0 <= b <= 64:
            return None
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        return a // b if isinstance(node.op, ast.FloorDiv) else a ** b
    return None


def _int_sequence(node: ast.expr) -> tuple[int, ...] | list[int] | None:
    """A tuple or list display of integers (``(8192 * 2,)``, ``[16384, 16384]``), or a list of them repeated
    (``[1024] * 16``, KernelBench's MLP layer widths); None for anything else. Lists stay lists: a task may append to
    one or pass it where a tuple means something else."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        seq, times = (node.left, node.right) if isinstance(node.left, ast.List) else (node.right, node.left)
        n = _int_expr(times)
        elts = _int_sequence(seq) if isinstance(seq, ast.List) else None
        return list(elts) * n if elts is not None and n is not None and 0 < n <= 1024 else None
    if not isinstance(node, (ast.Tuple, ast.List)) or not node.elts:
        return None
    elts = [_int_expr(e) for e in node.elts]
    if any(e is None for e in elts):
        return None
    return tuple(elts) if isinstance(node, ast.Tuple) else list(elts)   # type: ignore[arg-type]


def int_constants(source: str) -> dict[str, int | tuple[int, ...] | list[int]]:
    """Top-level names bound by single assignments to one integer (a literal or literal arithmetic) or to a tuple or
    list of them (KernelBench's ``input_shape = (8192 * 2,)``, ``layer_sizes = [16384, 16384]``): the sizes ``fit``
    may shrink. A name assigned anything else anywhere at top level is left out."""
    out: dict[str, int | tuple[int, ...] | list[int]] = {}
    other: set[str] = set()
    for node in ast.parse(source).body:
        for name, value in _assigned_names(node):
            v: int | tuple[int, ...] | list[int] | None = _int_expr(value)
            if v is None:
                v = _int_sequence(value)
            if v is None:
                other.add(name)
            else:
                out[name] = v
    return {k: v for k, v in out.items() if k not in other}


def _sizes(constants: dict[str, int | tuple[int, ...] | list[int]]) -> dict[tuple[str, int | None], int]:
    """Every integer ``fit`` may halve: ``(name, None)`` for an int constant, ``(name, i)`` for a sequence's i-th."""
    out: dict[tuple[str, int | None], int] = {}
    for name, v in constants.items():
        if isinstance(v, (tuple, list)):
            out.update({(name, i): e for i, e in enumerate(v)})
        else:
            out[(name, None)] = v
    return out


def _constants(sizes: dict[tuple[str, int | None], int], like: dict[str, Any]) -> dict[str, Any]:
    """``sizes`` back as constants shaped as in ``like`` (ints, tuples and lists)."""
    out: dict[str, Any] = {}
    for name, v in like.items():
        out[name] = type(v)(sizes[(name, i)] for i in range(len(v))) if isinstance(v, (tuple, list)) \
            else sizes[(name, None)]
    return out


@dataclasses.dataclass(frozen=True)
class MetaCost:
    """One reference call at some sizes, from shapes alone: bytes of inputs, outputs and parameters, and FLOPs."""

    nbytes: int
    flops: int

    def within(self, max_bytes: int, max_flops: int) -> bool:
        return self.nbytes <= max_bytes and self.flops <= max_flops

    def cheaper_than(self, other: "MetaCost") -> bool:
        """Smaller in one measure by at least 5 % and larger in none."""
        return (self.nbytes <= other.nbytes and self.flops <= other.flops
                and (self.nbytes < 0.95 * other.nbytes or self.flops < 0.95 * other.flops))


def run_reference_on_meta(task: Any, precision: str = "float32", during_call: Any = None) -> tuple[Any, Any, Any]:
    """(model, args, output) of one reference call built and run on meta tensors (shapes only, nothing allocated or
    computed), the call inside the context manager ``during_call`` (a FLOP counter, an op recorder) when given.
    Raises whatever the task raises there (data-dependent code, sizes its layers reject)."""
    import contextlib

    import torch

    from .inputs import DeviceFactoryMode, _to_device, precision_dtype
    from .tasks import load_task_module

    meta = torch.device("meta")
    module = load_task_module(task, module_name="kernel_task_sizing")
    dtype = precision_dtype(precision)
    with DeviceFactoryMode(meta, None):
        args = _to_device(module.get_inputs(), meta, dtype)
        init = module.get_init_inputs()
    with meta, torch.no_grad():
        model = module.Model(*init).to(dtype=dtype)
    with DeviceFactoryMode(meta, None), torch.no_grad(), during_call or contextlib.nullcontext():
        out = model(*args)
    return model, args, out


def meta_cost(task: Any, precision: str = "float32") -> MetaCost | None:
    """``MetaCost`` of one reference call, run on meta tensors (nothing allocated); None when the task does not
    build or run there (data-dependent code, or sizes its layers reject)."""
    from torch.utils.flop_counter import FlopCounterMode

    from .inputs import _tensor_bytes

    try:
        counter = FlopCounterMode(display=False)
        model, args, out = run_reference_on_meta(task, precision, counter)
        params = sum(_tensor_bytes(t) for t in (*model.parameters(), *model.buffers()))
        return MetaCost(_tensor_bytes(args) + _tensor_bytes(out) + params, int(counter.get_total_flops()))
    except Exception:   # noqa: BLE001 - any failure means "these sizes do not run": the caller tries others
        return None


def fit_sizes(task: Any, max_bytes: int = FIT_DEFAULT_BYTES, max_flops: int = FIT_DEFAULT_FLOPS,
              precision: str = "float32") -> tuple[Any, dict[str, tuple[Any, Any]]]:
    """``task`` shrunk until one reference call fits ``max_bytes`` and ``max_flops`` (``MetaCost``), and the
    constants changed (``{name: (old, new)}``; the task's ``meta["resized"]`` holds the same).

    Greedy: the largest size of at least ``FIT_MIN_VALUE`` (an int constant or one element of a tuple or list constant)
    is halved (floor) when the reference still runs on meta tensors at the new sizes and gets cheaper; if halving it
    alone fails, it is halved together with every other size of the same value (KernelBench's HingeLoss broadcasts a
    ``batch_size`` of 32768 against an ``input_shape`` of ``(32768,)``: they only shrink together). A size whose
    halving fails both ways or saves nothing is not tried again. Stops when the task fits or nothing is left to
    halve, so a task that cannot fit comes back as small as this could make it (the verifier's memory check then
    names what is left). A task already within the budget, or one that cannot be sized on meta tensors, comes back
    unchanged."""
    cost = meta_cost(task, precision)
    if cost is None or cost.within(max_bytes, max_flops):
        return task, {}
    try:
        original = int_constants(task.source)
    except SyntaxError:
        return task, {}
    sizes = _sizes(original)
    tried_out: set[tuple[str, int | None]] = set()
    current = task

    def attempt(keys: list[tuple[str, int | None]]) -> tuple[Any, MetaCost] | None:
        trial_sizes = {**sizes, **{k: sizes[k] // 2 for k in keys}}
        values = _constants(trial_sizes, original)
        changed = {n: v for n, v in values.items() if v != original[n]}
        try:
            trial = dataclasses.replace(task, source=rewrite_constants(task.source, changed))
        except (KeyError, ValueError):
            return None
        c = meta_cost(trial, precision)
        return (trial, c) if c is not None and c.cheaper_than(cost) else None

    for _ in range(_FIT_MAX_STEPS):
        if cost.within(max_bytes, max_flops):
            break
        candidates = sorted((k for k, v in sizes.items() if v >= FIT_MIN_VALUE and k not in tried_out),
                            key=lambda k: (-sizes[k], k[0], -1 if k[1] is None else k[1]))
        for key in candidates:
            keys = [key]
            done = attempt(keys)
            if done is None:
                group = [k for k in candidates if sizes[k] == sizes[key]]
                if len(group) > 1:
                    keys = group
                    done = attempt(keys)
            if done is None:
                tried_out.add(key)
                continue
            for k in keys:
                sizes[k] //= 2
            current, cost = done
            break
        else:
            break
    values = _constants(sizes, original)
    resized = {n: (original[n], v) for n, v in values.items() if v != original[n]}
    if resized and dataclasses.is_dataclass(current) and isinstance(getattr(current, "meta", None), dict):
        current = dataclasses.replace(current, meta={**current.meta, "resized": {
            n: [list(a) if isinstance(a, (tuple, list)) else a, list(b) if isinstance(b, (tuple, list)) else b]
            for n, (a, b) in resized.items()}})
    return current, resized
