"""One candidate end to end: extraction -> static checks -> build -> device stage -> verdict.

The parent (this module) is the only place a verdict is made. It loads the task (trusted), computes the
reference outputs itself on the same device, keeps the secret seeds, and compares. The sandboxed child
learns each trial seed only after the candidate is loaded and constructed, creates the inputs with the
same generator logic (inputs.py), runs ``ModelNew`` and hands back its outputs in sealed memfds
(safetensors, never pickle; no process can change them once sealed) or, for large full handovers on a CUDA
device, in a device buffer the parent offered and copies into its own memory on the reply
(``device_handover``), plus small JSON reports; the parent validates seals, layouts, sizes, structure, types,
shapes and dtypes before it compares.

Trust map of the checks:
- parent-side (security-relevant, decide the verdict): output values/shape/dtype/structure against the
  parent's own reference (so a candidate can neither see the reference's memory nor influence it),
  NaN/Inf agreement, scale-relative error, per-call wall-clock bounds on reported times, speedup cap,
  audits of several randomly chosen *timed* outputs of random trials and of the last one (a candidate that
  behaves differently while timed, only early on, or on some calls only, fails); timing inputs from one seed per
  call and runner (no reference output in the child answers the candidate's inputs); the ablation trial's
  output (decoy kernels); the precision probe (the reference on float16-rounded inputs); the timer-resolution
  and speed-of-light floors;
- child-reported (advisory; can only make the verdict stricter): forbidden aten ops and own device
  kernels seen by the profiler, tensor-subclass outputs, outputs aliasing inputs, inputs modified in place
  (compared against what the reference does), timer objects replaced after capture, harness functions
  replaced, global state changed, other threads' CPU time, calls into the candidate's extension
  (``fallback.runtime_violations``). Audited timing trials also run one hidden correctness trial and one
  ablation trial (profiled, checked like the others), each one call, at a secret position, of a batch made and run
  as a timed batch is: a candidate that switches to PyTorch once its trials are over, or where its inputs lie as a
  timed batch's do, fails.
"""
from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import math
import os
import re
import secrets
import shutil
import stat
import statistics
import tempfile
import time
import traceback
from typing import Any

from . import device_handover, feedback, speed_of_light
from .build import BuildResult, ExtensionService, build_candidate, compiler_excerpt
from .config import VerifierConfig
from .correctness import (COMMIT_BLOCK, COMPLEX128_KEYS, DIGEST_LANES, _unravel, committable, compare_outputs,
                          flatten_outputs, same_bits, same_structure, sample_entries, sample_index, spec_summary,
                          squared_error, uncommitted_entry, warm_block_digests)
from .device_lock import DeviceLock, DeviceLockTimeout, DeviceUse
from .devices import DeviceUnavailable, get_backend
from .extract import FormatError, extract_candidate
from .fallback import RUNTIME_RULES, candidate_kernels, forbidden_ops, runtime_violations
from .result_cache import config_fingerprint
from .sandbox import OUTPUT_SEALS, ChildFailed, ChildTimeout, ProtocolError, SandboxedChild
from .static_checks import check_candidate, musa_portability_notes
from .tasks import Task, load_task_module
from .timing import TimedCall, choose_reps, floor_flush, implausible_timing, reported_time_problem, stats
from .types import (REFERENCE_FAILED, REFERENCE_INSENSITIVE, REFERENCE_NOT_REPEATABLE, TASK_LOAD_FAILED, Category,
                    VerifyResult, reward_eq2)
from .warm_spare import StartedChild, WarmSpares, keep_child_caches, seed_child_caches


class _Verdict(Exception):
    """Raised inside the device stage to stop with a verdict."""

    def __init__(self, category: Category, feedback_text: str, rule: str | None = None, **details):
        super().__init__(feedback_text)
        self.category, self.feedback_text, self.rule, self.details = category, feedback_text, rule, details


def _finish(task: Task, cfg: VerifierConfig, category: Category, feedback_text: str, *, q: float = 0.0,
            speedup: float | None = None, rule: str | None = None, code: str | None = None,
            details: dict[str, Any] | None = None, **fields) -> VerifyResult:
    notes = []
    if task.train_mode_layers and category in (Category.CORRECTNESS_ERROR, Category.PASS, Category.RUNTIME_ERROR):
        notes.append(feedback.TRAIN_MODE_NOTE)
    if cfg.backend == "musa" and code:
        notes += musa_portability_notes(code)
    if category != Category.PASS:
        speedup = None
        fields["speedup_compile"] = None
    reward = None if category == Category.INFRA else reward_eq2(category, q, speedup, cfg.reward)
    return VerifyResult(task_id=task.task_id, category=category, q=q, speedup=speedup, reward=reward,
                        feedback=feedback.compose(feedback_text, notes, cfg.feedback_max_chars), backend=cfg.backend,
                        rule=rule, details=details or {}, **fields)


def precheck(task: Task, response: str | bytes, cfg: VerifierConfig) -> str | VerifyResult:
    """Extraction and static rules (no process spawned): the candidate code, or the final verdict."""
    try:
        code = extract_candidate(response, cfg.max_response_bytes)
    except FormatError as e:
        return _finish(task, cfg, Category.FORMAT_ERROR, feedback.format_error(str(e)))
    violations = check_candidate(code, cfg)
    if violations:
        v = violations[0]
        text = "; ".join(str(x) for x in violations[:5])
        return _finish(task, cfg, Category.CHEATING, feedback.cheating(v.rule, text), rule=v.rule, code=code,
                       details={"violations": [{"rule": x.rule, "line": x.line, "message": x.message}
                                               for x in violations]})
    return code


def build_failure_result(task: Task, cfg: VerifierConfig, build: BuildResult, code: str) -> VerifyResult:
    """The verdict for a build that failed: compile_error (compiler log), timeout, or infra."""
    details = {"build": build.to_dict()}
    if build.error == "infra":
        return _finish(task, cfg, Category.INFRA, feedback.infra(build.log_tail[-500:]), details=details,
                       code_hash=build.code_hash)
    if build.timed_out or build.error == "timeout":
        return _finish(task, cfg, Category.TIMEOUT, feedback.timeout("building the extension",
                                                                     cfg.compile_timeout_s) + "\n" +
                       build.log_tail[-600:], details=details, code_hash=build.code_hash, code=code)
    return _finish(task, cfg, Category.COMPILE_ERROR, feedback.compile_error(build.log_tail), details=details,
                   code_hash=build.code_hash, code=code)


def memory_problem(fp, cfg: VerifierConfig, backend, index: int, details: dict[str, Any],
                   capacity_only: bool = False, task_only: bool = False):
    """Why a task of footprint ``fp`` (``inputs.estimate_footprint``: sized on meta tensors, nothing
    allocated) cannot fit ``backend`` (an ``inputs.MemoryProblem``: a ``str`` with ``rule`` and ``scope``), or None.
    ``capacity_only``: the device against its whole memory rather than what is free now (a stage that will have the
    device alone, before it does). ``task_only``: nothing that is free now counts, only the whole memory of the device
    and host and the child's limit (choosing tasks ahead of time). Over a whole memory or the limit is the task's
    fault here (``rule="task_too_large"``, never retried); over only what is free now has no rule (retried)."""
    from . import inputs
    if fp is not None:
        details["footprint"] = fp.to_dict()
    gpu = backend.is_gpu
    problem = inputs.memory_problem(
        fp, is_gpu=gpu, backend_name=cfg.backend,
        host_free=None if task_only else inputs.host_available_bytes(), host_total=inputs.host_total_bytes(),
        child_limit=None if gpu else cfg.memory_limit_bytes,
        device_free=None if (not gpu or capacity_only or task_only) else inputs.device_free_bytes(cfg.backend, index),
        device_total=inputs.device_total_bytes(cfg.backend, index) if gpu else None)
    if problem:
        details["memory_gate"] = {"scope": problem.scope, "rule": problem.rule}
    return problem


def _memory_error(e: BaseException) -> bool:
    """An exception that says memory ran short (host or device) or the OS failed: a matter of the moment, never taken
    for the task's fault."""
    text = f"{type(e).__name__}: {e}"
    return isinstance(e, (MemoryError, OSError)) or bool(_OUT_OF_MEMORY.search(text) or _HOST_ALLOC_FAILED.search(text))


def _transient_error(e: BaseException) -> bool:
    """``_memory_error``, or an error of the device, its driver or its libraries (a device fault can come from
    another process's kernel, the candidate's included): never taken for the task's fault."""
    return _memory_error(e) or bool(_DEVICE_FAULT.search(f"{type(e).__name__}: {e}"))


def _load_fault_rule(e: BaseException) -> str | None:
    """The rule of a task module that failed to execute in the parent (before any candidate code runs, in a process
    none ever runs in): ``task_load_failed``, except for memory and I/O errors, which may pass."""
    return None if _memory_error(e) else TASK_LOAD_FAILED


def _task_load_failure(task: Task, cfg: VerifierConfig, e: BaseException, **fields) -> VerifyResult:
    rule = _load_fault_rule(e)
    return _finish(task, cfg, Category.INFRA, feedback.infra(
        f"task {task.task_id} failed to load: {type(e).__name__}: {e}", rule), rule=rule, **fields)


def verify(task: Task, response: str | bytes, cfg: VerifierConfig, device_index: int | None = None) -> VerifyResult:
    """Always returns a verdict; harness bugs and unavailable devices are ``infra`` with details."""
    t0 = time.monotonic()
    try:
        code = precheck(task, response, cfg)
        if isinstance(code, VerifyResult):
            return code
        if cfg.backend == "cpu":   # a task that cannot run on this host fails before anything is compiled
            details: dict[str, Any] = {}
            from .inputs import task_footprint
            try:
                module = load_task_module(task)
            except Exception as e:   # no candidate code has run: a deterministic failure is the task's
                return _task_load_failure(task, cfg, e, details=details, code=code)
            too_big = memory_problem(task_footprint(task, cfg.precision, module), cfg, get_backend("cpu"), 0, details)
            if too_big:
                return _finish(task, cfg, Category.INFRA, feedback.infra(f"task {task.task_id}: {too_big}",
                                                                         too_big.rule),
                               rule=too_big.rule, details=details, code=code)
        build = build_candidate(task, code, cfg)
        if not build.ok:
            return build_failure_result(task, cfg, build, code)
        result = run_candidate(task, code, build, cfg, device_index)
        result.details.setdefault("build", {"cached": build.cached, "seconds": round(build.seconds, 3),
                                            "compiled": build.compiled, "extensions": build.extensions})
        result.details["seconds"] = round(time.monotonic() - t0, 3)
        return result
    except Exception as e:  # a bug of ours: never the model's fault
        return _finish(task, cfg, Category.INFRA, feedback.infra(f"{type(e).__name__}: {e}"),
                       details={"traceback": traceback.format_exc()[-4000:]})


_TRIAL_FIELDS = {"fd": int, "spec": (str, dict), "n_outputs": int, "values": dict, "types": list,
                 "subclass_outputs": list, "devices": list, "aliases_input": bool, "inputs_modified": bool,
                 "aten_ops": dict, "device_kernels": dict, "timer_patched": list, "native_calls": int,
                 "violations": list, "background_cpu_ms": (int, float), "threads_started": int,
                 "ablation": dict, "shapes": dict, "commit_fd": int, "device_layout": dict, "device_error": str,
                 "commit_layout": dict}
# a precision probe flags a candidate whose error against the reference reaches this share of the error that
# rounding the inputs to float16 causes (an honest float32 kernel's error is thousands of times smaller)
PRECISION_PROBE_RATIO = 0.5
# ... and is this many times the float32 reference's own error (against float64, at least one ulp of the output
# scale): where rounding to float16 changes the output less than float32 arithmetic does (a loss reduced to one
# scalar), no precision can be told apart and nothing is flagged
PRECISION_PROBE_FP32_FACTOR = 32.0
# ... and, where float32 accumulation alone could cause an error that large (long reductions), the output is within
# this share of the reference's own spread of the reference run on float16- or bfloat16-rounded inputs
PRECISION_PROBE_FOLLOWS = 0.5
# device memory left free beside a full handover's buffer and this process's snapshot of it
DEVICE_HANDOVER_HEADROOM = 1 << 30
# the most a stage that shares the device may take for a handover's buffer and snapshot (a stage alone: any size):
# this share of the device's memory, at most this many bytes. Memory the footprint estimate did not count, so a small
# share: on an 80 GB H100, outputs up to about 660 MB (KernelBench level 1's 256 MB outputs: a handover through a memfd cost
# the child 0.14-0.23 s, and the parent as much again, in every correctness trial of the shared phase)
DEVICE_HANDOVER_SHARED_SHARE = 1 / 64
DEVICE_HANDOVER_SHARED_MAX_BYTES = 2 << 30
# a runtime error that says the device ran out of memory (torch, CUDA/MUSA runtime, cuBLAS/muBLAS)
_OUT_OF_MEMORY = re.compile(r"out of memory|OutOfMemoryError|ErrorMemoryAllocation|STATUS_ALLOC_FAILED",
                            re.IGNORECASE)
# torch's CPU allocator failing (a RuntimeError: "[enforce fail at alloc_cpu.cpp] ... DefaultCPUAllocator: can't
# allocate memory ... Error code 12 (Cannot allocate memory)"), or C++'s: the host was short of memory at that moment,
# which the candidates' processes running beside the parent can cause (a task module that allocates as it loads read
# as ``task_load_failed``, final)
_HOST_ALLOC_FAILED = re.compile(r"DefaultCPUAllocator|can't allocate memory|Cannot allocate memory|std::bad_alloc")

# a runtime error of the device, its driver or its libraries (not of the task's code)
_DEVICE_FAULT = re.compile(r"\b(CUDA|MUSA|cuDNN|CUBLAS|cublas|cusolver|NCCL|HIP)(\b|_)|device-side|driver|Xid|ECC|"
                           r"illegal memory access|launch failure", re.IGNORECASE)

_INTEGRITY_FIELDS = {"violations": list, "background_cpu_ms": (int, float), "threads_started": int}
# a timed batch's reply ("called"), timed or a hidden trial's round's
_CALLED_FIELDS = {"span_ms": (int, float), "rep_ms": list, "flush_ms": (int, float), "plain_tensors": bool,
                  "outputs_shared": bool, **_INTEGRITY_FIELDS}
# entries of each reference output kept per correctness trial to tell whether the reference depends on its inputs
# (``reference_ignores_inputs``): every entry up to this many, else this many at positions drawn at random (the same
# positions for every output of one shape: ``_probe_positions``)
REFERENCE_PROBE_ELEMENTS = 1 << 20
# the seed of those positions (fixed: the same positions in every trial, the output shapes being the task's)
REFERENCE_PROBE_SEED = 0x36A5
# a reference ignores its inputs when its outputs on the trials' inputs agree this much more tightly than the
# comparison's tolerance: a large reduction to one scalar (an MSE over 2^18 entries at float16's 1e-2, a full-size
# KernelBench loss at float32's 1e-4) moves by less than the tolerance from trial to trial, yet is no constant, and
# its honest kernels must be scored
INSENSITIVE_TOLERANCE_FACTOR = 1e-2


@functools.lru_cache(maxsize=32)
def _probe_positions(shape: tuple[int, ...]):
    """REFERENCE_PROBE_ELEMENTS flat positions of a tensor of ``shape`` (more entries than that), sorted, drawn at
    random from a fixed seed, as one index tensor per dimension (CPU). At random, not at an even stride: a stride
    can alias with the layout (``cat([ones(n, 1), x], 1)`` with x of n x 3 at stride 4 samples only the constant
    column, and the reference would seem to ignore its inputs)."""
    import torch
    numel = math.prod(shape)
    g = torch.Generator().manual_seed(REFERENCE_PROBE_SEED)
    idx = torch.randint(numel, (REFERENCE_PROBE_ELEMENTS,), generator=g, dtype=torch.int64).sort().values
    return torch.unravel_index(idx, shape)


def _probe(ref_leaves: list) -> list:
    """A copy of ``ref_leaves`` with each tensor cut to at most REFERENCE_PROBE_ELEMENTS entries (flat; all of them
    up to that many, else ``_probe_positions``: the same positions in every trial). The sample is gathered where the
    tensor lies, without a copy of the whole (a non-contiguous or expanded output is never materialised)."""
    import torch
    out = []
    for leaf in ref_leaves:
        if isinstance(leaf, torch.Tensor):
            leaf = leaf.detach()
            if leaf.numel() <= REFERENCE_PROBE_ELEMENTS:
                out.append(leaf.reshape(-1).clone())
            else:
                out.append(leaf[tuple(i.to(leaf.device) for i in _probe_positions(tuple(leaf.shape)))])
        else:
            out.append(leaf)
    return out


def reference_ignores_inputs(probes: list[list], tolerance: float, scale_floor: float) -> bool:
    """Whether the reference's outputs on the correctness trials' different inputs (``_probe``'s samples, one list
    per trial) are all the same, within ``INSENSITIVE_TOLERANCE_FACTOR`` of the tolerance."""
    if len(probes) < 2:
        return False
    tol = tolerance * INSENSITIVE_TOLERANCE_FACTOR
    return all(compare_outputs(p, probes[0], tol, tol, scale_floor).ok for p in probes[1:])


def _number(value: Any, default: float = math.nan) -> float:
    """A child-reported number as a float; anything else becomes ``default`` (NaN is judged implausible).
    JSON from the untrusted child may carry Infinity, NaN or integers too large for a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    try:
        return float(value)
    except (OverflowError, ValueError):
        return default


def _count(value: Any) -> int:
    """A child-reported byte count as a non-negative int (0 when it is not a finite number)."""
    v = _number(value, 0.0)
    return int(v) if math.isfinite(v) and v > 0 else 0


def _commitment_key(key: Any) -> tuple[int, int] | None:
    """(call, output) of a commitment's key ``d<call>_<output>``; None for anything else."""
    if not isinstance(key, str) or not key.startswith("d") or len(key) > 40:
        return None
    rep_s, _, out_s = key[1:].partition("_")
    return (int(rep_s), int(out_s)) if rep_s.isdigit() and out_s.isdigit() else None


def _checked(msg: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """Reject a child message whose fields have the wrong types: after the candidate is loaded the child
    is untrusted, and malformed data must become a runtime error of the candidate, never a harness crash
    (which would be retried as infra)."""
    for key, typ in fields.items():
        if key in msg and not isinstance(msg[key], typ):
            raise ProtocolError(f"malformed field {key!r} in a {msg.get('op')!r} message")
    for key in ("aten_ops", "device_kernels"):
        counts = msg.get(key)
        if isinstance(counts, dict) and not all(isinstance(k, str) and isinstance(v, int) for k, v in counts.items()):
            raise ProtocolError(f"malformed counts in {key!r}")
    return msg


def _costed(name: str):
    """Method decorator: the call's seconds go to ``_DeviceStage._cost(name)``."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            with self._cost(name):
                return fn(self, *args, **kwargs)
        return call
    return wrap


class _Conversation:
    """Requests to the run child; serves its load_inline requests in between (time spent compiling
    extends the deadline: compiles have their own budget)."""

    def __init__(self, child: SandboxedChild, service: ExtensionService, timeout_s: float,
                 pending: list[dict[str, Any]] | None = None):
        self.child, self.service = child, service
        self.deadline = time.monotonic() + timeout_s
        self.pending = list(pending or [])   # start-up messages a warm spare sent before it was taken
        self.replied_at: float | None = None  # when the last answer to ``ask`` arrived
        self.parent_s = 0.0                   # the parent's own work between requests (see ``ask``)

    def expect(self) -> dict[str, Any]:
        while True:
            msg = self.pending.pop(0) if self.pending else self.child.recv(self.deadline)
            if msg["op"] == "ext_request":
                before = self.service.seconds
                reply = self.service.handle(msg)
                self.deadline += self.service.seconds - before
                self.child.send(reply)
                continue
            return msg

    def ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send a request and wait for its answer. What the parent did since the previous answer (reference
        runs, reading and comparing outputs: minutes for KernelBench-sized tasks on a CPU) extends the
        deadline: it is not the candidate's time."""
        if self.replied_at is not None:
            spent = max(0.0, time.monotonic() - self.replied_at)
            self.deadline += spent
            self.parent_s += spent
        self.child.send(msg)
        reply = self.expect()
        self.replied_at = time.monotonic()
        return reply

    def pause(self, seconds: float) -> None:
        """Time that is neither the candidate's nor the parent's work on it (waiting for a warm spare)."""
        self.deadline += seconds
        if self.replied_at is not None:
            self.replied_at += seconds


class _DeviceStage:
    """Parent side of the device stage for one candidate."""

    sampled = False   # outputs too large to hand over in full more than once (set by the first reference)
    _batch_commit: dict | None = None   # the last timed batch's output digests by (call, output), for its audits
    _batch_calls = 1                    # calls in that batch
    _device_snapshot = None             # this process's copy of the output buffer, taken on the child's reply
    _device_off: str | None = None      # why handovers stopped being offered on the device
    _ref_buffer_bytes = 0               # device buffer one reference call's tensor outputs need
    _ref_commit_bytes = 0               # ... and their commitment (the digests of its large outputs)
    _ref_sample_bytes = 0               # ... and a sampled handover of them (``sample_index``'s entries)
    alone = False     # the stage has the device to itself from the candidate's import on
    _capacity = 0     # bytes of the device's memory (of the host's, on a CPU)

    def __init__(self, task: Task, code: str, build: BuildResult, cfg: VerifierConfig, device_index: int | None,
                 spares: WarmSpares | None = None, force_alone: bool = False):
        self.task, self.code, self.build, self.cfg = task, code, build, cfg
        self.spares = spares
        self.force_alone = force_alone
        self._timing_runners: list[str] = []   # set when timing begins (``_timing``)
        self.backend = get_backend(cfg.backend)
        self.index = device_index or 0
        self.details: dict[str, Any] = {"tolerance": {"atol": cfg.tolerance, "rtol": cfg.tolerance,
                                                      "precision": cfg.precision, "rule": "elementwise+scale"}}
        self.phase = "start"
        self.workdir = ""
        self.conv: _Conversation | None = None
        self.child: SandboxedChild | None = None
        self.device_lock = DeviceLock(cfg.backend, device_index, cfg.device_lock_dir)
        self.work: tuple[int, int] | None = None   # (bytes, FLOPs) of one reference call (speed of light)
        self.ref_ops = 1   # ATen compute ops of one reference call (the plausibility cap scales with them)
        self.use: DeviceUse | None = None    # this stage's hold on the device (``verifier.device_lock``)
        self._held_since: float | None = None   # when the current exclusive hold began
        self._costs: dict[str, list] = {}      # seconds and counts of the parent's own work, by kind
        # device buffers offered for handovers ("out": full outputs, "sample": sampled ones, "commit": commitments)
        self._device_bufs: dict[str, device_handover.ExportedBuffer] = {}

    @contextlib.contextmanager
    def _cost(self, name: str):
        """Account the parent's seconds (and the number of times) spent on ``name``: reported in
        ``details["costs"]`` (where a check's time goes on KernelBench-sized tasks)."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            costs = self.__dict__.setdefault("_costs", {})
            entry = costs.setdefault(name, [0.0, 0])
            entry[0] += time.monotonic() - t0
            entry[1] += 1
            self.details["costs"] = {k: {"s": round(v[0], 3), "n": v[1]} for k, v in costs.items()}

    def _child_costs(self, reply: dict[str, Any]) -> None:
        """The child's own timing of its harness work (advisory: shown in details, never judged)."""
        ms = reply.get("harness_ms")
        if not isinstance(ms, dict):
            return
        out = self.details.setdefault("child_seconds", {})
        for k, v in list(ms.items())[:16]:
            v = _number(v, 0.0)
            if isinstance(k, str) and math.isfinite(v) and v >= 0:
                out[k[:40]] = round(out.get(k[:40], 0.0) + v / 1e3, 3)

    # ---------------------------------------------------------------------------------- helpers
    def _warm_digests(self) -> None:
        """This process checks samples against the child's digests with the same fused kernel: build it once per
        process under the shared hold, not inside the first check's exclusive seconds. A failure here is only
        recorded: the checks that need the kernel meet it again and fail or fall back there."""
        if not self.backend.is_gpu:
            return
        try:
            warm_block_digests(self.device)
        except Exception as e:   # noqa: BLE001 - a warm-up must not decide a verdict
            self.details["digest_warmup_error"] = f"{type(e).__name__}: {e}"[:300]

    def _speedup_cap(self, t_ref: float) -> float:
        """The plausibility cap. A reference bound by host dispatch (several ops, each at most
        ``dispatch_bound_op_ms`` of its time) may be beaten by a few times its op count from fusion alone: one
        kernel instead of n launches and their dispatch (a 64-op chain: ~150x on an H200, honestly). The parent
        counted the ops on the task's own model; a candidate that slows the reference's timed calls only makes
        it look less dispatch-bound, which lowers its cap."""
        cfg = self.cfg
        per_op = t_ref / max(self.ref_ops, 1)
        dispatch_bound = self.ref_ops > 1 and per_op <= cfg.dispatch_bound_op_ms
        cap = max(cfg.speedup_cap, cfg.speedup_cap_per_op * self.ref_ops) if dispatch_bound else cfg.speedup_cap
        self.details["speedup_cap"] = {"reference_ops": self.ref_ops, "ms_per_op": per_op,
                                       "dispatch_bound": dispatch_bound, "cap": cap}
        return cap

    @_costed("reference")
    def _reference(self, model, seed: int):
        import torch

        from .inputs import make_inputs
        try:
            args = make_inputs(self.module, seed, self.device, self.cfg.precision)
        except Exception as e:
            raise self._reference_run_failure("get_inputs", e)
        before = [a.detach().clone() if isinstance(a, torch.Tensor) else None for a in args]
        try:
            with torch.no_grad(), self.backend.reference_precision():
                if self.work is None:   # the first reference call also sizes the speed-of-light floor
                    out, flops, self.ref_ops = speed_of_light.count_work(lambda: model(*args))
                    out_bytes = speed_of_light.tensor_bytes(flatten_outputs(out)[0])
                    self.work = (speed_of_light.tensor_bytes(args) + out_bytes, flops)
                    # outputs this large are compared in full in the first correctness trial only (see the config)
                    self.sampled = out_bytes > self.cfg.sample_outputs_above_bytes
                else:
                    out = model(*args)
        except Exception as e:
            raise self._reference_run_failure("forward", e)
        self.backend.synchronize_fn()()
        leaves, spec = flatten_outputs(out)
        self._ref_buffer_bytes = device_handover.buffer_bytes(leaves)
        self._ref_sample_bytes = sum(   # as ``device_handover.buffer_bytes`` lays them out
            device_handover.aligned(sample_entries(t.numel(), self.cfg.output_sample_elements) * t.element_size())
            for t in leaves if isinstance(t, torch.Tensor))
        self._ref_commit_bytes = sum(device_handover.aligned(-(-t.numel() // COMMIT_BLOCK) * DIGEST_LANES * 8)
                                     for t in leaves if isinstance(t, torch.Tensor) and committable(t)
                                     and t.numel() > self.cfg.output_sample_elements)
        mutates = any(b is not None and not same_bits(a, b) for a, b in zip(args, before))
        ranges = [(a.untyped_storage().data_ptr(), a.untyped_storage().data_ptr() + a.untyped_storage().nbytes())
                  for a in args if isinstance(a, torch.Tensor) and a.numel()]
        aliases = any(isinstance(o, torch.Tensor) and o.numel() and any(
            o.untyped_storage().data_ptr() < hi and lo < o.untyped_storage().data_ptr() + o.untyped_storage().nbytes()
            for lo, hi in ranges) for o in leaves)
        return leaves, spec, mutates, aliases

    def _device_offer(self, kind: str, nbytes: int) -> dict[str, Any] | None:
        """The device buffer of ``kind`` offered for a handover of ``nbytes`` (its handle and size), or None where
        the memfd is used: not CUDA, too small to be worth it, not enough free device memory for the buffer and
        this process's snapshot of it, or an earlier failure (``details["handover"]["device_off"]`` says which)."""
        import torch
        cfg = self.cfg
        if cfg.backend != "cuda" or cfg.device_handover_above_bytes is None or self._device_off \
                or nbytes <= cfg.device_handover_above_bytes:
            return None
        if not (self.alone or self._held_since is not None):
            shared_max = min(DEVICE_HANDOVER_SHARED_MAX_BYTES, int(self._capacity * DEVICE_HANDOVER_SHARED_SHARE))
            # memory the footprint estimate did not count, while other stages share the device: all kinds' buffers
            # and copies together (a stage holding it alone, as while timing, may: its buffers are freed before it
            # gives the device back). Between requests the other kinds' buffers are idle (what was read from them
            # is in copies), so they make room first: a sampled trial's commitment and sample after a full trial.
            if 2 * nbytes > shared_max:
                return None
            others = [k for k in self._device_bufs if k != kind]
            if others and 2 * nbytes + sum(2 * self._device_bufs[k].nbytes for k in others) > shared_max:
                self._close_device_buffers(*others)
        buf = self._device_bufs.get(kind)
        if buf is None or buf.nbytes < nbytes:
            self._close_device_buffers(kind)
            free = torch.cuda.mem_get_info(self.device)[0]
            if free < 2 * nbytes + DEVICE_HANDOVER_HEADROOM:
                self._device_off = f"{free} bytes free on the device, {2 * nbytes} needed"
            else:
                try:
                    buf = self._device_bufs[kind] = device_handover.ExportedBuffer(nbytes, self.device)
                except device_handover.DeviceHandoverError as e:
                    self._device_off = str(e)
            if self._device_off:
                self.details.setdefault("handover", {"full": 0, "sampled": 0, "bytes": 0})["device_off"] = \
                    self._device_off
                return None
        return buf.message()

    @_costed("handover_snapshot")
    def _snapshot(self, kind: str, report: dict[str, Any], layout_key: str):
        """On the child's reply, before anything else runs: this process's own copy of the buffer of ``kind``
        where the child says (``layout_key``) it wrote there; None, with the reason noted, where it did not."""
        if layout_key in report:
            return self._device_bufs[kind].snapshot()
        if "device_error" in report:
            self.details.setdefault("handover", {"full": 0, "sampled": 0, "bytes": 0})["device_error"] = \
                str(report["device_error"])[:300]
        return None

    def _close_device_buffers(self, *kinds: str) -> None:
        for kind in kinds or list(self._device_bufs):
            buf = self._device_bufs.pop(kind, None)
            if buf is not None:
                try:
                    buf.close()
                except device_handover.DeviceHandoverError as e:
                    self.details["device_buffer_close"] = str(e)[:200]
        if not kinds or "out" in kinds:
            self._device_snapshot = None

    def _sample_seed(self) -> tuple[int, int] | None:
        """(seed, entries) of a sampled handover, drawn now (after the call whose output it picks), or None
        for a full one."""
        return (secrets.randbits(62), self.cfg.output_sample_elements) if self.sampled else None

    @_costed("sample_view")
    def _sample_view(self, ref_leaves: list, sample: tuple[int, int] | None) -> tuple[list, dict[int, Any]]:
        """The reference leaves as a sampled handover carries them (a tensor `sample_index` samples becomes the
        entries ``sample_index`` picks, drawn by this process from the seed it chose) and the picks by leaf."""
        import torch
        if sample is None:
            return list(ref_leaves), {}
        targets, picks = [], {}
        for i, r in enumerate(ref_leaves):
            idx = sample_index(r.numel(), sample[1], sample[0] + i, r.device) if isinstance(r, torch.Tensor) else None
            if idx is None:
                targets.append(r)
            else:
                picks[i] = idx
                targets.append(r.reshape(-1).index_select(0, idx.to(r.device)))
        return targets, picks

    def _handed_over(self, ref_leaves: list, report: dict[str, Any], sample: tuple[int, int] | None,
                     commitment: dict[int, Any] | None = None):
        """The child's outputs (sampled or full) and what each is compared with: the sampled reference entries,
        or the full reference leaf when the child reports a full shape other than the reference's (the comparison
        then names the shape). A sample is first checked against the ``commitment`` the child made before the
        seed existed (digests by output): a sampled block that differs from its digest was changed after the
        call, i.e. fixed up once the seed told which entries count."""
        import torch
        targets, picks = self._sample_view(ref_leaves, sample)
        leaves = self._load_outputs(report, targets)
        shapes = report.get("shapes") if isinstance(report.get("shapes"), dict) else {}
        info = self.details.setdefault("handover", {"full": 0, "sampled": 0, "bytes": 0})
        info["sampled" if picks else "full"] += 1
        if "device_layout" in report:
            info["device"] = info.get("device", 0) + 1
        info["bytes"] += sum(t.numel() * t.element_size() for t in leaves
                             if isinstance(t, torch.Tensor) and not t.is_meta)
        for i in list(picks):
            leaf, ref, shape = leaves[i] if i < len(leaves) else None, ref_leaves[i], shapes.get(str(i))
            if isinstance(leaf, torch.Tensor) and not leaf.is_meta and shape == list(ref.shape):
                continue   # the requested sample of an output of the reference's shape and dtype
            del picks[i]
            targets[i] = ref
            if not isinstance(leaf, torch.Tensor):
                continue   # the comparison names what it is
            if not (isinstance(shape, list) and len(shape) <= 64 and all(
                    isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62 for d in shape)):
                shape = list(leaf.shape)
            if shape == list(ref.shape) and leaf.dtype == ref.dtype:
                leaves[i] = "<not the requested sample>"
            else:
                leaves[i] = torch.empty(shape, dtype=leaf.dtype, device="meta")
        if commitment is not None:
            self._check_commitment(leaves, ref_leaves, picks, commitment)
        return leaves, targets, picks

    def _check_commitment(self, leaves: list, ref_leaves: list, picks: dict[int, Any], commitment: dict) -> None:
        import torch
        for i, idx in picks.items():
            digests = commitment.get(i)
            if digests is None:   # a sampled output the child did not commit to: its harness was tampered with
                raise _Verdict(Category.CHEATING, feedback.cheating(
                    "sample_fixup", f"{RUNTIME_RULES['sample_fixup']}: output {i} was handed over without the "
                    "commitment made when the call returned"), rule="sample_fixup", q=1.0)
            try:
                bad = uncommitted_entry(leaves[i], idx, ref_leaves[i].numel(), digests)
            except Exception as e:   # whatever the child sent, a verdict of the candidate's, never a harness crash
                raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error(
                    "harness", f"unusable output commitment: {type(e).__name__}")) from None
            if bad is not None:
                where = _unravel(bad, ref_leaves[i].shape) if isinstance(ref_leaves[i], torch.Tensor) else bad
                raise _Verdict(Category.CHEATING, feedback.cheating(
                    "sample_fixup", f"{RUNTIME_RULES['sample_fixup']}: output {i} near index {where} differs from "
                    "what the call returned"), rule="sample_fixup", q=1.0)

    @_costed("handover_read")
    def _read_commitment(self, report: dict[str, Any], limit: int, offered: bool = False
                         ) -> dict[tuple[int, int], Any]:
        """The output digests the child committed to, by (call, output): from this process's snapshot of the
        device buffer ``offered`` for them (``commit_layout``), or from a sealed memfd (``commit_fd``), opened and
        checked before the parent draws the seed. Either way nothing can change them afterwards."""
        import torch
        from safetensors import safe_open

        snapshot = self._snapshot("commit", report, "commit_layout") if offered else None
        if snapshot is not None or "commit_layout" in report:
            if snapshot is None:
                raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error(
                    "harness", "a commitment laid out in a device buffer that was not offered"))
            try:
                views = device_handover.read_layout(snapshot, report["commit_layout"], _commitment_key)
            except device_handover.DeviceHandoverError as e:
                raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error(
                    "harness", f"unusable commitment: {e}")) from None
            out = {_commitment_key(k): d for k, d in views.items()}
            if not all(d.dtype == torch.int64 and d.dim() == 2 and d.shape[1] == DIGEST_LANES for d in out.values()):
                raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error("harness", "malformed output commitment"))
            return out
        fd = self._open_sealed_output(report.get("commit_fd"))
        out = {}
        try:
            if os.fstat(fd).st_size > limit:
                raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error("harness", "oversized output commitment"))
            try:
                with safe_open(f"/proc/self/fd/{fd}", framework="pt") as f:
                    for key in f.keys():
                        if _commitment_key(key):
                            out[_commitment_key(key)] = f.get_tensor(key)
            except _Verdict:
                raise
            except Exception as e:
                raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error("harness", f"unreadable commitment: {e}"))
        finally:
            os.close(fd)
        if not all(d.dtype == torch.int64 and d.dim() == 2 and d.shape[1] == DIGEST_LANES for d in out.values()):
            raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error("harness", "malformed output commitment"))
        return out

    def _commit_limit(self, calls: int = 1) -> int:
        """Bytes a commitment of ``calls`` calls' outputs may take in a memfd: their digests as the reference's
        outputs size them (``_ref_commit_bytes``, what the device buffer for them holds), plus room for the
        safetensors header."""
        return calls * (self._ref_commit_bytes + (1 << 20))

    @staticmethod
    def _full_position(c, picks: dict[int, Any], ref_leaves: list) -> None:
        """Name a mismatch found in a sample by its index in the full output."""
        m = c.mismatch
        if m is not None and m.output in picks and m.index is not None and len(m.index) == 1:
            m.index = _unravel(int(picks[m.output][m.index[0]]), ref_leaves[m.output].shape)

    @_costed("handover_read")
    def _load_outputs(self, report: dict[str, Any], ref_leaves: list) -> list:
        """The child's outputs, from the device buffer it was offered or from a sealed memfd."""
        if "device_layout" in report:
            tensors = self._device_outputs(report["device_layout"], ref_leaves)
        else:
            tensors = self._sealed_outputs(report, ref_leaves)
        n = int(report.get("n_outputs", 0))
        if n < 0 or n > 10000:
            raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error("harness", f"{n} outputs reported"))
        values = report.get("values") or {}
        leaves = []
        for i in range(n):
            if f"out{i}" in tensors:
                t = tensors[f"out{i}"]
                leaves.append(t if t.is_meta else t.to(self.device))   # meta: a header that already differs
            else:
                leaves.append(values.get(str(i)))
        return leaves

    def _device_outputs(self, layout: Any, ref_leaves: list) -> dict:
        """The outputs the child copied into the offered device buffer, as views of this process's snapshot of it
        (``verifier.device_handover``)."""
        snapshot, self._device_snapshot = self._device_snapshot, None
        if snapshot is None:
            raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error(
                "harness", "outputs laid out in a device buffer that was not offered"))
        try:
            return device_handover.read_outputs(snapshot, layout, ref_leaves)
        except device_handover.DeviceHandoverError as e:
            raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error("harness", f"unusable outputs: {e}")) from None

    def _sealed_outputs(self, report: dict[str, Any], ref_leaves: list) -> dict:
        """The outputs in the sealed memfd the child names (``_open_sealed_output``), no larger than the reference
        outputs justify, parsed by safetensors (never pickle)."""
        import torch
        from safetensors import safe_open

        expected = sum(t.numel() * t.element_size() for t in ref_leaves if isinstance(t, torch.Tensor))
        limit = 4 * expected + (64 << 20)
        fd = self._open_sealed_output(report.get("fd"))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
                raise _Verdict(Category.CORRECTNESS_ERROR, feedback.correctness(
                    0.0, 0, self.cfg.num_correct_trials, f"the outputs take {st.st_size} bytes, the reference's "
                    f"{expected}", None, None))
            # Parse through the already-opened fd (no path race): safetensors maps the file and copies
            # each tensor out once, instead of holding the raw bytes and the tensors at the same time
            # (outputs of KernelBench-sized tasks are several GB).
            try:
                with safe_open(f"/proc/self/fd/{fd}", framework="pt") as f:
                    pairs = set(((f.metadata() or {}).get(COMPLEX128_KEYS) or "").split(","))
                    tensors = {k: self._read_tensor(f, k, ref_leaves, k in pairs) for k in f.keys()}
            except _Verdict:
                raise
            except MemoryError:
                raise
            except Exception as e:
                raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error("harness", f"unreadable outputs: {e}"))
        finally:
            os.close(fd)
        return tensors

    def _open_sealed_output(self, number: Any) -> int:
        """This process's own descriptor of the output memfd the child names by its fd number, opened through
        /proc/<child pid>/fd (the pid is the parent's, never the child's word). Only a file sealed against
        writes and resizing is accepted: from here on no process can change what is compared."""
        if not isinstance(number, int) or isinstance(number, bool) or not 0 <= number < 1 << 20:
            raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error("harness", "malformed output descriptor"))
        try:
            fd = os.open(f"/proc/{self.child.proc.pid}/fd/{number}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error("harness", f"output file: {e}")) from None
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & OUTPUT_SEALS != OUTPUT_SEALS:
            os.close(fd)
            raise _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error(
                "harness", "the outputs were not handed over in a sealed memory file"))
        return fd

    @staticmethod
    def _read_tensor(f, key: str, ref_leaves: list, complex_pairs: bool = False):
        """One output tensor; one whose header (shape, dtype) already differs from the reference leaf at its
        position becomes an empty meta tensor of that shape and dtype (the comparison reports the difference),
        so this process never materialises more than the reference's own outputs take. ``complex_pairs``: the
        child wrote a complex128 output as float64 (re, im) pairs (``correctness.COMPLEX128_KEYS``)."""
        import torch
        from safetensors.torch import _getdtype
        sl = f.get_slice(key)
        shape, dtype = list(sl.get_shape()), _getdtype(sl.get_dtype())
        if complex_pairs and dtype == torch.float64 and shape and shape[-1] == 2:
            shape, dtype = shape[:-1], torch.complex128
        index = int(key[3:]) if key.startswith("out") and key[3:].isdigit() else -1
        ref = ref_leaves[index] if 0 <= index < len(ref_leaves) else None
        if not isinstance(ref, torch.Tensor) or list(ref.shape) != shape or ref.dtype != dtype:
            return torch.empty(shape, dtype=dtype, device="meta")
        t = f.get_tensor(key)
        return torch.view_as_complex(t) if dtype == torch.complex128 else t

    @functools.cached_property
    def _spare_key(self) -> tuple:
        """Which spares this stage may take: same verdict config and work dir, same backend and device."""
        return (f"{config_fingerprint(self.cfg)}:{self.cfg.work_dir}", self.cfg.backend, self.index)

    def _start_child(self) -> StartedChild:
        """A run child in a new private working directory; it starts without knowing its candidate."""
        cfg = self.cfg
        workdir = tempfile.mkdtemp(prefix="verifier-run-", dir=cfg.work_dir)
        seed_child_caches(self._spare_key, workdir)   # the harness's Triton kernels, built by an earlier child
        job = {"backend": cfg.backend, "candidate_path": os.path.join(workdir, "candidate.py"),
               "task_path": os.path.join(workdir, "task.py"), "precision": cfg.precision,
               "cpu_threads": cfg.cpu_threads, "cpu_flush_bytes": cfg.cpu_flush_bytes,
               # no new processes once the candidate is imported (syscall_filter.install_no_processes): a cpu
               # child needs none, unless it compiles the reference (inductor runs the compiler and its workers)
               "no_processes": cfg.backend == "cpu" and cfg.syscall_filter and not cfg.compare_torch_compile}
        child = SandboxedChild("run", job, cfg, self.backend, workdir, [], device_index=self.index)
        try:
            child.start()
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return StartedChild(child, workdir)

    def _hold(self, mode: str) -> None:
        """Take the device ``shared`` or ``exclusive`` (releasing any other hold first); the wait is neither
        the candidate's time nor the parent's work."""
        self._release()
        self.use = self.device_lock.shared(self.cfg.device_wait_timeout_s) if mode == "shared" else \
            self.device_lock.exclusive(self.cfg.device_wait_timeout_s)
        if mode == "exclusive":
            self._held_since = time.monotonic()
        waits = self.details.setdefault("device_wait_s", {})
        waits[mode] = round(waits.get(mode, 0.0) + self.use.waited_s, 3)
        if self.conv is not None:
            self.conv.pause(self.use.waited_s)

    def _release(self) -> None:
        """Give the device back; an exclusive hold's seconds add to ``details["device_exclusive_s"]`` (the time
        no other stage could use the device because of this one)."""
        if self.use is not None:
            self.use.release()
        if self._held_since is not None:
            held = time.monotonic() - self._held_since
            self._held_since = None
            self.details["device_exclusive_s"] = round(self.details.get("device_exclusive_s", 0.0) + held, 3)

    def _spare_lease(self) -> DeviceUse:
        return self.device_lock.shared(self.cfg.device_wait_timeout_s)

    def _start(self, started: StartedChild) -> dict[str, Any]:
        """Take over ``started`` (a warm spare, or this stage's own child, still importing), with the device held:
        grant it the device if nobody has yet, and load the task once it is ready."""
        cfg = self.cfg
        self.child, self.workdir = started.child, started.workdir
        # a warm spare was started before this stage began (by the previous candidate's stage)
        self.details["child"] = {"pid": self.child.proc.pid if self.child.proc else None,
                                 "started_s_before_stage": round(max(0.0, self._last_lap - self.child.started_at), 3)}
        self.service = ExtensionService(cfg, self.backend, build_pch=False, code=self.code)
        self.conv = _Conversation(self.child, self.service, cfg.startup_timeout_s, started.messages)
        hello = self.conv.expect()
        self.details["isolation"] = hello.get("isolation")
        ready = self.conv.expect()
        started.note_arrival(ready)   # (a spare's messages were timed as they came)
        if ready.get("op") == "imported":   # its CPU-only start-up is over; the device is ours (held shared) now
            if not started.device_granted:
                started.grant_device()
            ready = self.conv.expect()
            started.note_arrival(ready)
        self.details["child"]["startup_s"] = started.startup_seconds()
        if ready.get("op") != "ready":
            err = ready.get("error", {})
            raise _Verdict(Category.INFRA, feedback.infra(f"device child failed to start: {err.get('type')}: "
                                                          f"{err.get('message', '')[:300]}"), traceback=err)
        self.details["device"] = ready.get("device")
        # only the harness has run in the child so far (no candidate file is in its directory yet): what it built
        # seeds the next children (``warm_spare.keep_child_caches``)
        keep_child_caches(self._spare_key, self.workdir)
        if self.alone:   # from here on the stage has the device to itself
            self._hold("exclusive")
            too_big = memory_problem(self.footprint, self.cfg, self.backend, self.index, self.details)
            if too_big:   # nothing of the task is loaded yet
                raise _Verdict(Category.INFRA, feedback.infra(f"task {self.task.task_id}: {too_big}", too_big.rule),
                               rule=too_big.rule)
        for name, text in (("candidate.py", self.code), ("task.py", self.task.source)):
            _write_new_file(os.path.join(self.workdir, name), text)
        self.child.send({"op": "load"})
        loaded = self.conv.expect()    # no candidate code has run yet: a failure here is the harness's
        if loaded.get("op") != "task_loaded":
            err = loaded.get("error") if isinstance(loaded.get("error"), dict) else {}
            raise _Verdict(Category.INFRA, feedback.infra(f"the device child could not load task "
                                                          f"{self.task.task_id}: {err.get('type')}: "
                                                          f"{str(err.get('message', ''))[:300]}"))
        self.details["process_filter"] = loaded.get("process_filter")
        if self.spares:   # start the next candidate's child now; it must be up before this one is timed
            # (a stage alone holds the device from here through its timing: its next spare waits for the lock before
            # it imports, so that no import runs beside that timing, as on a cpu backend, whose device is the CPU)
            self.spares.replenish(self._spare_key, self._start_child, cfg.startup_timeout_s, self._spare_lease,
                                  lease_imports=not self.backend.is_gpu or self.alone)
        self.conv.deadline = time.monotonic() + cfg.run_timeout_s  # the candidate's clock starts now
        self.phase = "import"
        return ready

    def _reference_construct_failure(self, e: Exception) -> _Verdict:
        """The verdict when the parent's own ``get_init_inputs()`` / ``Model(...)`` raised. The parent never runs
        candidate code, but the candidate's child runs beside it by now, and could exhaust the memory the reference
        needs: so the task's fault (``reference_failed``, not retried) only where the error is no memory error and
        the same exception comes again on meta tensors (no memory, no device); otherwise a retried infra verdict."""
        from .inputs import reference_error_on_meta
        again = None if _transient_error(e) else reference_error_on_meta(self.module, self.cfg.precision,
                                                                         construct_only=True)
        rule = REFERENCE_FAILED if again is not None and again[0] in ("get_init_inputs", "Model") and \
            type(again[1]) is type(e) else None
        return _Verdict(Category.INFRA, feedback.infra(
            f"the task's reference Model failed to construct: {type(e).__name__}: {e}"
            + ("" if rule is None else " (again on meta tensors)"), rule), rule=rule)

    def _reference_run_failure(self, stage: str, e: Exception) -> Exception:
        """What to raise when the parent's own ``get_inputs()`` or reference forward raised ``e`` (``stage``). The
        parent never runs candidate code, but the candidate's child runs beside it and could exhaust the memory the
        reference needs: the task's fault (``reference_failed``, not retried) only where ``e`` is no memory error and
        the reference raises the same exception at the same stage on meta tensors; else ``e`` itself (a retried infra
        verdict, as before)."""
        from .inputs import reference_error_on_meta
        if isinstance(e, _Verdict) or _transient_error(e):
            return e
        again = reference_error_on_meta(self.module, self.cfg.precision)
        if again is None or again[0] != stage or type(again[1]) is not type(e):
            return e
        return _Verdict(Category.INFRA, feedback.infra(
            f"the task's reference failed in {'get_inputs()' if stage == 'get_inputs' else 'Model.forward'} (again on "
            f"meta tensors): {type(e).__name__}: {str(e)[:500]}", REFERENCE_FAILED), rule=REFERENCE_FAILED)

    def _reference_build_error(self, seed: int) -> Exception | None:
        """What the parent's own ``get_init_inputs()`` + ``Model(...)`` under ``seed`` raise (no memory error), or None
        when they build. The parent never runs candidate code: a failure here is the task's."""
        from .inputs import build_model, make_init_inputs
        try:
            model = build_model(self.module.Model, make_init_inputs(self.module, seed, self.device), seed,
                                self.device, self.cfg.precision)
        except Exception as e:   # noqa: BLE001 - the task's own code
            return None if _transient_error(e) else e
        del model
        return None

    def _fail_from_error(self, msg: dict[str, Any]) -> _Verdict:
        phase = msg.get("phase")
        if not isinstance(msg.get("error", {}), dict) or not isinstance(msg.get("log", ""), str):
            msg = {"phase": phase, "error": {"type": "ProtocolError", "message": "malformed error report"}}
        if phase == "construct" and getattr(self, "_init_seed", None) is not None and \
                getattr(self, "module", None) is not None:
            # the child builds the reference (for timing) beside ModelNew: whether a failure there is the task's,
            # and no -1 for the candidate, the parent's own build of the reference under the same seed decides
            # (on meta tensors first, which costs nothing: only a reference that fails there is built for real)
            from .inputs import reference_error_on_meta
            on_meta = reference_error_on_meta(self.module, self.cfg.precision, construct_only=True)
            err = self._reference_build_error(self._init_seed) if on_meta and on_meta[0] in ("get_init_inputs",
                                                                                              "Model") else None
            if err is not None:
                return _Verdict(Category.INFRA, feedback.infra(
                    f"the task's reference Model failed to construct (in the verifier's own process too): "
                    f"{type(err).__name__}: {str(err)[:500]}", REFERENCE_FAILED), rule=REFERENCE_FAILED)
        if phase == "compile":
            if self.service.infra_error:
                return _Verdict(Category.INFRA, feedback.infra(self.service.infra_error[-500:]))
            if self.service.timed_out:
                return _Verdict(Category.TIMEOUT, feedback.timeout("building the extension",
                                                                   self.cfg.compile_timeout_s))
            return _Verdict(Category.COMPILE_ERROR, feedback.compile_error(compiler_excerpt(msg.get("log", ""))))
        if phase == "harness":
            err = msg.get("error", {})
            if self.phase in ("start",):
                return _Verdict(Category.INFRA, feedback.infra(f"{err.get('type')}: {err.get('message')}"))
            return _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error("harness", str(err.get("message"))))
        err = msg.get("error", {})
        where = {"import": "importing the candidate", "construct": "constructing ModelNew",
                 "trial": "ModelNew.forward", "warmup": "warm-up", "prepare": "creating timing inputs",
                 "call": "timed call", "audit": "saving a timed output",
                 "commit": "committing to timed outputs"}.get(phase, str(phase))
        headline = f"{err.get('type')}: {str(err.get('message', '')).strip()[:700]}"
        # the model sees its own frames (``traceback``); the whole traceback stays in the verdict's details for people
        return _Verdict(Category.RUNTIME_ERROR, feedback.runtime_error(where, headline, err.get("traceback", "")),
                        traceback=str(err.get("traceback_full") or err.get("traceback", ""))[-4000:])

    def _lap(self, phase: str) -> None:
        """Seconds spent in each device-stage phase (child start, candidate import, correctness, timing)."""
        now = time.monotonic()
        self.details.setdefault("phase_seconds", {})[phase] = round(now - self._last_lap, 3)
        self._last_lap = now
        if self.conv is not None:   # of which the parent's own work (not on the candidate's clock)
            self.details["parent_seconds"] = round(self.conv.parent_s, 3)

    def _ask(self, msg: dict[str, Any], expect: str) -> dict[str, Any]:
        with self._cost(f"child_{msg.get('op')}"):   # the request's round trip (the child's work on it)
            reply = self.conv.ask(msg)
        self._child_costs(reply)
        if self.conv.parent_s > self.cfg.run_timeout_s:   # the task is too slow to check here, whatever the code
            raise _Verdict(Category.INFRA, feedback.infra(
                f"task {self.task.task_id}: the verifier's own work (reference runs, reading and comparing outputs) "
                f"took {self.conv.parent_s:.0f} s, more than run_timeout_s={self.cfg.run_timeout_s:g} on the "
                f"{self.cfg.backend} backend; verify it at smaller shapes or on a faster backend"))
        if reply.get("op") == "error":
            raise self._fail_from_error(reply)
        if reply.get("op") != expect:
            raise ProtocolError(f"expected {expect}, got {reply.get('op')}")
        return reply

    # ---------------------------------------------------------------------------------- stages
    def run(self) -> VerifyResult:
        from .inputs import build_model
        cfg = self.cfg
        try:
            self.backend.ensure_available(self.index)
        except DeviceUnavailable as e:
            return _finish(self.task, cfg, Category.INFRA, feedback.infra(str(e)), details=dict(self.details))
        self.device = self.backend.torch_device(self.index)
        try:
            self.module = load_task_module(self.task)
        except Exception as e:   # before any child starts: a deterministic failure is the task's
            return _task_load_failure(self.task, cfg, e)
        from . import inputs
        fp = inputs.task_footprint(self.task, cfg.precision, self.module)   # cached per source and precision
        # a task too large to share the device's memory with other stages has the device to itself
        capacity = (inputs.device_total_bytes(cfg.backend, self.index) if self.backend.is_gpu
                    else inputs.host_available_bytes())
        alone = self.force_alone or not inputs.shares_device(fp, cfg.shared_device_max_bytes, capacity)
        self.alone, self.footprint, self._capacity = alone, fp, capacity or 0
        self.details["device_use"] = "exclusive" if alone else "shared, exclusive while timing"
        q = 0.0
        self._last_lap = time.monotonic()
        try:
            # take a warm spare before holding the device: its start-up holds the device's shared lock
            spare = self.spares.take(self._spare_key) if self.spares else None
            # a child's imports need the host's CPU only: on a GPU our own child imports while we wait for the device
            # (on a cpu backend the CPU is the device, and the child starts once we hold it)
            early_child = self.backend.is_gpu
            try:
                if spare is None and early_child:
                    spare = self._start_child()
                # a stage that will have the device alone starts its child under a shared hold too (a child's
                # start-up holds no task data, like a warm spare's): it takes the device before the candidate
                # is loaded (``_start``), so the seconds no other stage can use the device start there
                self._hold("shared")
                self._warm_digests()
                # read with the device held alone (in ``_start`` when alone), or shared: no other stage starts or
                # allocates meanwhile (the memory that stages already running hold does count against it)
                # (a task that cannot fit even the whole device is refused before any child starts)
                too_big = memory_problem(fp, self.cfg, self.backend, self.index, self.details, capacity_only=alone)
                if not too_big:
                    self.details["device_health"] = self.backend.health(self.index) if self.backend.is_gpu else {}
                    if spare is None:
                        spare = self._start_child()
            except BaseException as e:
                if spare is not None:
                    spare.discard()
                if isinstance(e, DeviceLockTimeout):
                    return _finish(self.task, cfg, Category.INFRA, feedback.infra(str(e)),
                                   details=dict(self.details))
                raise
            if too_big:   # the farm cannot run this task here: no candidate runs, nothing is allocated
                if spare is not None:
                    spare.discard()
                return _finish(self.task, cfg, Category.INFRA, feedback.infra(f"task {self.task.task_id}: {too_big}",
                                                                              too_big.rule), rule=too_big.rule,
                               details=dict(self.details))
            self._start(spare)
            self._lap("start")
            loaded = _checked(self.conv.expect(), {"timer_patched": list, **_INTEGRITY_FIELDS})
            self._lap("import")
            if loaded.get("op") == "error":
                raise self._fail_from_error(loaded)
            if loaded.get("op") != "loaded":
                raise ProtocolError(f"expected loaded, got {loaded.get('op')}")
            self.phase = "construct"
            if loaded.get("timer_patched"):
                raise _Verdict(Category.CHEATING, feedback.cheating(
                    "timer_patch", f"timing functions were replaced: {loaded['timer_patched']}"), rule="timer_patch")
            self._raise_runtime_violations(loaded)
            init_seed = self._init_seed = secrets.randbits(63)
            constructed = _checked(self._ask({"op": "construct", "seed": init_seed}, "constructed"),
                                   {"loaded_params": int, "unmatched": list})
            self.details["state_dict"] = {"loaded": constructed.get("loaded_params"),
                                          "unmatched": constructed.get("unmatched")}
            from .inputs import make_init_inputs
            try:
                init = make_init_inputs(self.module, init_seed, self.device)
                ref_model = build_model(self.module.Model, init, init_seed, self.device, cfg.precision)
            except Exception as e:
                raise self._reference_construct_failure(e)
            q = self._correctness(ref_model)
            if self.backend.is_gpu:
                self.backend.empty_cache()  # hand the parent's cached reference blocks back to the device
            self._lap("correctness")
            if not alone:
                self._release()      # other stages' start-ups and trials may finish; none start while we wait
                if self.spares:      # our next child's start-up (CPU, device context, profiler) must be over too
                    waited = time.monotonic()
                    self.spares.wait_started(self._spare_key, cfg.startup_timeout_s)
                    self.conv.pause(time.monotonic() - waited)   # not the candidate's time
                    self._lap("spare_wait")
                self._hold("exclusive")
                self._lap("device_wait")
            self.phase = "timing"
            t_ref, t_cand, t_comp = self._timing(ref_model)
            self._lap("timing")
            del ref_model
            speedup = t_ref / t_cand if t_cand > 0 else math.inf
            speedup_compile = (t_comp / t_cand) if (t_comp is not None and t_cand > 0) else None
            cap = self._speedup_cap(t_ref)
            if not math.isfinite(speedup) or speedup > cap:
                raise _Verdict(Category.CHEATING, feedback.cheating(
                    "implausible_speedup", f"speedup {speedup:.3g}x is above the plausibility cap {cap:g}x "
                    f"(reference {t_ref:.4g} ms over {self.ref_ops} ops, candidate {t_cand:.4g} ms)"),
                    rule="implausible_speedup", q=q)
            return _finish(self.task, cfg, Category.PASS, feedback.passed(t_ref, t_cand, speedup, speedup_compile),
                           q=q, speedup=speedup, details=self.details, t_ref_ms=t_ref, t_cand_ms=t_cand,
                           speedup_compile=speedup_compile, code_hash=self.build.code_hash,
                           device_name=(self.details.get("device") or {}).get("device_name"), code=self.code)
        except _Verdict as v:
            self.details.update({k: val for k, val in v.details.items() if k != "q"})
            return _finish(self.task, cfg, v.category, v.feedback_text, q=v.details.get("q", q), rule=v.rule,
                           details=self.details, code_hash=self.build.code_hash, code=self.code,
                           device_name=(self.details.get("device") or {}).get("device_name"))
        except DeviceLockTimeout as e:
            return _finish(self.task, cfg, Category.INFRA, feedback.infra(str(e)), q=q, details=self.details,
                           code_hash=self.build.code_hash, code=self.code)
        except ChildTimeout:
            if self.phase == "start":
                return _finish(self.task, cfg, Category.INFRA, feedback.infra("the device child did not start in "
                                                                              f"{cfg.startup_timeout_s:.0f} s"),
                               details=self.details)
            from .inputs import large_data_note
            return _finish(self.task, cfg, Category.TIMEOUT, feedback.timeout(
                {"import": "importing the candidate", "construct": "correctness trials"}.get(self.phase, self.phase),
                cfg.run_timeout_s) + large_data_note(self.details.get("footprint"), cfg.backend), q=0.0,
                details=self.details, code_hash=self.build.code_hash, code=self.code)
        except (ChildFailed, ProtocolError) as e:
            exit_info = self.child.close(grace_s=2.0) if self.child else None
            if exit_info:
                self.details["child_exit"] = exit_info.describe()
            if self.phase == "start":
                return _finish(self.task, cfg, Category.INFRA, feedback.infra(
                    f"device child died before loading the candidate ({exit_info.describe() if exit_info else e}): "
                    f"{exit_info.stderr_tail[-800:] if exit_info else ''}"), details=self.details)
            what = exit_info.describe() if exit_info and not isinstance(e, ProtocolError) else str(e)
            tail = exit_info.stderr_tail[-900:] if exit_info else ""
            return _finish(self.task, cfg, Category.RUNTIME_ERROR, feedback.runtime_error(
                {"import": "importing the candidate"}.get(self.phase, self.phase),
                f"the process running your code {what}\n{tail}"), details=self.details,
                code_hash=self.build.code_hash, code=self.code)
        finally:
            if self.child is not None:
                timed_out = self.child.exit is None and self.conv is not None and time.monotonic() > self.conv.deadline
                if self.child.exit is None:
                    try:
                        if not timed_out and not self.child.exited():
                            self.child.send({"op": "exit"})
                    except ChildFailed:
                        pass
                exit_info = self.child.close(grace_s=2.0 if not timed_out else 0.0, timed_out=timed_out)
                self.details.setdefault("child_exit", exit_info.describe())
                self.details["child_output_bytes"] = exit_info.stdout_bytes + exit_info.stderr_bytes
            self._close_device_buffers()   # after the child is gone: nothing maps them any more
            if self.workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
            if self.backend.is_gpu:
                try:
                    self.backend.empty_cache()
                except Exception:
                    pass
            self._release()   # after the child is gone: nothing of it runs beside the next timing

    def _runtime_problems(self, report: dict[str, Any], correct: bool, ref_leaves: list) -> list[tuple[str, str]]:
        import torch
        return runtime_violations(report, host_backend=not self.backend.is_gpu, correct=correct,
                                  output_elements=sum(t.numel() for t in ref_leaves if isinstance(t, torch.Tensor)))

    def _raise_runtime_violations(self, report: dict[str, Any], q: float = 0.0) -> None:
        for key in ("background_cpu_ms", "threads_started"):
            if key in report:
                self.details[key] = report[key]
        problems = runtime_violations(report, host_backend=not self.backend.is_gpu)
        if problems:
            rule, message = problems[0]
            raise _Verdict(Category.CHEATING, feedback.cheating(rule, f"{RUNTIME_RULES[rule]}: {message}"),
                           rule=rule, q=q)

    @_costed("precision_probe")
    def _precision_probe(self, ref_model, seed: int, leaves: list, ref_leaves: list,
                         picks: dict[int, Any] | None = None) -> tuple[str, str] | None:
        """Run on the parent, once per candidate, on a float32 correctness trial that passed: the reference again
        on the same inputs rounded to float16, and in float64. An output whose error (against float64) is of the
        size that rounding the inputs causes, and far above the float32 reference's own error, was computed in
        float16, bfloat16 or TF32 (it passed the tolerance, typically on a long reduction); an honest float32
        kernel's error is of the float32 reference's order. On long reductions (an MSE over 2^18 entries) another
        float32 summation order alone can err more than rounding the inputs does: there only an output that
        follows the reference run on rounded inputs is flagged. Finding: (rule, message) or None."""
        import torch

        from . import inputs
        if self.cfg.precision != "float32":
            self.details["precision_probe"] = {"skipped": f"precision {self.cfg.precision}"}
            return None
        fp = getattr(self, "footprint", None)
        if not self.backend.is_gpu and fp is not None:   # its copies of a KernelBench-sized task could exhaust the host
            need, free = inputs.precision_probe_bytes(fp), inputs.host_available_bytes()
            if free is not None and need > free:
                self.details["precision_probe"] = {"skipped": f"needs about {need} bytes of host memory, "
                                                              f"{free} available"}
                return None
        args = inputs.make_inputs(self.module, seed, self.device, self.cfg.precision)
        if not any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args):
            self.details["precision_probe"] = {"skipped": "no float32 input"}
            return None
        if self.work is not None and 2 * self.work[0] > self.cfg.shared_device_max_bytes:
            self.details["precision_probe"] = {"skipped": "too large for a float64 reference beside the others"}
            return None

        def reference_on(dtype):
            """The float32 reference run on the inputs rounded to ``dtype``."""
            with torch.no_grad(), self.backend.reference_precision():
                return flatten_outputs(ref_model(*[a.to(dtype).to(a.dtype) if isinstance(a, torch.Tensor)
                                                   and a.dtype == torch.float32 else a for a in args]))[0]
        leaves16 = reference_on(torch.float16)
        with torch.no_grad(), self.backend.reference_precision():
            try:   # the float32 reference's own error, against float64: the scale of an honest kernel's error
                model64 = copy.deepcopy(ref_model).to(torch.float64)
                out64 = model64(*[a.to(torch.float64) if isinstance(a, torch.Tensor) and a.dtype == torch.float32
                                  else a for a in args])
            except Exception as e:   # an op without a float64 kernel: no scale, no probe
                self.details["precision_probe"] = {"skipped": f"no float64 reference: {type(e).__name__}"}
                return None
        self.backend.synchronize_fn()()
        leaves64 = flatten_outputs(out64)[0]
        # the terms an output entry sums: inputs per output entry, or multiply-adds per entry (a matmul's K)
        n_out = sum(r.numel() for r in ref_leaves if isinstance(r, torch.Tensor)) or 1
        n_in = sum(a.numel() for a in args if isinstance(a, torch.Tensor))
        n_red = max(n_in / n_out, (self.work[1] if self.work is not None else 0) / (2 * n_out), 1.0)
        # the error statistics over the entries the handover sampled, and over a sample of any other output of
        # more than output_sample_elements entries (root mean squares: a few million entries estimate them well)
        k, picks = self.cfg.output_sample_elements, dict(picks or {})
        leaves, ref_leaves = list(leaves), list(ref_leaves)
        for i, ref in enumerate(ref_leaves):
            if picks.get(i) is None and isinstance(ref, torch.Tensor) and i < len(leaves) and ref.numel() > k:
                picks[i] = sample_index(ref.numel(), k, secrets.randbits(62), ref.device)
                if picks[i] is not None:
                    leaves[i] = leaves[i].reshape(-1).index_select(0, picks[i].to(leaves[i].device)) \
                        if isinstance(leaves[i], torch.Tensor) and leaves[i].numel() > k else leaves[i]

        def picked(outs: list) -> list:
            return [t.reshape(-1).index_select(0, picks[i].to(t.device)) if picks.get(i) is not None
                    and isinstance(t, torch.Tensor) and t.numel() > k else t for i, t in enumerate(outs)]
        ref_leaves, leaves16, leaves64 = picked(ref_leaves), picked(leaves16), picked(leaves64)
        count = sum(squared_error(ref, r64)[1] for ref, r64 in zip(ref_leaves, leaves64))

        def rms(a: list, b: list) -> float:
            return math.sqrt(sum(squared_error(x, y)[0] for x, y in zip(a, b)) / max(count, 1))
        rms_cand, rms16 = rms(leaves, leaves64), rms(leaves16, ref_leaves)
        # an honest float32 kernel may be a few times less accurate than torch's (another summation order);
        # at least one float32 ulp of the outputs' scale counts as the reference's own error
        scale = math.sqrt(sum(squared_error(r, torch.zeros_like(r))[0] for r in ref_leaves
                              if isinstance(r, torch.Tensor) and r.is_floating_point()) / max(count, 1))
        honest = max(rms(ref_leaves, leaves64), scale * 2.0 ** -23)
        # a float32 sum of n_red terms of the outputs' size may be off by up to n_red float32 ulps (a sequential
        # sum, stagnating on long positive reductions); rounding inputs to float16 averages out over the same
        # terms, so below this bound the error's size alone cannot tell the precisions apart
        accumulation = scale * n_red * 2.0 ** -24
        ratio = rms_cand / rms16 if rms16 > 0 else 0.0
        info = {"rms_ratio_to_fp16_rounding": ratio,
                "rms_ratio_to_fp32_reference": rms_cand / honest if honest > 0 else 0.0,
                "reduction_length": n_red,
                "rms_ratio_to_fp32_accumulation": rms_cand / accumulation if accumulation > 0 else 0.0}
        self.details["precision_probe"] = info
        if not (rms16 > 0 and ratio >= PRECISION_PROBE_RATIO and rms_cand >= PRECISION_PROBE_FP32_FACTOR * honest):
            return None
        if rms_cand < accumulation:
            # as large as float32 accumulation can make it: a downgrade only if the output follows the reference
            # run on rounded inputs (an honest error is independent of that rounding's, and at least as far away)
            info["distance_to_rounded_reference"] = follows = {}
            for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
                rounded_out = leaves16 if dtype is torch.float16 else picked(reference_on(dtype))
                spread = rms(rounded_out, ref_leaves)
                follows[name] = rms(leaves, rounded_out) / spread if spread > 0 else math.inf
            if min(follows.values()) > PRECISION_PROBE_FOLLOWS:
                return None
        return ("precision_downgrade", f"your output's error against the float32 reference is {ratio:.2f}x the "
                                       "error of rounding the inputs to float16; compute in float32 (no "
                                       "half/bfloat16 inputs or intermediates, no TF32)")

    @_costed("compare")
    def _compare(self, leaves: list, ref_leaves: list):
        return compare_outputs(leaves, ref_leaves, self.cfg.tolerance, self.cfg.tolerance, self.cfg.scale_floor)

    def _speed_of_light(self, t_cand: float) -> None:
        """A candidate timed below ``sol_margin`` of the device's speed-of-light floor is cheating."""
        spec = speed_of_light.device_spec((self.details.get("device") or {}).get("device_name"),
                                          self.cfg.sol_device_spec)
        if spec is None or self.work is None:
            return
        floor = speed_of_light.Floor(spec, self.work[0], self.work[1], self.cfg.precision)
        self.details["speed_of_light"] = dict(floor.to_dict(), margin=self.cfg.sol_margin)
        if t_cand < self.cfg.sol_margin * floor.floor_ms:
            raise _Verdict(Category.CHEATING, feedback.cheating(
                "below_speed_of_light", f"measured {t_cand:.4g} ms per call, but the {floor.describe()}; the "
                "timing was not honest (hidden work, a cache kept across the flush, or a forged report)"),
                rule="below_speed_of_light", q=1.0)

    def _decoy_check(self, ref_model, q: float, batch: int = 1, stashed_seed: int | None = None) -> None:
        """An ablation trial: the child overwrites with random bytes everything the candidate's native calls
        (extension functions, Triton launches) returned or wrote, right after each call. An output that is
        still right came from elsewhere: the kernels were decoys (a no-op call beside allowed data movement on
        a transpose-like task, or a kernel whose result is thrown away). Inconclusive, and skipped, when no
        native call ran through the ablation, when native work ran where it cannot see (pybind class methods,
        the candidate's own dispatcher ops, CUDA graph replays), or when the reference returns an input.
        ``batch``: see ``_ask_trial``; ``stashed_seed``: the ablation call already ran in the last round, as the second
        judged call of its batch (``_ask_trial``'s ``ablation``), and only its report is asked for."""
        import torch
        if stashed_seed is None:
            seed = secrets.randbits(63)
            report, sample, commitment = self._ask_trial(seed, ablate=True, batch=batch)
        else:
            seed = stashed_seed
            report, sample, commitment = self._ask_one_trial(seed, True, False, {"stashed": True})
        self._raise_runtime_violations(report, q=q)
        ref_leaves, ref_spec, _, ref_aliases = self._reference(ref_model, seed)
        ab = report.get("ablation") or {}
        calls, opaque, poisoned = _count(ab.get("calls")), _count(ab.get("opaque")), _count(ab.get("poisoned"))
        info: dict[str, Any] = {"native_calls": calls, "overwritten": poisoned, "opaque_calls": opaque}
        passthrough = _count(ab.get("passthrough"))   # calls that returned their own argument unchanged: no work
        if passthrough:
            info["passthrough_calls"] = passthrough
        self.details["ablation"] = info
        if ref_aliases or calls == 0 or opaque > 0 or not any(
                isinstance(t, torch.Tensor) and t.numel() for t in ref_leaves):
            info["conclusive"] = False
            return
        info["conclusive"] = True
        leaves, targets, _ = self._handed_over(ref_leaves, report, sample, commitment)
        c = self._compare(leaves, targets)
        info["output_still_correct"] = c.ok
        if c.ok and same_structure(report.get("spec"), ref_spec):
            raise _Verdict(Category.CHEATING, feedback.cheating(
                "decoy_kernel", f"{RUNTIME_RULES['decoy_kernel']} ({calls} native call(s) ran, {poisoned} of their "
                                "results overwritten, " + (f"{passthrough} handed back their argument as it was, "
                                                           if passthrough else "") + "the output unchanged)"),
                rule="decoy_kernel", q=q)

    def _ask_trial(self, seed: int, ablate: bool = False, full: bool = False, batch: int = 1, at: int | None = None,
                   ablation: tuple[int, int] | None = None
                   ) -> tuple[dict[str, Any], tuple[int, int] | None, dict[int, Any] | None]:
        """Run one trial in the child: its report (with the handover's fields), the sample it handed over (None:
        every entry) and the digests it committed to first. Where outputs are sampled (``self.sampled``) and the
        trial is not ``full``, the child keeps the output after the call, commits to it, and hands over the
        entries of a seed drawn only once the commitment is sealed ("collect"). A full handover goes through a
        device buffer where one can be offered (``_device_offer``), else through a sealed memfd. Once timing has begun
        (hidden trials) the judged call is one, at a secret position, of the candidate's batch of ``batch`` calls in a
        round made and run as a timed trial is (every runner's inputs, then the batches of the runners drawn before the
        candidate's), whose times are thrown away: its inputs lie where a timed call's would. ``at``: the judged call's
        position (drawn here if None). ``ablation`` (position, seed): the batch holds a second judged call there, an
        ablation trial after ``at``, whose report the child keeps for ``_decoy_check(..., stashed_seed=...)`` (one
        round where two would cost twice)."""
        if not self._timing_runners:   # the correctness phase: a call of its own, as every call before timing
            return self._ask_one_trial(seed, ablate, full)
        batch = max(int(batch), 1)   # one call per timed batch too: a round, never a call made beside the trial's
        at = secrets.randbelow(batch) if at is None else at
        if not 0 <= at < batch or (ablation is not None and not at < ablation[0] < batch):
            raise ValueError(f"judged calls at {at} and {ablation} in a batch of {batch}: the ablation call must follow")
        # a round made as a timed trial is (``_timing``): every runner's inputs, fresh seeds but ours at secret calls
        # of the candidate's batch, the runners before it in a shuffled order run, their times thrown away (those after
        # it would change nothing the calls see: the next request is another round's or trial's ``prepare``)
        runners = list(self._timing_runners)
        seeds = {r: [secrets.randbits(63) for _ in range(batch)] for r in runners}
        seeds["cand"][at] = seed
        in_batch: dict[str, Any] = {"prepared": True, "at": at}
        if ablation is not None:
            seeds["cand"][ablation[0]] = ablation[1]
            in_batch["also"] = {"at": ablation[0], "seed": ablation[1], "ablate": True}
        self._ask({"op": "prepare", "seeds": seeds, "runners": runners}, "prepared")
        order = sorted(runners, key=lambda _: secrets.randbits(32))
        for runner in order[:order.index("cand")]:
            self._untimed_call(runner)
        return self._ask_one_trial(seed, ablate, full, in_batch)

    def _untimed_call(self, runner: str) -> None:
        """Another runner's batch of a hidden trial's round (``_ask_trial``): run as in a timed trial, not timed."""
        reply = _checked(self._ask({"op": "call", "runner": runner}, "called"), _CALLED_FIELDS)
        self._raise_runtime_violations(reply, q=1.0)

    def _ask_one_trial(self, seed: int, ablate: bool, full: bool, in_batch: dict[str, Any] | None = None
                       ) -> tuple[dict[str, Any], tuple[int, int] | None, dict[int, Any] | None]:
        hold = self.sampled and not full
        offer = self._device_offer("commit", self._ref_commit_bytes) if hold \
            else self._device_offer("out", self._ref_buffer_bytes)
        msg = {"op": "trial", "seed": seed, **(in_batch or {}), **({"ablate": True} if ablate else {}),
               **({"hold": True, "commit_k": self.cfg.output_sample_elements} if hold else {}),
               **({"commit_out" if hold else "device_out": offer} if offer else {})}
        report = _checked(self._ask(msg, "trial_done"), _TRIAL_FIELDS)
        self._device_snapshot = None
        if not hold:
            if offer is not None:
                self._device_snapshot = self._snapshot("out", report, "device_layout")
            return report, None, None
        commitment = {i: d for (_, i), d in self._read_commitment(report, self._commit_limit(),
                                                                   offered=offer is not None).items()}
        sample = self._sample_seed()
        got = self._ask_sampled({"op": "collect", "sample_seed": sample[0], "sample_k": sample[1]}, "collected")
        merged = dict(report)
        for key in ("fd", "device_layout", "spec", "types", "values", "n_outputs", "shapes", "background_cpu_ms",
                    "threads_started"):
            if key in got:
                merged[key] = got[key]
        merged["violations"] = list(report.get("violations") or []) + list(got.get("violations") or [])
        return merged, sample, commitment

    def _ask_sampled(self, msg: dict[str, Any], expect: str) -> dict[str, Any]:
        """Ask for a sampled handover (``collect``, ``audit``), offering the device buffer for samples where one can
        be offered (a few tens of MB that a memfd would carry through host memory), and snapshot it on the reply."""
        return self._ask_handover("sample", self._ref_sample_bytes, msg, expect)

    def _ask_handover(self, kind: str, nbytes: int, msg: dict[str, Any], expect: str) -> dict[str, Any]:
        """Ask for outputs, offering the device buffer of ``kind`` for them where one can be offered, and snapshot
        it on the reply (the snapshot of an earlier request never stands in for this one's)."""
        offer = self._device_offer(kind, nbytes)
        self._device_snapshot = None   # an earlier copy is not held beside the one this reply makes
        report = _checked(self._ask({**msg, **({"device_out": offer} if offer else {})}, expect), _TRIAL_FIELDS)
        self._device_snapshot = self._snapshot(kind, report, "device_layout") if offer else None
        return report

    def _trial(self, ref_model, seed: int, full: bool = False, probe: bool = False,
               batch: int = 1, at: int | None = None, ablation: tuple[int, int] | None = None
               ) -> tuple[dict[str, Any], dict[str, Any]]:
        """One correctness trial: the child's report, and the parent's judgement of it (``ok``, differences,
        the first mismatch, in-place/aliasing flags against the reference, runtime rule violations; with
        ``probe``, ``_probe``'s sample of the reference's outputs). The reference runs first: its outputs size the
        device buffer a full handover is offered. ``batch``, ``at``, ``ablation``: see ``_ask_trial``."""
        ref_leaves, ref_spec, ref_mutates, ref_aliases = self._reference(ref_model, seed)
        report, sample, commitment = self._ask_trial(seed, full=full, batch=batch, at=at, ablation=ablation)
        if report.get("subclass_outputs"):
            raise _Verdict(Category.CHEATING, feedback.cheating(
                "tensor_subclass_output", f"forward returned tensor subclasses {report['subclass_outputs'][:3]} "
                "(lazy or disguised outputs); return plain torch.Tensor"), rule="tensor_subclass_output")
        if report.get("timer_patched"):
            raise _Verdict(Category.CHEATING, feedback.cheating(
                "timer_patch", f"timing functions were replaced: {report['timer_patched']}"), rule="timer_patch")
        row: dict[str, Any] = {"ok": False, "mismatch": None}
        flags = {"inputs_modified": bool(report.get("inputs_modified")) and not ref_mutates,
                 "aliases_input": bool(report.get("aliases_input")) and not ref_aliases}
        leaves, targets, picks = self._handed_over(ref_leaves, report, sample, commitment)
        wrong_device = [d for d in report.get("devices") or [] if d != self.device.type]
        if wrong_device:
            row["mismatch"] = f"outputs on device {str(wrong_device[0])[:40]!r}, expected {self.device.type!r}"
        elif not same_structure(report.get("spec"), ref_spec):
            row["mismatch"] = (f"output structure {spec_summary(report.get('spec'))} differs from the reference's "
                               f"{spec_summary(ref_spec)}")
        else:
            c = self._compare(leaves, targets)
            self._full_position(c, picks, ref_leaves)
            row.update(ok=c.ok, max_abs_diff=c.max_abs_diff, max_rel_diff=c.max_rel_diff,
                       mismatch=c.mismatch.describe() if c.mismatch else None)
            if picks:
                row["sampled"] = True
        problems = self._runtime_problems(report, row["ok"], ref_leaves)
        if row["ok"] and "precision_probe" not in self.details:
            finding = self._precision_probe(ref_model, seed, leaves, ref_leaves, picks)
            if finding:
                problems.append(finding)
        del leaves
        return report, {"row": row, "flags": flags, "problems": problems,
                        "ref_probe": _probe(ref_leaves) if probe else None}

    def _correctness(self, ref_model) -> float:
        cfg = self.cfg
        n = cfg.num_correct_trials
        results = []
        aten: dict[str, int] = {}
        kernels: dict[str, int] = {}
        flags = {"inputs_modified": False, "aliases_input": False}
        problems: list[tuple[str, str]] = []
        probes: list[list] = []
        first_mismatch = failed_seed = None
        max_abs = max_rel = 0.0
        for i in range(n):   # outputs too large to hand over in full every time are, in the first trial
            seed = secrets.randbits(63)
            report, judged = self._trial(ref_model, seed, full=i == 0, probe=True)
            for k, v in (report.get("aten_ops") or {}).items():
                aten[str(k)] = aten.get(str(k), 0) + int(v)
            for k, v in (report.get("device_kernels") or {}).items():
                kernels[str(k)] = kernels.get(str(k), 0) + int(v)
            for k in flags:
                flags[k] |= judged["flags"][k]
            problems += judged["problems"]
            probes.append(judged["ref_probe"])
            row = judged["row"]
            results.append(row)
            max_abs, max_rel = max(max_abs, row.get("max_abs_diff", 0.0)), max(max_rel, row.get("max_rel_diff", 0.0))
            if not row["ok"] and first_mismatch is None:
                first_mismatch, failed_seed = row["mismatch"], seed
        self.details.update({"trials": results, "aten_ops": aten, "device_kernels": dict(list(kernels.items())[:50])})
        passed = sum(r["ok"] for r in results)
        q = passed / n
        bad_ops = forbidden_ops(aten)
        if bad_ops:
            raise _Verdict(Category.CHEATING, feedback.cheating(
                "forbidden_op", "ModelNew.forward ran PyTorch compute ops instead of (or besides) your kernels",
                bad_ops), rule="forbidden_op", forbidden_ops=bad_ops, q=q)
        if problems:
            rule, message = problems[0]
            raise _Verdict(Category.CHEATING, feedback.cheating(rule, f"{RUNTIME_RULES[rule]}: {message}"),
                           rule=rule, q=q)
        if self.backend.is_gpu and not candidate_kernels(kernels):
            raise _Verdict(Category.CHEATING, feedback.cheating(
                "no_device_kernel", "no device kernel of your own ran in ModelNew.forward"), rule="no_device_kernel",
                q=q)
        if flags["inputs_modified"]:
            raise _Verdict(Category.CHEATING, feedback.cheating(
                "input_mutation", "ModelNew.forward modified its input tensors in place (the reference does not)"),
                rule="input_mutation", q=q)
        if flags["aliases_input"]:
            raise _Verdict(Category.CHEATING, feedback.cheating(
                "output_aliases_input", "ModelNew.forward returned memory of an input tensor (the reference "
                                        "returns new tensors)"), rule="output_aliases_input", q=q)
        if passed < n:
            self._check_reference_repeats(ref_model, failed_seed)
            raise _Verdict(Category.CORRECTNESS_ERROR, feedback.correctness(q, passed, n, first_mismatch, max_abs,
                                                                            max_rel), q=q)
        self._check_reference_depends_on_inputs(probes)
        self._decoy_check(ref_model, q)
        return q

    def _check_reference_depends_on_inputs(self, probes: list[list]) -> None:
        """Before a pass is the candidate's: the reference's outputs on the trials' different inputs are not all
        the same within the tolerance. Where they are (KernelBench's level2/83 clamps min(x, 0) to [0, 1]: zeros
        for every input; level2/23 averages a GroupNorm's output: 0 up to rounding), a kernel that ignores its
        inputs and writes that constant passes every trial, so no check of values can score a kernel: the task
        is broken, an infra verdict. Compared on ``_probe``'s samples of the outputs, far more tightly than
        a candidate is (``reference_ignores_inputs``): a reference whose output varies by less than the tolerance
        is still scored (a constant then passes too: that task's weakness, as KernelBench's own later versions fix
        by scaling such inputs at random)."""
        if reference_ignores_inputs(probes, self.cfg.tolerance, self.cfg.scale_floor):
            raise _Verdict(Category.INFRA, feedback.infra(
                f"the task's reference gives the same output for the inputs of all {len(probes)} correctness trials: "
                "a kernel that ignores its inputs would pass, so the task cannot score a kernel", REFERENCE_INSENSITIVE),
                rule=REFERENCE_INSENSITIVE)

    def _check_reference_repeats(self, ref_model, seed: int | None) -> None:
        """Before a mismatch is the candidate's: the reference gives the same outputs twice for the inputs of the
        failed trial. One that does not (a hidden state kept across calls, as KernelBench v0.1's VanillaRNN) cannot be
        matched by any kernel: the task is broken, an infra verdict, not a -1 for the candidate. (Dropout repeats:
        every call is seeded.)"""
        if seed is None:
            return
        first = self._reference(ref_model, seed)[0]
        again = self._reference(ref_model, seed)[0]
        c = self._compare(again, first)
        if not c.ok:
            raise _Verdict(Category.INFRA, feedback.infra(
                "the task's reference is not repeatable: two calls on the same inputs differ ("
                + (c.mismatch.describe() if c.mismatch else "outputs differ") + "); a stateful or random reference "
                "cannot score a kernel", REFERENCE_NOT_REPEATABLE), rule=REFERENCE_NOT_REPEATABLE)

    def _hidden_trial(self, ref_model, batch: int) -> None:
        """A correctness trial among the timed calls: one call of a batch of ``batch`` calls made and run as a timed
        batch is, at a secret position (``_ask_trial``). The candidate cannot tell it from a timed call, so one
        that computes with PyTorch (or wrongly, or off its extension) once its correctness trials are over, or only
        where its inputs lie as a timed batch's do, is judged like in a correctness trial, with the profiler on. The
        ablation trial that follows (``_decoy_check``) is a second judged call of the same batch, at a secret position
        after the hidden call's, or a round of its own where the hidden call is the batch's last (a batch of one)."""
        # the ablation call after the hidden one, never before: a native call's results overwritten are seen by the
        # calls that follow (the ablation is recognisable), so an ablation first warned of a judged call to come
        # (review of session 40). The batch ends with it, so nothing is left to warn.
        batch = max(int(batch), 1)
        at = secrets.randbelow(batch)
        ablation = (at + 1 + secrets.randbelow(batch - at - 1), secrets.randbits(63)) if at < batch - 1 else None
        report, judged = self._trial(ref_model, secrets.randbits(63), batch=batch, at=at, ablation=ablation)
        bad_ops = forbidden_ops(report.get("aten_ops") or {})
        if bad_ops:
            raise _Verdict(Category.CHEATING, feedback.cheating(
                "forbidden_op", "ModelNew.forward ran PyTorch compute ops while being timed", bad_ops),
                rule="forbidden_op", forbidden_ops=bad_ops, q=1.0)
        if judged["problems"]:
            rule, message = judged["problems"][0]
            raise _Verdict(Category.CHEATING, feedback.cheating(rule, f"{RUNTIME_RULES[rule]}: {message}"),
                           rule=rule, q=1.0)
        if self.backend.is_gpu and not candidate_kernels(report.get("device_kernels") or {}):
            raise _Verdict(Category.CHEATING, feedback.cheating(
                "no_device_kernel", "no device kernel of your own ran in ModelNew.forward while being timed"),
                rule="no_device_kernel", q=1.0)
        if not judged["row"]["ok"] or any(judged["flags"].values()):
            raise _Verdict(Category.CHEATING, feedback.cheating(
                "timing_output_mismatch", "a call made while being timed was wrong ("
                + str(judged["row"]["mismatch"] or "it modified or returned its inputs")
                + "); the kernel must compute the result on every call"), rule="timing_output_mismatch", q=1.0)
        # an ablation trial among the timed calls too: a decoy that counts its calls ran its kernel for real in the
        # correctness phase (its ablation trial is always the call after the last correctness trial) and only then
        # handed back allowed data movement beside a token native call. In the same round as the hidden trial where
        # the batch allows: a round of its own, always right after the hidden trial's, was a round the candidate
        # could expect to be ablated
        self._decoy_check(ref_model, 1.0, batch=batch, stashed_seed=ablation[1] if ablation else None)

    def _timing(self, ref_model, retry: bool = True) -> tuple[float, float, float | None]:
        import random
        cfg = self.cfg
        runners = ["ref", "cand"] + (["ref_compile"] if cfg.compare_torch_compile else [])
        self._timing_runners = runners   # hidden trials run rounds of these (``_ask_trial``)
        rng = random.Random(secrets.randbits(64))
        warm = _checked(self._ask({"op": "warmup", "n": cfg.num_warmup, "seed": secrets.randbits(63),
                                   "runners": runners, "compile_ref": cfg.compare_torch_compile,
                                   "hide_dispatch": cfg.timing_hide_dispatch}, "warmed"),
                        {"est_ms": dict, "input_bytes": (int, float), "output_bytes": dict, "flush_bytes": int,
                         **_INTEGRITY_FIELDS})
        self._raise_runtime_violations(warm, q=1.0)
        est = {r: _number(warm.get("est_ms", {}).get(r)) for r in runners}
        out_bytes = {r: _count(warm.get("output_bytes", {}).get(r)) for r in runners}
        reps = choose_reps(est, _count(warm.get("input_bytes")), out_bytes, cfg.timing_batch_ms,
                           cfg.max_timing_reps, cfg.timing_memory_bytes, _number(warm.get("flush_ms"), 0.0))
        self.details["flush_bytes"] = warm.get("flush_bytes")
        spin_bound_ms = 1.1 * _number(warm.get("flush_ms"), 0.0) if _count(warm.get("hide_cycles")) else 0.0
        self.details["dispatch"] = {"enqueue_ms": _number(warm.get("enqueue_ms"), 0.0),
                                    "hide_cycles": _count(warm.get("hide_cycles"))}
        audits_left = min(cfg.num_timing_audits, cfg.num_timing_trials)
        calls: list[TimedCall] = []
        trial_s: list[float] = []   # parent wall time of each trial
        done = 0
        last_checked = -1   # the last trial whose timed output was audited
        for j in range(cfg.num_timing_trials):
            # the budget counts trials at their median pace, so one stalled call cannot end timing early (and
            # with it the chance of an audit); the run timeout still bounds a candidate that stalls throughout
            pace = statistics.median(trial_s) if trial_s else 0.0
            if j >= 3 and pace * j > cfg.time_budget_s:
                break
            # the trial that will probably end timing is audited too, so behaving only early gains nothing
            last = j == cfg.num_timing_trials - 1 or (j + 1 >= 3 and pace * (j + 1) > cfg.time_budget_s)
            # the random audits, drawn trial by trial (selection sampling) against the trials the budget is expected
            # to allow, so that all of them happen whether timing ends at 120 trials or at 40
            expected = cfg.num_timing_trials if j < 3 or pace <= 0 else \
                min(cfg.num_timing_trials, max(j + 1, int(cfg.time_budget_s / pace)))
            audit = audits_left > 0 and rng.random() * max(expected - j, 1) < audits_left
            audits_left -= audit
            t_trial = time.monotonic()
            n = reps
            # one seed per call and runner: the child never holds a reference output for the inputs the
            # candidate is timed on (a candidate that finds the reference's outputs in its process replays
            # wrong answers, which the audits see)
            seeds = {r: [secrets.randbits(63) for _ in range(n)] for r in runners}
            self._ask({"op": "prepare", "seeds": seeds, "runners": runners}, "prepared")
            order = list(runners)
            rng.shuffle(order)
            trial: dict[str, TimedCall] = {}
            audit_s = 0.0   # the parent's audits of this trial: not part of its pace (its commitment is: every
                            # trial of a sampled check makes one, and it holds the device as the calls do)
            for runner in order:
                t0 = time.monotonic()
                reply = _checked(self._ask({"op": "call", "runner": runner}, "called"), _CALLED_FIELDS)
                wall_ms = (time.monotonic() - t0) * 1e3
                self._raise_runtime_violations(reply, q=1.0)
                if runner == "cand" and self.sampled:
                    # a commitment to every batch (asking only for the audited ones would tell the child which
                    # those are), read and sealed before any audit draws its seed
                    offer = self._device_offer("commit", n * self._ref_commit_bytes)
                    got = _checked(self._ask({"op": "commit", "commit_k": cfg.output_sample_elements,
                                              **({"commit_out": offer} if offer else {})}, "committed"),
                                   {"commit_fd": int, "commit_layout": dict, "device_error": str, **_INTEGRITY_FIELDS})
                    self._raise_runtime_violations(got, q=1.0)
                    self._batch_commit, self._batch_calls = self._read_commitment(
                        got, self._commit_limit(n), offered=offer is not None), n
                rep_ms = [_number(x) for x in reply.get("rep_ms", [])]
                if len(rep_ms) != n:
                    rep_ms = [math.nan] * n   # a reply that does not match the request is implausible
                trial[runner] = TimedCall(runner, _number(reply.get("span_ms")), wall_ms, rep_ms,
                                          _number(reply.get("flush_ms")), spin_ms=_number(reply.get("spin_ms"), 0.0))
                if runner == "cand" and not reply.get("plain_tensors", False):
                    raise _Verdict(Category.CHEATING, feedback.cheating(
                        "tensor_subclass_output", "a timed call returned a tensor subclass (lazy output)"),
                        rule="tensor_subclass_output", q=1.0)
                shared = runner == "cand" and reply.get("outputs_shared", False)
                if shared:
                    # calls of the batch returned the same storage (a reused output buffer): only the last
                    # call's result survives, so audit that one and time one call per request from now on
                    self.details["timing_outputs_shared"] = True
                if runner == "cand" and (audit or last):
                    # several calls of the batch, picked after it ran: a candidate that does the real work
                    # on some calls only (batch-and-skip) is caught unless it skips almost none
                    picks = [n - 1] if shared else sorted(rng.sample(range(n), min(n, cfg.audit_calls_per_trial)))
                    t_audit = time.monotonic()
                    for k in picks:
                        self._audit(ref_model, seeds["cand"][k], k, trial=j)
                    audit_s += time.monotonic() - t_audit
                    last_checked = j
                if shared:
                    reps = 1
            if last_checked == j:
                # once every runner of this trial has run: a hidden trial's round prepares inputs anew
                t_audit = time.monotonic()
                self._hidden_trial(ref_model, n)
                audit_s += time.monotonic() - t_audit
            # the span floor subtracts the reference's cache clears (same buffer, same trial) and each call's own
            # dispatch-hiding spins, at most the warm-up's whole flush each (timing.floor_flush)
            for c in trial.values():
                c.floor_flush_ms = floor_flush(trial["ref"], c, spin_bound_ms)
            calls.extend(trial[r] for r in order)
            trial_s.append(time.monotonic() - t_trial - audit_s)
            done += 1
        if last_checked != done - 1:   # timing ended sooner than its pace predicted: a hidden trial at the end
            self._hidden_trial(ref_model, reps)
        problem = implausible_timing(calls)
        by = {r: [c.call_ms for c in calls if c.runner == r] for r in runners}
        timing = {r: stats(v) for r, v in by.items()}
        timing.update(trials=done, calls_per_trial=reps, wall_ms=stats([c.wall_ms for c in calls if c.runner == "cand"]))
        # the same trials' ratios, paired (ref and cand of one trial ran back to back): a measure of how much
        # of the speedup's spread is drift between trials rather than noise within them
        pairs = [r / c for r, c in zip(by["ref"], by["cand"]) if math.isfinite(r) and math.isfinite(c) and c > 0]
        if pairs:
            timing["paired_speedup_median"] = statistics.median(pairs)
        med = {r: timing[r]["median"] for r in runners}
        # a time no device allows is cheating whatever the overhead statistics say (they may only be noisy)
        if math.isfinite(med["cand"]) and not reported_time_problem(calls):
            self._speed_of_light(med["cand"])
        if problem and retry and not reported_time_problem(calls):
            # only the statistical overhead check failed: scheduling noise on a loaded host can do that, so
            # time once more (fresh trials). A candidate that hides work outside its span fails again, and
            # one that behaves only once it is re-timed gains nothing: the slower of the two rounds counts.
            self.details["timing_repeated"] = {"reason": problem, "first_round": timing}
            second = self._timing(ref_model, retry=False)
            if med["cand"] > 0 and second[1] > 0 and med["ref"] / med["cand"] < second[0] / second[1]:
                self.details["timing"] = timing
                return med["ref"], med["cand"], med.get("ref_compile")
            return second
        self.details["timing"] = timing
        if problem:
            raise _Verdict(Category.CHEATING, feedback.cheating("implausible_timing", problem),
                           rule="implausible_timing", q=1.0)
        return med["ref"], med["cand"], med.get("ref_compile")

    def _audit(self, ref_model, seed: int, rep: int = 0, trial: int | None = None) -> None:
        sample = self._sample_seed()   # drawn after the audited batch ran
        msg = {"op": "audit", "rep": rep, **({"sample_seed": sample[0], "sample_k": sample[1]} if sample else {})}
        # a full audit goes through the device buffer too: an audit hands over a timed call's whole output while the
        # device is held alone (through a memfd, 256 MB cost the child ~0.23 s each, a dozen times per check)
        report = self._ask_sampled(msg, "audited") if sample else \
            self._ask_handover("out", self._ref_buffer_bytes, msg, "audited")
        self._raise_runtime_violations(report, q=1.0)
        ref_leaves, ref_spec, _, _ = self._reference(ref_model, seed)
        commitment = None
        if sample is not None:
            call = rep % max(self._batch_calls, 1)   # the child audits output rep % (calls in the batch)
            commitment = {i: d for (r, i), d in (self._batch_commit or {}).items() if r == call}
        leaves, targets, picks = self._handed_over(ref_leaves, report, sample, commitment)
        c = self._compare(leaves, targets)
        self._full_position(c, picks, ref_leaves)
        self.details.setdefault("audits", []).append({"ok": c.ok, "max_rel_diff": c.max_rel_diff, "trial": trial,
                                                      "call": rep})
        if not c.ok or not same_structure(report.get("spec"), ref_spec):
            raise _Verdict(Category.CHEATING, feedback.cheating(
                "timing_output_mismatch", "an output produced while being timed was wrong (" +
                (c.mismatch.describe() if c.mismatch else "structure differs") + "); the kernel must compute the "
                "result on every call"), rule="timing_output_mismatch", q=1.0)


def _out_of_memory_because_of_others(result: VerifyResult, cfg: VerifierConfig, device_index: int | None) -> bool:
    """A GPU runtime error that reads as out-of-memory, while the device's free memory (read now, the
    candidate's processes gone) is too little for this task: the shortage was other processes'. The text
    alone never decides it, since the candidate writes it."""
    if result.category != Category.RUNTIME_ERROR or not _OUT_OF_MEMORY.search(result.feedback or ""):
        return False
    if cfg.backend == "cpu":
        return False
    from . import inputs
    return inputs.memory_taken_by_others(result.details.get("footprint"),
                                         inputs.device_free_bytes(cfg.backend, device_index or 0))


def _write_new_file(path: str, text: str) -> None:
    """Create ``path`` (never through a symlink or over an existing file: a spare's directory may have
    been reachable by another candidate's process when the sandbox runs without Landlock)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


@contextlib.contextmanager
def _parent_threads(n: int):
    """This thread's torch intra-op threads capped at ``n`` while a CPU check runs here. The parent's own work (the
    reference's outputs for the correctness trials, comparisons) is light, and the cores belong to the child being
    timed, the next warm spare starting and the compile workers: with more threads than free cores, every small op
    waits at OpenMP barriers for a thread the scheduler has parked (measured on two busy cores: comparisons 6-10x
    slower, a teacher check ~0.9 s longer). ``n`` is the child's ``cpu_threads``, so the reference's outputs are
    computed as the candidate runs."""
    import torch
    old = torch.get_num_threads()
    if n >= old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run_candidate(task: Task, code: str, build: BuildResult, cfg: VerifierConfig,
                  device_index: int | None = None, spares: WarmSpares | None = None) -> VerifyResult:
    """Device stage: a fresh sandboxed child pinned to one device; correctness, fallback check, timing.
    With ``spares`` (a farm device worker), the child is one started ahead of time and the next is started
    while this candidate runs (``verifier.warm_spare``)."""
    if cfg.backend != "cpu":   # on a GPU the parent's comparisons run on the device: its host threads idle
        return _run_candidate(task, code, build, cfg, device_index, spares)
    with _parent_threads(max(1, cfg.cpu_threads)):
        return _run_candidate(task, code, build, cfg, device_index, spares)


def _run_candidate(task: Task, code: str, build: BuildResult, cfg: VerifierConfig, device_index: int | None,
                   spares: WarmSpares | None) -> VerifyResult:
    try:
        result = _DeviceStage(task, code, build, cfg, device_index, spares).run()
        if result.details.get("device_use") != "exclusive" and _out_of_memory_because_of_others(result, cfg,
                                                                                                device_index):
            # the device was shared and other processes hold the memory the candidate ran short of: the
            # verdict comes from a run with the device to itself
            first = result.feedback[:300]
            result = _DeviceStage(task, code, build, cfg, device_index, spares, force_alone=True).run()
            result.details["rerun_alone"] = f"ran out of memory while sharing the device: {first}"
        if _out_of_memory_because_of_others(result, cfg, device_index):   # even alone: not the candidate's
            return _finish(task, cfg, Category.INFRA, feedback.infra(
                "the device ran out of memory that other workers' processes hold; retried later"),
                details=result.details, code_hash=build.code_hash, code=code)
        return result
    except Exception as e:
        return _finish(task, cfg, Category.INFRA, feedback.infra(f"{type(e).__name__}: {e}"),
                       details={"traceback": traceback.format_exc()[-4000:]}, code_hash=build.code_hash)
