"""AST rules a candidate must pass before anything of it runs.

Why an AST and not regexes: ``getattr(torch.cuda, "Stream")``, ``T = torch.Tensor; T.add = f`` and
``"cudaStream" + "Create"`` defeat text matching. Here names are resolved through import aliases and
simple assignments, ``getattr`` with a literal name is treated like the attribute itself (with a
computed name it is rejected), and the native sources handed to ``load_inline`` must be literals (or
names bound once to literals) so the exact text the compiler sees is scanned.

Static rules are one layer. The sandbox (no network, writes confined, rlimits), the parent-side
verdict (reference and comparison never in the child) and the runtime profiler check back them up.

Security rules cannot be switched off. Policy rules (``POLICY_RULES``) can, via
``VerifierConfig.enforce_policy_rules`` / ``disabled_rules``.
"""
from __future__ import annotations

import ast
import dataclasses
import re
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # pragma: no cover
    from .config import VerifierConfig

SECURITY_RULES: dict[str, str] = {
    "reference_model": "uses the reference Model (import, subclass, instantiate, __main__ or the task module)",
    "file_access": "touches files (open, os, pathlib, shutil, torch.save/load, fopen/ifstream in C++, ...)",
    "network_access": "uses the network (socket, urllib, requests, ...)",
    "process_or_thread": "spawns processes or threads (subprocess, threading, multiprocessing, ctypes, "
                         "os.fork/system, std::thread, OpenMP, ...)",
    "stream_creation": "creates or switches device streams (torch.cuda.Stream, cudaStreamCreate, ...)",
    "monkey_patching": "patches modules or torch (attribute assignment, setattr, sys.modules, builtins, "
                       "TORCH_LIBRARY_IMPL)",
    "global_torch_state": "changes global torch state (torch.backends, RNG seeds, torch.set_*)",
    "dynamic_code": "runs or inspects code dynamically (exec, eval, compile, __import__, importlib, inspect, "
                    "gc, computed getattr, dunder/frame attributes, dlopen, Python C API from C++)",
    "extension_load_file": "builds extensions from files (torch.utils.cpp_extension.load, torch.ops.load_library)",
    "tensor_subclass": "defines tensor subclasses or torch function/dispatch modes (lazy outputs)",
    "torch_compiler": "uses torch.compile / TorchScript / export (generated code hides PyTorch fallbacks)",
    "profiler_probe": "inspects the profiler (behaving differently while being checked)",
    "library_fallback": "computes with another library (numpy, scipy, cupy, numba, jax, ...)",
    "native_source": "native sources or load_inline arguments that are not static literals, or obfuscated "
                     "native code (token pasting, raw machine code)",
}
POLICY_RULES: dict[str, str] = {
    "try_except": "try/except (fallback to PyTorch when the kernel fails)",
    "import_not_allowed": "imports a module outside the allowed list",
    "torch_private_api": "uses private torch APIs (torch._C, torch._ops, ...)",
}
ALL_RULES = {**SECURITY_RULES, **POLICY_RULES}

# Names under which the harness loads the task and the candidate inside the sandboxed child.
TASK_MODULE_NAME = "kernel_task"
CANDIDATE_MODULE_NAME = "kernel_candidate"

LOAD_INLINE_APIS = {
    "torch.utils.cpp_extension.load_inline",
    "torch_musa.utils.musa_extension.load_inline",
    "torchada.utils.cpp_extension.load_inline",
}

# top-level module -> rule (security: importing these is never needed by a kernel)
_MODULE_RULES: dict[str, str] = {}
for _rule, _mods in {
    "file_access": "os posix nt posixpath ntpath genericpath pathlib shutil tempfile io _io glob fileinput zipfile "
                   "tarfile gzip bz2 lzma zlib sqlite3 shelve dbm pickle _pickle marshal dill cloudpickle joblib mmap "
                   "fcntl filecmp codecs h5py zipimport pkgutil site resource termios tty pwd grp linecache csv",
    "network_access": "socket _socket ssl select selectors urllib urllib3 http requests httpx aiohttp ftplib "
                      "smtplib telnetlib xmlrpc socketserver websocket websockets paramiko poplib imaplib nntplib "
                      "webbrowser grpc zmq",
    "process_or_thread": "subprocess _posixsubprocess multiprocessing threading _thread concurrent signal pty "
                         "asyncio ctypes _ctypes cffi ray dask sched",
    "dynamic_code": "importlib inspect gc builtins __builtin__ sys types code codeop runpy imp traceback dis pdb bdb "
                    "trace faulthandler tracemalloc copyreg atexit pyximport cython ast",
    "reference_model": f"__main__ verifier {TASK_MODULE_NAME} {CANDIDATE_MODULE_NAME}",
    "library_fallback": "numpy scipy cupy cupyx numba jax jaxlib tensorflow pycuda cuda tvm mlx sklearn pandas "
                        "torchvision torchaudio xformers flash_attn apex transformer_engine deepspeed",
    "torch_compiler": "functorch",
}.items():
    for _m in _mods.split():
        _MODULE_RULES[_m] = _rule
# Bare `import os` / `import sys` that is never used is harmless (LLM boilerplate); any use is a violation.
_TOLERATED_UNUSED = {"os", "sys", "time", "numpy"}

# qualified-name prefixes (dotted components) -> rule
_QUALIFIED_RULES: list[tuple[str, str]] = [
    ("torch.utils.cpp_extension.load", "extension_load_file"),
    ("torch.utils.cpp_extension._jit_compile", "extension_load_file"),
    ("torch.utils.cpp_extension.CppExtension", "extension_load_file"),
    ("torch.utils.cpp_extension.CUDAExtension", "extension_load_file"),
    ("torch.utils.cpp_extension.BuildExtension", "extension_load_file"),
    ("torch.ops.load_library", "extension_load_file"),
    ("torch.classes.load_library", "extension_load_file"),
    ("torch_musa.utils.musa_extension.load", "extension_load_file"),
    ("torch_musa.utils.musa_extension.MUSAExtension", "extension_load_file"),
    ("torchada.utils.cpp_extension.load", "extension_load_file"),
    ("torch.save", "file_access"), ("torch.load", "file_access"), ("torch.hub", "file_access"),
    ("torch.from_file", "file_access"), ("torch.utils.model_zoo", "file_access"),
    ("torch.serialization", "file_access"), ("torch.package", "file_access"),
    ("torch.UntypedStorage.from_file", "file_access"), ("torch.TypedStorage.from_file", "file_access"),
    ("torch.multiprocessing", "process_or_thread"), ("torch.distributed", "process_or_thread"),
    ("torch.utils.data", "process_or_thread"),
    ("torch.Stream", "stream_creation"), ("torch.accelerator.set_stream", "stream_creation"),
    ("torch.backends", "global_torch_state"), ("torch.random", "global_torch_state"),
    ("torch.manual_seed", "global_torch_state"), ("torch.seed", "global_torch_state"),
    ("torch.use_deterministic_algorithms", "global_torch_state"),
    ("torch.compile", "torch_compiler"), ("torch._dynamo", "torch_compiler"), ("torch._inductor", "torch_compiler"),
    ("torch.jit", "torch_compiler"), ("torch.export", "torch_compiler"), ("torch.fx", "torch_compiler"),
    ("torch.onnx", "torch_compiler"),
    ("torch.library", "tensor_subclass"), ("torch._library", "tensor_subclass"),
    ("torch.overrides", "tensor_subclass"), ("torch.utils._python_dispatch", "tensor_subclass"),
    ("torch.profiler", "profiler_probe"), ("torch.autograd.profiler", "profiler_probe"),
    ("torch.autograd.profiler_util", "profiler_probe"),
    ("operator.attrgetter", "dynamic_code"), ("operator.methodcaller", "dynamic_code"),
]
for _dev in ("cuda", "musa", "xpu", "mps"):
    _QUALIFIED_RULES += [
        (f"torch.{_dev}.Stream", "stream_creation"), (f"torch.{_dev}.stream", "stream_creation"),
        (f"torch.{_dev}.streams", "stream_creation"), (f"torch.{_dev}.ExternalStream", "stream_creation"),
        (f"torch.{_dev}.set_stream", "stream_creation"), (f"torch.{_dev}.StreamContext", "stream_creation"),
        (f"torch.{_dev}.manual_seed", "global_torch_state"), (f"torch.{_dev}.manual_seed_all", "global_torch_state"),
        (f"torch.{_dev}.seed", "global_torch_state"), (f"torch.{_dev}.seed_all", "global_torch_state"),
        (f"torch.{_dev}.set_rng_state", "global_torch_state"),
        (f"torch.{_dev}.set_rng_state_all", "global_torch_state"),
    ]
_HARMLESS_TORCH_SETTERS = {"set_grad_enabled", "set_printoptions"}

# attribute names that are suspicious whatever object they hang off
_ATTR_RULES = {
    "Stream": "stream_creation", "ExternalStream": "stream_creation", "set_stream": "stream_creation",
    "_make_subclass": "tensor_subclass", "_make_wrapper_subclass": "tensor_subclass", "as_subclass": "tensor_subclass",
    "__torch_function__": "tensor_subclass", "__torch_dispatch__": "tensor_subclass",
    "TorchFunctionMode": "tensor_subclass", "TorchDispatchMode": "tensor_subclass",
    "_is_profiler_enabled": "profiler_probe",
    "f_globals": "dynamic_code", "f_locals": "dynamic_code", "f_back": "dynamic_code", "f_code": "dynamic_code",
    "f_builtins": "dynamic_code", "gi_frame": "dynamic_code", "cr_frame": "dynamic_code", "ag_frame": "dynamic_code",
    "tb_frame": "dynamic_code", "tb_next": "dynamic_code", "co_code": "dynamic_code", "_getframe": "dynamic_code",
    "load_library": "extension_load_file",
}
_ALLOWED_DUNDER_ATTRS = {"__init__", "__name__", "__qualname__", "__doc__", "__len__", "__call__", "__module__",
                         "__version__"}

# builtins that are violations wherever they appear (called or passed around)
_BUILTIN_RULES = {
    "exec": "dynamic_code", "eval": "dynamic_code", "compile": "dynamic_code", "__import__": "dynamic_code",
    "globals": "dynamic_code", "locals": "dynamic_code", "vars": "dynamic_code", "breakpoint": "dynamic_code",
    "__builtins__": "dynamic_code", "__loader__": "dynamic_code", "__spec__": "dynamic_code",
    "open": "file_access", "input": "file_access",
    "setattr": "monkey_patching", "delattr": "monkey_patching",
    "Model": "reference_model", "__main__": "reference_model",
}
_TORCH_TENSOR_CLASSES = {"torch.Tensor", "torch.nn.Parameter", "torch.nn.parameter.Parameter",
                         "torch._tensor.Tensor", "torch.nn.Buffer"}
_NN_MODULE = {"torch.nn.Module", "torch.nn.modules.module.Module"}

# native (C++/CUDA/MUSA) source patterns -> rule. `(?<![\w.>:])` keeps methods like x.clone( out.
_NB = r"(?<![\w.>:$])"
_NATIVE_PATTERNS: list[tuple[re.Pattern, str]] = [(re.compile(p), r) for p, r in [
    (_NB + r"(fopen|freopen|fdopen|tmpfile|tmpnam|mkstemp|opendir|readdir|unlink|unlinkat|rmdir|mkdir|chmod|chown"
     r"|truncate|ftruncate|open|openat|creat|rename|symlink|linkat)\s*\(", "file_access"),
    (r"\b(std::)?(i|o)?fstream\b|\bfilesystem::|\bFILE\s*\*", "file_access"),
    (r"#\s*include\s*[<\"]\s*(/|\.\.|~)", "file_access"),
    (r"/proc/|/dev/(mem|kmem|shm)|/sys/", "file_access"),
    (_NB + r"(socket|connect|bind|listen|accept|gethostbyname|getaddrinfo|sendto|recvfrom|sendmsg|recvmsg)\s*\(",
     "network_access"),
    (r"\bcurl_\w+", "network_access"),
    (_NB + r"(system|popen|fork|vfork|execl|execlp|execle|execv|execvp|execvpe|execve|posix_spawnp?|clone|clone3"
     r"|kill|raise|ptrace|prctl|signal|sigaction|setrlimit|unshare|setns)\s*\(", "process_or_thread"),
    (r"\bstd::(thread|jthread|async)\b|\bpthread_create\b|#\s*pragma\s+omp\b|\bomp_set_num_threads\b"
     r"|\bset_num_threads\b|-fopenmp\b|\bsys(call|enter)\b", "process_or_thread"),
    (r"\b(dlopen|dlsym|dlmopen|dlvsym|LoadLibrary\w*)\b", "dynamic_code"),
    (_NB + r"(mmap|mprotect|munmap|mremap|madvise|process_vm_readv|process_vm_writev)\s*\(", "dynamic_code"),
    (r"\bPy(Import|Run|Eval|Sys|Module)_\w+|\bPyObject_(SetAttr|GetAttr|DelAttr|GenericSetAttr)\w*"
     r"|\b(py|pybind11)::(module_?::import|exec|eval|eval_file|setattr|getattr|delattr|globals)\b", "dynamic_code"),
    (r"\b(cuda|musa|hip)StreamCreate\w*|\bgetStreamFromPool\b|\bgetStreamFromExternal\b"
     r"|\b(cuda|musa)StreamCreateWithPriority\b|\bcu(da)?StreamCreate\b|\bcuStreamCreate\w*", "stream_creation"),
    (r"\bTORCH_LIBRARY_IMPL\b|\bTORCH_LIBRARY_FRAGMENT\b|\bTORCH_LIBRARY\s*\(\s*aten\b"
     r"|\bc10::Dispatcher\b|\bregisterKernel\b", "monkey_patching"),
    (r"##", "native_source"),
    (r"\.(byte|word|quad|incbin|inst)\b|\bint\s+\$?0x80\b", "native_source"),
]]
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class Violation:
    rule: str
    message: str
    line: int | None = None

    @property
    def policy(self) -> bool:
        return self.rule in POLICY_RULES

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        return f"[{self.rule}] {where}{self.message}"


class _NotFoldable(Exception):
    pass


def _root_name(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


class _Analyzer:
    def __init__(self, tree: ast.Module, backend: str, allowed_imports: Iterable[str]):
        self.tree = tree
        self.backend = backend
        self.allowed_imports = set(allowed_imports)
        self.violations: list[Violation] = []
        self._seen: set[tuple[str, str]] = set()
        self.aliases: dict[str, str] = {}        # local name -> dotted qualified name
        self.module_aliases: set[str] = set()    # names bound by `import x` (module objects)
        self.tolerated: dict[str, tuple[str, int]] = {}  # unused-tolerated import name -> (module, line)
        self.assign_count: dict[str, int] = {}
        self.assign_value: dict[str, ast.AST] = {}
        self.params: set[str] = set()
        self.classes: dict[str, ast.ClassDef] = {}
        self.native_texts: list[str] = []
        self.parents: dict[ast.AST, ast.AST] = {}

    # -- helpers -----------------------------------------------------------------------------
    def add(self, rule: str, message: str, node: ast.AST | None = None) -> None:
        line = getattr(node, "lineno", None)
        key = (rule, str(line)) if line else (rule, message)
        if key in self._seen:
            return
        self._seen.add(key)
        self.violations.append(Violation(rule, message, getattr(node, "lineno", None)))

    def qual(self, node: ast.AST) -> str | None:
        """Dotted name an expression refers to, through import aliases and getattr with a literal."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.qual(node.value)
            return f"{base}.{node.attr}" if base else None
        if self._is_literal_getattr(node):
            base = self.qual(node.args[0])
            return f"{base}.{node.args[1].value}" if base else None
        return None

    @staticmethod
    def _is_literal_getattr(node: ast.AST) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str))

    # -- pass 1: bindings ---------------------------------------------------------------------
    def collect(self) -> None:
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                        self.module_aliases.add(a.asname)
                    else:
                        top = a.name.split(".")[0]
                        self.aliases.setdefault(top, top)
                        self.module_aliases.add(top)
            elif isinstance(node, ast.ImportFrom):
                mod = "." * node.level + (node.module or "")
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{mod}.{a.name}" if mod else a.name
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args
                for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
                    if a is not None:
                        self.params.add(a.arg)
            for target in self._bound_names(node):
                self.assign_count[target] = self.assign_count.get(target, 0) + 1
        for node in ast.walk(self.tree):
            if (isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if len(targets) == 1 and isinstance(targets[0], ast.Name):
                    name = targets[0].id
                    self.assign_value[name] = node.value
                    q = self.qual(node.value)
                    if q and q.split(".")[0] in self.aliases and q != name:
                        self.aliases.setdefault(name, q)  # T = torch.Tensor makes T an alias

    @staticmethod
    def _bound_names(node: ast.AST) -> list[str]:
        out = []
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            targets = [node.target]
        elif isinstance(node, ast.NamedExpr):
            targets = [node.target]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            targets = [i.optional_vars for i in node.items if i.optional_vars is not None]
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    out.append(n.id)
        return out

    # -- constant folding of load_inline arguments --------------------------------------------
    def fold(self, node: ast.AST, depth: int = 0) -> Any:
        if depth > 50:
            raise _NotFoldable("too deep")
        if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            return [self.fold(e, depth + 1) for e in node.elts]
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise _NotFoldable("dict unpacking")
            return {self.fold(k, depth + 1): self.fold(v, depth + 1) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                if isinstance(v, ast.FormattedValue):
                    if v.format_spec is not None or v.conversion not in (-1, 115):
                        raise _NotFoldable("formatted value with spec")
                    parts.append(str(self.fold(v.value, depth + 1)))
                else:
                    parts.append(self.fold(v, depth + 1))
            return "".join(parts)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = self.fold(node.left, depth + 1), self.fold(node.right, depth + 1)
            try:
                return left + right if isinstance(node.op, ast.Add) else left * right
            except TypeError:
                raise _NotFoldable("operand types") from None
        if isinstance(node, ast.Name):
            if (self.assign_count.get(node.id) == 1 and node.id in self.assign_value
                    and node.id not in self.params):
                return self.fold(self.assign_value[node.id], depth + 1)
            raise _NotFoldable(f"name {node.id!r} is not bound once to a literal")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
                and len(node.args) == 1 and not node.keywords):
            sep, items = self.fold(node.func.value, depth + 1), self.fold(node.args[0], depth + 1)
            if isinstance(sep, str) and isinstance(items, list) and all(isinstance(i, str) for i in items):
                return sep.join(items)
        raise _NotFoldable(type(node).__name__)

    @staticmethod
    def _strings(value: Any) -> Iterable[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, list):
            for v in value:
                yield from _Analyzer._strings(v)
        elif isinstance(value, dict):
            for k, v in value.items():
                yield from _Analyzer._strings(k)
                yield from _Analyzer._strings(v)

    def check_load_inline(self, call: ast.Call) -> None:
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            self.add("native_source", "load_inline must be called with explicit arguments (no *args/**kwargs)", call)
            return
        folded: dict[str, Any] = {}
        for i, a in enumerate(call.args):
            folded[f"arg{i}"] = a
        for k in call.keywords:
            folded[k.arg] = k.value
        for key, node in folded.items():
            try:
                value = self.fold(node)
            except _NotFoldable as e:
                self.add("native_source", f"load_inline argument `{key}` must be a literal (or a name bound once "
                                          f"to a literal) so the compiled source can be checked ({e})", node)
                continue
            if key in ("functions",) and value is not None:
                names = [value] if isinstance(value, str) else (list(value) if isinstance(value, (list, dict)) else [])
                bad = [n for n in names if not isinstance(n, str) or not _IDENT.match(n)]
                if bad:
                    self.add("native_source", f"load_inline functions must be identifiers, got {bad[:3]!r}", node)
            if key in ("name", "arg0") and not (isinstance(value, str) and _IDENT.match(value)):
                self.add("native_source", f"load_inline name must be an identifier, got {value!r}", node)
            self.native_texts.extend(self._strings(value))

    # -- pass 2: rules -----------------------------------------------------------------------
    def check_qualified(self, q: str, node: ast.AST) -> None:
        parts = q.split(".")
        for prefix, rule in _QUALIFIED_RULES:
            pp = prefix.split(".")
            if parts[:len(pp)] == pp:
                self.add(rule, f"`{q}` is not allowed ({SECURITY_RULES.get(rule) or POLICY_RULES[rule]})", node)
                return
        if parts[0] == "torch" and len(parts) > 1:
            if parts[1].startswith("set_") and parts[1] not in _HARMLESS_TORCH_SETTERS:
                self.add("global_torch_state", f"`{q}` changes global torch state", node)
            elif any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
                self.add("torch_private_api", f"`{q}` is a private torch API", node)
            elif "profiler" in parts:
                self.add("profiler_probe", f"`{q}` inspects the profiler", node)

    def check_attribute_name(self, attr: str, node: ast.AST, q: str | None) -> None:
        rule = _ATTR_RULES.get(attr)
        if rule:
            self.add(rule, f"attribute `{attr}` is not allowed ({SECURITY_RULES[rule]})", node)
        if attr.startswith("__") and attr.endswith("__") and attr not in _ALLOWED_DUNDER_ATTRS and not rule:
            self.add("dynamic_code", f"dunder attribute `{attr}` is not allowed", node)
        if attr == "Model":
            self.add("reference_model", "the reference `Model` must not be used", node)
        if attr == "modules" and q and q.split(".")[0] == "sys":
            self.add("monkey_patching", "`sys.modules` must not be touched", node)

    def check_import(self, module: str, node: ast.AST, bound: str | None) -> None:
        top = module.split(".")[0]
        if not top:  # relative import
            self.add("reference_model", f"relative import `{module}` (the candidate is a single module)", node)
            return
        rule = _MODULE_RULES.get(top)
        if rule:
            if top in _TOLERATED_UNUSED and bound is not None and module == top:
                self.tolerated[bound] = (top, getattr(node, "lineno", 0))
            else:
                self.add(rule, f"import of `{module}` is not allowed ({SECURITY_RULES[rule]})", node)
            return
        self.check_qualified(module, node)
        if top not in self.allowed_imports:
            self.add("import_not_allowed", f"import of `{module}` is not in the allowed list "
                                           f"({', '.join(sorted(self.allowed_imports))})", node)

    def check_assign_target(self, target: ast.AST, node: ast.AST) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for e in target.elts:
                self.check_assign_target(e, node)
            return
        if isinstance(target, ast.Starred):
            self.check_assign_target(target.value, node)
            return
        if not isinstance(target, (ast.Attribute, ast.Subscript)):
            return
        root = _root_name(target)
        if isinstance(root, ast.Name):
            if root.id in ("self", "ctx", "cls") or root.id in self.classes:
                return
            if root.id in self.aliases or root.id in _MODULE_RULES or root.id in ("torch", "F", "nn", "math"):
                q = self.qual(target) or root.id
                self.add("monkey_patching", f"assignment to `{q}` patches a module or library object", node)
            return
        if isinstance(root, ast.Call) and isinstance(root.func, ast.Name) and root.func.id == "super":
            return
        self.add("monkey_patching", "assignment to an attribute of a computed object is not allowed", node)

    def check_class(self, node: ast.ClassDef) -> None:
        for kw in node.keywords:
            if kw.arg == "metaclass":
                self.add("dynamic_code", f"class {node.name} uses a metaclass", node)
        for base in node.bases:
            q = self.qual(base) or ""
            if q in _TORCH_TENSOR_CLASSES or q.endswith(".Tensor") or q == "Tensor":
                self.add("tensor_subclass", f"class {node.name} subclasses a tensor type ({q})", node)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in (
                    "__torch_function__", "__torch_dispatch__"):
                self.add("tensor_subclass", f"{node.name}.{item.name} overrides torch dispatch", item)
        if node.name == "ModelNew" and not self._derives_from_module(node, set()):
            bases = ", ".join(self.qual(b) or ast.unparse(b) for b in node.bases) or "nothing"
            self.add("reference_model", f"ModelNew must subclass nn.Module directly (it subclasses {bases})", node)

    def _derives_from_module(self, node: ast.ClassDef, seen: set[str]) -> bool:
        if node.name in seen:
            return False
        seen.add(node.name)
        for base in node.bases:
            q = self.qual(base)
            if q in _NN_MODULE:
                return True
            if isinstance(base, ast.Name) and base.id in self.classes and base.id != "Model":
                if self._derives_from_module(self.classes[base.id], seen):
                    return True
        return False

    def run(self) -> None:
        self.collect()
        used_names = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.check_import(a.name, node, a.asname or a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                self.check_import(module, node, None)
                for a in node.names:
                    if a.name == "*":
                        self.add("dynamic_code", f"`from {module} import *` hides what is used", node)
                    elif a.name == "Model":
                        self.add("reference_model", "importing `Model` is not allowed", node)
                    else:
                        self.check_qualified(f"{module}.{a.name}", node)
                        self.check_attribute_name(a.name, node, module)
            elif isinstance(node, ast.ClassDef):
                self.check_class(node)
            elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
                self.add("try_except", "try/except is not allowed (no fallback paths around the kernel)", node)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    self.check_assign_target(t, node)
            elif isinstance(node, ast.Delete):
                for t in node.targets:
                    self.check_assign_target(t, node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name in ("__torch_function__", "__torch_dispatch__"):
                    self.add("tensor_subclass", f"{node.name} overrides torch dispatch", node)
            elif isinstance(node, ast.Name):
                used_names.add(node.id)
                rule = _BUILTIN_RULES.get(node.id)
                locally_bound = node.id in self.params or node.id in self.assign_count
                if rule and isinstance(node.ctx, ast.Load) and (not locally_bound or node.id == "Model"):
                    self.add(rule, f"`{node.id}` is not allowed ({SECURITY_RULES[rule]})", node)
                if node.id in ("getattr", "hasattr") and isinstance(node.ctx, ast.Load) and not locally_bound:
                    parent = self.parents.get(node)
                    if not (isinstance(parent, ast.Call) and parent.func is node):
                        self.add("dynamic_code", f"`{node.id}` may only be called directly", node)
                if isinstance(node.ctx, ast.Load):
                    q = self.aliases.get(node.id)
                    if q and q != node.id:
                        self.check_qualified(q, node)
            elif isinstance(node, ast.Attribute):
                q = self.qual(node)
                self.check_attribute_name(node.attr, node, q)
                if q:
                    self.check_qualified(q, node)
            elif isinstance(node, ast.Call):
                self.check_call(node)
        for name, (module, line) in self.tolerated.items():
            if name in used_names:
                rule = _MODULE_RULES[module]
                self.violations.append(Violation(rule, f"`{module}` is used ({SECURITY_RULES[rule]})", line))
        for text in self.native_texts:
            for pattern, rule in _NATIVE_PATTERNS:
                m = pattern.search(text)
                if m:
                    self.add(rule, f"native source contains `{m.group(0).strip()}` "
                                   f"({SECURITY_RULES.get(rule) or POLICY_RULES[rule]})")

    def check_call(self, node: ast.Call) -> None:
        func = node.func
        q = self.qual(func)
        if q in LOAD_INLINE_APIS or (isinstance(func, ast.Name) and func.id == "load_inline") or (
                isinstance(func, ast.Attribute) and func.attr == "load_inline"):
            self.check_load_inline(node)
        if isinstance(func, ast.Name):
            if func.id == "getattr":
                if len(node.args) >= 2 and not (isinstance(node.args[1], ast.Constant)
                                                and isinstance(node.args[1].value, str)):
                    self.add("dynamic_code", "getattr with a computed attribute name is not allowed", node)
                elif self._is_literal_getattr(node):
                    attr = node.args[1].value
                    self.check_attribute_name(attr, node, self.qual(node.args[0]))
                    qq = self.qual(node)
                    if qq:
                        self.check_qualified(qq, node)
            elif func.id == "type" and len(node.args) == 3:
                self.add("dynamic_code", "type(name, bases, dict) creates classes dynamically", node)
            elif func.id in ("hasattr",) and len(node.args) >= 2 and not isinstance(node.args[1], ast.Constant):
                self.add("dynamic_code", "hasattr with a computed attribute name is not allowed", node)
            elif func.id == "super" and node.args:
                q0 = self.qual(node.args[0]) or ""
                if q0.split(".")[-1] == "Model":
                    self.add("reference_model", "super(Model, ...) reaches the reference", node)

    def load_inline_references(self) -> None:
        """load_inline must only be called directly (never aliased or passed around)."""
        for node in ast.walk(self.tree):
            if not isinstance(node, (ast.Name, ast.Attribute)):
                continue
            q = self.qual(node)
            if q not in LOAD_INLINE_APIS:
                continue
            parent = self.parents.get(node)
            if isinstance(parent, ast.Call) and parent.func is node:
                continue
            if isinstance(parent, ast.Attribute):  # part of a longer chain
                continue
            self.add("native_source", "load_inline must be called directly, not aliased or passed around", node)


def check_source(code: str, backend: str = "cpu", *, enforce_policy: bool = True,
                 disabled_rules: Iterable[str] = (), allowed_imports: Iterable[str] | None = None) -> list[Violation]:
    """All rule violations of a candidate (empty list: it may be built and run)."""
    from .config import DEFAULT_ALLOWED_IMPORTS

    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError) as e:
        return [Violation("native_source", f"code does not parse: {e}")]
    analyzer = _Analyzer(tree, backend, DEFAULT_ALLOWED_IMPORTS if allowed_imports is None else allowed_imports)
    analyzer.run()
    analyzer.load_inline_references()
    disabled = set(disabled_rules)
    out = []
    for v in analyzer.violations:
        if v.rule in POLICY_RULES and (not enforce_policy or v.rule in disabled):
            continue
        out.append(v)
    return sorted(out, key=lambda v: (v.rule in POLICY_RULES, v.line or 0, v.rule))  # security rules first


def check_candidate(code: str, cfg: "VerifierConfig | None" = None) -> list[Violation]:
    """Static stage of ``verify``: violations under the rules ``cfg`` enforces."""
    if cfg is None:
        return check_source(code)
    return check_source(code, cfg.backend, enforce_policy=cfg.enforce_policy_rules,
                        disabled_rules=cfg.disabled_rules, allowed_imports=cfg.allowed_imports)


_LANE_PATTERNS = [
    (re.compile(r"0x[fF]{8}\b"), "full 32-lane mask 0xffffffff"),
    (re.compile(r"__shfl\w*_sync\s*\([^;]*,\s*32\s*\)"), "__shfl_*_sync width 32"),
    (re.compile(r"%\s*32\b"), "`% 32`"),
    (re.compile(r"/\s*32\b"), "`/ 32`"),
    (re.compile(r"&\s*31\b"), "`& 31`"),
    (re.compile(r">>\s*5\b"), "`>> 5`"),
    (re.compile(r"\bWARP_SIZE\s*=?\s*32\b|#\s*define\s+\w*WARP\w*\s+32\b"), "a warp-size constant of 32"),
]


def musa_portability_notes(code: str) -> list[str]:
    """Hints for MUSA targets: warp size is 128 on mp_21/mp_22 (S80/S3000/S4000) and 32 on mp_31 (S5000)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return []
    analyzer = _Analyzer(tree, "musa", ())
    analyzer.collect()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            q = analyzer.qual(node.func)
            if q in LOAD_INLINE_APIS or getattr(node.func, "attr", getattr(node.func, "id", "")) == "load_inline":
                analyzer.check_load_inline(node)
    found = []
    for text in analyzer.native_texts:
        for pattern, what in _LANE_PATTERNS:
            if pattern.search(text) and what not in found:
                found.append(what)
    notes = []
    if found:
        notes.append("MUSA warp size is 128 on mp_21/mp_22 (MTT S80/S3000/S4000) and 32 on mp_31 (S5000); this "
                     "kernel hard-codes 32-lane assumptions (" + ", ".join(found) + "). Use warpSize instead.")
    if any(re.search(r"\basm\b|__asm__", t) for t in analyzer.native_texts):
        notes.append("inline PTX (asm) does not run on MUSA; write portable device code.")
    return notes
