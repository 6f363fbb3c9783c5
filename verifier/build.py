"""Build stage (CPU side): compile every ``load_inline`` extension a candidate creates, with a shared cache.

``build_candidate`` imports the candidate module in a sandboxed ``build`` child whose ``load_inline``
functions are routed back to this process. Each routed call is served by ``ExtensionService``:

- the call's arguments (sources, flags, function list, name) plus backend, arch list and torch/CUDA
  versions are hashed to an extension key;
- ``<cache>/ext/<key>/`` holds the finished build (``meta.json`` + the ``.so``); a hit needs no compiler;
- a miss is compiled in a separate sandboxed ``compile`` child that runs only torch's own ``load_inline``
  on those arguments (no candidate Python), into a staging dir that is renamed into place atomically;
- an ``flock`` per key makes concurrent builds of the same sources (many compile-pool processes) wait
  for one compiler instead of racing; locks die with their process, so a killed build never wedges others.

So identical extension sources are compiled once across candidates (multi-turn repairs that change only
Python, RL groups, the test suite), and nothing a candidate controls can write into the cache: sandboxed
children may write only their private dirs, and only this process publishes entries.

``<cache>/cand/<code_hash>/record.json`` (code hash = sha256 of code, backend, arch list, torch and Python
versions) makes a second ``build_candidate`` of the same code a pure cache hit. The device child later
imports with the same routing and gets the cached ``.so`` files. Compile failures reported by the compiler
are cached too (deterministic); timeouts and infrastructure failures (a broken toolchain) are not.

Relation to ``TORCH_EXTENSIONS_DIR``: every child gets a private one (so nothing can build into a shared
place behind the router's back); the compile child passes an explicit ``build_directory`` (the staging dir
of the extension key) to torch's own ``load_inline``, which honours it the same way. ``MAX_JOBS`` comes from
``cfg.max_jobs``; ``TORCH_CUDA_ARCH_LIST`` / ``TORCH_MUSA_ARCH_LIST`` from the config's arch list, so builds
work on GPU-less hosts.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any, Iterator

from . import pch
from .config import VerifierConfig
from .devices import DeviceBackend, get_backend
from .sandbox import ChildFailed, ChildTimeout, ProtocolError, SandboxedChild, run_one_shot
from .tasks import Task

_LOG_CHARS = 20000
# compiler logs that mean the build host's toolchain is broken, not the candidate: infra, never cached
_TOOLCHAIN_PROBLEM = re.compile(
    r"cannot find -l(cudart|cuda|c10\w*|torch\w*|musart|musa\w*|python\S*)\b|nvcc: (command )?not found"
    r"|No such file or directory: '(nvcc|mcc|c\+\+|g\+\+|ninja)'|Ninja is required|CUDA_HOME environment variable"
    r"|fatal error: (cuda_runtime|cuda|musa_runtime|musa|Python)\.h: No such file")
# ... each the claim of a host fact, checked before it is believed: the candidate writes lines of that log itself
# (gcc echoes its source lines, and prints ``static_assert(false, "\nx.cpp:1:1: fatal error: cuda.h: No such
# file")`` as a line of its own), and a compile error it made read as infra was never scored
_HEADER_BACKEND = {"cuda_runtime": "cuda", "cuda": "cuda", "musa_runtime": "musa", "musa": "musa"}
_BUILD_LIBS = {"c10", "torch", "torch_cpu", "torch_python", "c10_cuda", "torch_cuda", "cudart", "cuda", "c10_musa",
               "torch_musa", "musart", "musa"}


def _toolkit_homes() -> list[str]:
    from torch.utils import cpp_extension
    return [h for h in (cpp_extension.CUDA_HOME, os.environ.get("MUSA_HOME"), "/usr/local/musa") if h]


def _python_libs() -> set[str]:
    """The names ``-l`` takes for this interpreter's own library (``python3.12``, with its ABI flags): the only
    ``-lpython...`` whose absence can be the host's problem. Any other name (``cannot find -lpython9.99``, which a
    ``static_assert`` message prints as a line of its own) is no library a build of this host ever links."""
    import sysconfig
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    names = {version, version + (sysconfig.get_config_var("ABIFLAGS") or ""), f"python{sys.version_info.major}"}
    lib = sysconfig.get_config_var("LDLIBRARY") or ""
    if lib.startswith("lib"):
        names.add(lib[3:].split(".so")[0].split(".a")[0].split(".dylib")[0])
    return names


def _claim_holds(m: re.Match, backend: str) -> bool:
    """Whether the toolchain problem ``m`` names (a missing header, library or tool) is true of this host and
    concerns ``backend``'s builds; False for a claim about another backend's toolchain, or one the host refutes."""
    import sysconfig

    from torch.utils import cpp_extension
    text = m.group(0)
    homes = _toolkit_homes()
    header = re.search(r"fatal error: (\w+)\.h", text)
    if header:
        name = header.group(1)
        if _HEADER_BACKEND.get(name, backend) != backend:
            return False
        dirs = [sysconfig.get_paths()["include"], *cpp_extension.include_paths(), "/usr/include"] + \
            [os.path.join(h, "include") for h in homes]
        return not any(os.path.isfile(os.path.join(d, f"{name}.h")) for d in dirs)
    lib = re.search(r"cannot find -l(\S+)", text)
    if lib:
        name = lib.group(1)
        if name not in _BUILD_LIBS and name not in _python_libs():   # none that torch's own builds link
            return False
        if ("cud" in name and backend != "cuda") or ("mus" in name and backend != "musa"):
            return False
        dirs = [*cpp_extension.library_paths(), sysconfig.get_config_var("LIBDIR") or "", "/usr/lib64", "/usr/lib",
                "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"] + \
            [os.path.join(h, sub) for h in homes for sub in ("lib64", "lib", "lib64/stubs")]
        return not any(os.path.exists(os.path.join(d, f"lib{name}{ext}")) for d in dirs if d for ext in (".so", ".a"))
    if "CUDA_HOME" in text:
        return backend == "cuda" and cpp_extension.CUDA_HOME is None
    tool = re.search(r"(nvcc|mcc|c\+\+|g\+\+|ninja)|Ninja", text).group(0).lower()
    if (tool == "nvcc" and backend != "cuda") or (tool == "mcc" and backend != "musa"):
        return False
    # the compile child's PATH starts with this interpreter's bin dir (``sandbox.child_env``): a tool found there is
    # there for the build too
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", os.defpath)])
    return shutil.which(tool, path=path) is None and \
        not any(os.path.isfile(os.path.join(h, "bin", tool)) for h in homes)


def toolchain_problem(log: str, backend: str) -> str | None:
    """The first toolchain problem in a failed build's ``log`` that holds on this host for ``backend`` (infra),
    or None: the compile error is the candidate's."""
    return next((m.group(0) for m in _TOOLCHAIN_PROBLEM.finditer(log) if _claim_holds(m, backend)), None)


@dataclasses.dataclass
class BuildResult:
    ok: bool
    code_hash: str
    build_dir: str
    log_tail: str
    seconds: float
    timed_out: bool
    cached: bool = False
    extensions: list[str] = dataclasses.field(default_factory=list)   # extension keys the candidate loaded
    error: str | None = None          # None | "compile" | "timeout" | "infra"
    compiled: int = 0                 # extensions this call compiled (0 on cache hits)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _toolchain() -> dict[str, Any]:
    import torch
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}


def cache_root(cfg: VerifierConfig) -> str:
    root = cfg.build_cache_dir or os.path.join(tempfile.gettempdir(), f"verifier-build-cache-{os.getuid()}")
    for sub in ("ext", "cand", "locks", "pch"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    return root


def code_hash(code: str, cfg: VerifierConfig) -> str:
    blob = json.dumps({"code": code, "backend": cfg.backend, "arch": cfg.arch_list(), **_toolchain()},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def extension_key(api: str, kwargs: dict[str, Any], cfg: VerifierConfig) -> str:
    blob = json.dumps({"api": api, "kwargs": kwargs, "backend": cfg.backend, "arch": cfg.arch_list(),
                       **_toolchain()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:40]


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


@contextlib.contextmanager
def file_lock(path: str, deadline: float) -> Iterator[None]:
    """Exclusive flock, polled until ``deadline`` (monotonic); raises TimeoutError."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out waiting for lock {path}") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def compiler_excerpt(log: str, limit: int = 4000) -> str:
    """The compiler's error lines (from the first 'error'), else the tail of the log."""
    lines = log.splitlines()
    first = next((i for i, line in enumerate(lines)
                  if re.search(r"\berror\b|cannot find|undefined reference|undefined symbol", line, re.IGNORECASE)
                  and "Error building extension" not in line), None)
    text = "\n".join(lines[first:]) if first is not None else log
    return text[:limit] if first is not None else text[-limit:]


# The lines torch's ``load_inline`` puts before the candidate's sources in the files it compiles (torch 2.x,
# ``torch.utils.cpp_extension.load_inline``): ``main.cpp`` starts with the extension header, ``cuda.cu`` with three
# includes, then each source string follows, joined by newlines (``main.cpp`` ends with the bindings of ``functions``).
_GENERATED_PREFIX_LINES = {"main.cpp": ("cpp_sources", 1), "cuda.cu": ("cuda_sources", 3)}
# a compiler's position in a generated file: gcc/clang ``main.cpp:12:5:``, nvcc ``cuda.cu(12):``
_GENERATED_POSITION = re.compile(r"\b(main\.cpp|cuda\.cu)(?::(\d+)(?::\d+)?|\((\d+)\))")


def source_lines_in_log(log: str, api: str, kwargs: dict[str, Any], code: str = "") -> str:
    """``log`` with each position in a file that ``load_inline`` generated followed by where that line is in what the
    candidate wrote: ``main.cpp:12:5 (line 57 of your code)``, or of its source string where the string is not one
    literal of ``code`` spanning its lines (``_literal_line``). The compiler's own numbers are off by the lines torch
    puts first (one in ``main.cpp``, three in ``cuda.cu``), and nvcc prints no source line to find it by."""
    if api != "torch.utils.cpp_extension.load_inline":   # torch_musa's generates its files its own way
        return log
    try:
        tree = ast.parse(code) if code else None
    except (SyntaxError, ValueError):
        tree = None
    spans: dict[str, list[tuple[int, int, int | None, str]]] = {}   # file -> (first line, last line, code line, name)
    for file, (arg, prefix) in _GENERATED_PREFIX_LINES.items():
        prefix = 0 if kwargs.get("no_implicit_headers") else prefix   # torch then writes the sources alone
        items = kwargs.get(arg)
        items = [items] if isinstance(items, str) else items if isinstance(items, list) else []
        line = prefix + 1
        for k, text in enumerate(items):
            if not isinstance(text, str):
                return log
            n = text.count("\n") + 1
            at = _literal_line(tree, text) if tree is not None and text.strip() else None
            name = arg if len(items) == 1 else f"{arg}[{k}]"
            spans.setdefault(file, []).append((line, line + n - 1, at, name))
            line += n

    def where(m: re.Match) -> str:
        file, number = m.group(1), int(m.group(2) or m.group(3))
        for first, last, at, name in spans.get(file, []):
            if first <= number <= last:
                offset = number - first
                place = f"line {at + offset} of your code" if at is not None else f"line {offset + 1} of {name}"
                return f"{m.group(0)} ({place})"
        return m.group(0)
    return _GENERATED_POSITION.sub(where, log)


def _literal_line(tree: ast.AST, text: str) -> int | None:
    """The line of the code where the one string literal whose value is ``text`` starts, if it spans as many lines as
    ``text`` has (no ``\\n`` escapes, no concatenation at run time); else None."""
    hits = [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value == text]
    if len(hits) != 1 or hits[0].end_lineno is None or hits[0].end_lineno - hits[0].lineno != text.count("\n"):
        return None
    return hits[0].lineno


class ExtensionService:
    """Parent side of ``load_inline`` routing: cache lookups and sandboxed compiles, within a time budget."""

    def __init__(self, cfg: VerifierConfig, backend: DeviceBackend | None = None, build_pch: bool = True,
                 code: str = ""):
        self.cfg = cfg
        self.code = code   # the candidate's source: compile errors name its lines (``source_lines_in_log``)
        self.build_pch = build_pch   # off in the device stage: it may use a published PCH, never wait for one
        self.backend = backend or get_backend(cfg.backend)
        self.root = cache_root(cfg)
        self.budget_left = float(cfg.compile_timeout_s)
        self.compiled = 0
        self.timed_out = False
        self.infra_error: str | None = None
        self.last_log = ""
        self.keys: list[str] = []
        self.seconds = 0.0
        self.isolation: dict[str, Any] | None = None
        self.pch_store = pch.PchStore(self.root, cfg, self.backend)
        self.pch_built = False

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            return self._handle(request)
        finally:
            spent = time.monotonic() - t0
            self.seconds += spent

    def _fail(self, log: str) -> dict[str, Any]:
        self.last_log = log
        return {"op": "ext_failed", "log": log[-_LOG_CHARS:]}

    def _ready(self, key: str, meta: dict[str, Any]) -> dict[str, Any]:
        self.keys.append(key)
        so = os.path.join(self.root, "ext", key, meta["so"])
        return {"op": "ext_ready", "key": key, "so_path": so, "module_name": meta["module_name"]}

    def _lookup(self, key: str) -> dict[str, Any] | None:
        meta_path = os.path.join(self.root, "ext", key, "meta.json")
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError):
            return None
        if meta.get("ok") and not os.path.isfile(os.path.join(self.root, "ext", key, meta.get("so", ""))):
            return None
        return meta

    def _handle(self, request: dict[str, Any]) -> dict[str, Any]:
        api, kwargs = request.get("api"), request.get("kwargs")
        if api not in self.backend.extension_apis or not isinstance(kwargs, dict):
            return self._fail(f"load_inline API {api!r} is not available on backend {self.cfg.backend!r}")
        key = extension_key(api, kwargs, self.cfg)
        meta = self._lookup(key)
        if meta is None:
            if self.budget_left <= 0:
                self.timed_out = True
                return self._fail(f"compile time budget of {self.cfg.compile_timeout_s:.0f} s is used up")
            pkey, pch_dir, built = self._pch_for(api, kwargs)   # before the lock: nobody waits on a PCH build
            deadline = time.monotonic() + self.budget_left
            t0 = time.monotonic()
            try:
                with file_lock(os.path.join(self.root, "locks", f"ext-{key}.lock"), deadline):
                    meta = self._lookup(key) or self._compile(api, kwargs, key, deadline, pkey, pch_dir, built)
            except TimeoutError:
                self.timed_out = True
                meta = {"ok": False, "log": "timed out waiting for a concurrent build of the same extension"}
            finally:
                self.budget_left -= time.monotonic() - t0
        if not meta.get("ok"):
            return self._fail(source_lines_in_log(meta.get("log", "extension build failed"), api, kwargs, self.code))
        return self._ready(key, meta)

    def _pch_for(self, api: str, kwargs: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
        """(flag-set key, PCH dir to build with, "built" if this call made it). Called outside the compile
        budget's clock: a PCH build is not this candidate's compile time, and one candidate triggers at most
        one."""
        pkey = pch.pch_key(api, kwargs, self.cfg, _toolchain())
        if pkey is None:
            return None, None, None
        pch_dir, built = self.pch_store.prepare(pkey, time.monotonic() + pch.BUILD_TIMEOUT_S,
                                                build=self.build_pch and not self.pch_built)
        self.pch_built = self.pch_built or built is not None
        return pkey, pch_dir, built

    def _compile(self, api: str, kwargs: dict[str, Any], key: str, deadline: float, pkey: str | None,
                 pch_dir: str | None, built: str | None) -> dict[str, Any]:
        """Compile one extension (with its flag set's precompiled header where there is one) and publish it."""
        if pch_dir is None:
            meta, staging, _ = self._run_compiler(api, kwargs, key, deadline)
            if pkey and staging:
                self.pch_store.record_flags(pkey, staging)
        else:
            t0 = time.monotonic()
            meta, staging, log = self._run_compiler(api, pch.with_pch(kwargs, pch_dir), key, deadline)
            rejected = pch.pch_was_rejected(log)   # GCC read the header instead
            if staging and not meta["ok"] and pch.may_have_failed_because_of_pch(log):
                # the verdict on the candidate's code comes from a build without the PCH, on its own clock
                shutil.rmtree(staging, ignore_errors=True)
                spent = time.monotonic() - t0
                self.budget_left += spent
                meta, staging, _ = self._run_compiler(api, kwargs, key, deadline + spent)
                if meta.get("ok") or rejected:
                    self.pch_store.discard(pkey, log)
            elif rejected:
                self.pch_store.discard(pkey, log)
                meta["pch"] = "rejected"
            else:
                meta["pch"] = built or "used"
        if staging is None:
            return meta
        return self._publish(key, meta, staging)

    def _run_compiler(self, api: str, kwargs: dict[str, Any], key: str,
                      deadline: float) -> tuple[dict[str, Any], str | None, str]:
        """(meta, staging dir to publish or None when the result must not be cached, the whole log)."""
        ext_dir = os.path.join(self.root, "ext")
        staging = os.path.join(ext_dir, f".tmp-{key}-{uuid.uuid4().hex[:8]}")
        os.makedirs(staging)
        job = {"backend": self.cfg.backend, "api": api, "kwargs": kwargs, "build_dir": staging,
               "log_chars": _LOG_CHARS}
        t0 = time.monotonic()
        run = run_one_shot("compile", job, self.cfg, self.backend, [staging], deadline, "verifier-compile-",
                           started_op="compiling")
        if run.hello:
            self.isolation = run.hello.get("isolation")
        reply, timed_out, exit_info = run.reply, run.timed_out, run.exit
        seconds = time.monotonic() - t0
        log = (exit_info.stdout_tail + "\n" + exit_info.stderr_tail).strip()
        if timed_out:
            self.timed_out = True
            shutil.rmtree(staging, ignore_errors=True)
            return {"ok": False, "log": f"compilation timed out after {seconds:.0f} s\n{log[-2000:]}"}, None, log
        if reply is None or reply.get("op") not in ("compiled", "compile_failed"):
            shutil.rmtree(staging, ignore_errors=True)
            if run.started:
                # the child had begun the candidate's build (``compiling``): torch's load_inline loads the library it
                # built in that process, so its static initializers ran there (a trap, a division by zero, a write
                # of a reply of its own to the channel). A death or an out-of-protocol message from then on is the
                # candidate's, whatever signal or status; only the harness's own steps before it are infra
                what = exit_info.describe() if reply is None else f"sent {str(reply.get('op'))[:40]!r}"
                return ({"ok": False, "log": f"the process that built and loaded your extension {what} (code that "
                                             f"runs when the library is loaded, such as static initializers, runs "
                                             f"there)\n{log[-4000:]}"}, None, log)
            if reply is not None and reply.get("op") == "compile_unavailable":
                self.infra_error = f"extension toolchain unavailable: {reply.get('error', {}).get('message')}"
            else:   # no candidate work had begun: the harness failed (its start, its torch import)
                self.infra_error = f"compile child {exit_info.describe()}: {log[-2000:]}"
            return {"ok": False, "log": self.infra_error}, None, log
        self.compiled += 1
        if reply["op"] == "compile_failed":
            # torch streams the compiler output (verbose) to stdout; its exception only names the extension
            full = f"{log}\n{reply.get('log', '')}".strip()
            problem = toolchain_problem(full, self.backend.name)
            if problem:
                shutil.rmtree(staging, ignore_errors=True)
                self.infra_error = f"build host toolchain problem ({problem}):\n{compiler_excerpt(full, 2000)}"
                return {"ok": False, "log": self.infra_error}, None, full
            return {"ok": False, "log": full[-_LOG_CHARS:], "seconds": seconds}, staging, full
        so = os.path.normpath(reply.get("so", ""))
        if so.startswith("..") or os.path.isabs(so) or not os.path.isfile(os.path.join(staging, so)):
            shutil.rmtree(staging, ignore_errors=True)
            return {"ok": False, "log": f"the build produced no usable library ({so!r})"}, None, log
        return ({"ok": True, "so": so, "module_name": os.path.basename(so).split(".")[0], "seconds": seconds,
                 "log": log[-4000:]}, staging, log)

    def _publish(self, key: str, meta: dict[str, Any], staging: str) -> dict[str, Any]:
        """Move a finished build into the cache by rename (another process may have published it first)."""
        _write_json(os.path.join(staging, "meta.json"), meta)
        final = os.path.join(self.root, "ext", key)
        try:
            os.rename(staging, final)
        except OSError:  # another process published the same key first
            shutil.rmtree(staging, ignore_errors=True)
            return self._lookup(key) or meta
        return meta


def _result_from_record(record: dict[str, Any], build_dir: str, seconds: float) -> BuildResult:
    return BuildResult(ok=record["ok"], code_hash=record["code_hash"], build_dir=build_dir,
                       log_tail=record.get("log_tail", ""), seconds=seconds, timed_out=False, cached=True,
                       extensions=list(record.get("extensions", [])), error=record.get("error"),
                       details=dict(record.get("details", {})))


def _uses_load_inline(code: str) -> bool:
    """Whether the candidate calls a load_inline at all (static checks force direct calls)."""
    import ast
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name == "load_inline":
                return True
    return False


def build_candidate(task: Task, code: str, cfg: VerifierConfig) -> BuildResult:
    """Compile every load_inline extension ``code`` creates (sandboxed, cached, concurrency-safe).

    Never raises for candidate behaviour: a compiler error is ``ok=False, error="compile"`` with the log
    tail, a timeout ``timed_out=True``, a harness failure ``error="infra"``. The candidate must have passed
    the static checks: its module-level code runs here (sandboxed)."""
    t0 = time.monotonic()
    backend = get_backend(cfg.backend)
    root = cache_root(cfg)
    h = code_hash(code, cfg)
    build_dir = os.path.join(root, "cand", h)
    record_path = os.path.join(build_dir, "record.json")
    if os.path.isfile(record_path):
        with open(record_path) as f:
            return _result_from_record(json.load(f), build_dir, time.monotonic() - t0)
    if not _uses_load_inline(code):
        # nothing to compile (pure PyTorch/Triton candidate): skip the build child; import errors surface in
        # the device stage, which imports the module anyway
        return BuildResult(True, h, build_dir, "", time.monotonic() - t0, False, details={"skipped": "no load_inline"})
    lock_deadline = (time.monotonic() + cfg.compile_timeout_s + cfg.run_timeout_s + cfg.startup_timeout_s
                     + pch.BUILD_TIMEOUT_S)
    try:
        with file_lock(os.path.join(root, "locks", f"cand-{h}.lock"), lock_deadline):
            if os.path.isfile(record_path):
                with open(record_path) as f:
                    return _result_from_record(json.load(f), build_dir, time.monotonic() - t0)
            result = _build(task, code, cfg, backend, h, build_dir)
    except TimeoutError as e:
        return BuildResult(False, h, build_dir, str(e), time.monotonic() - t0, True, error="timeout")
    result.seconds = time.monotonic() - t0
    return result


def _build(task: Task, code: str, cfg: VerifierConfig, backend: DeviceBackend, h: str,
           build_dir: str) -> BuildResult:
    t0 = time.monotonic()
    service = ExtensionService(cfg, backend, code=code)
    workdir = tempfile.mkdtemp(prefix="verifier-build-", dir=cfg.work_dir)
    cand_path = os.path.join(workdir, "candidate.py")
    with open(cand_path, "w") as f:
        f.write(code)
    child = SandboxedChild("build", {"backend": cfg.backend, "candidate_path": cand_path}, cfg, backend, workdir, [])
    deadline = time.monotonic() + cfg.startup_timeout_s
    phase = "start"
    outcome: dict[str, Any] | None = None
    timed_out = False
    details: dict[str, Any] = {}
    try:
        child.start()
        hello = child.recv(deadline)
        details["isolation"] = hello.get("isolation")
        phase = "harness"
        msg = child.recv(deadline)
        if msg.get("op") != "ready":
            raise ProtocolError(f"expected ready, got {msg.get('op')}")
        phase = "import"
        deadline = time.monotonic() + cfg.run_timeout_s
        while True:
            msg = child.recv(deadline)
            if msg["op"] == "ext_request":
                spent = service.seconds
                reply = service.handle(msg)
                deadline += service.seconds - spent   # compile time has its own budget
                child.send(reply)
                continue
            outcome = msg
            break
    except ChildTimeout:
        timed_out = True
    except (ChildFailed, ProtocolError) as e:
        details["channel"] = str(e)
    finally:
        exit_info = child.close(grace_s=2.0, timed_out=timed_out)
        shutil.rmtree(workdir, ignore_errors=True)
    details.update({"child_exit": exit_info.describe(), "stdout_bytes": exit_info.stdout_bytes,
                    "stderr_bytes": exit_info.stderr_bytes, "compile_seconds": round(service.seconds, 3)})
    seconds = time.monotonic() - t0

    def result(ok: bool, log: str, error: str | None, timed: bool = False) -> BuildResult:
        return BuildResult(ok, h, build_dir, log[-_LOG_CHARS:], seconds, timed, False, list(service.keys), error,
                           service.compiled, details)

    if service.infra_error:
        return result(False, service.infra_error, "infra")
    if timed_out or service.timed_out:
        where = "compiling" if service.timed_out else "importing the candidate module"
        return result(False, f"timed out while {where}\n{service.last_log[-4000:]}", "timeout", True)
    if phase in ("start", "harness"):
        return result(False, f"build harness failed ({exit_info.describe()}): "
                             f"{exit_info.stderr_tail[-2000:]}", "infra")
    if outcome is None:
        # the candidate's module code crashed the child: the device stage will hit it again
        details["import_crash"] = exit_info.describe()
        res = result(True, f"importing the candidate {exit_info.describe()}\n{exit_info.stderr_tail[-2000:]}", None)
    elif outcome["op"] == "build_failed":
        res = result(False, compiler_excerpt(service.last_log or outcome.get("log", ""), _LOG_CHARS), "compile")
    elif outcome["op"] == "import_error":
        err = outcome.get("error", {})
        details["import_error"] = f"{err.get('type')}: {err.get('message', '')[:500]}"
        res = result(True, err.get("traceback_full") or err.get("traceback", ""), None)   # record.json: the whole one
    elif outcome["op"] == "imported":
        res = result(True, "", None)
    else:
        # the candidate's module code was running (phase "import") and can write to the result channel: a message out
        # of protocol is its own doing, not the harness's. Judged like a crash while importing (the device stage,
        # which imports the module again under the same rules, gives the verdict)
        details["import_crash"] = f"sent an out-of-protocol message {str(outcome.get('op'))[:40]!r}"
        res = result(True, f"importing the candidate sent an unexpected message {str(outcome.get('op'))[:40]!r}",
                     None)
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "candidate.py"), "w") as f:
        f.write(code)
    _write_json(os.path.join(build_dir, "record.json"), {
        "ok": res.ok, "code_hash": h, "log_tail": res.log_tail, "extensions": res.extensions, "error": res.error,
        "details": {k: v for k, v in details.items() if k != "isolation"}})
    return res
