"""Infra verdicts that are the task's own fault carry a rule of ``TASK_FAULT_RULES`` (never retried); those of the
moment carry none (retried).

- the memory gate: over the device's or host's whole memory (or the child's limit) is ``task_too_large``; over only
  what is free right now has no rule;
- a task module that does not execute is ``task_load_failed``; a reference whose ``get_init_inputs``/``Model``/
  ``get_inputs``/forward raises in the parent, and again on meta tensors, is ``reference_failed``; a candidate's own
  failure, or a memory or device error, is never taken for the task's;
- the meta-tensor footprint is computed once per (source, path, precision) in a process.
"""
import os

import pytest

from verifier import evaluate, inputs
from verifier.config import VerifierConfig
from verifier.evaluate import _DeviceStage, memory_problem, verify
from verifier.farm import TASK_FAULT_RULES
from verifier.tasks import load_task, load_task_module
from verifier.types import REFERENCE_FAILED, TASK_LOAD_FAILED, TASK_TOO_LARGE, Category

from . import test_hostile_outputs
from .candidates import calling, python_only, task_path

GiB = 1 << 30

RELU = open(task_path("relu")).read()

HINGE = test_hostile_outputs.HINGE   # KernelBench level1/100_HingeLoss.py at its full size: 36 GiB a trial


@pytest.fixture(autouse=True)
def _fresh_footprints():
    inputs.clear_footprint_cache()
    yield
    inputs.clear_footprint_cache()


def _task(tmp_path, name: str, source: str):
    path = tmp_path / "level1" / f"{name}.py"
    os.makedirs(path.parent, exist_ok=True)
    path.write_text(source)
    return load_task(str(path))


def _cfg(tmp_path, **kw):
    return VerifierConfig(build_cache_dir=str(tmp_path / "cache"), num_timing_trials=5, num_warmup=1,
                          time_budget_s=2.0, run_timeout_s=120.0, **kw)


RELU_CANDIDATE = python_only(calling("torch.relu(x)", "x"))


def test_the_new_task_fault_rules_are_never_retried():
    assert {TASK_TOO_LARGE, TASK_LOAD_FAILED, REFERENCE_FAILED} <= TASK_FAULT_RULES
    assert {"reference_not_repeatable", "reference_insensitive"} <= TASK_FAULT_RULES


# ------------------------------------------------------------------------------------------------- memory gate
FULL_RELU = inputs.Footprint(6 * GiB, 6 * GiB, 0, 6 * GiB)   # KernelBench level1/19_ReLU at float32: 54 GiB a trial


def test_the_memory_gate_tells_the_hosts_capacity_from_what_is_free_now():
    need = sum(inputs.trial_bytes(FULL_RELU))
    # fits the host's whole memory, not what is free now: other work holds it, a retry may pass
    busy = inputs.memory_problem(FULL_RELU, is_gpu=False, backend_name="cpu", host_free=20 * GiB,
                                 host_total=need + GiB, child_limit=64 * GiB)
    assert busy and busy.rule is None and busy.scope == "free_now"
    assert "20.0 GiB is available" in busy and "right now" in busy
    # more than the host has in all: the task's fault on this host, whatever is free
    whole = inputs.memory_problem(FULL_RELU, is_gpu=False, backend_name="cpu", host_free=20 * GiB,
                                  host_total=24 * GiB, child_limit=64 * GiB)
    assert whole.rule == TASK_TOO_LARGE and whole.scope == "capacity" and "24.0 GiB this host has in all" in whole
    assert "size profile `fit`" in whole
    # the child's configured limit is the task's fault too (the same every time)
    limit = inputs.memory_problem(FULL_RELU, is_gpu=False, backend_name="cpu", host_free=None, child_limit=16 * GiB)
    assert limit.rule == TASK_TOO_LARGE and "memory_limit_bytes" in limit
    # a GPU: the device's whole memory against what is free on it now
    gpu_busy = inputs.memory_problem(FULL_RELU, is_gpu=True, backend_name="cuda", host_free=None, child_limit=None,
                                     device_free=16 * GiB, device_total=140 * GiB)
    assert gpu_busy.rule is None and "cuda device memory" in gpu_busy
    gpu_small = inputs.memory_problem(FULL_RELU, is_gpu=True, backend_name="cuda", host_free=None, child_limit=None,
                                      device_free=16 * GiB, device_total=24 * GiB)
    assert gpu_small.rule == TASK_TOO_LARGE and "the device has in all" in gpu_small
    assert inputs.memory_problem(FULL_RELU, is_gpu=True, backend_name="cuda", host_free=None, child_limit=None,
                                 device_free=140 * GiB, device_total=140 * GiB) is None


def test_task_only_ignores_what_is_free_now(monkeypatch):
    """Choosing tasks ahead of time (the RL environment) asks about the whole memory only."""
    monkeypatch.setattr(inputs, "host_available_bytes", lambda: 1 * GiB)
    monkeypatch.setattr(inputs, "host_total_bytes", lambda: 512 * GiB)
    cfg, cpu = VerifierConfig(memory_limit_bytes=512 * GiB), evaluate.get_backend("cpu")
    details = {}
    now = memory_problem(FULL_RELU, cfg, cpu, 0, details)
    assert now.rule is None and details["memory_gate"] == {"scope": "free_now", "rule": None}
    assert memory_problem(FULL_RELU, cfg, cpu, 0, {}, task_only=True) is None
    monkeypatch.setattr(inputs, "host_total_bytes", lambda: 24 * GiB)
    assert memory_problem(FULL_RELU, cfg, cpu, 0, {}, task_only=True).rule == TASK_TOO_LARGE


def test_a_full_size_task_on_a_small_host_is_the_tasks_fault_and_one_on_a_busy_host_is_not(tmp_path, monkeypatch):
    task = _task(tmp_path, "100_HingeLoss", HINGE)
    candidate = python_only(calling("torch.relu(predictions)", "predictions, targets"))
    monkeypatch.setattr(inputs, "host_available_bytes", lambda: 22 * GiB)
    monkeypatch.setattr(inputs, "host_total_bytes", lambda: 24 * GiB)
    r = verify(task, candidate, _cfg(tmp_path))
    assert r.category == Category.INFRA and r.rule == TASK_TOO_LARGE and "build" not in r.details
    assert r.details["memory_gate"]["scope"] == "capacity" and "in all" in r.feedback
    monkeypatch.setattr(inputs, "host_total_bytes", lambda: 256 * GiB)   # the host is large, only busy now
    r = verify(task, candidate, _cfg(tmp_path))
    assert r.category == Category.INFRA and r.rule is None and "right now" in r.feedback
    assert r.details["memory_gate"] == {"scope": "free_now", "rule": None}


def test_host_total_is_at_least_what_is_available():
    total, avail = inputs.host_total_bytes(), inputs.host_available_bytes()
    assert total is not None and total > 0
    assert avail is None or avail <= total


# ------------------------------------------------------------------------------------ tasks that do not run
def test_a_task_that_fails_to_import_is_the_tasks_fault(tmp_path):
    task = _task(tmp_path, "bad_import", "import not_a_package_of_this_host\n" + RELU)
    r = verify(task, RELU_CANDIDATE, _cfg(tmp_path))
    assert r.category == Category.INFRA and r.rule == TASK_LOAD_FAILED and "not_a_package_of_this_host" in r.feedback
    assert "build" not in r.details   # before anything was compiled or run


def test_a_task_that_fails_to_load_for_want_of_memory_is_retried(tmp_path):
    task = _task(tmp_path, "oom_import", "raise MemoryError('no memory at import')\n" + RELU)
    r = verify(task, RELU_CANDIDATE, _cfg(tmp_path))
    assert r.category == Category.INFRA and r.rule is None


def test_the_device_stage_tags_a_task_that_does_not_load(tmp_path):
    """The farm's path (no cpu precheck): the device stage loads the task before any child starts."""
    from verifier.build import build_candidate
    from verifier.extract import extract_candidate
    cfg = _cfg(tmp_path)
    task = _task(tmp_path, "bad_import2", "import not_a_package_of_this_host\n" + RELU)
    code = extract_candidate(RELU_CANDIDATE, cfg.max_response_bytes)
    r = evaluate.run_candidate(task, code, build_candidate(task, code, cfg), cfg)
    assert r.category == Category.INFRA and r.rule == TASK_LOAD_FAILED


@pytest.mark.parametrize("name,old,new,where", [
    ("bad_init", "super().__init__()", "super().__init__()\n        raise ValueError('a bug in the task')",
     "construct"),
    ("bad_inputs", "return [torch.randn(batch_size, dim)]", "raise KeyError('no inputs')", "get_inputs()"),
    ("bad_forward", "return torch.relu(x)", "return torch.relu(x) + torch.ones(3)", "Model.forward"),
])
def test_a_reference_that_raises_is_the_tasks_fault_not_the_candidates(tmp_path, name, old, new, where):
    """A bug in the task's Model/get_inputs/forward was a runtime_error of the candidate (the child builds the
    reference beside ModelNew: -1 for any answer) or an untagged infra verdict, retried 3 x 4 x 3 times."""
    assert old in RELU
    task = _task(tmp_path, name, RELU.replace(old, new))
    r = verify(task, RELU_CANDIDATE, _cfg(tmp_path))
    assert r.category == Category.INFRA and r.rule == REFERENCE_FAILED, (r.category, r.rule, r.feedback[:300])
    assert where in r.feedback and r.reward is None


def test_a_broken_model_is_the_tasks_fault_even_when_its_inputs_do_not_run_on_meta_tensors(tmp_path):
    """The construction check ran the whole reference on meta tensors and gave up at a data-dependent get_inputs
    (``.item()``), leaving a broken Model.__init__ a -1 for the candidate; it now asks about construction only."""
    source = RELU.replace("super().__init__()", "super().__init__()\n        raise ValueError('a bug in the task')")
    source = source.replace("return [torch.randn(batch_size, dim)]",
                            "x = torch.randn(batch_size, dim)\n    return [x * float(x.sum().item() != 0)]")
    assert ".item()" in source
    r = verify(_task(tmp_path, "bad_init_data_dependent", source), RELU_CANDIDATE, _cfg(tmp_path))
    assert r.category == Category.INFRA and r.rule == REFERENCE_FAILED, (r.category, r.rule, r.feedback[:300])


def test_a_candidate_that_fails_to_construct_on_a_sound_task_is_still_its_own_error(tmp_path):
    broken = python_only('''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        raise ValueError("the candidate's own bug")

    def forward(self, x):
        return torch.relu(x)
''')
    r = verify(load_task(task_path("relu")), broken, _cfg(tmp_path))
    assert r.category == Category.RUNTIME_ERROR and "the candidate's own bug" in r.feedback


def _stage(tmp_path, source: str) -> _DeviceStage:
    stage = _DeviceStage.__new__(_DeviceStage)
    stage.cfg, stage.details = VerifierConfig(), {}
    stage.backend = evaluate.get_backend("cpu")
    stage.device = stage.backend.torch_device(0)
    stage.module = load_task_module(_task(tmp_path, "t", source))
    return stage


def test_memory_and_device_errors_of_the_reference_are_never_the_tasks_fault(tmp_path):
    """The candidate's child runs beside the parent's reference: it can exhaust the memory (or fault the device)
    the reference needs. Such errors stay retried, however the task behaves on meta tensors."""
    broken = _stage(tmp_path, RELU.replace("return torch.relu(x)", "return torch.relu(x) + torch.ones(3)"))
    err = MemoryError("out of memory")
    assert broken._reference_run_failure("forward", err) is err
    dev = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert broken._reference_run_failure("forward", dev) is dev
    for text in ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)",
                 "CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"):
        assert broken._reference_run_failure("forward", RuntimeError(text)).__class__ is RuntimeError, text
    assert broken._reference_construct_failure(RuntimeError("CUDA error: out of memory")).rule is None
    # a sound reference that failed here once (whatever the reason) is not the task's fault
    sound = _stage(tmp_path, RELU)
    once = RuntimeError("something odd")
    assert sound._reference_run_failure("forward", once) is once
    assert sound._reference_construct_failure(ValueError("odd")).rule is None
    # the same exception at another stage is no evidence either
    assert broken._reference_run_failure("get_inputs", RuntimeError("x")).__class__ is RuntimeError
    # the same exception at the same stage is
    v = broken._reference_run_failure("forward", RuntimeError("size mismatch"))
    assert v.category == Category.INFRA and v.rule == REFERENCE_FAILED


# --------------------------------------------------------------------------------------------- footprint cache
def test_the_footprint_is_computed_once_per_source_and_precision(tmp_path, monkeypatch):
    calls = []
    real = inputs.estimate_footprint
    monkeypatch.setattr(inputs, "estimate_footprint", lambda m, p: calls.append(p) or real(m, p))
    task = _task(tmp_path, "relu", RELU)
    a = inputs.task_footprint(task, "float32")
    b = inputs.task_footprint(task, "float32")
    assert a == b and len(calls) == 1 and a is not b   # a copy: callers may change theirs
    b.input_bytes = 1
    assert inputs.task_footprint(task, "float32").input_bytes == a.input_bytes
    assert inputs.task_footprint(task, "bfloat16").input_bytes == a.input_bytes // 2 and len(calls) == 2
    # the file changed (the same path): a new source, never the old footprint
    changed = _task(tmp_path, "relu", RELU.replace("dim = 512", "dim = 1024"))
    assert changed.path == task.path
    assert inputs.task_footprint(changed, "float32").input_bytes == 2 * a.input_bytes and len(calls) == 3
    # a size profile rewrites the source: its own entry
    from verifier.size_profiles import apply_size_profile
    fitted = apply_size_profile(_task(tmp_path, "big", RELU.replace("dim = 512", "dim = 67108864")), "fit")
    assert inputs.task_footprint(fitted, "float32").input_bytes <= 64 << 20 and len(calls) == 4


def test_the_footprint_cache_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs, "FOOTPRINT_CACHE_SIZE", 2)
    tasks = [_task(tmp_path, f"r{i}", RELU.replace("dim = 512", f"dim = {512 + i}")) for i in range(3)]
    for t in tasks:
        inputs.task_footprint(t, "float32")
    assert len(inputs._footprints) == 2
    inputs.task_footprint(tasks[0], "float32")   # evicted: computed again
    assert inputs.footprint_cache_stats == {"hits": 0, "misses": 4}


def test_a_verification_sizes_its_task_once_and_the_next_not_at_all(tmp_path, monkeypatch):
    """The cpu precheck and the device stage each ran the meta-tensor run (5-16 s for KernelBench's long RNNs)."""
    calls = []
    real = inputs.estimate_footprint
    monkeypatch.setattr(inputs, "estimate_footprint", lambda m, p: calls.append(p) or real(m, p))
    task = load_task(task_path("relu"))
    cfg = _cfg(tmp_path)
    for _ in range(2):
        r = verify(task, RELU_CANDIDATE, cfg)
        assert r.category != Category.INFRA, r.feedback
    assert calls == ["float32"]


def test_a_task_fault_verdict_does_not_say_it_will_be_retried():
    """Its text said "will be retried" and then "(the task's own fault: not retried)"."""
    from verifier import feedback
    from verifier.types import TASK_FAULT_RULES

    for rule in TASK_FAULT_RULES:
        text = feedback.infra("needs 54 GiB", rule)
        assert "not retried" in text and "will be retried" not in text and rule in text
    assert "will be retried" in feedback.infra("a worker died") and "will be retried" in feedback.infra("busy", None)
