"""Decontamination against KernelBench (research note §5.3), in three layers, cheap to expensive:

1. ``exact``: the SHA-256 of a normalised AST (imports, docstrings, comments, annotations and ``__main__``
   blocks removed; torch aliases made canonical; every user identifier renamed to ``v0, v1, ...`` in order
   of appearance; numbers kept) against every historical version of every KernelBench task. Renaming
   variables, reformatting or re-commenting a KernelBench task does not change this hash.
2. ``signature_shapes``: the ordered list of compute calls in ``forward`` (``self.conv(...)`` resolved to its
   ``nn`` class) equal to a KernelBench task's, *and* the same input shapes and constructor values (from
   ``get_inputs()``/``get_init_inputs()`` run on the meta device) or the same multiset of numeric module
   constants. The same signature with other shapes is only tagged ``kb_op_overlap`` (single-op families
   necessarily overlap KernelBench level 1) and kept.
3. ``ngram``: Jaccard similarity of token 8-shingles of the normalised source (numbers kept), estimated with a
   128-permutation MinHash for the committed KernelBench index and computed exactly for local reference
   sets; at or above the threshold (0.85, above any pair of distinct KernelBench level-2 tasks) the task is
   dropped.

KernelBench's sources are not in this repository: ``data/kernelbench_index.json.gz`` holds only the derived
fingerprints, built by ``python -m data_synth.kb_index`` from a KernelBench git checkout. Any other task set
(the bundled tasks, a training set a held-out set must not repeat) can be added as a reference too.
"""
from __future__ import annotations

import ast
import base64
import builtins
import dataclasses
import gzip
import hashlib
import io
import json
import os
import signal
import threading
import tokenize
import types
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from verifier.inputs import DeviceFactoryMode

from .util import DataSynthError

NORMALIZATION_VERSION = 1
NGRAM = 8
NUM_PERM = 128
DEFAULT_THRESHOLD = 0.85
INDEX_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "kernelbench_index.json.gz")

_KEEP_NAMES = set(dir(builtins)) | {"self", "torch", "nn", "F", "math", "np", "Model", "ModelNew", "forward",
                                     "__init__", "get_inputs", "get_init_inputs", "super", "cls"}
_CANONICAL_MODULES = {"torch": "torch", "torch.nn": "nn", "torch.nn.functional": "F", "math": "math",
                      "numpy": "np"}
# calls that only reshape, move or describe tensors: not part of an op signature
_NON_COMPUTE = {"view", "reshape", "size", "shape", "contiguous", "permute", "transpose", "t", "flatten", "unflatten",
                "unsqueeze", "squeeze", "expand", "expand_as", "view_as", "chunk", "split", "to", "float", "half",
                "double", "int", "long", "bool", "type", "dim", "numel", "super", "len", "range", "tuple", "list",
                "dict", "item", "cuda", "cpu", "detach", "clone", "zip", "enumerate", "isinstance", "getattr",
                "print", "min", "max", "abs", "sum", "round", "math", "sqrt", "ceil", "floor", "__init__",
                "new_zeros", "new_ones", "new_empty", "zeros", "ones", "empty", "zeros_like", "ones_like",
                "empty_like", "full", "arange", "stride", "repeat_interleave", "parameters", "modules", "append"}
_ALIASES = {"mm": "matmul", "bmm": "matmul", "__matmul__": "matmul", "matmult": "matmul", "mult": "mul",
            "multiply": "mul", "divide": "div", "truediv": "div", "subtract": "sub", "swish": "silu",
            "relu_": "relu", "sigmoid_": "sigmoid", "tanh_": "tanh", "softmax2d": "softmax"}


# ------------------------------------------------------------------------------------------ normalisation

def _module_aliases(tree: ast.Module) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                canon = _CANONICAL_MODULES.get(a.name)
                if canon and a.asname:
                    out[a.asname] = canon
                elif a.name in _CANONICAL_MODULES and "." not in a.name:
                    out[a.name] = _CANONICAL_MODULES[a.name]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in _CANONICAL_MODULES:
                    out[a.asname or a.name] = _CANONICAL_MODULES[full]
    return out


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


class _Strip(ast.NodeTransformer):
    """Drops what carries no meaning; makes torch aliases canonical (torch.nn.functional.x -> F.x)."""

    def __init__(self, aliases: dict[str, str]):
        self.aliases = aliases

    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out = []
        for st in body:
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) and isinstance(st.value.value, str):
                continue
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(st, ast.If) and "__name__" in ast.dump(st.test) and "__main__" in ast.dump(st.test):
                continue
            out.append(st)
        return out or [ast.Pass()]

    def generic_visit(self, node):
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            if isinstance(getattr(node, field, None), list) and getattr(node, field) and \
                    isinstance(getattr(node, field)[0], ast.stmt):
                setattr(node, field, self._body(getattr(node, field)))
        return node

    def visit_arg(self, node):
        node.annotation = None
        return node

    def visit_FunctionDef(self, node):
        node.returns = None
        node.decorator_list = []
        return self.generic_visit(node)

    def visit_AnnAssign(self, node):
        if node.value is None:
            return None
        return ast.copy_location(ast.Assign(targets=[self.visit(node.target)], value=self.visit(node.value)), node)

    def visit_Call(self, node):
        node = self.generic_visit(node)
        # super(Model, self).__init__() -> super().__init__()
        if isinstance(node.func, ast.Name) and node.func.id == "super":
            node.args = []
        return node

    def visit_Name(self, node):
        if node.id in self.aliases:
            node.id = self.aliases[node.id]
        return node

    def visit_Attribute(self, node):
        node = self.generic_visit(node)
        dotted = _dotted(node)
        if dotted in ("torch.nn.functional", "nn.functional"):
            return ast.copy_location(ast.Name(id="F", ctx=ast.Load()), node)
        if dotted == "torch.nn":
            return ast.copy_location(ast.Name(id="nn", ctx=ast.Load()), node)
        return node


class _Rename(ast.NodeTransformer):
    """Renames user identifiers (variables, arguments, constants, ``self.<attr>``) to v0, v1, ... in order of
    appearance; torch API names, keyword names and method names stay."""

    def __init__(self):
        self.map: dict[str, str] = {}

    def _new(self, name: str) -> str:
        if name in _KEEP_NAMES:
            return name
        if name not in self.map:
            self.map[name] = f"v{len(self.map)}"
        return self.map[name]

    def visit_Name(self, node):
        node.id = self._new(node.id)
        return node

    def visit_arg(self, node):
        node.arg = self._new(node.arg)
        return node

    def visit_FunctionDef(self, node):
        node.name = self._new(node.name)
        return self.generic_visit(node)

    def visit_ClassDef(self, node):
        node.name = self._new(node.name)
        return self.generic_visit(node)

    def visit_Attribute(self, node):
        self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            node.attr = "a_" + self._new(node.attr)
        return node


def stripped_tree(source: str) -> ast.Module:
    tree = ast.parse(source)
    return ast.fix_missing_locations(_Strip(_module_aliases(tree)).visit(tree))


def canonical_tree(source: str) -> ast.Module:
    return ast.fix_missing_locations(_Rename().visit(stripped_tree(source)))


def normalized_hash(source: str) -> str:
    tree = canonical_tree(source)
    return hashlib.sha256(f"v{NORMALIZATION_VERSION}:{ast.dump(tree, annotate_fields=False)}".encode()).hexdigest()[:24]


def tokens(source: str) -> list[str]:
    """Tokens of the normalised source (identifiers renamed, numbers kept)."""
    text = ast.unparse(canonical_tree(source))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.NAME, tokenize.OP, tokenize.NUMBER, tokenize.STRING):
            out.append(tok.string)
    return out


def shingle_hashes(source: str, n: int = NGRAM) -> np.ndarray:
    toks = tokens(source)
    grams = [" ".join(toks[i:i + n]) for i in range(max(1, len(toks) - n + 1))]
    hs = {int.from_bytes(hashlib.blake2b(g.encode(), digest_size=4).digest(), "little") for g in grams}
    return np.array(sorted(hs), dtype=np.uint64)


_PRIME = np.uint64((1 << 61) - 1)
_PERM_RNG = np.random.RandomState(20260601)
_A = _PERM_RNG.randint(1, (1 << 61) - 1, size=NUM_PERM, dtype=np.uint64)
_B = _PERM_RNG.randint(0, (1 << 61) - 1, size=NUM_PERM, dtype=np.uint64)


def minhash(hashes: np.ndarray) -> np.ndarray:
    """128-permutation MinHash of a shingle set ((a*h + b) mod 2^61-1, low 32 bits)."""
    if hashes.size == 0:
        return np.full(NUM_PERM, 0xFFFFFFFF, dtype=np.uint32)
    with np.errstate(over="ignore"):
        phv = (np.outer(hashes, _A) + _B) % _PRIME
    return (phv & np.uint64(0xFFFFFFFF)).min(axis=0).astype(np.uint32)


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    if a.size == 0 and b.size == 0:
        return 1.0
    inter = np.intersect1d(a, b, assume_unique=True).size
    return inter / (a.size + b.size - inter)


# ------------------------------------------------------------------------------------------ op signature

def _call_name(func: ast.AST, modules: dict[str, str]) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        if isinstance(func.value, ast.Name) and func.value.id == "self":
            return modules.get(func.attr, None)
        return func.attr
    return None


def _canon_op(name: str) -> str:
    n = name.lower()
    n = _ALIASES.get(n, n)
    return n.replace("_", "")


def op_signature(source: str) -> tuple[str, ...]:
    """Ordered compute calls of ``Model.forward`` (post-order: operands before the op that uses them)."""
    tree = stripped_tree(source)
    model = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model"), None)
    if model is None:
        return ()
    modules: dict[str, str] = {}
    fwd = None
    for fn in model.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
            for st in ast.walk(fn):
                if isinstance(st, ast.Assign) and isinstance(st.value, ast.Call):
                    cls = _dotted(st.value.func) or ""
                    for t in st.targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
                                and cls.startswith("nn."):
                            modules[t.attr] = cls[3:]
        elif isinstance(fn, ast.FunctionDef) and fn.name == "forward":
            fwd = fn
    if fwd is None:
        return ()
    sig: list[str] = []
    binops = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.MatMult: "matmul",
              ast.Pow: "pow", ast.FloorDiv: "floordiv", ast.Mod: "mod"}

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute):
                visit(node.func.value)
            for a in node.args:
                visit(a)
            for k in node.keywords:
                visit(k.value)
            name = _call_name(node.func, modules)
            if name and name not in _NON_COMPUTE and name != "Parameter":
                sig.append(_canon_op(name))
        elif isinstance(node, ast.BinOp):
            visit(node.left)
            visit(node.right)
            sig.append(binops.get(type(node.op), "binop"))
        else:
            for child in ast.iter_child_nodes(node):
                visit(child)

    for st in fwd.body:
        visit(st)
    return tuple(sig)


# ------------------------------------------------------------------------------------------ shapes

def constants_key(source: str) -> str:
    """Sorted numeric module-level constants (ints and floats; tuples flattened)."""
    vals: list[str] = []
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""

    def add(v: Any) -> None:
        if isinstance(v, bool):
            return
        if isinstance(v, (int, float)):
            vals.append(repr(v))
        elif isinstance(v, (tuple, list)):
            for x in v:
                add(x)

    for node in tree.body:
        if isinstance(node, ast.Assign):
            try:
                value = ast.literal_eval(node.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            for t in node.targets:
                if isinstance(t, ast.Tuple) and isinstance(value, (tuple, list)) and len(t.elts) == len(value):
                    for x in value:
                        add(x)
                else:
                    add(value)
    return ",".join(sorted(vals))


class _Timeout(Exception):
    pass


def shape_key(source: str, timeout_s: float = 10.0) -> str | None:
    """Input shapes and constructor values, from ``get_inputs()``/``get_init_inputs()`` on the meta device
    (nothing allocated); None when the module cannot run that way."""

    def describe(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return list(obj.shape)
        if isinstance(obj, (list, tuple)):
            return [describe(o) for o in obj]
        if isinstance(obj, (int, float, bool, str)) or obj is None:
            return obj
        return type(obj).__name__

    use_alarm = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")
    old = None
    if use_alarm:
        def _raise(*_):
            raise _Timeout()
        old = signal.signal(signal.SIGALRM, _raise)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        module = types.ModuleType("_data_synth_shape_probe")
        with DeviceFactoryMode(torch.device("meta"), None):
            exec(compile(source, "<task>", "exec"), module.__dict__)  # noqa: S102 - task files are trusted
            ins = describe(list(module.get_inputs()))
            init = describe(list(module.get_init_inputs()))
        return json.dumps({"inputs": ins, "init": init}, sort_keys=True)
    except BaseException as e:  # noqa: BLE001 - any failure means "no shape key"
        if isinstance(e, KeyboardInterrupt):
            raise
        return None
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------------------ fingerprints

@dataclasses.dataclass
class Fingerprint:
    hash: str
    opsig: tuple[str, ...]
    shape_key: str | None
    const_key: str
    minhash: np.ndarray
    shingles: np.ndarray | None = None   # exact shingle set (local references and candidates only)

    def to_json(self) -> dict[str, Any]:
        return {"hash": self.hash, "opsig": "|".join(self.opsig), "shape_key": self.shape_key,
                "const_key": self.const_key,
                "minhash": base64.b64encode(self.minhash.astype("<u4").tobytes()).decode()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Fingerprint":
        mh = np.frombuffer(base64.b64decode(d["minhash"]), dtype="<u4").astype(np.uint32)
        return cls(d["hash"], tuple(x for x in d["opsig"].split("|") if x), d.get("shape_key"), d.get("const_key", ""),
                   mh)


def fingerprint(source: str, with_shapes: bool = True) -> Fingerprint:
    """All three layers' keys of one task source. Raises ``SyntaxError`` for a file that does not parse, and for one
    the recursive analyses cannot take (nested past the interpreter's recursion limit, NUL bytes): every caller names
    the file on a SyntaxError, where the RecursionError ended the command with a traceback."""
    try:
        sh = shingle_hashes(source)
        return Fingerprint(hash=normalized_hash(source), opsig=op_signature(source),
                           shape_key=shape_key(source) if with_shapes else None, const_key=constants_key(source),
                           minhash=minhash(sh), shingles=sh)
    except (RecursionError, MemoryError, ValueError) as e:
        reason = "nested too deeply to analyse" if isinstance(e, (RecursionError, MemoryError)) else str(e)
        raise SyntaxError(reason) from None


@dataclasses.dataclass
class RefEntry:
    label: str                        # "kernelbench:level1/19_ReLU.py" or "<set>:<task_id>"
    fp: Fingerprint
    versions: int = 1


class Reference:
    """A set of tasks that generated tasks must not repeat."""

    def __init__(self, name: str, entries: Iterable[RefEntry] = ()):
        self.name = name
        self.entries: list[RefEntry] = []
        self._by_hash: dict[str, RefEntry] = {}
        self._by_sig: dict[tuple[str, ...], list[RefEntry]] = {}
        for e in entries:
            self.add(e)

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, e: RefEntry) -> None:
        self.entries.append(e)
        self._by_hash.setdefault(e.fp.hash, e)
        self._by_sig.setdefault(e.fp.opsig, []).append(e)
        self._matrix = None

    def minhash_matrix(self) -> np.ndarray:
        if getattr(self, "_matrix", None) is None:
            self._matrix = np.stack([e.fp.minhash for e in self.entries]) if self.entries else \
                np.zeros((0, NUM_PERM), dtype=np.uint32)
        return self._matrix

    def nearest(self, fp: Fingerprint) -> tuple[float, str | None]:
        """Highest n-gram similarity to any entry: exact Jaccard where both shingle sets are known, the
        MinHash estimate otherwise."""
        if not self.entries:
            return 0.0, None
        est = (self.minhash_matrix() == fp.minhash[None, :]).mean(axis=1)
        best_i = int(np.argmax(est))
        best = float(est[best_i])
        if fp.shingles is not None:
            for i, e in enumerate(self.entries):
                if e.fp.shingles is not None:
                    est[i] = jaccard(fp.shingles, e.fp.shingles)
            best_i = int(np.argmax(est))
            best = float(est[best_i])
        return best, self.entries[best_i].label

    @classmethod
    def from_sources(cls, name: str, items: Iterable[tuple[str, str]]) -> "Reference":
        """(label, source) pairs; sources that do not parse are an error naming them."""
        ref = cls(name)
        for label, src in items:
            try:
                ref.add(RefEntry(f"{name}:{label}", fingerprint(src)))
            except SyntaxError as e:
                raise DataSynthError(f"reference {name}: {label} does not parse: {e}") from None
        return ref

    @classmethod
    def load_index(cls, path: str = INDEX_PATH) -> "Reference":
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                doc = json.load(f)
        except FileNotFoundError:
            raise DataSynthError(f"KernelBench index not found: {path} (build it with python -m data_synth.kb_index)") \
                from None
        except (OSError, json.JSONDecodeError, EOFError) as e:
            raise DataSynthError(f"KernelBench index {path} is unreadable: {e}") from None
        if doc.get("format") != "data_synth.kb_index/1" or doc.get("normalization") != NORMALIZATION_VERSION:
            raise DataSynthError(f"{path}: index format {doc.get('format')} / normalization "
                                 f"{doc.get('normalization')} does not match this code (rebuild it)")
        ref = cls("kernelbench")
        ref.info = {k: v for k, v in doc.items() if k != "entries"}  # type: ignore[attr-defined]
        for e in doc["entries"]:
            ref.add(RefEntry(f"kernelbench:{e['paths'][0]}", Fingerprint.from_json(e), int(e.get("versions", 1))))
        return ref


@dataclasses.dataclass
class DecontamVerdict:
    task_id: str
    dropped: bool
    layer: str | None = None          # exact | signature_shapes | ngram
    match: str | None = None          # the reference task it matched
    similarity: float | None = None   # best n-gram similarity seen
    nearest: str | None = None
    tags: list[str] = dataclasses.field(default_factory=list)   # kb_op_overlap: same op signature, other shapes

    @property
    def reason(self) -> str | None:
        if not self.dropped:
            return None
        if self.layer == "ngram":
            return f"ngram: {NGRAM}-gram Jaccard {self.similarity:.3f} with {self.match}"
        if self.layer == "exact":
            return f"exact: normalised source identical to {self.match}"
        return f"signature_shapes: same op signature and shapes as {self.match}"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "reason": self.reason}


class Decontaminator:
    """Checks candidates against reference sets; ``remember`` adds accepted tasks so later duplicates
    within the same run are caught by the same layers."""

    def __init__(self, references: Sequence[Reference], threshold: float = DEFAULT_THRESHOLD):
        if not 0 < threshold <= 1:
            raise DataSynthError(f"n-gram threshold must be in (0, 1], got {threshold}")
        self.references = list(references)
        self.threshold = threshold
        self.own = Reference("generated")

    def check(self, task_id: str, source: str, fp: Fingerprint | None = None) -> DecontamVerdict:
        fp = fp or fingerprint(source)
        v = DecontamVerdict(task_id=task_id, dropped=False)
        best, best_label = 0.0, None
        for ref in [*self.references, self.own]:
            hit = ref._by_hash.get(fp.hash)
            if hit is not None:
                return DecontamVerdict(task_id, True, "exact", hit.label, 1.0, hit.label)
            for e in ref._by_sig.get(fp.opsig, []) if fp.opsig else []:
                same_shapes = (fp.shape_key is not None and fp.shape_key == e.fp.shape_key) or \
                              (bool(fp.const_key) and fp.const_key == e.fp.const_key)
                if same_shapes:
                    return DecontamVerdict(task_id, True, "signature_shapes", e.label, None, e.label)
                if ref.name == "kernelbench" and "kb_op_overlap" not in v.tags:
                    v.tags.append("kb_op_overlap")
            sim, label = ref.nearest(fp)
            if sim > best:
                best, best_label = sim, label
        v.similarity, v.nearest = round(best, 4), best_label
        if best >= self.threshold:
            v.dropped, v.layer, v.match = True, "ngram", best_label
        return v

    def remember(self, task_id: str, source: str, fp: Fingerprint | None = None) -> None:
        self.own.add(RefEntry(f"generated:{task_id}", fp or fingerprint(source)))
