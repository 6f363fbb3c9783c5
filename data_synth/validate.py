"""Validation of a reference program by running it (CUDA-Agent / TOS filters, research note §1.3):

* ``runs``: the module loads and a forward pass succeeds, built exactly as the verifier builds it
  (``verifier.inputs``: seeded inputs and construction, floating tensors in the task's precision);
* ``finite``: every floating output is finite;
* ``deterministic``: a second model and input set from the same seeds give bitwise-equal outputs;
* ``input_dependent``: other inputs give a clearly different output (not a near-constant function);
* ``not_constant``: an output with several elements is not one repeated value;
* ``compile_agrees``: ``torch.compile`` (Inductor) matches eager within a scale-relative tolerance. On a CPU a
  compile costs seconds (tens for the first in a process), so it runs on a deterministic sample of tasks
  (``compile_fraction``), but when it runs it is the real Inductor;
* ``runtime``: the eager forward (one thread on the cpu, like the verifier's timing; the fastest of a few
  runs, which a busy machine disturbs least) lies in a band where a speedup is measurable: not dominated by
  call overhead, not so slow that timing wastes the farm. It is the one check that depends on the machine:
  a task whose time sits at a band edge can be accepted on one run and skipped on another;
* ``prompt_metadata``: the prompt builder can show shapes/strides/dtypes (``describe_task_inputs`` ran
  ``get_inputs()`` on the meta device).

A task failing a check is skipped with the check's name and the evidence, never dropped silently.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from typing import Any

import torch
import torch._inductor.config

from megatron_rl.rollout.prompts import describe_task_inputs
from verifier import inputs as vinputs
from verifier.size_profiles import ManifestEntry, apply_size_profile
from verifier.tasks import load_task_module

from .generate import GeneratedTask
from .taskset import verifier_task
from .util import DataSynthError

log = logging.getLogger("data_synth")
CHECKS = ("runs", "finite", "deterministic", "input_dependent", "not_constant", "compile_agrees", "runtime",
          "prompt_metadata")
BANDS_MS = {"cpu": (0.01, 250.0), "gpu": (0.01, 100.0)}


@dataclasses.dataclass
class ValidationConfig:
    profile: str = "cpu"               # size profile the reference runs at
    device: str = "cpu"
    min_ms: float | None = None        # runtime band of one eager forward; None: the profile's default
    max_ms: float | None = None
    compile_fraction: float = 0.0      # share of tasks (chosen by a hash of the id) checked against torch.compile
    compile_rtol: float = 1e-3
    compile_backend: Any = "inductor"  # torch.compile backend (a name or a callable)
    # Inductor on a CPU first proves each vector ISA by compiling and loading a probe in a fresh interpreter
    # (tens of seconds per process); trusting the CPU's flags skips that, as TORCHINDUCTOR_VEC_ISA_OK=1 does
    trust_cpu_isa: bool = True
    # the band is narrowed by this factor on both sides; generation uses 2, so a task it accepts stays inside
    # the plain band when validated again on a machine that is faster or busier
    band_margin: float = 1.0
    timing_runs: int = 5
    threads: int = 1                   # torch intra-op threads while timing on the cpu (the verifier uses 1)
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.profile not in BANDS_MS:
            raise DataSynthError(f"profile must be one of {sorted(BANDS_MS)}, got {self.profile!r}")
        if self.band_margin < 1.0:
            raise DataSynthError(f"band margin must be >= 1, got {self.band_margin}")
        if not 0.0 <= self.compile_fraction <= 1.0:
            raise DataSynthError(f"compile fraction must be in [0, 1], got {self.compile_fraction}")
        lo, hi = self.band
        if not 0 <= lo < hi:
            raise DataSynthError(f"runtime band needs 0 <= min_ms < max_ms, got {lo}..{hi}")

    @property
    def band(self) -> tuple[float, float]:
        lo, hi = BANDS_MS[self.profile]
        lo, hi = (lo if self.min_ms is None else self.min_ms, hi if self.max_ms is None else self.max_ms)
        return lo * self.band_margin, hi / self.band_margin

    def compile_selected(self, task_id: str) -> bool:
        if self.compile_fraction <= 0:
            return False
        h = int.from_bytes(hashlib.sha256(f"{self.seed}/{task_id}".encode()).digest()[:8], "big") / 2 ** 64
        return h < self.compile_fraction


@dataclasses.dataclass
class ValidationResult:
    task_id: str
    ok: bool
    reason: str | None = None          # "<check>: <evidence>" of the first failing check
    checks: dict[str, str] = dataclasses.field(default_factory=dict)   # check -> "ok" | "skipped" | failure
    eager_ms: float | None = None
    outputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    inputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)   # what the prompt shows
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Fail(Exception):
    def __init__(self, check: str, detail: str):
        super().__init__(f"{check}: {detail}")
        self.check, self.detail = check, detail


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)) and out and all(isinstance(o, torch.Tensor) for o in out):
        return list(out)
    raise _Fail("runs", f"forward() must return a tensor or a tuple of tensors, got {type(out).__name__}")


def _scale(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def _run(module, precision: str, device: str, seed: int, input_seed: int,
         rng_seed: int | None = None) -> tuple[torch.nn.Module, list, list]:
    """One forward built the verifier's way; ``rng_seed`` reseeds the global RNG just before the call, so a
    reference that draws random numbers in forward() (dropout, randn) shows up as non-deterministic."""
    init = vinputs.make_init_inputs(module, seed, device)
    model = vinputs.build_model(module.Model, init, seed, torch.device(device), precision)
    args = vinputs.make_inputs(module, input_seed, device, precision)
    if rng_seed is not None:
        torch.manual_seed(rng_seed)
    with torch.no_grad():
        out = _tensors(model(*args))
    return model, args, out


def _precision(task: GeneratedTask) -> str:
    p = (task.precisions or ["float32"])[0]
    return p if p in ("float32", "float16", "bfloat16") else "float32"


def validate_task(task: GeneratedTask, cfg: ValidationConfig | None = None) -> ValidationResult:
    """Run every check on one task (written to disk or not); never raises for a bad reference."""
    cfg = cfg or ValidationConfig()
    t0 = time.perf_counter()
    res = ValidationResult(task_id=task.task_id, ok=False)
    try:
        _validate(task, cfg, res)
        res.ok = True
    except _Fail as f:
        res.checks[f.check] = f.detail
        res.reason = f"{f.check}: {f.detail}"
    except Exception as e:  # noqa: BLE001 - a broken reference is a skip with its reason, not a crash
        res.checks["runs"] = f"{type(e).__name__}: {e}"
        res.reason = f"runs: {type(e).__name__}: {str(e)[:300]}"
    res.seconds = round(time.perf_counter() - t0, 3)
    for c in CHECKS:
        res.checks.setdefault(c, "not reached" if not res.ok else "skipped")
    if not res.ok:
        log.warning("skip %s: %s", task.task_id, res.reason)
    return res


def _source_for(task: GeneratedTask, profile: str) -> Any:
    vt = verifier_task(task)
    if profile != "cpu" and task.sizes.get(profile):
        entry = ManifestEntry(path=vt.path, task_id=vt.task_id, level=vt.level, op_family=None, backend="any",
                              precisions=tuple(task.precisions), sizes=task.sizes)
        vt = apply_size_profile(vt, profile, entry)
    return vt


def _validate(task: GeneratedTask, cfg: ValidationConfig, res: ValidationResult) -> None:
    vt = _source_for(task, cfg.profile)
    try:
        module = load_task_module(vt, module_name=f"data_synth_validate_{abs(hash(task.task_id))}")
    except Exception as e:  # noqa: BLE001
        raise _Fail("runs", f"the task does not load: {type(e).__name__}: {e}") from None
    precision = _precision(task)
    seed = cfg.seed
    try:
        _, _, out1 = _run(module, precision, cfg.device, seed, seed)
    except _Fail:
        raise
    except Exception as e:  # noqa: BLE001
        raise _Fail("runs", f"the reference raised {type(e).__name__}: {str(e)[:300]}") from None
    res.checks["runs"] = "ok"
    res.outputs = [{"shape": list(o.shape), "dtype": str(o.dtype).replace("torch.", "")} for o in out1]

    for i, o in enumerate(out1):
        if o.is_floating_point() and not bool(torch.isfinite(o).all()):
            bad = int((~torch.isfinite(o)).sum())
            raise _Fail("finite", f"output {i} has {bad} non-finite values of {o.numel()}")
    res.checks["finite"] = "ok"

    _, _, out2 = _run(module, precision, cfg.device, seed, seed, rng_seed=seed + 104729)
    for i, (a, b) in enumerate(zip(out1, out2)):
        if a.shape != b.shape or not torch.equal(a, b):
            diff = float((a.double() - b.double()).abs().max()) if a.shape == b.shape else float("nan")
            raise _Fail("deterministic", f"output {i} differs between two runs on the same inputs (max |diff| "
                                         f"{diff:.3g}): forward() draws random numbers or is otherwise unstable")
    res.checks["deterministic"] = "ok"

    _, _, out3 = _run(module, precision, cfg.device, seed, seed + 7919)
    changed = False
    for a, b in zip(out1, out3):
        if a.shape != b.shape:
            changed = True
            break
        if a.is_floating_point():
            scale = max(_scale(a), _scale(b), 1e-12)
            if float((a.double() - b.double()).abs().max()) > 1e-3 * scale:
                changed = True
        elif not torch.equal(a, b):
            changed = True
    if not changed:
        raise _Fail("input_dependent", "other inputs give the same output (within 1e-3 of its scale)")
    res.checks["input_dependent"] = "ok"

    for i, o in enumerate(out1):
        if o.numel() > 1:
            flat = o.reshape(-1)
            if o.is_floating_point():
                spread = float(flat.double().max() - flat.double().min())
                if spread <= 1e-6 * max(_scale(o), 1e-12):
                    raise _Fail("not_constant", f"output {i} holds one value ({float(flat[0]):.4g}) in all "
                                                f"{o.numel()} elements")
            elif bool((flat == flat[0]).all()):
                raise _Fail("not_constant", f"output {i} holds one value in all {o.numel()} elements")
    res.checks["not_constant"] = "ok"

    if cfg.compile_selected(task.task_id):
        _compile_check(module, precision, cfg, out1)
        res.checks["compile_agrees"] = "ok"
    else:
        res.checks["compile_agrees"] = "skipped"

    res.eager_ms = _time_eager(module, precision, cfg)
    lo, hi = cfg.band
    if not lo <= res.eager_ms <= hi:
        raise _Fail("runtime", f"eager forward takes {res.eager_ms:.4g} ms, outside the {cfg.profile} band "
                               f"[{lo:g}, {hi:g}] ms")
    res.checks["runtime"] = "ok"

    meta = describe_task_inputs(vt.source, vt.path)
    if meta.method != "meta":
        raise _Fail("prompt_metadata", f"the prompt cannot show input shapes: {meta.note}")
    res.inputs = [{"name": a.name, "kind": a.kind, "shape": list(a.shape) if a.shape is not None else None,
                   "stride": list(a.stride) if a.stride is not None else None, "dtype": a.dtype, "value": a.value}
                  for a in meta.inputs]
    res.checks["prompt_metadata"] = "ok"


def _compile_check(module, precision: str, cfg: ValidationConfig, eager: list[torch.Tensor]) -> None:
    init = vinputs.make_init_inputs(module, cfg.seed, cfg.device)
    model = vinputs.build_model(module.Model, init, cfg.seed, torch.device(cfg.device), precision)
    args = vinputs.make_inputs(module, cfg.seed, cfg.device, precision)
    patch = {"cpp.vec_isa_ok": True} if cfg.trust_cpu_isa and torch._inductor.config.cpp.vec_isa_ok is None else {}
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, dynamic=False, backend=cfg.compile_backend)
        with torch.no_grad(), torch._inductor.config.patch(patch):
            out = _tensors(compiled(*args))
    except _Fail:
        raise
    except Exception as e:  # noqa: BLE001
        raise _Fail("compile_agrees", f"torch.compile failed: {type(e).__name__}: {str(e)[:300]}") from None
    tol = {"float32": cfg.compile_rtol, "float16": 1e-2, "bfloat16": 2e-2}[precision]
    for i, (a, b) in enumerate(zip(eager, out)):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise _Fail("compile_agrees", f"output {i}: eager {tuple(a.shape)} {a.dtype}, compiled "
                                          f"{tuple(b.shape)} {b.dtype}")
        if a.is_floating_point():
            scale = max(_scale(a), 1e-12)
            err = float((a.double() - b.double()).abs().max())
            if err > tol * scale + tol * 1e-3:
                raise _Fail("compile_agrees", f"output {i}: max |eager - compiled| {err:.3g} > {tol:g} x scale "
                                              f"{scale:.3g}")
        elif not torch.equal(a, b):
            raise _Fail("compile_agrees", f"output {i}: integer outputs differ")


def _time_eager(module, precision: str, cfg: ValidationConfig) -> float:
    init = vinputs.make_init_inputs(module, cfg.seed, cfg.device)
    model = vinputs.build_model(module.Model, init, cfg.seed, torch.device(cfg.device), precision)
    args = vinputs.make_inputs(module, cfg.seed, cfg.device, precision)
    cuda = cfg.device.startswith("cuda")
    old_threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(cfg.threads)
    try:
        with torch.no_grad():
            t = time.perf_counter()
            model(*args)
            first_ms = (time.perf_counter() - t) * 1e3
            runs = 1 if first_ms > 20 * cfg.band[1] else cfg.timing_runs
            times = []
            for _ in range(runs):
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                model(*args)
                if cuda:
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3)
    finally:
        if not cuda:
            torch.set_num_threads(old_threads)
    return float(min(times))
