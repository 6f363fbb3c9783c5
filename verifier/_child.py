"""Code that runs inside the sandboxed child process (``python -I -B verifier/_child.py JOB.json FD``).

Nothing this process reports is trusted for the verdict. The child confines itself first (sandbox.py),
then, depending on ``job["mode"]``:

- ``compile``: build one extension from ``load_inline`` arguments (no candidate Python runs here);
- ``build``:   import the candidate module so every ``load_inline`` it makes is built (through the parent);
- ``run``:     the device stage. Load the task, capture the timer, import the candidate, then answer the
               parent's requests: construct both models under the parent's seed, run correctness trials
               (inputs from secret seeds the parent sends only now; outputs written as safetensors, never
               pickle), time reference and candidate call by call, and save audited timed outputs.

``load_inline`` calls of the candidate are routed to the parent (``ext_request``), which compiles them in a
separate ``compile`` child or serves them from the build cache; the child only imports the finished .so.
"""
from __future__ import annotations

import json
import os
import sys
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

_write = os.write  # captured before any candidate code exists
_ERR_TAIL = 4000


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
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"type": type(exc).__name__, "message": str(exc)[-_ERR_TAIL:], "traceback": tb[-_ERR_TAIL:]}


def _load_module(name: str, path: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
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


class ExtensionClient:
    """Replaces the backend's load_inline functions so builds go through the parent's build service."""

    def __init__(self, chan: Channel, backend):
        self.chan = chan
        self.backend = backend
        self.built: list[str] = []

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

    @staticmethod
    def _import(path: str, module_name: str, is_python_module: bool):
        if not is_python_module:
            import torch
            torch.ops.load_library(path)
            return path
        import importlib.util
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
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


def run_build(job: dict, chan: Channel) -> None:
    import torch  # noqa: F401  (import time is not the candidate's)

    from verifier.devices import get_backend
    from verifier.static_checks import CANDIDATE_MODULE_NAME
    client = ExtensionClient(chan, get_backend(job["backend"]))
    client.install()
    chan.send({"op": "ready"})
    try:
        module = _load_module(CANDIDATE_MODULE_NAME, job["candidate_path"])
    except ExtensionBuildFailed as e:
        chan.send({"op": "build_failed", "log": str(e)})
        return
    except BaseException as e:
        chan.send({"op": "import_error", "error": _describe(e), "extensions": client.built})
        return
    chan.send({"op": "imported", "extensions": client.built, "has_model_new": hasattr(module, "ModelNew")})


class DeviceSession:
    """State of the run mode: models, prepared timing inputs, the last timed candidate output."""

    def __init__(self, job: dict, chan: Channel):
        import torch
        import safetensors.torch  # noqa: F401  every harness module is loaded before any candidate code

        from verifier import correctness, devices, fallback, inputs, timing  # noqa: F401
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
        self.task = None                                   # arrives with the "load" request
        self.client = ExtensionClient(chan, self.backend)
        self.client.install()
        self.precision = job["precision"]
        self.out_dir = os.path.join(os.getcwd(), "outputs")
        os.makedirs(self.out_dir, exist_ok=True)
        self.ref_model = self.new_model = self.compiled_ref = None
        self.args: dict[str, list] = {}
        self.outputs: dict[str, object] = {}   # every output of the current timing trial stays alive
        self.last_cand: list = []
        self.flusher = None
        self.counter = 0

    def _warm_profiler(self) -> None:
        """Pay the profiler's one-time start-up (CUPTI/kineto initialisation: about a second on a GPU) before
        any candidate is known, so that a child started ahead of its candidate (a warm spare) has it done."""
        x = self.torch.ones(8, device=self.device)
        with self.backend.profiler():
            (x + 1).sum()
            self.timer.synchronize()

    def load(self, task_path: str) -> None:
        from verifier.static_checks import TASK_MODULE_NAME
        self.task = _load_module(TASK_MODULE_NAME, task_path)

    # -- helpers --------------------------------------------------------------------------------
    def _save(self, out) -> dict:
        from safetensors.torch import save_file

        from verifier.correctness import flatten_outputs
        torch = self.torch
        leaves, spec = flatten_outputs(out)
        tensors, values, types = {}, {}, []
        for i, leaf in enumerate(leaves):
            types.append(type(leaf).__name__)
            if isinstance(leaf, torch.Tensor):
                t = leaf.detach()
                tensors[f"out{i}"] = torch.Tensor.to(t, "cpu", copy=True).contiguous()
            elif leaf is None or isinstance(leaf, (bool, int, float)):
                values[str(i)] = leaf
            else:
                values[str(i)] = repr(leaf)[:200]
        self.counter += 1
        path = os.path.join(self.out_dir, f"out{self.counter}.safetensors")
        save_file(tensors, path)
        return {"file": path, "spec": spec, "types": types, "values": values, "n_outputs": len(leaves)}

    @staticmethod
    def _storage_range(t):
        s = t.untyped_storage()
        return s.data_ptr(), s.data_ptr() + s.nbytes()

    def _bytesum(self, x, chunk: int = 64 << 20):
        """Two byte sums of a large tensor, accumulated over slices: a whole-tensor int64 sum would
        materialise an 8x copy (tens of GB for KernelBench-sized inputs)."""
        torch = self.torch
        b = x.detach().contiguous().reshape(-1).view(torch.uint8)
        total = strided = 0
        for start in range(0, b.numel(), chunk):
            part = b[start:start + chunk]
            total += int(part.sum(dtype=torch.int64))
            offset = (-start) % 7  # keep the global stride-7 sample aligned across slices
            strided += int(part[offset::7].sum(dtype=torch.int64))
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
                if not torch.equal(x.detach(), p):
                    return False
            elif self._bytesum(x) != p:
                return False
        return True

    def _aliases(self, outputs, inputs) -> bool:
        torch = self.torch
        ranges = [self._storage_range(x) for x in inputs if isinstance(x, torch.Tensor) and x.numel()]
        for o in outputs:
            if isinstance(o, torch.Tensor) and o.numel():
                lo, hi = self._storage_range(o)
                if any(lo < b_hi and b_lo < hi for b_lo, b_hi in ranges):
                    return True
        return False

    # -- requests ---------------------------------------------------------------------------------
    def construct(self, msg):
        from verifier import inputs
        from verifier.static_checks import CANDIDATE_MODULE_NAME
        cand = sys.modules[CANDIDATE_MODULE_NAME]
        seed = int(msg["seed"])
        init = inputs.make_init_inputs(self.task, seed, self.device)
        self.ref_model = inputs.build_model(self.task.Model, init, seed, self.device, self.precision)
        self.new_model = inputs.build_model(cand.ModelNew, init, seed, self.device, self.precision)
        state = inputs.load_matching_state(self.new_model, self.ref_model)
        return {"op": "constructed", "loaded_params": len(state["loaded"]), "unmatched": state["unmatched"][:20]}

    def trial(self, msg):
        from verifier import fallback, inputs
        from verifier.correctness import flatten_outputs
        torch = self.torch
        args = inputs.make_inputs(self.task, int(msg["seed"]), self.device, self.precision)
        prints = self._fingerprints(args)
        with self.backend.profiler() as prof:
            out = self.new_model(*args)
            self.timer.synchronize()
        events = prof.function_events
        leaves, _ = flatten_outputs(out)
        reply = {"op": "trial_done",
                 "subclass_outputs": [type(x).__name__ for x in leaves
                                      if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor],
                 "devices": [x.device.type for x in leaves if isinstance(x, torch.Tensor)],
                 "aliases_input": self._aliases(leaves, args),
                 "inputs_modified": not self._unchanged(args, prints),
                 "aten_ops": dict(fallback.outermost_aten_ops(events)),
                 "device_kernels": dict(fallback.device_kernel_names(events, self.backend.device_event_types())),
                 "timer_patched": self.timer.patched(self.backend)}
        reply.update(self._save(out))
        return reply

    def warmup(self, msg):
        """Warm every runner up; report a rough per-call time and the bytes of one input set and of each
        runner's output, from which the parent sizes the timed batches."""
        from verifier import inputs, timing
        if self.flusher is None:
            nbytes = timing.flush_bytes(self.backend, _Cfg(self.job), 0)
            self.flusher = timing.CacheFlusher(self.device, nbytes)
        if msg.get("compile_ref") and self.compiled_ref is None:
            self.compiled_ref = self.torch.compile(self.ref_model)
        est_ms, output_bytes, input_bytes = {}, {}, 0
        for runner in msg["runners"]:
            model = self._model(runner)
            times = []
            for _ in range(max(int(msg["n"]), 1)):
                args = inputs.make_inputs(self.task, int(msg["seed"]), self.device, self.precision)
                input_bytes = self._nbytes(args)
                out, ms, _ = self.timer.time_call(lambda: model(*args))
                times.append(ms)
                output_bytes[runner] = self._nbytes(out)
                del out
            est_ms[runner] = min(times)
        flush_ms = min(self.timer.time_call(self.flusher.flush)[1] for _ in range(3))
        return {"op": "warmed", "flush_bytes": self.flusher.nbytes, "est_ms": est_ms, "input_bytes": input_bytes,
                "output_bytes": output_bytes, "flush_ms": flush_ms}

    def _nbytes(self, value) -> int:
        from verifier.correctness import flatten_outputs
        leaves, _ = flatten_outputs(value)
        return sum(x.nbytes for x in leaves if isinstance(x, self.torch.Tensor))

    def _model(self, runner):
        return {"ref": self.ref_model, "cand": self.new_model, "ref_compile": self.compiled_ref}[runner]

    def prepare(self, msg):
        """Fresh inputs for every call of the coming timed batches (one seed per call), cloned per runner so
        that no runner sees another's writes, nor inputs it has already seen (no caching by pointer)."""
        from verifier import inputs
        self.args = {r: [] for r in msg["runners"]}
        self.outputs = {}
        self.last_cand = []
        for seed in msg["seeds"]:
            base = inputs.make_inputs(self.task, int(seed), self.device, self.precision)
            for runner in msg["runners"]:
                self.args[runner].append([x.clone() if isinstance(x, self.torch.Tensor) else x for x in base])
            del base
        self.timer.synchronize()
        return {"op": "prepared"}

    def call(self, msg):
        import gc
        runner = msg["runner"]
        model = self._model(runner)
        calls = [(lambda a=a: model(*a)) for a in self.args[runner]]
        gc.disable()
        try:
            batch = self.timer.time_batch(calls, self.flusher.flush)
        finally:
            gc.enable()
        from verifier.correctness import flatten_outputs
        plain, shared, seen = True, False, set()
        for out in batch.outputs:
            leaves, _ = flatten_outputs(out)
            tensors = [x for x in leaves if isinstance(x, self.torch.Tensor)]
            plain &= all(type(x) is self.torch.Tensor for x in tensors)
            ptrs = {x.untyped_storage().data_ptr() for x in tensors if x.numel()}
            shared |= not seen.isdisjoint(ptrs)
            seen |= ptrs
        # every output of the trial stays alive until the next one: a call must never be handed a block that
        # holds a just-freed right answer (the reference's, or its own from the previous call)
        self.outputs[runner] = batch.outputs
        if runner == "cand":
            self.last_cand = batch.outputs
        return {"op": "called", "span_ms": batch.span_ms, "rep_ms": batch.rep_ms, "flush_ms": batch.flush_ms,
                "plain_tensors": plain, "outputs_shared": shared}

    def audit(self, msg):
        if not self.last_cand:
            return {"op": "error", "phase": "harness", "error": {"type": "RuntimeError",
                                                                 "message": "no timed output to audit"}}
        reply = self._save(self.last_cand[int(msg.get("rep", 0)) % len(self.last_cand)])
        reply["op"] = "audited"
        return reply


class _Cfg:
    """The few config values timing.flush_bytes reads, from the job."""

    def __init__(self, job):
        self.cpu_flush_bytes = int(job["cpu_flush_bytes"])


def run_device(job: dict, chan: Channel) -> None:
    try:
        session = DeviceSession(job, chan)
    except BaseException as e:  # no candidate code has run yet: a harness/device problem
        chan.send({"op": "error", "phase": "harness", "error": _describe(e)})
        return
    info = session.backend.info(0)
    chan.send({"op": "ready", "device": info, "torch": session.torch.__version__})
    # A run child may be started before its candidate exists (a warm spare): the task and candidate files
    # are written into the working directory only now, and the parent says so with "load".
    try:
        msg = chan.recv()
    except SystemExit:   # the worker that started this spare is gone: leave nothing in its directory
        import shutil      # (the directory itself may not be removable from inside the sandbox)
        shutil.rmtree(os.path.dirname(job["candidate_path"]), ignore_errors=True)
        raise
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
    chan.send({"op": "task_loaded"})
    from verifier.static_checks import CANDIDATE_MODULE_NAME
    try:
        module = _load_module(CANDIDATE_MODULE_NAME, job["candidate_path"])
        if not hasattr(module, "ModelNew"):
            raise AttributeError("the candidate module defines no ModelNew")
    except ExtensionBuildFailed as e:
        chan.send({"op": "error", "phase": "compile", "log": str(e)})
        return
    except BaseException as e:
        chan.send({"op": "error", "phase": "import", "error": _describe(e)})
        return
    chan.send({"op": "loaded", "timer_patched": session.timer.patched(session.backend)})
    handlers = {"construct": session.construct, "trial": session.trial, "warmup": session.warmup,
                "prepare": session.prepare, "call": session.call, "audit": session.audit}
    while True:
        msg = chan.recv()
        op = msg.get("op")
        if op == "exit":
            chan.send({"op": "bye"})
            return
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
