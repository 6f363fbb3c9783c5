"""AST rules a candidate must pass before anything of it runs.

Why an AST and not regexes: ``getattr(torch.cuda, "Stream")``, ``T = torch.Tensor; T.add = f`` and
``"cudaStream" + "Create"`` defeat text matching. Here names are resolved through import aliases and
simple assignments, ``getattr`` with a literal name is treated like the attribute itself (with a
computed name it is rejected), and the native sources handed to ``load_inline`` must be literals (or
names bound once to literals) so the exact text the compiler sees is scanned.

Everything the candidate's Python can reach is judged by name, wherever it hangs: stdlib modules that
torch and the allowed modules re-export as attributes (``torch.os``, ``torch.nn.functional.np``,
``typing.sys``, ``enum.bltns``), ways to compute on the host instead of in a kernel (``.numpy()``,
``.tolist()``, ``apply_``), global torch state and module-wide hooks, string evaluation hidden in the
allowed modules (``typing.get_type_hints``), and the profiler. Module objects may not be laundered
through containers, calls or conditionals (``[torch][0].utils``), and attributes may be assigned only
on ``self``/``ctx``/``cls`` and the candidate's own classes, so names keep resolving.

The native sources and flags themselves are judged by ``native_checks``.

Static rules are one layer. The sandbox (no network, writes confined, rlimits), the parent-side
verdict (reference and comparison never in the child) and the runtime profiler check back them up.

Security rules cannot be switched off. Policy rules (``POLICY_RULES``) can, via
``VerifierConfig.enforce_policy_rules`` / ``disabled_rules``.
"""
from __future__ import annotations

import ast
import dataclasses
import re
import sys
from typing import TYPE_CHECKING, Any, Iterable

from .native_checks import NativeFinding, native_findings, toolchain_mismatches

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
    "profiler_probe": "inspects the profiler or the allocator's statistics (behaving differently while being "
                      "checked)",
    "library_fallback": "computes with another library (numpy, scipy, cupy, numba, jax, ...)",
    "native_source": "native sources or load_inline arguments that are not static literals, or obfuscated "
                     "native code (token pasting, raw machine code, macro or flag aliases, unsafe compiler flags)",
    "host_compute": "computes on the host instead of in a kernel (.numpy(), .tolist(), apply_/map_, storages, "
                    "DLPack) or bypasses the dispatcher from C++ (at::native::, at::cpu::, BLAS/oneDNN calls)",
    "cache_persistence": "keeps data resident in the device's L2 cache across the timing flush (access-policy "
                         "windows, persisting-L2 limits, stream/graph attributes, evict_last cache policies)",
    "timer_tampering": "reads, records or drives timers and events itself (cudaEvent*/musaEvent*, clock_gettime, "
                       "std::chrono, rdtsc, torch.cuda.Event): only the verifier times",
    "runtime_policy": "changes process-wide runtime policy that the reference's timed calls share (allocator "
                      "settings such as mallopt/malloc_trim or c10::SetCPUAllocator, environment variables, "
                      "scheduling and memory locking)",
    # the build stage reports a missing CUDA/MUSA header, library or compiler as a broken build host (infra,
    # retried, never scored); a candidate must not be able to ask for one and escape its verdict
    "toolchain_mismatch": "asks for a toolchain this backend does not have (CUDA/MUSA sources, headers or "
                          "libraries on another backend, unknown torch/Python libraries)",
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
_ALLOCATOR_STATS = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                    "memory_stats", "memory_stats_as_nested_dict", "memory_snapshot", "memory_summary",
                    "mem_get_info", "list_gpu_processes", "current_allocated_memory", "driver_allocated_memory",
                    "get_memory_info", "memory_cached", "max_memory_cached", "device_memory_used",
                    "host_memory_stats", "host_memory_stats_as_nested_dict", "caching_allocator_alloc",
                    "caching_allocator_delete", "get_allocator_backend", "memory_usage")
for _dev in ("cuda", "musa", "xpu", "mps"):
    _QUALIFIED_RULES += [
        (f"torch.{_dev}.Stream", "stream_creation"), (f"torch.{_dev}.stream", "stream_creation"),
        (f"torch.{_dev}.streams", "stream_creation"), (f"torch.{_dev}.ExternalStream", "stream_creation"),
        (f"torch.{_dev}.set_stream", "stream_creation"), (f"torch.{_dev}.StreamContext", "stream_creation"),
        (f"torch.{_dev}.manual_seed", "global_torch_state"), (f"torch.{_dev}.manual_seed_all", "global_torch_state"),
        (f"torch.{_dev}.seed", "global_torch_state"), (f"torch.{_dev}.seed_all", "global_torch_state"),
        (f"torch.{_dev}.set_rng_state", "global_torch_state"),
        (f"torch.{_dev}.set_rng_state_all", "global_torch_state"),
        (f"torch.{_dev}.Event", "timer_tampering"), (f"torch.{_dev}.streams.Event", "timer_tampering"),
        (f"torch.{_dev}.Event.elapsed_time", "timer_tampering"),
    ]
    # what the allocator holds could tell a hidden trial's round (which follows an audited trial's audits) from a
    # timed trial; a kernel's forward never needs the allocator's statistics
    _QUALIFIED_RULES += [(f"torch.{_dev}.{name}", "profiler_probe") for name in _ALLOCATOR_STATS]
    _QUALIFIED_RULES += [(f"torch.{_dev}.memory.{name}", "profiler_probe") for name in _ALLOCATOR_STATS]
_QUALIFIED_RULES += [("torch.Event", "timer_tampering")]
_QUALIFIED_RULES += [(f"torch.accelerator.{name}", "profiler_probe") for name in _ALLOCATOR_STATS]
_QUALIFIED_RULES += [(f"torch.accelerator.memory.{name}", "profiler_probe") for name in _ALLOCATOR_STATS]
_HARMLESS_TORCH_SETTERS = {"set_grad_enabled", "set_printoptions", "set_device"}
# private torch helpers that are pure functions of their arguments, used to copy nn.Linear/nn.Conv* initialisation
# and argument handling (nothing reachable through them that the other rules would not catch by name)
_HARMLESS_TORCH_PRIVATE = {"torch.nn.init._calculate_fan_in_and_fan_out", "torch.nn.init._calculate_correct_fan",
                           "torch.nn.modules.utils._single", "torch.nn.modules.utils._pair",
                           "torch.nn.modules.utils._triple", "torch.nn.modules.utils._quadruple",
                           "torch.nn.modules.utils._ntuple", "torch.nn.modules.utils._reverse_repeat_tuple"}
_QUALIFIED_RULES += [("torch.compiler", "torch_compiler"), ("torch.autograd.graph", "global_torch_state"),
                     ("torch.autograd.anomaly_mode", "global_torch_state"),
                     ("torch.autograd.grad_mode.set_grad_enabled", "global_torch_state")]
# torch.utils holds process spawners (collect_env.run, benchmark's valgrind wrapper), file writers
# (tensorboard, file_baton, hipify), dispatch modes (flop_counter) and DLPack; a kernel needs load_inline only
_TORCH_UTILS_ALLOWED = {"cpp_extension": {"load_inline", "CUDA_HOME", "ROCM_HOME"}}
_TORCH_UTILS_RULES = {"cpp_extension": "extension_load_file", "dlpack": "host_compute",
                      "collect_env": "process_or_thread", "benchmark": "process_or_thread",
                      "bottleneck": "process_or_thread", "tensorboard": "file_access", "file_baton": "file_access",
                      "hipify": "file_access", "flop_counter": "tensor_subclass", "module_tracker": "tensor_subclass"}
# stdlib roots a candidate may import (policy allowlist): their private names hide eval and module handles
# (typing._eval_type, collections._sys)
_STDLIB_ROOTS = {"math", "typing", "functools", "itertools", "operator", "collections", "dataclasses", "enum",
                 "numbers", "warnings", "__future__"}

# attribute names that are suspicious whatever object they hang off
_ATTR_RULES = {
    "Stream": "stream_creation", "ExternalStream": "stream_creation", "set_stream": "stream_creation",
    "_make_subclass": "tensor_subclass", "_make_wrapper_subclass": "tensor_subclass", "as_subclass": "tensor_subclass",
    "__torch_function__": "tensor_subclass", "__torch_dispatch__": "tensor_subclass",
    "TorchFunctionMode": "tensor_subclass", "TorchDispatchMode": "tensor_subclass",
    "_is_profiler_enabled": "profiler_probe",
    # builtins reached as attributes of a builtins module or namespace (`.eval` is nn.Module.eval: allowed)
    "exec": "dynamic_code", "globals": "dynamic_code", "locals": "dynamic_code", "breakpoint": "dynamic_code",
    "setattr": "monkey_patching", "delattr": "monkey_patching",
    "f_globals": "dynamic_code", "f_locals": "dynamic_code", "f_back": "dynamic_code", "f_code": "dynamic_code",
    "f_builtins": "dynamic_code", "gi_frame": "dynamic_code", "cr_frame": "dynamic_code", "ag_frame": "dynamic_code",
    "tb_frame": "dynamic_code", "tb_next": "dynamic_code", "co_code": "dynamic_code", "_getframe": "dynamic_code",
    "load_library": "extension_load_file", "from_file": "file_access",
    # host-side computation the profiler never sees
    "numpy": "host_compute", "tolist": "host_compute", "apply_": "host_compute", "map_": "host_compute",
    "map2_": "host_compute", "storage": "host_compute", "untyped_storage": "host_compute",
    "typed_storage": "host_compute", "_typed_storage": "host_compute", "_storage": "host_compute",
    "to_dlpack": "host_compute", "from_dlpack": "host_compute", "dlpack": "host_compute",
    # string annotations evaluated with eval(); building functions from raw code objects
    "get_type_hints": "dynamic_code", "ForwardRef": "dynamic_code", "evaluate_forward_ref": "dynamic_code",
    "get_annotations": "dynamic_code", "singledispatch": "dynamic_code", "singledispatchmethod": "dynamic_code",
    "CodeType": "dynamic_code", "FunctionType": "dynamic_code", "LambdaType": "dynamic_code",
    "ModuleType": "dynamic_code", "new_class": "dynamic_code", "attrgetter": "dynamic_code",
    "methodcaller": "dynamic_code",
    # global torch state, reached from any object
    "set_num_threads": "global_torch_state", "set_num_interop_threads": "global_torch_state",
    "set_detect_anomaly": "global_torch_state", "detect_anomaly": "global_torch_state",
    "set_multithreading_enabled": "global_torch_state", "set_flush_denormal": "global_torch_state",
    "set_default_dtype": "global_torch_state", "set_default_device": "global_torch_state",
    "set_default_tensor_type": "global_torch_state", "manual_seed": "global_torch_state",
    "manual_seed_all": "global_torch_state", "set_rng_state": "global_torch_state",
    "use_deterministic_algorithms": "global_torch_state", "set_float32_matmul_precision": "global_torch_state",
    "CUDAPluggableAllocator": "extension_load_file", "change_current_allocator": "extension_load_file",
    "collect_env": "process_or_thread",
    "elapsed_time": "timer_tampering",
}
# attribute names of stdlib modules (and the aliases torch and the allowed modules import them under) that
# are reachable as attributes: torch.os, torch.sys, torch.ctypes, torch.utils.cpp_extension.subprocess,
# torch.nn.functional.np, typing.sys, collections._sys, enum.bltns. Leading/trailing underscores are ignored.
_LEGIT_ATTR_NAMES = {"cuda", "select", "signal", "code", "trace", "csv", "site", "pwd", "grp", "tty", "sched", "main",
                     "resource"}
_MODULE_ATTR_RULES = {m.strip("_"): r for m, r in _MODULE_RULES.items()
                      if m.strip("_") not in _LEGIT_ATTR_NAMES and r != "torch_compiler"}
_MODULE_ATTR_RULES.update({
    "bltns": "dynamic_code", "frozen_importlib": "dynamic_code", "frozen_importlib_external": "dynamic_code",
    "sitebuiltins": "dynamic_code", "osp": "file_access", "posixpath": "file_access", "logging": "file_access",
    "tokenize": "file_access", "pickletools": "file_access", "compat_pickle": "file_access",
    "sysconfig": "file_access", "np": "library_fallback", "numpy": "host_compute", "mp": "process_or_thread",
    "python_multiprocessing": "process_or_thread", "reducer": "process_or_thread", "reduction": "process_or_thread",
    "setuptools": "process_or_thread", "torchgen": "process_or_thread", "platform": "process_or_thread",
    "mock": "monkey_patching", "unittest": "monkey_patching", "time": "profiler_probe", "datetime": "profiler_probe",
    "pynvml": "global_torch_state",
})
# first-level torch submodules: module objects that must not be laundered through containers or calls
_TORCH_SUBMODULES = set("""nn autograd cuda utils ops backends profiler library jit fx testing distributed
multiprocessing func functional linalg fft special sparse nested masked amp overrides hub package onnx export
compiler cpu mps xpu musa random serialization storage types version distributions quantization ao signal futures
monitor mtia accelerator classes _C _dynamo _inductor _refs _prims _ops _tensor _utils _library _subclasses
_functorch _higher_order_ops _logging _guards _jit_internal _sources _streambase""".split())
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
# literal mapping keys that name what the builtins above are (a globals or builtins dict read by key);
# "input" is an ordinary key of a candidate's own dicts
_KEY_RULES = {k: r for k, r in _BUILTIN_RULES.items() if k != "input"}
_TORCH_TENSOR_CLASSES = {"torch.Tensor", "torch.nn.Parameter", "torch.nn.parameter.Parameter",
                         "torch._tensor.Tensor", "torch.nn.Buffer"}
_NN_MODULE = {"torch.nn.Module", "torch.nn.modules.module.Module"}

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SCOPE_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
                ast.GeneratorExp)
# builtins the analysis gives a meaning (getattr with a literal name is an attribute access): never rebound
_ANALYZED_BUILTINS = ("getattr", "hasattr")
_SHADOWED_MODULES = set(sys.stdlib_module_names) | set(_MODULE_RULES) | {
    "torch", "triton", "torch_musa", "torchada", "safetensors", "numpy", "verifier", "pybind11", "typing_extensions"}


# a str.format replacement field's attribute steps: "{0.__class__}", "{x[a].__globals__.y}" (the dunder names)
_FORMAT_FIELD = re.compile(r"\{([^{}!:]*)")
_FORMAT_ATTR = re.compile(r"\.(__\w+__)")


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
        self._scopes: dict[ast.AST, tuple[set[str], set[str]]] = {}
        self.self_attrs: set[str] = set()        # attribute names the candidate assigns on `self`
        self.classes: dict[str, ast.ClassDef] = {}
        self.native_texts: list[str] = []
        self.native_flags: list[str] = []        # compiler/linker flag strings of load_inline calls
        self.native_requests: list[tuple[str, Any]] = []   # (argument, folded value) of load_inline calls
        # where each native text came from: (argument, Python line of the text's first line or None, call line)
        self.native_origins: list[tuple[str, int | None, int | None]] = []
        self.flag_lines: list[int | None] = []   # the load_inline call line of each entry of native_flags
        # per load_inline call: (call line, end of its requests, texts and flags in the lists above)
        self.inline_calls: list[tuple[int | None, int, int, int]] = []
        self.parents: dict[ast.AST, ast.AST] = {}
        self.import_tops: set[str] = set()       # top-level modules the candidate imports
        self.module_paths: set[str] = set()      # dotted names known to be modules (imported as such)

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
    def _is_literal_getattr(node: ast.AST, name: str = "getattr") -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
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
                    self.import_tops.add(a.name.split(".")[0])
                    parts = a.name.split(".")
                    self.module_paths.update(".".join(parts[:i + 1]) for i in range(len(parts)))
                    if a.asname:
                        self.aliases[a.asname] = a.name
                        self.module_aliases.add(a.asname)
                    else:
                        top = a.name.split(".")[0]
                        self.aliases.setdefault(top, top)
                        self.module_aliases.add(top)
            elif isinstance(node, ast.ImportFrom):
                mod = "." * node.level + (node.module or "")
                if mod:
                    self.import_tops.add(mod.split(".")[0])
                    parts = mod.split(".")
                    self.module_paths.update(".".join(parts[:i + 1]) for i in range(len(parts)))
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
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                self.self_attrs.add(node.attr)
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
        # every other way a statement binds a name counts too: `class src(str, Enum)` or `case src:` after
        # `src = "..."` would hand load_inline another source than the one folded and scanned
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out += [(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"]
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.append(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            out.append(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            out.append(node.rest)
        elif type(node).__name__ == "TypeAlias":
            targets = [node.name]
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                    out.append(n.id)   # not `self` in `self.x = ...`, nor `a` in `a[0] = ...` (see _check_container)
        return out

    # -- scopes: is a builtin's name shadowed where it is used? ----------------------------------
    def scope_info(self, scope: ast.AST) -> tuple[set[str], set[str]]:
        """(names bound locally, names declared global) of a function, lambda or comprehension scope."""
        cached = self._scopes.get(scope)
        if cached is not None:
            return cached
        bound: set[str] = set()
        declared: set[str] = set()
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = scope.args
            bound.update(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x)
            stack = list(scope.body) if isinstance(scope.body, list) else [scope.body]
            while stack:
                n = stack.pop()
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    bound.add(n.name)
                    continue
                if isinstance(n, _SCOPE_NODES):
                    continue   # a nested scope (a walrus in a comprehension binds here: ignoring it is stricter)
                if isinstance(n, (ast.Global, ast.Nonlocal)):
                    declared.update(n.names)
                elif isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                    bound.add(n.id)
                else:
                    bound.update(self._bound_names(n))
                stack.extend(ast.iter_child_nodes(n))
        else:
            for g in scope.generators:
                bound.update(n.id for n in ast.walk(g.target) if isinstance(n, ast.Name))
        self._scopes[scope] = (bound, declared)
        return bound, declared

    def shadowed(self, node: ast.Name) -> bool:
        """Whether ``node`` refers to a local of an enclosing function scope rather than to a builtin. Module and
        class bindings do not count: an unexecuted one (``if 0: exec = 1``) falls back to the builtin, and
        defaults, decorators and the first iterable of a comprehension are evaluated outside their scope."""
        child, parent, came_from_iter = node, self.parents.get(node), False
        while parent is not None:
            inside = False
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside = any(child is stmt for stmt in parent.body)
            elif isinstance(parent, ast.Lambda):
                inside = child is parent.body
            elif isinstance(parent, _SCOPE_NODES):
                inside = not (parent.generators and child is parent.generators[0] and came_from_iter)
            if inside:
                bound, declared = self.scope_info(parent)
                if node.id in declared:
                    return False
                if node.id in bound:
                    return True
            came_from_iter = isinstance(parent, ast.comprehension) and child is parent.iter
            child, parent = parent, self.parents.get(parent)
        return False

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
                value = self.assign_value[node.id]
                if isinstance(value, (ast.List, ast.Tuple, ast.Dict, ast.Set)):
                    self._check_container(node.id)
                return self.fold(value, depth + 1)
            raise _NotFoldable(f"name {node.id!r} is not bound once to a literal")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
                and len(node.args) == 1 and not node.keywords):
            sep, items = self.fold(node.func.value, depth + 1), self.fold(node.args[0], depth + 1)
            if isinstance(sep, str) and isinstance(items, list) and all(isinstance(i, str) for i in items):
                return sep.join(items)
        raise _NotFoldable(type(node).__name__)

    def _check_container(self, name: str) -> None:
        """A list folded for load_inline is the very object load_inline gets: ``flags.append("-fopenmp")`` or
        ``srcs[0] = ...`` would compile what was never scanned. Every read of its name must copy it with
        literals only (``a + ["-g"]``, ``"".join(a)``, an f-string: no object of the candidate's sees the list,
        as an ``__radd__`` or a ``join`` method would) or pass it to torch's load_inline."""
        for n in ast.walk(self.tree):
            if not (isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)):
                continue
            parent = self.parents.get(n)
            if isinstance(parent, ast.FormattedValue) and parent.value is n:
                continue
            if isinstance(parent, ast.BinOp) and isinstance(parent.op, (ast.Add, ast.Mult)):
                other = parent.right if parent.left is n else parent.left
                try:
                    self.fold(other)
                    continue
                except _NotFoldable:
                    pass
            if (isinstance(parent, ast.Call) and len(parent.args) == 1 and parent.args[0] is n
                    and isinstance(parent.func, ast.Attribute) and parent.func.attr == "join"
                    and isinstance(parent.func.value, ast.Constant) and isinstance(parent.func.value.value, str)):
                continue
            if isinstance(parent, ast.keyword):
                parent = self.parents.get(parent)
            if isinstance(parent, ast.Call) and n is not parent.func and self._is_load_inline_call(parent):
                continue
            raise _NotFoldable(f"list {name!r} is used elsewhere (line {n.lineno}); it could change before the build")

    def _is_load_inline_call(self, call: ast.Call) -> bool:
        """A call of torch's (or torch_musa's) load_inline, through a name nothing else rebinds."""
        func = call.func
        if self.qual(func) not in LOAD_INLINE_APIS:
            return False
        return not isinstance(func, ast.Name) or self.assign_count.get(func.id, 0) <= 1

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
        call_line = getattr(call, "lineno", None)
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
            elif key in ("name", "arg0") and value.split(".")[0] in _SHADOWED_MODULES:
                # the child attributes calls to the extension by its module name
                self.add("native_source", f"load_inline name {value!r} is the name of a module", node)
            self.native_requests.append((key, value))
            strings = list(self._strings(value))
            if isinstance(value, list) and any(t.lstrip().startswith(("-", "@")) for t in strings):
                # a flag list (extra_cflags, extra_ldflags, ... in any position), arguments of flags included
                # (["-l", "torch_x"], ["-D", "X=system"])
                self.native_flags.append(" ".join(strings))
                self.flag_lines.append(call_line)
                continue
            elements = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
            origins = [self._text_line(e) for e in elements] if len(elements) == len(strings) else []
            for i, text in enumerate(strings):
                if text.lstrip().startswith(("-", "@")):
                    self.native_flags.append(text)
                    self.flag_lines.append(call_line)
                else:
                    self.native_texts.append(text)
                    self.native_origins.append((key, origins[i] if origins else None, call_line))
        self.inline_calls.append((call_line, len(self.native_requests), len(self.native_texts), len(self.native_flags)))

    def _text_line(self, node: ast.AST, depth: int = 0) -> int | None:
        """Python line of the first line of the string ``node`` folds to, when it is one literal (or a name
        bound once to one): native line k of the text is then Python line (this + k - 1)."""
        if depth > 20:
            return None
        if isinstance(node, (ast.Constant, ast.JoinedStr)):
            return getattr(node, "lineno", None)
        if isinstance(node, ast.Name) and self.assign_count.get(node.id) == 1 and node.id in self.assign_value:
            return self._text_line(self.assign_value[node.id], depth + 1)
        return None

    def native_violation(self, f: "NativeFinding") -> Violation:
        """A native finding as the model will read it: the construct, where it is, and what to do instead."""
        desc = SECURITY_RULES.get(f.rule) or POLICY_RULES[f.rule]
        line, where = None, ""
        if f.source is not None and f.source < len(self.native_origins):
            key, base, call_line = self.native_origins[f.source]
            arg = key if not key.startswith("arg") else f"argument {int(key[3:]) + 1}"
            if base is not None and f.line is not None:
                line, where = base + f.line - 1, f" in the `{arg}` of load_inline"
            else:
                line = call_line
                where = f" in the `{arg}` of this load_inline call" + (f" (line {f.line} of that source)"
                                                                          if f.line else "")
        elif f.source is None:
            token = f.evidence.split("`")[1] if f.evidence.count("`") >= 2 else ""
            line = next((ln for fl, ln in zip(self.native_flags, self.flag_lines) if token and token in fl),
                        self.flag_lines[0] if self.flag_lines else None)
            where = " in the flags of this load_inline call" if "compiler flag" not in f.evidence else ""
        text = f"native code{where} contains {f.evidence} ({desc})"
        if f.hint:
            text += f"; {f.hint}"
        return Violation(f.rule, text, line)

    # -- pass 2: rules -----------------------------------------------------------------------
    def check_qualified(self, q: str, node: ast.AST) -> None:
        parts = q.split(".")
        for i in range(1, len(parts)):
            if parts[i] in ("torch", "triton"):   # F.torch.utils...: torch re-exported as an attribute
                self.check_qualified(".".join(parts[i:]), node)
                break
        for prefix, rule in _QUALIFIED_RULES:
            pp = prefix.split(".")
            if parts[:len(pp)] == pp:
                self.add(rule, f"`{q}` is not allowed ({SECURITY_RULES.get(rule) or POLICY_RULES[rule]})", node)
                return
        if parts[0] == "torch" and len(parts) > 1:
            if len(parts) > 2 and parts[1] == "utils":
                allowed = _TORCH_UTILS_ALLOWED.get(parts[2])
                if allowed is None or (len(parts) > 3 and parts[3] not in allowed):
                    rule = _TORCH_UTILS_RULES.get(parts[2], "dynamic_code")
                    self.add(rule, f"`{q}` is not allowed (a kernel needs only torch.utils.cpp_extension."
                                   f"load_inline from torch.utils)", node)
                    return
            if any(p.startswith("set_") and p not in _HARMLESS_TORCH_SETTERS for p in parts[1:]):
                self.add("global_torch_state", f"`{q}` changes global torch state", node)
            elif any(p.startswith("_") and not p.startswith("__") for p in parts[1:]) and not any(
                    ".".join(parts[:k]) in _HARMLESS_TORCH_PRIVATE and not any(p.startswith("_") for p in parts[k:])
                    for k in (4, 5)):
                self.add("torch_private_api", f"`{q}` is a private torch API", node)
            elif "profiler" in parts:
                self.add("profiler_probe", f"`{q}` inspects the profiler", node)
        elif parts[0] in _STDLIB_ROOTS and parts[0] in self.import_tops and any(
                p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:]):
            self.add("dynamic_code", f"`{q}` is a private name of `{parts[0]}`", node)

    def own_self_attribute(self, node: ast.AST) -> bool:
        """``self.NAME`` where the candidate assigns ``self.NAME`` itself (and never rebinds ``self``): the value
        is one of its own (a module put there would have been caught where it was taken)."""
        return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and node.attr in self.self_attrs and "self" not in self.aliases and "self" not in self.assign_count)

    def check_attribute_name(self, attr: str, node: ast.AST, q: str | None) -> None:
        rule = _ATTR_RULES.get(attr) or _MODULE_ATTR_RULES.get(attr.strip("_"))
        if rule and attr not in _ATTR_RULES and self.own_self_attribute(node):
            rule = None   # self.reduction, self.thread, self.types: the name of a stdlib module, not one
        if rule is None and attr.startswith("register_module_"):
            rule = "monkey_patching"   # module-wide hooks fire inside the reference's forward too
        if rule is None and "profiler" in attr.lower():
            rule = "profiler_probe"
        if rule:
            self.add(rule, f"attribute `{attr}` is not allowed ({SECURITY_RULES[rule]})", node)
        if attr.startswith("__") and attr.endswith("__") and attr not in _ALLOWED_DUNDER_ATTRS and not rule:
            self.add("dynamic_code", f"dunder attribute `{attr}` is not allowed (dunders reach interpreter internals; "
                                     f"allowed: {', '.join(sorted(_ALLOWED_DUNDER_ATTRS))}; use type(obj) instead "
                                     "of obj.__class__)", node)
        if attr == "Model":
            self.add("reference_model", "the reference `Model` must not be used", node)
        if attr == "modules" and q and q.split(".")[0] == "sys":
            self.add("monkey_patching", "`sys.modules` must not be touched", node)

    def check_key_name(self, key: str, node: ast.AST) -> None:
        """A literal key read from a mapping (``d["k"]``, ``d.get("k")``, ``case {"k": v}``) is judged like an
        attribute name where it can reach a namespace: ``g["__builtins__"]["exec"]`` on a function's globals."""
        rule = _KEY_RULES.get(key)
        if rule:
            self.add(rule, f"key `{key!r}` is not allowed ({SECURITY_RULES[rule]})", node)
        elif key.startswith("__") and key.endswith("__") and key not in _ALLOWED_DUNDER_ATTRS:
            self.add("dynamic_code", f"dunder key `{key!r}` is not allowed (namespaces of interpreter internals)",
                     node)

    def check_match_args(self, node: ast.Assign | ast.AugAssign | ast.AnnAssign) -> None:
        """``__match_args__`` names the attributes a positional class pattern reads (``case C(g)`` is
        ``g = subject.<__match_args__[0]>``): they must be literal and pass the attribute rules."""
        try:
            names = self.fold(node.value) if node.value is not None and not isinstance(node, ast.AugAssign) \
                else None
        except _NotFoldable:
            names = None
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            self.add("dynamic_code", "`__match_args__` must be a literal tuple of attribute names", node)
            return
        for name in names:
            self.check_attribute_name(name, node, None)

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
                                           f"({', '.join(sorted(self.allowed_imports))}); remove it", node)

    def check_assign_target(self, target: ast.AST, node: ast.AST) -> None:
        if getattr(node, "lineno", None) is None:
            node = target      # a comprehension's `for` clause has no line of its own
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
            elif self._has_attribute_step(target):
                # `m = [torch][0]; m.autograd.profiler.profile = X` would patch torch through a local name
                self.add("monkey_patching", f"assignment to an attribute of `{root.id}` (attributes may be set "
                                            "only on self, ctx, cls or the candidate's own classes; keep the value "
                                            "in a variable or on self, or call a method such as "
                                            "requires_grad_(False))", node)
            return
        if isinstance(root, ast.Call) and isinstance(root.func, ast.Name) and root.func.id == "super":
            return
        self.add("monkey_patching", "assignment to an attribute of a computed object is not allowed", node)

    @staticmethod
    def _has_attribute_step(target: ast.AST) -> bool:
        """Whether a store target sets an attribute somewhere (``m.x = ``, ``m.x[0] = ``), not only items."""
        node = target
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            if isinstance(node, ast.Attribute):
                return True
            node = node.value
        return False

    def check_module_value(self, node: ast.AST, q: str) -> None:
        """A module object may be the root of an attribute chain, a call or a plain alias (``F = torch.nn``);
        anywhere else (a container, an argument, a return value, a conditional) it escapes name resolution."""
        parent = self.parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.value is node:
            return
        if isinstance(parent, ast.Call) and parent.func is node:
            return
        if isinstance(parent, (ast.Assign, ast.AnnAssign)) and parent.value is node:
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                return
        if self._is_literal_getattr(parent) and parent.args[0] is node:
            return
        if self._is_literal_getattr(parent, "hasattr") and parent.args[0] is node:
            return   # hasattr(torch, "musa"): feature detection, the answer is a bool
        if isinstance(parent, (ast.Import, ast.ImportFrom, ast.alias)):
            return
        self.add("dynamic_code", f"module `{q}` used as a value (modules may only be accessed by name)", node)

    def is_module(self, node: ast.AST, q: str | None) -> bool:
        if not q:
            return False
        if isinstance(node, ast.Name) and (node.id in self.module_aliases
                                           or (node.id in self.aliases and self.aliases[node.id] in self.module_paths)):
            return True
        parts = q.split(".")
        return q in self.module_paths or (len(parts) == 2 and parts[0] == "torch" and parts[1] in _TORCH_SUBMODULES)

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
        for node in ast.walk(self.tree):
            names = self._bound_names(node) + ([node.arg] if isinstance(node, ast.arg) else [])
            for name in _ANALYZED_BUILTINS:
                if name in names:
                    self.add("dynamic_code", f"`{name}` must not be redefined or rebound (the checks rely on "
                                             "the builtin); give yours another name", node)
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
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor,
                                   ast.comprehension)):
                # for/comprehension targets assign too: `for torch.relu in [f]: pass`
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    self.check_assign_target(t, node)
                    if isinstance(t, ast.Name) and t.id == "__match_args__":
                        self.check_match_args(node)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None:
                        self.check_assign_target(item.optional_vars, node)
            elif isinstance(node, ast.Delete):
                for t in node.targets:
                    self.check_assign_target(t, node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name in ("__torch_function__", "__torch_dispatch__"):
                    self.add("tensor_subclass", f"{node.name} overrides torch dispatch", node)
            elif isinstance(node, ast.Name):
                used_names.add(node.id)
                rule = _BUILTIN_RULES.get(node.id)
                locally_bound = (rule is not None or node.id in _ANALYZED_BUILTINS) and self.shadowed(node)
                if rule and isinstance(node.ctx, ast.Load) and (not locally_bound or node.id == "Model"):
                    self.add(rule, f"`{node.id}` is not allowed ({SECURITY_RULES[rule]})", node)
                if node.id in _ANALYZED_BUILTINS and not isinstance(node.ctx, ast.Load):
                    self.add("dynamic_code", f"`{node.id}` must not be redefined or rebound (the checks rely on "
                                             "the builtin); give yours another name", node)
                if node.id in ("getattr", "hasattr") and isinstance(node.ctx, ast.Load) and not locally_bound:
                    parent = self.parents.get(node)
                    if not (isinstance(parent, ast.Call) and parent.func is node):
                        self.add("dynamic_code", f"`{node.id}` may only be called directly", node)
                if isinstance(node.ctx, ast.Load):
                    q = self.aliases.get(node.id)
                    if q and q != node.id:
                        self.check_qualified(q, node)
                    if self.is_module(node, q or node.id):
                        self.check_module_value(node, q or node.id)
            elif isinstance(node, ast.Attribute):
                q = self.qual(node)
                self.check_attribute_name(node.attr, node, q)
                if q:
                    self.check_qualified(q, node)
                    if isinstance(node.ctx, ast.Load) and self.is_module(node, q):
                        self.check_module_value(node, q)
            elif isinstance(node, ast.Call):
                self.check_call(node)
            elif isinstance(node, ast.Subscript):
                if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                    self.check_key_name(node.slice.value, node)
            elif isinstance(node, ast.MatchClass):
                # `case object(__globals__=g)` reads the attribute as `x.__globals__` does, with no Attribute node
                base = self.qual(node.cls)
                for attr in node.kwd_attrs:
                    self.check_attribute_name(attr, node, None)
                    if base:
                        self.check_qualified(f"{base}.{attr}", node)
            elif isinstance(node, ast.MatchMapping):
                # `case {"exec": run}` looks the key up as `d["exec"]` does
                for key in node.keys:
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        self.check_key_name(key.value, node)
        for name, (module, line) in self.tolerated.items():
            if name in used_names:
                rule = _MODULE_RULES[module]
                self.violations.append(Violation(rule, f"`{module}` is imported here and used "
                                                       f"({SECURITY_RULES[rule]}); remove the import and its uses",
                                                 line))
        start = (0, 0, 0)
        seen_rules = set()
        for call_line, r_end, t_end, f_end in self.inline_calls:
            for what in toolchain_mismatches(self.native_requests[start[0]:r_end], self.native_texts[start[1]:t_end],
                                             self.native_flags[start[2]:f_end], self.backend):
                if ("toolchain_mismatch", what) not in seen_rules:
                    seen_rules.add(("toolchain_mismatch", what))
                    self.violations.append(Violation("toolchain_mismatch", f"load_inline asks for {what}", call_line))
            start = (r_end, t_end, f_end)
        for finding in native_findings(self.native_texts, self.native_flags, self.backend):
            if (finding.rule, finding.evidence) not in seen_rules:
                seen_rules.add((finding.rule, finding.evidence))
                self.violations.append(self.native_violation(finding))

    def check_format_template(self, node: ast.Call) -> None:
        """str.format / format_map resolve a field's attribute steps as getattr does ('{0.__class__}'.format(x)):
        a template that folds to a constant is held to the attribute rules. One built at run time is let through:
        it can only render reprs, and the process holds no reference output to read."""
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("format", "format_map"):
            template = node.args[0] if self.qual(func.value) == "str" and node.args else func.value
        else:
            return
        try:
            text = self.fold(template)
        except _NotFoldable:
            return
        if not isinstance(text, str):
            return
        for field in _FORMAT_FIELD.findall(text):
            for attr in _FORMAT_ATTR.findall(field):
                if attr not in _ALLOWED_DUNDER_ATTRS:
                    self.add("dynamic_code", f"format field `{{{field}}}` reaches `{attr}` (dunder attributes reach "
                                             "interpreter internals)", node)

    def check_call(self, node: ast.Call) -> None:
        func = node.func
        q = self.qual(func)
        self.check_format_template(node)
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
            elif self._is_literal_getattr(node, "hasattr"):
                base = self.qual(node.args[0])
                self.check_attribute_name(node.args[1].value, node, base)
                if base:
                    self.check_qualified(f"{base}.{node.args[1].value}", node)
            elif func.id == "super" and node.args:
                q0 = self.qual(node.args[0]) or ""
                if q0.split(".")[-1] == "Model":
                    self.add("reference_model", "super(Model, ...) reaches the reference", node)
        if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            self.check_key_name(node.args[0].value, node)
        if q and q.split(".")[-1] == "set_grad_enabled" and isinstance(self.parents.get(node), ast.Expr) and not (
                len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and node.args[0].value is False):
            # as a statement it switches autograd on for everything after it, the reference's timed runs too
            self.add("global_torch_state", f"`{q}(...)` as a statement changes global autograd state "
                                           "(use it as a context manager)", node)

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


def _is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":`` (either operand order) with no ``else``."""
    if not (isinstance(node, ast.If) and not node.orelse and isinstance(node.test, ast.Compare)
            and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq)):
        return False
    sides = [node.test.left, node.test.comparators[0]]
    names = [x for x in sides if isinstance(x, ast.Name) and x.id == "__name__"]
    consts = [x for x in sides if isinstance(x, ast.Constant) and x.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def _without_main_block(tree: ast.Module) -> ast.Module:
    """The module without its top-level ``if __name__ == "__main__":`` blocks. The harness imports a candidate
    as ``kernel_candidate``, so such a block (LLMs often add a smoke test with seeds, timers and the reference
    Model) never runs; it is dropped only while nothing in the file can rebind ``__name__``."""
    guards = [n for n in tree.body if _is_main_guard(n)]
    if not guards:
        return tree
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "__name__" and not isinstance(node.ctx, ast.Load):
            return tree
        if isinstance(node, (ast.Global, ast.Nonlocal)) and "__name__" in node.names:
            return tree
        if isinstance(node, ast.arg) and node.arg == "__name__":
            return tree
        if "__name__" in _Analyzer._bound_names(node):
            return tree
    return ast.Module(body=[n for n in tree.body if not _is_main_guard(n)], type_ignores=tree.type_ignores)


def check_source(code: str, backend: str = "cpu", *, enforce_policy: bool = True,
                 disabled_rules: Iterable[str] = (), allowed_imports: Iterable[str] | None = None) -> list[Violation]:
    """All rule violations of a candidate (empty list: it may be built and run)."""
    from .config import DEFAULT_ALLOWED_IMPORTS

    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError) as e:
        return [Violation("native_source", f"code does not parse: {e}")]
    except (RecursionError, MemoryError):
        return [Violation("dynamic_code", "code is too deeply nested to check")]
    tree = _without_main_block(tree)
    analyzer = _Analyzer(tree, backend, DEFAULT_ALLOWED_IMPORTS if allowed_imports is None else allowed_imports)
    try:
        analyzer.run()
        analyzer.load_inline_references()
    except (RecursionError, MemoryError):   # a pathological expression must be a verdict, not a harness error
        return [Violation("dynamic_code", "code is too deeply nested to check")]
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
