"""Code that runs inside the sandboxed child process (``python -I -B verifier/_child.py JOB.json FD``).

Nothing this process reports is trusted for the verdict. The child confines itself first (sandbox.py),
then, depending on ``job["mode"]``:

- ``compile``: build one extension from ``load_inline`` arguments (no candidate Python runs here);
- ``build``:   import the candidate module so every ``load_inline`` it makes is built (through the parent; a cpu
               build child refuses new processes before the import, as the run child does);
- ``run``:     the device stage. Load the task, capture the timer, import the candidate, then answer the
               parent's requests: construct both models under the parent's seed, run correctness trials
               (inputs from secret seeds the parent sends only now; outputs written as safetensors, never
               pickle), time reference and candidate call by call, and save audited timed outputs.

``load_inline`` calls of the candidate are routed to the parent (``ext_request``), which compiles them in a
separate ``compile`` child or serves them from the build cache; the child only imports the finished .so,
and counts the calls into it (the cpu backend has no device kernels to show that a kernel ran).

Right before the candidate is imported the run child arms its guards: an identity snapshot of what the
harness calls (``HarnessGuard``), the global torch state and module-wide hooks (``StateGuard``, which
also restores them before every timed batch, so a candidate cannot slow the reference down through them),
torch's op namespaces, and the CPU time of other threads. Findings travel as ``violations`` in every
reply; like the rest of the child's reports they can only make the parent's verdict stricter.
"""
from __future__ import annotations

import dataclasses
import fcntl
import gc
import json
import mmap
import os
import secrets
import statistics
import sys
import time
import traceback
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from verifier.sandbox import OUTPUT_SEALS  # noqa: E402  (stdlib only, like this module until isolation)

_write = os.write  # captured before any candidate code exists
_pwrite, _ftruncate, _mmap = os.pwrite, os.ftruncate, mmap.mmap
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_ERR_TAIL = 4000


_getframe = sys._getframe
# Garbage collection around model calls. A candidate's finalizers (``__del__``, a generator's ``finally``) run when
# its cyclic garbage is collected, so where a collection can happen tells calls apart: a timed batch ran with the
# collector off, a trial with it on, and a forward that dropped a cycle holding a ``__del__`` and then allocated
# ~1000 objects learnt whether it was checked (kernel when profiled, ATen in the timed calls, whose outputs the
# audits check by value only). Every model call now starts right after a full collection and runs with the
# collector off (``settle_garbage``, then ``gc.disable``). What survives a collection is frozen (``gc.freeze``), so the
# next one scans only what was made since: its cost is the last call's own garbage, microseconds for the reference.
# (A collection over everything let a candidate that kept millions of objects alive slow the reference's flush
# intervals, whose time the timer subtracts from the candidate's span: work hidden outside its timed calls.) Cyclic
# garbage made of objects frozen earlier is never collected: the child lives for one verification.
_gc_collect, _gc_disable, _gc_enable, _gc_freeze = gc.collect, gc.disable, gc.enable, gc.freeze


def settle_garbage() -> None:
    """Collect every unreachable cycle now (its finalizers run here, outside any call), then freeze what is left, as
    before every model call and every timed batch."""
    _gc_collect()
    _gc_freeze()


# Bytes of a timed reference tensor's storage that ``DeviceSession._check_reference`` compares: all of a smaller one,
# this many at secret positions of a larger one (a check's cost follows the number of tensors, not their size)
REFERENCE_SAMPLE_BYTES = 1 << 14
# the ops ``DeviceSession._check_reference`` compares with: watched for replaced kernels before every timed batch, as
# the reference's own ops are (a kernel registered over aten::equal would blind the watch)
REFERENCE_CHECK_OPS = frozenset({"aten::equal", "aten::bitwise_xor", "aten::index_select", "aten::cat"})

# The gaps ``DeviceSession.prepare`` leaves between a timed trial's input sets, which it makes in a random order: a
# random size each, below one set's bytes and, over the whole trial, this many bytes. Before, a batch's inputs lay at
# one stride, so "this input lies one stride past the last one" told a timed call from a checked one (a hidden trial's
# round is prepared alike, so whatever the layout still tells, it tells of the hidden trial's call too).
SPACER_BYTES = 64 << 20

# Every call of a model (correctness, ablation and hidden trials, warm-up, timed batches) starts at this Python stack
# depth. A forward can measure its depth without any forbidden name (recursing until RecursionError, swallowed by a
# context manager's __exit__): a trial's forward ran one frame shallower than a timed call's, so a candidate ran its
# kernel where it was profiled (every trial, the hidden ones included) and PyTorch in the timed calls, whose outputs
# the audits check by value only.
CALL_DEPTH = 128


def at_call_depth(runner):
    """``runner()`` (a lambda that calls one harness function, which calls the model through one lambda) run with
    ``runner``'s frame at Python stack depth ``CALL_DEPTH``, whatever the caller's depth. The padding is plain Python
    calls (inlined by the interpreter: the C stack is the same as without it), outside any timed interval."""
    frame, depth = _getframe(), 0
    while frame is not None:
        depth += 1
        frame = frame.f_back
    # this frame is at `depth`; _descend(k) runs from depth + 1 to depth + 1 + k, and calls runner one deeper
    return _descend(max(0, CALL_DEPTH - depth - 2), runner)


def _descend(k: int, runner):
    if k:
        return _descend(k - 1, runner)
    return runner()


def call_once(fn):
    """``fn()``: a trial's model call goes through one harness frame, as a timed call goes through ``time_batch``."""
    return fn()


def _watch_calls(own: set, hits: list):
    """Count in ``hits[0]`` the calls the Python code makes, until the returned function is called, into C functions
    of the candidate's extensions (``own``: their module names) or C methods bound to objects of their classes. Only C
    attributes are read: nothing of the candidate's Python (a ``__getattr__``, a ``__hash__``) runs in the hook.
    Through ``sys.monitoring`` where there is one, with a callback of one frame, which runs where the callee's frame
    will: a ``sys.setprofile`` hook is a frame below the deepest one, so a forward recursing until RecursionError
    reached one frame less while watched (a trial) than in a timed call, and the error raised in the hook removed it."""
    import types
    method, builtin, module_type = types.MethodType, types.BuiltinFunctionType, types.ModuleType

    def on_call(code, offset, fn, arg0):   # sys.monitoring's CALL callback: one frame, no calls of its own
        if type(fn) is method:
            fn = fn.__func__
        if type(fn) is builtin:
            owner = fn.__self__
            name = type(owner).__dict__.get("__module__") if type(owner) is not module_type else None
            if (type(fn.__module__) is str and fn.__module__ in own) or (type(name) is str and name in own):
                hits[0] += 1

    monitoring = getattr(sys, "monitoring", None)
    tool = None
    if monitoring is not None:
        tool = next((t for t in (3, 4) if monitoring.get_tool(t) is None), None)
    if tool is None:   # no sys.monitoring (Python < 3.12) or its tool ids taken: the profile hook, a frame deeper
        def profile(frame, event, fn):
            if event == "c_call":
                on_call(None, 0, fn, None)
        sys.setprofile(profile)
        return lambda: sys.setprofile(None)

    monitoring.use_tool_id(tool, "verifier-native-calls")
    monitoring.register_callback(tool, monitoring.events.CALL, on_call)
    monitoring.set_events(tool, monitoring.events.CALL)

    def stop():
        monitoring.set_events(tool, 0)
        monitoring.register_callback(tool, monitoring.events.CALL, None)
        monitoring.free_tool_id(tool)
    return stop


class _JudgedCall:
    """One judged call of a trial (``trial``): profiled, its calls into the candidate's extensions counted
    (``_watch_calls``), the ablator on around it in an ablation trial. ``start`` right before it, ``stop`` right after
    (once: again is a no-op, also on an error), ``stop_in_batch`` where later calls of a batch follow it."""

    def __init__(self, session, seed: int, args, ablate: bool, ms: dict) -> None:
        self.session, self.seed, self.args, self.ablate, self.ms = session, seed, args, ablate, ms
        self.seen: dict = {}
        self.hits = [0]
        self.prints = None   # the inputs' fingerprints before a call of its own (outside a batch)
        self.out = None

    def start(self) -> None:
        s, seen = self.session, self.seen
        seen["calls"], seen["opaque"] = s.client.native_calls, s.client.opaque_calls
        if self.ablate:
            # the model's tensors as they are right before this call (earlier calls of a batch may have replaced
            # some): those the ablation overwrites are put back after it
            gen = s.torch.Generator(device=s.device)
            gen.manual_seed(self.seed)
            s._ablation = {"calls": 0, "poisoned": 0, "passthrough": 0, "probes": 0, "generator": gen,
                           "done": set(), "restore": [], "model": s._model_tensors()}
            s._protected = {s._tb.untyped_storage(a).data_ptr() for a in self.args if issubclass(type(a), s._tb)}
            s.client.ablator = s._ablated_call
        profiler = s.backend.profiler()
        seen["prof"] = profiler.__enter__()
        seen["profiler"] = profiler   # only once it runs: stop() must not stop one that never started
        seen["stop_watch"] = _watch_calls(s.client.module_names, self.hits)

    def stop(self) -> None:
        s, seen = self.session, self.seen
        stop_watch, profiler = seen.pop("stop_watch", None), seen.pop("profiler", None)
        try:
            if stop_watch is not None:
                stop_watch()
        finally:
            s.client.ablator = None
            seen.setdefault("calls_after", s.client.native_calls)
            seen.setdefault("opaque_after", s.client.opaque_calls)
            if profiler is not None:
                try:
                    s.timer.synchronize()
                finally:
                    profiler.__exit__(None, None, None)

    def stop_in_batch(self, out) -> None:
        """Judged now: the batch's later calls must not change what this one returned (a persistent output buffer)
        nor see the model's tensors as the ablation left them."""
        from verifier import inputs
        from verifier.correctness import flatten_outputs
        s, seen = self.session, self.seen
        self.stop()
        leaves, _ = flatten_outputs(out)
        seen["aliases_input"] = s._aliases(leaves, self.args)
        self.out = s._copied(out)
        seen["inputs_modified"] = s._timed(self.ms, "trial_fingerprints", lambda: not s._unchanged(
            self.args, s._fingerprints(inputs.make_inputs(s.task, self.seed, s.device, s.precision))))
        if self.ablate and s._ablation is not None:
            s._restore(s._ablation["restore"])
            s._ablation["restore"] = []


class ExtensionBuildFailed(RuntimeError):
    """A load_inline build failed (the parent ran the compiler); the message is the compiler log tail."""


class Channel:
    """JSON lines: requests on stdin, replies on the result fd."""

    def __init__(self, fd: int):
        self.fd = fd
        self.stdin = sys.stdin.buffer

    def send(self, msg: dict) -> None:
        data = json.dumps(msg, default=str).encode() + b"\n"
        view = memoryview(data)
        while view:
            n = _write(self.fd, view)
            view = view[n:]

    def recv(self) -> dict:
        line = self.stdin.readline()
        if not line:
            raise SystemExit(0)  # the parent went away
        return json.loads(line)

    def request(self, msg: dict) -> dict:
        self.send(msg)
        return self.recv()


def _describe(exc: BaseException) -> dict:
    """The exception as text; a candidate's exception whose __str__ raises is still described.

    ``traceback`` is what the model is shown (``feedback.runtime_error``): its own frames, read from the traceback
    objects (`_frames_for_model`; never parsed from text, so a "File ..." line inside a message is not taken for a
    frame), without the message, which travels once, in ``message``. ``traceback_full`` is Python's whole traceback
    (harness frames, torch internals, chained exceptions, the message) for whoever debugs the verifier."""
    name = type(exc).__name__ if isinstance(type(exc).__name__, str) else "exception"
    try:
        message = str(exc)
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except BaseException:   # noqa: B036 - a hostile __str__/__repr__ may raise anything
        message, tb = f"{name} (its message could not be formatted)", ""
    if not isinstance(message, str):
        message = name
    try:
        frames = _frames_for_model(exc)
    except BaseException:   # noqa: B036 - a hostile exception (a __traceback__ that raises, ...): the message only
        frames = ""
    return {"type": name, "message": message[-_ERR_TAIL:], "traceback": frames[-_ERR_TAIL:],
            "traceback_full": tb[-_ERR_TAIL:]}


# Frames of this package (the child, its timers, guards and counting wrappers) and of the import machinery are the
# harness's plumbing: never shown to the model. `_load_module` records which file it loaded under which name.
_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MODULE_FILES: dict[str, str] = {}
_OWN_FRAMES_SHOWN = 12      # at most: the outermost 3 and the innermost 9 (a deep recursion's middle is left out)
_SOURCE_CHARS = 160         # of each source line shown


def _frames_for_model(exc: BaseException) -> str:
    """``exc``'s traceback as the model needs it, built from the traceback objects: each frame in the candidate's
    module (shown under the module's name, with its line number and source line; a frame repeating in a recursion
    written once, with its count), then, where the exception was raised inside a library the candidate called
    (torch, triton), that library's innermost frame. Left out, and counted in the header: the harness's frames
    (this package, the import machinery, and everything outside the candidate's first frame, such as the
    torch.nn.Module call wrappers the harness's call went through) and library frames between the candidate's own.
    Where no frame is the candidate's (the harness failed on what the candidate returned), the innermost library
    frame, if the error came from one. A chained exception (``raise ... from``, or raised while handling another)
    adds one line naming the other exception."""
    import linecache
    from verifier.static_checks import CANDIDATE_MODULE_NAME, TASK_MODULE_NAME
    candidate, task = _MODULE_FILES.get(CANDIDATE_MODULE_NAME), _MODULE_FILES.get(TASK_MODULE_NAME)

    frames = []   # (filename, line number, function name), outermost first
    tb = exc.__traceback__
    while tb is not None and len(frames) < 100_000:
        code = tb.tb_frame.f_code
        frames.append((str(code.co_filename), int(tb.tb_lineno or 0), str(code.co_name)))
        tb = tb.tb_next
    kinds = ["own" if f == candidate else "harness" if f.startswith((_HARNESS_DIR, "<frozen ")) else "library"
             for f, _, _ in frames]
    own = [i for i, k in enumerate(kinds) if k == "own"]

    def entry(i: int, note: str = "") -> list[str]:
        filename, lineno, func = frames[i]
        if filename == candidate:
            where = CANDIDATE_MODULE_NAME
        elif filename == task:
            where = "the reference (task)"
        else:
            parts = filename.replace(os.sep, "/").rsplit("-packages/", 1)   # site-packages/, dist-packages/
            where = parts[1] if len(parts) == 2 else os.path.basename(filename) or filename
        line = linecache.getline(filename, lineno).strip() if lineno > 0 else ""
        if len(line) > _SOURCE_CHARS:
            line = line[:_SOURCE_CHARS] + " [...]"
        return [f"  {where}, line {lineno}, in {func}{note}"] + ([f"    {line}"] if line else [])

    shown: list[str] = []
    if own:
        runs: list[list] = []   # [frame index, times it repeated right after itself]
        for i in own:
            if runs and frames[runs[-1][0]] == frames[i]:
                runs[-1][1] += 1
            else:
                runs.append([i, 0])
        if len(runs) > _OWN_FRAMES_SHOWN:
            inner = _OWN_FRAMES_SHOWN - 3
            hidden = sum(1 + r[1] for r in runs[3:-inner])
            runs = runs[:3] + [[None, hidden]] + runs[-inner:]
        for i, repeats in runs:
            if i is None:
                shown.append(f"  [... {repeats} more frames of your code ...]")
                continue
            shown += entry(i)
            if repeats:
                shown.append(f"  [the frame above repeated {repeats} more times]")
    last = len(frames) - 1
    raised_in_library = bool(frames) and kinds[last] == "library" and (not own or last > own[-1])
    if raised_in_library:
        shown += entry(last, "  <- raised inside this call" if own else "  <- raised here")
    if isinstance(exc, SyntaxError) and isinstance(exc.filename, str) and candidate \
            and exc.filename == candidate:   # the candidate's module does not compile
        shown.append(f"  {CANDIDATE_MODULE_NAME}, line {exc.lineno}")
        if isinstance(exc.text, str) and exc.text.strip():
            shown.append("    " + exc.text.strip()[:_SOURCE_CHARS])
    if not frames and not shown:   # no traceback at all (a candidate set its exception's to None): the message
        return ""
    if not shown:
        shown = ["  (raised in the verifier's harness, in none of your code's frames)"]
    library = kinds[own[0]:].count("library") - raised_in_library if own else 0   # the rest is the harness's
    harness = len(frames) - len(own) - library - raised_in_library
    omitted = " and ".join(([f"{library} library frame{'s' * (library != 1)}"] if library else [])
                           + (["the verifier's frames"] if harness else []))
    text = ["Traceback (most recent call last" + (f"; {omitted} omitted" if omitted else "") + "):"]
    text += shown
    cause = exc.__cause__ if exc.__cause__ is not None else None if exc.__suppress_context__ else exc.__context__
    if isinstance(cause, BaseException):
        try:
            lines = str(cause).strip().splitlines() or [""]
            what = lines[0][:300] + (" [...]" if len(lines) > 1 or len(lines[0]) > 300 else "")
        except BaseException:   # noqa: B036 - a hostile __str__
            what = "(its message could not be formatted)"
        how = "direct cause" if exc.__cause__ is not None else "raised while handling"
        text.append(f"({how}: {type(cause).__name__}: {what})")
    return "\n".join(text)


def _load_module(name: str, path: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    _MODULE_FILES[name] = path   # its frames' file name (`_frames_for_model`)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _jsonable(value, path="kwargs") -> None:
    if value is None or isinstance(value, (str, bool, int, float)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _jsonable(v, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"load_inline argument {path} has a non-string key {k!r}")
            _jsonable(v, f"{path}[{k!r}]")
        return
    raise TypeError(f"load_inline argument {path} must be strings/lists/dicts, got {type(value).__name__}")


def _counting(fn, client: "ExtensionClient"):
    """``fn`` (a function of a candidate extension) that counts its calls; in an ablation trial the call goes
    through ``client.ablator`` (``DeviceSession._ablated_call``)."""
    def call(*args, **kwargs):
        client.native_calls += 1
        if client.ablator is not None:
            return client.ablator(fn, args, kwargs)
        return fn(*args, **kwargs)
    call.__name__ = getattr(fn, "__name__", "native")
    call.__doc__ = getattr(fn, "__doc__", None)
    return call


class ExtensionClient:
    """Replaces the backend's load_inline functions so builds go through the parent's build service."""

    def __init__(self, chan: Channel, backend):
        self.chan = chan
        self.backend = backend
        self.built: list[str] = []
        self.native_calls = 0                 # calls into the functions of the candidate's extensions
        self.module_names: set[str] = set()   # their module names (pybind methods report them too)
        self.ablator = None                   # set during an ablation trial (DeviceSession.trial)
        self.opaque_calls = 0                 # native work the ablation cannot see into (CUDA graph replays)

    def install(self) -> None:
        import inspect

        from verifier.devices import resolve_extension_api
        for api in self.backend.extension_apis:
            try:
                module, attr = resolve_extension_api(api)
            except ImportError:
                continue  # e.g. torchada not installed
            real = getattr(module, attr)
            setattr(module, attr, self._wrapper(api, inspect.signature(real)))
        from torch.utils import cpp_extension

        def refuse(*args, **kwargs):
            raise RuntimeError("building extensions from files is not allowed; use load_inline")
        cpp_extension.load = refuse

    def _wrapper(self, api: str, sig):
        def load_inline(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            call = {k: v for k, v in bound.arguments.items() if k not in ("build_directory", "verbose")}
            if isinstance(call.get("functions"), tuple):
                call["functions"] = list(call["functions"])
            _jsonable(call)
            reply = self.chan.request({"op": "ext_request", "api": api, "kwargs": call})
            if reply.get("op") != "ext_ready":
                raise ExtensionBuildFailed(reply.get("log") or "extension build failed")
            self.built.append(reply["key"])
            return self._import(reply["so_path"], reply["module_name"], call.get("is_python_module", True))
        load_inline.__name__ = "load_inline"
        return load_inline

    def _import(self, path: str, module_name: str, is_python_module: bool):
        if not is_python_module:
            import torch
            torch.ops.load_library(path)
            return path
        import importlib.util
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if module_name not in sys.modules and importlib.util.find_spec(module_name) is None:
            self.module_names.add(module_name)   # an extension named like a module (torch) would count its calls
        for attr, fn in list(vars(module).items()):
            if not attr.startswith("_") and type(fn).__name__ == "builtin_function_or_method":
                setattr(module, attr, _counting(fn, self))
        return module


# ------------------------------------------------------------------------------------------------ modes
def run_compile(job: dict, chan: Channel) -> None:
    from verifier.devices import resolve_extension_api
    try:
        module, attr = resolve_extension_api(job["api"])
        fn = getattr(module, attr)
    except Exception as e:  # MUSA toolchain missing etc.: the parent reports infra
        chan.send({"op": "compile_unavailable", "error": _describe(e)})
        return
    kwargs = dict(job["kwargs"], build_directory=job["build_dir"], verbose=True)
    # from here on the candidate's code takes part: its sources go to the compiler, and torch's load_inline then
    # loads the library it built here (its static initializers run in this process). Whatever this process says
    # or does after this message may be the candidate's: the parent reads no harness failure into it.
    chan.send({"op": "compiling"})
    try:
        result = fn(**kwargs)
    except BaseException as e:
        chan.send({"op": "compile_failed", "log": str(e)[-job.get("log_chars", 20000):]})
        return
    so = getattr(result, "__file__", None) if not isinstance(result, str) else result
    if not so or not os.path.isfile(so):
        chan.send({"op": "compile_failed", "log": f"the build produced no shared library ({so!r})"})
        return
    chan.send({"op": "compiled", "so": os.path.relpath(so, job["build_dir"])})


def run_pch(job: dict, chan: Channel) -> None:
    """Precompile torch/extension.h with the command the parent derived from an earlier build of the same
    flags (``verifier.pch``); no candidate code runs here. GCC only: clang neither finds nor reads it."""
    import subprocess
    cmd = list(job["cmd"])
    try:
        version = subprocess.run([cmd[0], "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        chan.send({"op": "pch_failed", "log": f"{cmd[0]} --version: {e}"})
        return
    if "clang" in version.lower() or "Free Software Foundation" not in version:
        chan.send({"op": "pch_failed", "log": f"not GCC: {version[:200]}"})
        return
    r = subprocess.run(cmd, capture_output=True, text=True)   # the parent's deadline kills the process group
    out = cmd[cmd.index("-o") + 1]
    if r.returncode != 0 or not os.path.isfile(out):
        chan.send({"op": "pch_failed", "log": (r.stdout + r.stderr)[-4000:]})
        return
    chan.send({"op": "pch_built"})


def run_build(job: dict, chan: Channel) -> None:
    import torch  # noqa: F401  (import time is not the candidate's)

    from verifier.devices import get_backend
    from verifier.static_checks import CANDIDATE_MODULE_NAME
    client = ExtensionClient(chan, get_backend(job["backend"]))
    client.install()
    chan.send({"op": "ready"})
    # No new processes from here on, as in a cpu run child (``run_device``): the candidate's module code and its
    # extensions' load (a C++ global constructor runs at dlopen) run next, and a helper forked here would outlive
    # this child into the run. Nothing honest here needs one: every load_inline compile runs in the parent's
    # ``compile`` child (``ext_request``); this child only imports the finished .so. (The run child's exception for
    # compare_torch_compile is its reference's inductor compile: no reference runs here.)
    if job["backend"] == "cpu" and (job.get("isolation") or {}).get("syscall_filter"):
        from verifier import syscall_filter
        syscall_filter.install_no_processes()
    try:
        module = _load_module(CANDIDATE_MODULE_NAME, job["candidate_path"])
    except ExtensionBuildFailed as e:
        chan.send({"op": "build_failed", "log": str(e)})
        return
    except BaseException as e:
        chan.send({"op": "import_error", "error": _describe(e), "extensions": client.built})
        return
    chan.send({"op": "imported", "extensions": client.built, "has_model_new": hasattr(module, "ModelNew")})


def _write_safetensors(fd: int, tensors: dict) -> None:
    """Write tensors (on any device) to the memfd ``fd`` in the safetensors format (8-byte header length, JSON
    header, raw data): the file is sized first, then each tensor is copied straight into its shared mapping
    (a device tensor device-to-host, in one pass: no host copy of outputs that take gigabytes before they are
    written), and the mapping is gone again on return, so the file can be sealed against writes. No path
    (safetensors' own writer renames a temp file next to its target, which a memfd does not have)."""
    import torch
    from safetensors.torch import _TYPES

    from verifier.correctness import COMPLEX128_KEYS
    names = {dtype: name for name, dtype in _TYPES.items()}
    header, offset, pairs = {}, 0, []
    for key, t in tensors.items():
        size = t.numel() * t.element_size()
        if t.dtype == torch.complex128:   # no safetensors dtype: its bytes as float64 (re, im) pairs
            pairs.append(key)
            header[key] = {"dtype": "F64", "shape": list(t.shape) + [2], "data_offsets": [offset, offset + size]}
        elif t.dtype in names:
            header[key] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        else:
            raise TypeError(f"output {key} has dtype {t.dtype}, which the verifier cannot hand over")
        offset += size
    if pairs:
        header["__metadata__"] = {COMPLEX128_KEYS: ",".join(pairs)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    _ftruncate(fd, len(head) + offset)
    view = memoryview(head)
    while view:
        view = view[_pwrite(fd, view, len(head) - len(view)):]
    if not offset:
        return
    mm = _mmap(fd, len(head) + offset, flags=_MAP_FLAGS)
    try:
        tb = torch._C.TensorBase
        for key, t in tensors.items():
            start, end = header[key]["data_offsets"]
            if end > start:
                src = tb.view(tb.reshape(tb.contiguous(t), (-1,)), torch.uint8)
                dst = torch.frombuffer(mm, dtype=torch.uint8, count=end - start, offset=len(head) + start)
                tb.copy_(dst, src)
                del dst, src
    finally:
        mm.close()   # a writable mapping left behind would make sealing fail


_MISSING = object()


class HarnessGuard:
    """Identity snapshot, taken before the candidate is imported, of the module functions and class attributes
    the harness and the reference rely on (the profiler, the timer, output saving, nn.Module and its layers,
    the task module). ``changed()`` names what was replaced, added to a class, or removed since."""

    def __init__(self, modules, classes):
        import types
        self._types = types
        self.modules = [(getattr(m, "__name__", "?"), m, dict(vars(m))) for m in modules if m is not None]
        self.classes = [(f"{c.__module__}.{c.__qualname__}", c, dict(vars(c))) for c in classes]

    def changed(self, callable=callable, isinstance=isinstance, vars=vars, sorted=sorted, set=set) -> list[str]:
        # builtins bound when the harness was imported: patching them later cannot blind the check
        types = self._types
        out = []
        for name, mod, snap in self.modules:
            now = vars(mod)
            for k, v in snap.items():
                if (callable(v) or isinstance(v, types.ModuleType)) and now.get(k, _MISSING) is not v:
                    out.append(f"{name}.{k}")
        for name, cls, snap in self.classes:
            now = vars(cls)
            out += [f"{name}.{k}" for k in now.keys() ^ snap.keys()]
            out += [f"{name}.{k}" for k, v in snap.items() if k in now and now[k] is not v]
        return sorted(set(out))


class StateGuard:
    """Global torch/interpreter state and module-wide hooks as they were before the candidate was imported.
    ``check_and_restore()`` names what differs and puts it back (the reference is timed in this process)."""

    _HOOKS = ("_global_buffer_registration_hooks", "_global_module_registration_hooks",
              "_global_parameter_registration_hooks", "_global_backward_pre_hooks", "_global_backward_hooks",
              "_global_is_full_backward_hook", "_global_forward_pre_hooks", "_global_forward_hooks",
              "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs")

    # process-wide flags of torch's global context that the checks above do not read, as (getter, setter) names in
    # torch._C (a build without one skips it): SDPA backends (flash attention off made the reference's CPU SDPA
    # 2.7x slower, and native code reaches the setters through `auto& c = at::globalContext()`), reduced-precision
    # reductions, preferred BLAS/linear-algebra libraries, NNPACK and oneDNN, the quantized engine
    _C_FLAGS = {name: ("_get_" + getter, "_set_" + setter) for name, getter, setter in (
        ("flash_sdp", "flash_sdp_enabled", "sdp_use_flash"), ("math_sdp", "math_sdp_enabled", "sdp_use_math"),
        ("mem_efficient_sdp", "mem_efficient_sdp_enabled", "sdp_use_mem_efficient"),
        ("cudnn_sdp", "cudnn_sdp_enabled", "sdp_use_cudnn"), ("fa3_sdp", "fa3_sdp_enabled", "sdp_use_fa3"),
        ("overrideable_sdp", "overrideable_sdp_enabled", "sdp_use_overrideable"),
        ("sdp_priority_order", "sdp_priority_order", "sdp_priority_order"),
        ("math_sdp_reduction", "math_sdp_allow_fp16_bf16_reduction", "math_sdp_allow_fp16_bf16_reduction"),
        ("cpu_fp16_reduction", "cpu_allow_fp16_reduced_precision_reduction",
         "cpu_allow_fp16_reduced_precision_reduction"),
        ("cublas_fp16_reduction", "cublas_allow_fp16_reduced_precision_reduction",
         "cublas_allow_fp16_reduced_precision_reduction"),
        ("cublas_bf16_reduction", "cublas_allow_bf16_reduced_precision_reduction",
         "cublas_allow_bf16_reduced_precision_reduction"),
        ("cublas_fp16_accumulation", "cublas_allow_fp16_accumulation", "cublas_allow_fp16_accumulation"),
        ("blas_backend", "blas_preferred_backend", "blas_preferred_backend"),
        ("linalg_backend", "linalg_preferred_backend", "linalg_preferred_backend"),
        ("nnpack", "nnpack_enabled", "nnpack_enabled"), ("mkldnn_deterministic", "mkldnn_deterministic",
                                                         "mkldnn_deterministic"),
        ("onednn_tf32", "onednn_allow_tf32", "onednn_allow_tf32"), ("qengine", "qengine", "qengine"),
        ("sm_carveout", "sm_carveout_experimental", "sm_carveout_experimental"),
        ("fill_uninitialized", "deterministic_fill_uninitialized_memory",
         "deterministic_fill_uninitialized_memory"))}

    def __init__(self, torch, kernels: dict[str, str] | None = None):
        from torch.nn.modules import module as nn_module
        self.torch, self.nn_module = torch, nn_module
        # the dispatcher's registrations of every op (``dispatch_tables``) from before the candidate existed: a
        # kernel registered over an existing op's (a torch::Library of kind IMPL, however its type is spelled)
        # runs inside the reference's timed calls. All ops are compared at chosen points (``full``: 0.1 s), the
        # ops the reference dispatches (``watch``) before every timed batch; a registration cannot be undone
        self.kernels = kernels or {}
        self.watched: list[str] = []
        self._by_name: dict[str, list[str]] = {}
        for op in self.kernels:
            self._by_name.setdefault(op.split(".")[0], []).append(op)
        self._flags = {}
        for key, (get, put) in self._C_FLAGS.items():
            getter, setter = getattr(torch._C, get, None), getattr(torch._C, put, None)
            try:
                getter()
            except Exception:   # absent from this build (or not readable here): not checked
                continue
            self._flags[key] = (getter, setter)
        self.expected = self._read()

    def _read(self) -> dict:
        torch, b = self.torch, self.torch.backends
        hooks = tuple(len(getattr(self.nn_module, h, None) or ()) for h in self._HOOKS)
        return {"grad_enabled": torch.is_grad_enabled(), "anomaly_mode": torch.is_anomaly_enabled(),
                "inference_mode": torch.is_inference_mode_enabled(), "num_threads": torch.get_num_threads(),
                "default_dtype": torch.get_default_dtype(), "default_device": str(torch.get_default_device()),
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "matmul_precision": torch.get_float32_matmul_precision(),
                "function_modes": torch._C._len_torch_function_stack(),
                "dispatch_modes": torch._C._len_torch_dispatch_stack(),
                "backends": (b.mkldnn.enabled, b.cudnn.enabled, b.cudnn.benchmark, b.cudnn.deterministic,
                             b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32),
                "module_hooks": hooks, "profile_function": sys.getprofile(), "trace_function": sys.gettrace(),
                # thread-local dispatch keys (autocast on, autograd or a backend excluded): reported, not restored
                "dispatch_tls": (str(torch._C._dispatch_tls_local_include_set()),
                                 str(torch._C._dispatch_tls_local_exclude_set())),
                **{key: getter() for key, (getter, _) in self._flags.items()}}

    def watch(self, op_names) -> None:
        """Check the registrations of these ops (profiler names, every overload) before every timed batch."""
        self.watched = sorted({op for name in op_names for op in self._by_name.get(name, ())})

    def replaced_kernels(self, full: bool = False) -> list[str]:
        ops = list(self.kernels) if full else self.watched
        return [op for op in ops if dispatch_tables(self.torch, [op]).get(op) != self.kernels[op]]

    def check_and_restore(self, full: bool = False) -> list[str]:
        now = self._read()
        diff = [k for k, v in self.expected.items() if now[k] is not v and now[k] != v]
        for key in diff:
            self._restore(key)
        replaced = self.replaced_kernels(full)
        if replaced:
            diff.append("the kernels of " + ", ".join(replaced[:3]))
        return diff

    def _restore(self, key: str) -> None:
        torch, e, b = self.torch, self.expected[key], self.torch.backends
        if key == "module_hooks":
            for h in self._HOOKS:
                hooks = getattr(self.nn_module, h, None)
                if hasattr(hooks, "clear"):
                    hooks.clear()
        elif key == "profile_function":
            sys.setprofile(e)
        elif key == "trace_function":
            sys.settrace(e)
        elif key == "function_modes":
            while torch._C._len_torch_function_stack() > e:
                torch._C._pop_torch_function_stack()
        elif key == "dispatch_modes":
            while torch._C._len_torch_dispatch_stack() > e:
                torch._C._pop_torch_dispatch_stack()
        elif key in self._flags:
            setter = self._flags[key][1]
            try:
                setter(*e) if isinstance(e, tuple) else setter(e)
            except Exception:   # reported either way; a value this build cannot set back stays reported
                pass
        elif key == "backends":
            (b.mkldnn.enabled, b.cudnn.enabled, b.cudnn.benchmark, b.cudnn.deterministic, b.cudnn.allow_tf32,
             b.cuda.matmul.allow_tf32) = e
        else:
            setter = {"grad_enabled": torch.set_grad_enabled, "anomaly_mode": torch.autograd.set_detect_anomaly,
                      "num_threads": torch.set_num_threads, "default_dtype": torch.set_default_dtype,
                      "default_device": torch.set_default_device, "deterministic": torch.use_deterministic_algorithms,
                      "matmul_precision": torch.set_float32_matmul_precision}.get(key)
            if setter is not None:   # inference mode cannot be left from outside its context: reported only
                setter(e)


def dispatch_tables(torch, names=None) -> dict[str, str]:
    """Each op's registrations as the dispatcher describes them (kernels by dispatch key, with where they were
    registered); ``names`` default to every op."""
    out = {}
    for name in torch._C._dispatch_get_all_op_names() if names is None else names:
        try:
            out[name] = torch._C._dispatch_dump(name)
        except Exception:
            out[name] = ""
    return out


def _op_namespaces(torch) -> set[str]:
    return {name.split("::")[0] for name in torch._C._dispatch_get_all_op_names()}


@dataclasses.dataclass(frozen=True)
class TensorOps:
    """torch's C functions the child's checks run, captured before any candidate code (a candidate can replace
    ``torch.Tensor``'s methods and module attributes, not the references taken here)."""
    torch: Any
    tb: Any                  # torch._C.TensorBase: its methods are C slots
    equal: Any
    xor: Any
    cat: Any
    index_select: Any

    @classmethod
    def capture(cls, torch) -> TensorOps:
        return cls(torch, torch._C.TensorBase, torch.equal, torch.bitwise_xor, torch.cat, torch.index_select)


class ReferenceWatch:
    """The timed reference's tensors (parameters and buffers, persistent or not, tensor attributes and the tensors in
    its list, tuple and dict attributes, the task module's tensors), recorded as it is built, before any candidate code
    runs again. Nothing the parent compares comes from that model (its outputs are never checked), so native code that
    writes into its weights slows only the reference's timed calls: the freed source model's memory is reused for it,
    and it holds the very values the candidate's load_state_dict was handed (denormals written there made an x86
    core's matmul ~100x slower).

    `check` runs before every warm-up and timed batch of either runner and after each of the candidate's; after each
    of the reference's own, the record is taken again (`rebaseline`): what the reference changes itself (BatchNorm's
    running statistics, an Embedding's max_norm renormalising the rows it looks up) is no finding, whenever it
    happens. Each storage's bytes (above ``REFERENCE_SAMPLE_BYTES``, that many at random positions) are kept XOR a
    random mask: a record that holds none of its values, so code that finds the tensor by its values finds no copy to
    rewrite along with it (a plain clone was found and rewritten too). Denormals written into 1e-3 of a float32
    tensor's entries (a matmul ~10 % slower) change ~4e-4 of its bytes: the sample misses them with a chance of about
    e^-6 (its positions are drawn once). The storages of one device are gathered and compared at once: one
    synchronisation per check, not one per tensor (a level-3 model holds hundreds). Tensors without a storage
    (sparse, MKLDNN) are not watched. Every op it runs was captured before the candidate loaded (`TensorOps`)."""

    def __init__(self, model, task, ops: TensorOps):
        self.ops = ops
        tb, storages = ops.tb, {}
        values = list(vars(task).values())   # tensors the task module keeps (constants its forward reads)
        for module in model.modules():
            values += [*module.parameters(recurse=False), *module.buffers(recurse=False), *vars(module).values()]
        for v in values:
            for t in (v if isinstance(v, (list, tuple)) else v.values() if isinstance(v, dict) else (v,)):
                if not issubclass(type(t), tb):
                    continue
                try:
                    storage = tb.untyped_storage(t)
                except (RuntimeError, NotImplementedError):   # sparse, MKLDNN: no storage to read
                    continue
                if storage.nbytes():
                    storages.setdefault(storage.data_ptr(), t)
        by_device: dict = {}
        for t in storages.values():
            by_device.setdefault(tb.untyped_storage(t).device, []).append(t)
        self.records = [self._record(device, tensors) for device, tensors in by_device.items()]

    def _record(self, device, tensors: list) -> dict:
        torch, tb = self.ops.torch, self.ops.tb
        gen = torch.Generator(device=device)
        gen.seed()   # a secret: /dev/urandom
        entries = []
        for t in tensors:
            storage = tb.untyped_storage(t)
            n = storage.nbytes()
            idx = None
            if n > REFERENCE_SAMPLE_BYTES:
                idx = torch.randint(0, n, (REFERENCE_SAMPLE_BYTES,), generator=gen, device=device, dtype=torch.int64)
            # a byte view of the storage made once (a view per check was most of a check's cost for small tensors);
            # the storage's address, read each check, tells when the tensor was given another one
            raw = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            entries.append((t, n, idx, raw, storage.data_ptr()))
        record = {"device": device, "entries": entries}
        raw = self.watched_bytes(record)
        record["mask"] = torch.empty(raw.numel(), dtype=torch.uint8, device=device).random_(0, 256, generator=gen)
        record["kept"] = self.ops.xor(raw, record["mask"])
        return record

    def watched_bytes(self, record: dict):
        """The watched bytes of one device's storages now, in record order; None when a tensor was given another
        storage (or its storage was resized)."""
        parts = []
        for entry in record["entries"]:
            if not self._same_storage(entry):
                return None
            raw, idx = entry[3], entry[2]
            parts.append(raw if idx is None else self.ops.index_select(raw, 0, idx))
        return self.ops.cat(parts)

    def _same_storage(self, entry: tuple) -> bool:
        """The watched tensor of ``entry`` still has the storage recorded for it (not swapped, not resized)."""
        t, n, _, _, ptr = entry
        storage = self.ops.tb.untyped_storage(t)
        return storage.data_ptr() == ptr and storage.nbytes() == n

    def check(self) -> str | None:
        """What changed since the record was last taken (built, or after the reference's own calls: `rebaseline`),
        as a finding's message; None when nothing did."""
        changed = total = 0
        for record in self.records:
            total += len(record["entries"])
            now = self.watched_bytes(record)
            if now is None or not self.ops.equal(self.ops.xor(now, record["mask"]), record["kept"]):
                changed += max(1, self._same(record, now).count(False))
        if not changed:
            return None
        return f"{changed} of the {total} weights and buffers of the reference timed in this process changed after " \
               "it was built"

    def rebaseline(self) -> None:
        """Take the record again after the reference's own calls, with no candidate code since the check before
        them: what the reference changes itself is its state from now on. A tensor it gave another storage, or
        whose storage it resized (a lazily grown buffer), is no longer watched."""
        for record in self.records:
            now = self.watched_bytes(record)
            if now is None:
                keep = [e for e in record["entries"] if self._same_storage(e)]
                record["entries"] = keep
                if not keep:
                    continue
                now = self.watched_bytes(record)
                record["mask"] = record["mask"][:now.numel()]
            record["kept"] = self.ops.xor(now, record["mask"])
        self.records = [r for r in self.records if r["entries"]]

    def _same(self, record: dict, now) -> list[bool]:
        """Per watched storage of ``record``: unchanged (the slow path, after a whole-record mismatch)."""
        if now is None:
            return [self._same_storage(e) for e in record["entries"]]
        same, at = [], 0
        for _, n, idx, _, _ in record["entries"]:
            k = n if idx is None else idx.numel()
            same.append(self.ops.equal(self.ops.xor(now[at:at + k], record["mask"][at:at + k]),
                                       record["kept"][at:at + k]))
            at += k
        return same


class DeviceSession:
    """State of the run mode: models, prepared timing inputs, the last timed candidate output."""

    def __init__(self, job: dict, chan: Channel):
        import torch

        from verifier import devices, timing
        _import_harness()   # every harness module is loaded before any candidate code (``run_device`` did already)
        self.torch = torch
        self.job, self.chan = job, chan
        self.backend = devices.get_backend(job["backend"])
        self.timer = timing.CapturedTimer(self.backend)   # before the candidate exists
        self.backend.ensure_available(0)
        self.device = self.backend.torch_device(0)
        if self.backend.name == "cpu":
            torch.set_num_threads(int(job["cpu_threads"]))
        torch.set_grad_enabled(False)
        self._precision = self.backend.reference_precision()
        self._precision.__enter__()                        # TF32 off for the reference timed here too
        self._warm_profiler()
        self._warm_digests()
        self.kernels = dispatch_tables(torch)                # before any task or candidate (StateGuard)
        self._full_check = False                           # the next integrity check compares every op's kernels
        self.task = None                                   # arrives with the "load" request
        self.client = ExtensionClient(chan, self.backend)
        self.client.install()
        self.triton_wrapped = self._wrap_launchers() if self.backend.is_gpu else False
        self._ablation: dict | None = None                 # counters of the current ablation trial
        self._protected: set[int] = set()                  # storages an ablation must never overwrite
        self.precision = job["precision"]
        self.held = None                         # (outputs, ablation restores) of a trial run with "hold"
        self._stash = None                       # (seed, output, report, restores) of a round's second judged call
        self.handed: list[int] = []              # sealed output memfds sent to the parent (closed at the next request)
        self.ref_model = self.new_model = self.compiled_ref = None
        self._ref_watch: ReferenceWatch | None = None   # the timed reference's tensors, veiled (built with it)
        self.args: dict[str, list] = {}
        self.outputs: dict[str, object] = {}   # every output of the current timing trial stays alive
        self.last_cand: list = []
        self.flusher = None
        self.counter = 0
        self._ops = TensorOps.capture(torch)    # C functions: a candidate cannot replace them (torch.Tensor's it can)
        self._tb, self._equal = self._ops.tb, self._ops.equal
        self._no_torch_function = torch._C.DisableTorchFunctionSubclass   # before the candidate could replace it
        self.harness = self.state = None        # armed right before the candidate is imported
        self.findings: list[dict] = []          # integrity findings so far (every reply carries them)
        self.own_namespaces: set[str] = set()   # op namespaces the candidate's extensions registered
        self._ns_before: set[str] = set()
        self._bg_base = 0.0
        self._threads_base = 0

    def _wrap_launchers(self) -> bool:
        """Route Triton kernel launches through the ablation hook (like calls into the candidate's extension)
        and count CUDA graph replays as native work the ablation cannot see into. Whether Triton's launcher
        could be wrapped: a candidate using an unwrapped Triton makes its ablation trial inconclusive."""
        client, torch = self.client, self.torch
        graph = getattr(getattr(torch, self.backend.name, None), "CUDAGraph", None) or \
            getattr(getattr(torch, self.backend.name, None), "MUSAGraph", None)
        if graph is not None and hasattr(graph, "replay"):
            real_replay = graph.replay

            def replay(g, *args, **kwargs):
                client.opaque_calls += 1
                return real_replay(g, *args, **kwargs)
            graph.replay = replay
        try:
            from triton.runtime.jit import JITFunction
        except Exception:   # no Triton here: a candidate cannot launch Triton kernels either
            return False
        real_run = JITFunction.run

        def run(jit, *args, **kwargs):
            if client.ablator is not None:
                return client.ablator(lambda *a, **k: real_run(jit, *a, **k), args, kwargs)
            return real_run(jit, *args, **kwargs)
        JITFunction.run = run
        return True

    def _ablated_call(self, fn, args: tuple, kwargs: dict):
        """One native call in an ablation trial: run it for real, then overwrite with random bytes everything
        it produced (returned tensors, and tensor arguments whose contents it changed), except the forward's
        inputs and the model's own tensors. Output that is still right afterwards came from elsewhere."""
        from verifier.correctness import flatten_outputs
        tb = self._tb
        tensors = [a for a in (*args, *kwargs.values()) if issubclass(type(a), tb)]
        self.timer.synchronize()
        before = self._fingerprints(tensors)
        out = fn(*args, **kwargs)
        self.timer.synchronize()
        self._ablation["calls"] += 1
        touched = [t for t, p in zip(tensors, before) if p is not None and not self._unchanged([t], [p])]
        try:
            leaves, _ = flatten_outputs(out)
        except (TypeError, ValueError):
            leaves = []
        returned = [x for x in leaves if issubclass(type(x), tb)]
        if returned and not touched and self._passes_through(fn, args, kwargs, tensors, returned):
            self._ablation["passthrough"] += 1
            return out   # it produced nothing: what it handed back is the forward's own work, left as it is
        for t in touched + returned:
            self._poison(t)
        return out

    def _passes_through(self, fn, args: tuple, kwargs: dict, tensors: list, returned: list) -> bool:
        """Whether a native call that changed none of its arguments returned only (views of) its floating-point
        arguments because it is the identity: ``finish(out)`` returning ``out``, so that overwriting what it
        returned would overwrite the real answer, computed elsewhere. Judged by calling it once more on
        random-byte copies of those arguments (NaNs, infinities, negatives): an honest in-place kernel that left
        this trial's data as it was (a relu on positive inputs) changes those copies or returns something else."""
        tb, torch = self._tb, self.torch
        storage = {tb.untyped_storage(t).data_ptr(): t for t in tensors if tb.is_floating_point(t)}
        if not all(tb.untyped_storage(x).data_ptr() in storage for x in returned):
            return False
        copies = {}
        for t in storage.values():
            c = tb.clone(t)
            raw = torch.empty(0, dtype=torch.uint8, device=self.device).set_(tb.untyped_storage(c))
            raw.random_(0, 256, generator=self._ablation["generator"])
            copies[id(t)] = (c, tb.clone(raw))
        swap = lambda a: copies[id(a)][0] if id(a) in copies else a   # noqa: E731
        self._ablation["probes"] += 1   # the profile hook sees this call too: it is no unwrapped native work
        again = fn(*[swap(a) for a in args], **{k: swap(v) for k, v in kwargs.items()})
        self.timer.synchronize()
        from verifier.correctness import flatten_outputs
        try:
            leaves, _ = flatten_outputs(again)
        except (TypeError, ValueError):
            return False
        mine = {tb.untyped_storage(c).data_ptr() for c, _ in copies.values()}
        unchanged = all(self._equal(torch.empty(0, dtype=torch.uint8, device=self.device).set_(
            tb.untyped_storage(c)), saved) for c, saved in copies.values())
        back = [x for x in leaves if issubclass(type(x), tb)]
        return unchanged and len(back) == len(returned) and all(tb.untyped_storage(x).data_ptr() in mine for x in back)

    def _poison(self, t) -> None:
        """Overwrite ``t``'s whole storage once. The forward's inputs are never touched; the model's own tensors
        (a persistent output buffer, state a kernel updates) are put back after the trial."""
        tb, torch = self._tb, self.torch
        storage = tb.untyped_storage(t)
        ptr = storage.data_ptr()
        if ptr in self._protected or ptr in self._ablation["done"] or not storage.nbytes():
            return
        self._ablation["done"].add(ptr)
        raw = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        if ptr in self._ablation["model"]:
            self._ablation["restore"].append((raw, raw.clone()))
        raw.random_(0, 256, generator=self._ablation["generator"])
        self._ablation["poisoned"] += 1

    def _model_tensors(self) -> set[int]:
        """Storages of the candidate model's parameters, buffers and tensor attributes. Read from the modules'
        instance dicts through ``nn.Module``'s own ``__dict__`` slot and ``dict``'s C methods, so that no code of the
        candidate's runs: this is read in ablation trials only, and an overridden ``state_dict``/``modules`` (or a
        state-dict hook) that ran here told the ablation trial apart (a decoy ran its kernel for real only there).
        Storages are read with ``__torch_function__`` off (``_no_torch_function``, captured before the candidate
        loaded): a tensor subclass's hook would run here, right before the ablated call (review of session 40).
        Tensors without a storage (sparse) are left out."""
        tb, found = self._tb, set()
        instance_dict = self.torch.nn.Module.__dict__["__dict__"].__get__
        stack, seen = [self.new_model], set()
        with self._no_torch_function():
            while stack:
                module = stack.pop()
                if id(module) in seen or not issubclass(type(module), self.torch.nn.Module):
                    continue
                seen.add(id(module))
                own = instance_dict(module)
                values = list(dict.values(own))
                for key in ("_parameters", "_buffers"):
                    if issubclass(type(dict.get(own, key)), dict):
                        values += dict.values(dict.get(own, key))
                for v in values:
                    if issubclass(type(v), tb):
                        try:
                            found.add(tb.untyped_storage(v).data_ptr())
                        except (RuntimeError, NotImplementedError):
                            pass
                if issubclass(type(dict.get(own, "_modules")), dict):
                    stack += dict.values(dict.get(own, "_modules"))
        return found

    # -- guards ---------------------------------------------------------------------------------
    def arm(self) -> None:
        """Snapshots taken after the task is loaded and before any candidate code runs."""
        import json as json_module
        import time

        import safetensors
        import safetensors.torch
        import torch.autograd.profiler as autograd_profiler
        import torch.autograd.profiler_util as profiler_util
        import torch.nn.functional
        from torch.nn.modules import module as nn_module

        from verifier import correctness, devices, fallback, inputs, timing
        torch = self.torch
        modules = [sys.modules.get("__main__"), sys.modules.get("verifier"), correctness, devices, fallback, inputs,
                   timing, safetensors, safetensors.torch, json_module, time, os, torch, torch.autograd,
                   autograd_profiler, profiler_util, sys.modules.get("torch.profiler"),
                   sys.modules.get("torch.profiler.profiler"), nn_module, torch.nn.functional,
                   sys.modules.get("builtins"), self.task]
        layers = [c for c in vars(torch.nn).values() if isinstance(c, type) and issubclass(c, torch.nn.Module)]
        classes = [torch.Tensor, torch.nn.Parameter, autograd_profiler.profile, autograd_profiler.record_function,
                   profiler_util.EventList, profiler_util.FunctionEvent, timing.CapturedTimer, timing.CacheFlusher,
                   DeviceSession, ExtensionClient, Channel, HarnessGuard, StateGuard] + layers + [
                   c for c in vars(self.task).values() if isinstance(c, type) and c.__module__ == self.task.__name__]
        self._guarded = (modules, classes)
        self.harness = HarnessGuard(modules, classes)
        self.state = StateGuard(torch, self.kernels)
        self._harness_changed, self._state_check = self.harness.changed, self.state.check_and_restore
        self._ns_before = _op_namespaces(torch)
        self._bg_base = self._bg_cpu_ms()
        self._threads_base = self._threads()
        settle_garbage()   # the harness's and torch's objects frozen: no collection scans them again

    def _rearm(self, bg_before: float) -> None:
        """After torch.compile imported dynamo (it wraps torch functions) or compiled (threads, global state):
        what changed since ``bg_before`` is the harness's doing, never the candidate's (it was checked first)."""
        self._bg_base += self._bg_cpu_ms() - bg_before
        self._threads_base = self._threads()
        self.state.expected = self.state._read()
        self.state.kernels = dispatch_tables(self.torch, list(self.state.kernels))
        self.harness = HarnessGuard(*self._guarded)
        self._harness_changed = self.harness.changed
        settle_garbage()   # what compiling made (dynamo's caches) frozen, as at arming

    def after_import(self) -> None:
        self.own_namespaces = _op_namespaces(self.torch) - self._ns_before
        self._full_check = True

    @staticmethod
    def _threads() -> int:
        try:
            return len(os.listdir("/proc/self/task"))
        except OSError:
            return 0

    @staticmethod
    def _bg_cpu_ms() -> float:
        """CPU time of every thread but this one (all harness work runs on the main thread)."""
        import time
        return (time.process_time() - time.thread_time()) * 1e3

    def integrity(self) -> list[dict]:
        """Record what the candidate replaced or changed (restoring global state); all findings so far. The
        checks run as the functions captured when the guards were armed (the classes may be patched since)."""
        patched = self._harness_changed() if self.harness else []
        if patched:
            self._finding("harness_patch", "replaced " + ", ".join(patched[:6]))
        full, self._full_check = self._full_check, False
        changed = self._state_check(full) if self.state else []
        if changed:
            self._finding("global_state", "changed " + ", ".join(changed[:6]))
        return self.findings

    def _finding(self, rule: str, message: str) -> None:
        if not any(f["rule"] == rule for f in self.findings):
            self.findings.append({"rule": rule, "message": message})

    def _common(self) -> dict:
        """Fields every reply after the candidate loaded carries. Other threads are accounted only where the
        harness itself runs on one thread (cpu with one intra-op thread: no pool threads that start lazily or
        spin between parallel regions)."""
        reply = {"violations": self.integrity()}
        if self.backend.name == "cpu" and int(self.job.get("cpu_threads", 1)) == 1:
            reply.update(background_cpu_ms=round(self._bg_cpu_ms() - self._bg_base, 3),
                         threads_started=self._threads() - self._threads_base)
        return reply

    def _warm_profiler(self) -> None:
        """Pay the profiler's one-time start-up (CUPTI/kineto initialisation: about a second on a GPU) before
        any candidate is known, so that a child started ahead of its candidate (a warm spare) has it done."""
        x = self.torch.ones(8, device=self.device)
        with self.backend.profiler():
            (x + 1).sum()
            self.timer.synchronize()

    def _warm_digests(self) -> None:
        """Build the output commitment's digest kernel (``verifier.digest_kernel``: one Triton build per entry
        size, a second or two each in the child's fresh Triton cache) before any candidate is known, as for the
        profiler: a full-size check commits after every timed batch, with the device held alone."""
        from verifier.correctness import warm_block_digests
        warm_block_digests(self.device)

    def load(self, task_path: str) -> None:
        from verifier.static_checks import TASK_MODULE_NAME
        self.task = _load_module(TASK_MODULE_NAME, task_path)

    # -- helpers --------------------------------------------------------------------------------
    def _save(self, out, sample: tuple[int, int] | None = None, device_out: dict | None = None) -> dict:
        """Hand ``out`` over in a sealed memfd. With ``sample`` (seed, k: sent by the parent after the call
        returned) a tensor that ``correctness.sample_index`` samples (more than max(k, 192) entries) travels as
        the entries it picks (its full shape in ``shapes``), gathered on its device: a few MB instead of
        gigabytes. With ``device_out`` (a buffer the parent exported) the handover goes there (``_hand_over``)."""
        from verifier.correctness import flatten_outputs, sample_index
        leaves, spec = flatten_outputs(out)
        tensors, values, types, shapes = {}, {}, [], {}
        tb = self._tb
        for i, leaf in enumerate(leaves):
            types.append(type(leaf).__name__)
            if issubclass(type(leaf), tb):
                t = tb.detach(leaf)
                device = tb.device.__get__(t)
                idx = sample_index(tb.numel(t), int(sample[1]), int(sample[0]) + i, device) if sample else None
                if idx is not None:
                    shapes[str(i)] = list(tb.size(t))
                    t = tb.index_select(tb.reshape(t, (-1,)), 0, tb.to(idx, device))
                tensors[f"out{i}"] = t
            elif leaf is None or type(leaf) in (bool, int, float):
                values[str(i)] = leaf
            else:
                values[str(i)] = f"<{type(leaf).__name__}>"   # never the candidate's __repr__
        reply = {"spec": spec, "types": types, "values": values, "n_outputs": len(leaves), "shapes": shapes}
        reply.update(self._hand_over("verifier-out", tensors, device_out, "device_layout", "fd"))
        return reply

    def _hand_over(self, name: str, tensors: dict, device_out: dict | None, layout_key: str, fd_key: str) -> dict:
        """``tensors`` copied into the device buffer the parent offered (``device_out``:
        ``verifier.device_handover``), their layout under ``layout_key``, where that works; else in a sealed
        memfd under ``fd_key``, with the reason the device handover did not work in ``device_error``."""
        from verifier import device_handover   # torch-importing modules load after isolation (module docstring)
        reply = {}
        if device_out is not None:
            try:
                return {layout_key: device_handover.write_outputs(device_out, tensors, self.device, self._tb)}
            except Exception as e:   # the memfd still works
                reply["device_error"] = f"{type(e).__name__}: {e}"[:300]
        reply[fd_key] = self._sealed(name, tensors)
        return reply

    def _sealed(self, name: str, tensors: dict) -> int:
        """``tensors`` in a sealed memfd, its descriptor kept until ``close_handed``: once the parent has read the
        reply naming it nobody, this process included, can change them (the parent opens it through
        /proc/<pid>/fd and checks the seals); it lives in memory."""
        self.counter += 1
        fd = os.memfd_create(f"{name}{self.counter}", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        _write_safetensors(fd, tensors)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, OUTPUT_SEALS)
        self.handed.append(fd)
        return fd

    def _commit(self, outputs: list, k: int, device_out: dict | None, ms: dict) -> dict:
        """Digests (``correctness.block_digests``, on the outputs' device) of every tensor of more than ``k``
        entries of each of ``outputs`` (one per call), handed over now, before the parent has drawn the seed that
        picks the entries to compare (see the commitments note in verifier/correctness.py): into the device
        buffer the parent offered (``device_out``) where that works, else in a sealed memfd (``_hand_over``). The
        digests' own time goes to ``ms["digests"]`` (the rest is their handover)."""
        from verifier.correctness import block_digests, committable, flatten_outputs

        def digest_all() -> dict:
            digests = {}
            for rep, out in enumerate(outputs):
                leaves, _ = flatten_outputs(out)
                for i, leaf in enumerate(leaves):
                    if type(leaf) is self.torch.Tensor and leaf.numel() > k and committable(leaf):
                        digests[f"d{rep}_{i}"] = block_digests(leaf)
            self.timer.synchronize()
            return digests
        digests = self._timed(ms, "digests", digest_all)
        return self._hand_over("verifier-commit", digests, device_out, "commit_layout", "commit_fd")

    def close_handed(self) -> None:
        """Drop this process's descriptors of outputs already sent (the parent holds its own by now)."""
        for fd in self.handed:
            os.close(fd)
        self.handed = []

    def _storage_range(self, t):
        s = self._tb.untyped_storage(t)
        return s.data_ptr(), s.data_ptr() + s.nbytes()

    def _bytesum(self, x, chunk: int = 64 << 20):
        """Two sums of a large tensor's 64-bit words, wrapping (32-bit words, or bytes, summed into int64 when
        its size is no multiple of eight or four): all of them, and every seventh; accumulated over slices of
        ``chunk`` words (a widening whole-tensor sum would materialise a copy of several times the input: tens
        of GB for KernelBench-sized inputs). A native int64 sum reads the data once at memory speed, where a
        widening byte sum costs seconds per trial on a CPU at those sizes; any change of one word changes the
        first sum."""
        torch = self.torch
        b = x.detach().contiguous().reshape(-1).view(torch.uint8)
        wide = b.numel() % 8 == 0
        if wide:
            b = b.view(torch.int64)
        elif b.numel() % 4 == 0:
            b = b.view(torch.int32)
        total = strided = 0
        for start in range(0, b.numel(), chunk):
            part = b[start:start + chunk]
            total += int(part.sum(dtype=torch.int64))
            offset = (-start) % 7  # keep the global stride-7 sample aligned across slices
            strided += int(part[offset::7].sum(dtype=torch.int64))
        if wide:   # int64 sums wrap: the same residue whatever the slicing
            total, strided = total % (1 << 64), strided % (1 << 64)
        return total, strided

    def _fingerprints(self, inputs):
        """Exact copies of small inputs, byte sums of large ones: to tell whether forward wrote to them."""
        torch = self.torch
        prints = []
        for x in inputs:
            if isinstance(x, torch.Tensor) and x.numel():
                prints.append(x.detach().clone() if x.nbytes <= (256 << 20) else self._bytesum(x))
            else:
                prints.append(None)
        return prints

    def _unchanged(self, inputs, prints) -> bool:
        torch = self.torch
        for x, p in zip(inputs, prints):
            if p is None:
                continue
            if isinstance(p, torch.Tensor):
                if not self._same_bits(x, p):
                    return False
            elif self._bytesum(x) != p:
                return False
        return True

    def _same_bits(self, x, saved) -> bool:
        """``x`` holds exactly the bytes of ``saved`` (its copy). Not ``torch.equal``: NaN is unequal to itself, so an
        input holding a NaN looked modified by every candidate, and the parent, seeing the reference "modify" it
        too, waived the input-mutation rule for the task (a candidate could then zero its inputs and pass)."""
        tb = self._tb

        def raw(t):
            t = tb.resolve_neg(tb.resolve_conj(tb.detach(t)))
            return tb.view(tb.reshape(tb.contiguous(t), (-1,)), self.torch.uint8)
        return tb.size(x) == tb.size(saved) and self._equal(raw(x), raw(saved))

    def _aliases(self, outputs, inputs) -> bool:
        torch = self.torch
        ranges = [self._storage_range(x) for x in inputs if isinstance(x, torch.Tensor) and x.numel()]
        for o in outputs:
            if type(o) is torch.Tensor and o.numel():
                lo, hi = self._storage_range(o)
                if any(lo < b_hi and b_lo < hi for b_lo, b_hi in ranges):
                    return True
        return False

    def _check_reference(self) -> None:
        """A ``reference_tampering`` finding when a watched tensor of the timed reference changed (`ReferenceWatch`)."""
        problem = self._ref_watch.check() if self._ref_watch is not None else None
        if problem:
            self._finding("reference_tampering", problem)

    def _rebaseline_reference(self) -> None:
        if self._ref_watch is not None:
            self._ref_watch.rebaseline()

    # -- requests ---------------------------------------------------------------------------------
    def construct(self, msg):
        from verifier import inputs
        from verifier.static_checks import CANDIDATE_MODULE_NAME
        cand = sys.modules[CANDIDATE_MODULE_NAME]
        seed = int(msg["seed"])
        init = inputs.make_init_inputs(self.task, seed, self.device)
        source = inputs.build_model(self.task.Model, init, seed, self.device, self.precision)
        self.new_model = inputs.build_model(cand.ModelNew, init, seed, self.device, self.precision)
        state = inputs.load_matching_state(self.new_model, source)
        # the candidate's load_state_dict (or a load hook) was handed that model's own tensors and may keep them, to
        # slow the reference timed here down (a value its time follows): the timed one is built afresh, out of reach
        # (from init inputs of its own: the candidate's __init__ was handed the others)
        del source, init
        self.ref_model = inputs.build_model(self.task.Model, inputs.make_init_inputs(self.task, seed, self.device),
                                            seed, self.device, self.precision)
        # ... but not out of reach of native code: the source's freed memory is reused for it, holding the very values
        # the candidate was handed (denormal weights written there made the timed reference ~5-100x slower)
        self._ref_watch = ReferenceWatch(self.ref_model, self.task, self._ops)
        return {"op": "constructed", "loaded_params": len(state["loaded"]), "unmatched": state["unmatched"][:20]}

    def trial(self, msg):
        """One correctness trial: the candidate's model called once, profiled and watched. With ``prepared`` (hidden
        trials among the timed calls) that call is the one at index ``at`` of the candidate's batch of a round the
        parent runs as a timed trial: ``prepare`` made every runner's inputs as for a timed trial (freeing the last
        one's), the runners drawn before the candidate's ran their batches through ``call``, and this one runs as
        ``call`` runs its batch (reference watch, flushes, a settled collector before each call, one depth), its
        outputs kept alive as a timed batch's. Its inputs lie where a timed batch's would, and so a forward that
        computes with PyTorch only where it guesses it is timed is profiled there too. ``also`` names a second judged
        call of the same batch (the round's ablation trial, at another secret index): its reply is kept for the
        ``stashed`` trial request that follows. Each judged call's output is copied before the batch's later calls
        run, and the batch ends with the last judged call (what would follow cannot change what they saw)."""
        from verifier import inputs
        self.integrity()
        if msg.get("stashed"):
            return self._stashed_trial(msg)
        self._stash = None
        now, ms = self.timer.now, {}
        t = now()
        in_batch = bool(msg.get("prepared")) and self.flusher is not None
        sets = self.args.get("cand", []) if in_batch else \
            [inputs.make_inputs(self.task, int(msg["seed"]), self.device, self.precision)]
        judged = [(int(msg.get("at", 0)) if in_batch else 0, int(msg["seed"]), bool(msg.get("ablate")))]
        also = msg.get("also") if in_batch else None
        if also is not None:
            judged.append((int(also["at"]), int(also["seed"]), bool(also.get("ablate"))))
        at_list = [at for at, _, _ in judged]
        if len(set(at_list)) != len(at_list) or not all(0 <= at < len(sets) for at in at_list) \
                or sum(ablate for _, _, ablate in judged) > 1:
            return {"op": "error", "phase": "harness", "error": {
                "type": "ValueError", "message": f"trial calls {at_list} (one ablated at most) in a batch of {len(sets)}"}}
        self.timer.synchronize()
        ms["trial_inputs"], t = (now() - t) * 1e3, now()
        calls = {at: _JudgedCall(self, seed, sets[at], ablate, ms) for at, seed, ablate in judged}
        for w in calls.values():
            # in a round, taken after the batch from the same seed's inputs made again: a copy made before it would be
            # one more input-sized block alive through the batch, where a timed batch has none
            w.prints = None if in_batch else self._fingerprints(w.args)
        ms["trial_fingerprints"], t = (now() - t) * 1e3, now()
        if in_batch:
            self._check_reference()   # as ``call`` does around a timed batch
        settle_garbage()   # as in a timed batch: all garbage collected before the call, none during it
        _gc_disable()
        try:
            if in_batch:
                batch_calls = [(lambda a=a: self.new_model(*a)) for a in sets[:max(calls) + 1]]

                def before_each():   # as in a timed batch (``call``)
                    settle_garbage()
                    inputs.reseed_unpredictably()
                batch = at_call_depth(lambda: self.timer.time_batch(
                    batch_calls, self.flusher, before_each,
                    watch={at: (w.start, w.stop_in_batch) for at, w in calls.items()}))
                self.outputs["cand"] = batch.outputs   # alive until the next ``prepare``, as a timed batch's are
                del batch, batch_calls
            else:
                (w,) = calls.values()
                inputs.reseed_unpredictably()
                w.start()
                w.out = at_call_depth(lambda: call_once(lambda: self.new_model(*w.args)))
        finally:
            try:
                for w in calls.values():
                    w.stop()   # once each: a call already stopped is left as it is
            finally:
                _gc_enable()
        if in_batch:
            self._check_reference()
        del sets
        ms["trial_forward"], t = (now() - t) * 1e3, now()
        replies = [(calls[at], self._judged_reply(calls[at], ms)) for at, _, _ in judged]
        ms["trial_profile"] = (now() - t) * 1e3
        if len(replies) > 1:
            w, (reply, restore) = replies[1]
            self._stash = (w.seed, w.out, reply, restore)
        w, (reply, restore) = replies[0]
        reply["harness_ms"] = ms
        return self._hand_over_trial(msg, w.out, reply, restore, ms)

    def _judged_reply(self, w: "_JudgedCall", ms: dict) -> tuple[dict, list]:
        """The report of a judged call (``trial``), and the ablation's restores still to run after its handover."""
        from verifier import fallback
        from verifier.correctness import flatten_outputs
        torch, seen = self.torch, w.seen
        events = seen["prof"].function_events
        ops, custom = fallback.outermost_ops(events, _op_namespaces(torch) - self.own_namespaces)
        leaves, _ = flatten_outputs(w.out)
        tensors = [x for x in leaves if issubclass(type(x), self._tb)]
        if "aliases_input" not in seen:
            seen["aliases_input"] = self._aliases(leaves, w.args)
            seen["inputs_modified"] = self._timed(ms, "trial_fingerprints",
                                                  lambda: not self._unchanged(w.args, w.prints))
        calls_made = seen["calls_after"] - seen["calls"]
        reply = {"op": "trial_done",
                 "subclass_outputs": [type(x).__name__ for x in tensors if type(x) is not torch.Tensor],
                 "devices": [self._tb.device.__get__(x).type for x in tensors],
                 "aliases_input": seen["aliases_input"],
                 "inputs_modified": seen["inputs_modified"],
                 "aten_ops": dict(ops),
                 "native_calls": calls_made + w.hits[0] + sum(custom.values()),
                 "device_kernels": dict(fallback.device_kernel_names(events, self.backend.device_event_types())),
                 "timer_patched": self.timer.patched(self.backend)}
        restore: list = []
        if w.ablate and self._ablation is not None:
            # native work outside the wrapped entry points: pybind methods of the candidate's classes, its
            # TORCH_LIBRARY ops, CUDA graph replays, Triton when its launcher could not be wrapped
            wrapped = calls_made   # each also shows up once among the hits
            opaque = max(0, w.hits[0] - wrapped - self._ablation["probes"]) + sum(custom.values()) + \
                seen["opaque_after"] - seen["opaque"]
            if "triton" in sys.modules and self.backend.is_gpu and not self.triton_wrapped:
                opaque += 1
            reply["ablation"] = {"calls": self._ablation["calls"], "poisoned": self._ablation["poisoned"],
                                 "passthrough": self._ablation["passthrough"], "opaque": opaque}
            restore, self._ablation, self._protected = self._ablation["restore"], None, set()
        return reply, restore

    def _hand_over_trial(self, msg, out, reply: dict, restore: list, ms: dict) -> dict:
        """A judged call's output to the parent: held for ``collect`` (with ``hold``) or saved whole now."""
        if msg.get("hold"):   # the parent asks for a sample of the output next ("collect"), picked only now
            self.held = (out, restore)
            if msg.get("commit_k"):
                reply.update(self._timed(ms, "trial_commit", lambda: self._commit([out], int(msg["commit_k"]),
                                                                                  msg.get("commit_out"), ms)))
        else:
            reply.update(self._timed(ms, "trial_save", lambda: self._save(out, device_out=msg.get("device_out"))))
            self._restore(restore)
        reply.update(self._common())
        return reply

    def _stashed_trial(self, msg):
        """The second judged call of the last round (``trial`` with ``also``), handed over as ``msg`` asks."""
        if self._stash is None or self._stash[0] != int(msg["seed"]):
            return {"op": "error", "phase": "harness", "error": {"type": "RuntimeError",
                                                                 "message": "no judged call kept for that seed"}}
        (_, out, reply, restore), self._stash = self._stash, None
        ms: dict = {}
        reply["harness_ms"] = ms
        return self._hand_over_trial(msg, out, reply, restore, ms)

    def _copied(self, value, depth: int = 0):
        """``value`` with each plain tensor in it cloned, containers walked with the base types' own methods (as
        ``flatten_outputs`` walks them: no code of the candidate's runs); anything else, a tensor subclass
        included, as it is (judged as returned)."""
        from verifier.correctness import MAX_OUTPUT_DEPTH
        kind = type(value)
        if kind is self.torch.Tensor:
            return self._tb.clone(value)
        if depth > MAX_OUTPUT_DEPTH:
            return value
        if issubclass(kind, list):
            return [self._copied(v, depth + 1) for v in list.__iter__(value)]
        if issubclass(kind, tuple):
            return tuple(self._copied(v, depth + 1) for v in tuple.__iter__(value))
        if issubclass(kind, dict):
            return {k: self._copied(dict.__getitem__(value, k), depth + 1) for k in list(dict.keys(value))}
        return value

    @staticmethod
    def _restore(restore) -> None:
        for raw, saved in restore:   # after the outputs are saved: a returned model buffer is judged poisoned
            raw.copy_(saved)

    def collect(self, msg):
        """The sampled outputs of the trial just run (``trial`` with ``hold``), at the parent's sample seed."""
        if self.held is None:
            return {"op": "error", "phase": "harness", "error": {"type": "RuntimeError",
                                                                 "message": "no trial output to collect"}}
        (out, restore), self.held = self.held, None
        ms = {}
        reply = self._timed(ms, "trial_save", lambda: self._save(out, (int(msg["sample_seed"]), int(msg["sample_k"])),
                                                                  device_out=msg.get("device_out")))
        del out
        self._restore(restore)
        reply.update(op="collected", harness_ms=ms, **self._common())
        return reply

    def warmup(self, msg):
        """Warm every runner up; report a rough per-call time and the bytes of one input set and of each
        runner's output, from which the parent sizes the timed batches."""
        from verifier import inputs, timing
        if self.flusher is None:
            nbytes = timing.flush_bytes(self.backend, _Cfg(self.job), 0)
            self.flusher = timing.CacheFlusher(self.device, nbytes)
        self._full_check = True   # every op's kernels once more before timing; from now on the reference's ops
        if msg.get("compile_ref") and self.compiled_ref is None:
            self.integrity()
            bg = self._bg_cpu_ms()
            self.compiled_ref = self.torch.compile(self.ref_model)
            self._rearm(bg)
        est_ms, output_bytes, input_bytes, enqueue_ms = {}, {}, 0, 0.0
        for runner in msg["runners"]:
            model = self._model(runner)
            self.integrity()
            self._check_reference()   # untouched since the record was taken (the correctness trials ran the candidate)
            if runner == "ref" and self.state is not None:
                args = inputs.make_inputs(self.task, int(msg["seed"]), self.device, self.precision)
                with self.backend.profiler() as prof:
                    model(*args)
                    self.timer.synchronize()
                del args   # one input set at a time: a full-size task's inputs are gigabytes
                # the reference's ops, and those its watch compares with (`_check_reference`)
                self.state.watch({e.name for e in prof.function_events} | REFERENCE_CHECK_OPS)
            if runner == "ref_compile":   # compiling may legitimately touch global state and start threads
                bg = self._bg_cpu_ms()
            times, enqueues = [], []
            for _ in range(max(int(msg["n"]), 1)):
                args = inputs.make_inputs(self.task, int(msg["seed"]), self.device, self.precision)
                input_bytes = self._nbytes(args)
                settle_garbage()
                _gc_disable()
                try:
                    inputs.reseed_unpredictably()
                    out, ms, _ = at_call_depth(lambda: self.timer.time_call(lambda: model(*args)))
                finally:
                    _gc_enable()
                enqueues.append(self.timer.last_enqueue_ms)
                times.append(ms)
                output_bytes[runner] = self._nbytes(out)
                del out
            if runner != "cand":
                self._rebaseline_reference()
            est_ms[runner] = min(times)
            # the median call's dispatch (the first call's lazy set-up would size every spin to the cap)
            enqueue_ms = max(enqueue_ms, statistics.median(enqueues))
            if runner == "ref_compile":
                self._rearm(bg)
        if msg.get("hide_dispatch") and self.backend.name == "cuda":
            props = self.torch.cuda.get_device_properties(self.device)
            self.flusher.hide_cycles = timing.hide_cycles(enqueue_ms, float(getattr(props, "clock_rate", 0) or 2e6))
            self.flusher._spin = self.timer.spin
        flush_ms = min(self.timer.time_call(self.flusher.flush)[1] for _ in range(3))
        return {"op": "warmed", "flush_bytes": self.flusher.nbytes, "est_ms": est_ms, "input_bytes": input_bytes,
                "output_bytes": output_bytes, "flush_ms": flush_ms, "enqueue_ms": enqueue_ms,
                "hide_cycles": self.flusher.hide_cycles, **self._common()}

    def _timed(self, ms: dict, key: str, fn):
        """``fn()``, its milliseconds added to ``ms[key]`` (the harness's own timing, reported to the parent)."""
        t = self.timer.now()
        try:
            return fn()
        finally:
            ms[key] = ms.get(key, 0.0) + (self.timer.now() - t) * 1e3

    def _nbytes(self, value) -> int:
        from verifier.correctness import flatten_outputs
        leaves, _ = flatten_outputs(value)
        return sum(self._tb.nbytes.__get__(x) for x in leaves if issubclass(type(x), self._tb))

    def _model(self, runner):
        return {"ref": self.ref_model, "cand": self.new_model, "ref_compile": self.compiled_ref}[runner]

    def prepare(self, msg):
        """Fresh inputs for every call of the coming timed batches, from one seed per call and runner: no
        runner sees another's writes, nor inputs it has already seen (no caching by pointer), and no
        reference output in this process ever answers the candidate's inputs (no replay from memory)."""
        from verifier import inputs
        self.args = {r: [] for r in msg["runners"]}
        self.outputs = {}
        self.last_cand = []
        self._stash = None
        t = self.timer.now()
        # made in a random order, each after a gap of random size (``SPACER_BYTES``)
        slots = [(r, k) for r in msg["runners"] for k in range(len(msg["seeds"][r]))]
        secrets.SystemRandom().shuffle(slots)
        made: dict[tuple[str, int], Any] = {}
        spacers, room = [], 0
        for runner, k in slots:
            if room:
                spacers.append(self.torch.empty(secrets.randbelow(room), dtype=self.torch.uint8, device=self.device))
            made[runner, k] = inputs.make_inputs(self.task, int(msg["seeds"][runner][k]), self.device, self.precision)
            room = room or max(4096, min(self._nbytes(made[runner, k]), SPACER_BYTES // max(len(slots), 1)))
        del spacers
        for runner in msg["runners"]:
            self.args[runner] = [made[runner, k] for k in range(len(msg["seeds"][runner]))]
        del made
        self.timer.synchronize()
        return {"op": "prepared", "harness_ms": {"timing_inputs": (self.timer.now() - t) * 1e3}}

    def call(self, msg):
        from verifier import inputs
        runner = msg["runner"]
        model = self._model(runner)
        calls = [(lambda a=a: model(*a)) for a in self.args[runner]]
        self.integrity()   # restores global state the candidate changed: the reference runs as it should
        self._check_reference()   # ... and its weights (through ops the integrity check just saw unreplaced)

        def before_each():   # in each call's flush interval, as before a trial's call
            settle_garbage()
            inputs.reseed_unpredictably()
        settle_garbage()   # the other runner's garbage (its finalizers) now, outside this batch's span and flushes
        _gc_disable()
        try:
            batch = at_call_depth(lambda: self.timer.time_batch(calls, self.flusher, before_each))
        finally:
            _gc_enable()
        # one pass of the watch after either runner's batch too (the same cost in both walls): after the candidate's
        # a check, after the reference's the record taken again (what it changed itself is no finding)
        if runner == "cand":
            self._check_reference()
        else:
            self._rebaseline_reference()
        from verifier.correctness import flatten_outputs
        plain, shared, seen = True, False, set()
        tb = self._tb
        for out in batch.outputs:
            leaves, _ = flatten_outputs(out)
            tensors = [x for x in leaves if issubclass(type(x), tb)]
            plain &= all(type(x) is self.torch.Tensor for x in tensors)
            ptrs = {tb.untyped_storage(x).data_ptr() for x in tensors if plain and x.numel()}
            shared |= not seen.isdisjoint(ptrs)
            seen |= ptrs
        # every output of the trial stays alive until the next one: a call must never be handed a block that
        # holds a just-freed right answer (the reference's, or its own from the previous call)
        self.outputs[runner] = batch.outputs
        if runner == "cand":
            self.last_cand = batch.outputs
        return {"op": "called", "span_ms": batch.span_ms, "rep_ms": batch.rep_ms, "flush_ms": batch.flush_ms,
                "spin_ms": batch.spin_ms, "plain_tensors": plain, "outputs_shared": shared, **self._common()}

    def commit(self, msg):
        """Commit to the outputs of the candidate's last timed batch (asked right after it, for every batch, before
        any audit's seed exists; a message of its own so that the call's round trip stays the call's)."""
        if not self.last_cand:
            return {"op": "error", "phase": "harness", "error": {"type": "RuntimeError",
                                                                 "message": "no timed output to commit to"}}
        ms = {}
        reply = self._timed(ms, "commit", lambda: self._commit(self.last_cand, int(msg["commit_k"]),
                                                                msg.get("commit_out"), ms))
        reply.update(op="committed", harness_ms=ms, **self._common())
        return reply

    def audit(self, msg):
        if not self.last_cand:
            return {"op": "error", "phase": "harness", "error": {"type": "RuntimeError",
                                                                 "message": "no timed output to audit"}}
        ms = {}
        sample = (int(msg["sample_seed"]), int(msg["sample_k"])) if msg.get("sample_k") else None
        out = self.last_cand[int(msg.get("rep", 0)) % len(self.last_cand)]
        reply = self._timed(ms, "audit_save", lambda: self._save(out, sample, device_out=msg.get("device_out")))
        reply["op"] = "audited"
        reply["harness_ms"] = ms
        reply.update(self._common())
        return reply


class _Cfg:
    """The few config values timing.flush_bytes reads, from the job."""

    def __init__(self, job):
        self.cpu_flush_bytes = int(job["cpu_flush_bytes"])


def _import_harness() -> None:
    """Every module the run mode needs, torch first: seconds of CPU on a busy host, and nothing of the device
    (no context, no allocation), so done before the parent grants the device (``device``, see ``run_device``)."""
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401

    from verifier import correctness, devices, fallback, inputs, timing  # noqa: F401


def _recv_before_load(job: dict, chan: Channel) -> dict:
    """The parent's next message while no candidate is known (a warm spare waits here, for seconds or minutes)."""
    try:
        return chan.recv()
    except SystemExit:   # the worker that started this spare is gone: leave nothing in its directory
        import shutil      # (the directory itself may not be removable from inside the sandbox)
        shutil.rmtree(os.path.dirname(job["candidate_path"]), ignore_errors=True)
        raise


def run_device(job: dict, chan: Channel) -> None:
    # Start-up in two steps. The imports need only the CPU; the device context, the profiler's start and the
    # digest kernels need the device, which the parent grants (``device``) once it holds the device's shared lock
    # for us (``verifier.device_lock``): a warm spare's imports then overlap another worker's timing, and the lock
    # is held only for what touches the device.
    try:
        _import_harness()
    except BaseException as e:  # no candidate code has run yet: a harness problem
        chan.send({"op": "error", "phase": "harness", "error": _describe(e)})
        return
    chan.send({"op": "imported", "at": time.monotonic()})   # when, for the parent's start-up breakdown
    msg = _recv_before_load(job, chan)
    if msg.get("op") != "device":
        if msg.get("op") == "exit":
            chan.send({"op": "bye"})
        return
    try:
        session = DeviceSession(job, chan)
    except BaseException as e:  # no candidate code has run yet: a harness/device problem
        chan.send({"op": "error", "phase": "harness", "error": _describe(e)})
        return
    info = session.backend.info(0)
    chan.send({"op": "ready", "device": info, "torch": session.torch.__version__})
    # A run child may be started before its candidate exists (a warm spare): the task and candidate files
    # are written into the working directory only now, and the parent says so with "load".
    msg = _recv_before_load(job, chan)
    if msg.get("op") != "load":
        if msg.get("op") == "exit":
            chan.send({"op": "bye"})
        return
    # The reply to "load" comes before any candidate code runs, so it is the one message after "ready"
    # that the parent may read as a harness (infra) problem.
    try:
        session.load(job["task_path"])
    except BaseException as e:  # the parent's own task file: a harness problem, not the candidate's
        chan.send({"op": "task_error", "error": _describe(e)})
        return
    from verifier.static_checks import CANDIDATE_MODULE_NAME
    try:
        session.arm()
    except BaseException as e:  # still no candidate code: the harness's problem
        chan.send({"op": "task_error", "error": _describe(e)})
        return
    # a cpu run child needs no process of its own from here on: a candidate's forked helper (memory shared through
    # shmat) would compute outside every timed span and every CPU-time account of this process
    from verifier import syscall_filter
    processes = syscall_filter.install_no_processes() if job.get("no_processes") else \
        {"applied": False, "reason": "not requested"}
    chan.send({"op": "task_loaded", "process_filter": processes})
    try:
        module = _load_module(CANDIDATE_MODULE_NAME, job["candidate_path"])
        if not hasattr(module, "ModelNew"):
            raise AttributeError("the candidate module defines no ModelNew")
        session.after_import()
    except ExtensionBuildFailed as e:
        chan.send({"op": "error", "phase": "compile", "log": str(e)})
        return
    except BaseException as e:
        chan.send({"op": "error", "phase": "import", "error": _describe(e)})
        return
    chan.send({"op": "loaded", "timer_patched": session.timer.patched(session.backend), **session._common()})
    handlers = {"construct": session.construct, "trial": session.trial, "warmup": session.warmup,
                "prepare": session.prepare, "call": session.call, "audit": session.audit,
                "collect": session.collect, "commit": session.commit}
    while True:
        msg = chan.recv()
        op = msg.get("op")
        if op == "exit":
            chan.send({"op": "bye"})
            return
        session.close_handed()
        handler = handlers.get(op)
        if handler is None:
            chan.send({"op": "error", "phase": "harness", "error": {"type": "ValueError",
                                                                    "message": f"unknown request {op!r}"}})
            return
        try:
            reply = handler(msg)
        except ExtensionBuildFailed as e:
            chan.send({"op": "error", "phase": "compile", "log": str(e)})
            return
        except BaseException as e:
            chan.send({"op": "error", "phase": op, "error": _describe(e)})
            return
        chan.send(reply)


def main() -> None:
    job_path, fd = sys.argv[1], int(sys.argv[2])
    with open(job_path) as f:
        job = json.load(f)
    chan = Channel(fd)
    from verifier import sandbox
    report = sandbox.apply_isolation(job["isolation"])
    chan.send({"op": "hello", "isolation": report, "pid": os.getpid()})
    mode = job["mode"]
    if mode == "compile":
        run_compile(job, chan)
    elif mode == "pch":
        run_pch(job, chan)
    elif mode == "build":
        run_build(job, chan)
    elif mode == "run":
        run_device(job, chan)
    elif mode == "probe":  # used by tests: run a snippet after isolation (no torch)
        exec(compile(job["code"], "<probe>", "exec"), {"chan": chan})  # noqa: S102 - test hook, trusted
    else:
        chan.send({"op": "error", "phase": "harness", "error": {"type": "ValueError", "message": f"mode {mode!r}"}})


if __name__ == "__main__":
    try:
        main()
    finally:
        # exit now: no atexit handlers, profiler/driver teardown or candidate finalizers between us and the
        # parent's wait (they cost seconds and can hang)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(0)
