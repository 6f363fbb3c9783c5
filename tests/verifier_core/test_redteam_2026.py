"""The 2026 reward hacks (issue 19): each class with its expected verdict, next to the honest candidate the
same defence must let through.

- L2 persistence and timer/event tampering from native code: static rules (no child);
- decoy kernels (a kernel that runs while the output comes from allowed data movement or is thrown away):
  the ablation trial;
- precision dress-up (float16 inputs passing the float32 tolerance on a reduction): the parent's precision
  probe;
- result replay from the harness's memory (the reference's outputs for the candidate's own inputs), with the
  static rules bypassed as native code could: one seed per call and runner in timing;
- batch-and-skip (real work on some calls only): several calls of every audited batch;
- aggregator underflow (per-call times below any timer's resolution): the timing plausibility rule.

End-to-end cases share the session's compiled library (candidates.py).
"""
import random
import time

import pytest

import verifier.evaluate as evaluate_module
from verifier.evaluate import _DeviceStage, _Verdict, verify
from verifier.native_checks import scan_native
from verifier.static_checks import check_source
from verifier.tasks import load_task
from verifier.timing import TimedCall, implausible_timing
from verifier.types import Category

from .candidates import calling, compiled, task_path

PRE = "import torch\nimport torch.nn as nn\n"


def native_rules(src: str, backend: str = "cuda") -> set[str]:
    return {rule for rule, _ in scan_native([src], [], backend)}


# ------------------------------------------------------------------------------------- L2 persistence
@pytest.mark.parametrize("src", [
    # the runtime API's access-policy window on the timed stream
    "void keep(float* p, size_t n, cudaStream_t s) { cudaStreamAttrValue v = {}; "
    "v.accessPolicyWindow.base_ptr = p; v.accessPolicyWindow.num_bytes = n; v.accessPolicyWindow.hitRatio = 1.f; "
    "v.accessPolicyWindow.hitProp = cudaAccessPropertyPersisting; "
    "cudaStreamSetAttribute(s, cudaStreamAttributeAccessPolicyWindow, &v); }",
    "void carve() { cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 32 << 20); }",
    "void carve() { cudaDeviceSetLimit((cudaLimit)6, 32 << 20); }",                 # the limit by number
    "void keep(CUstream s, CUstreamAttrValue* v) { cuStreamSetAttribute(s, CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW, v); }",
    "void keep(cudaLaunchAttribute* a) { a->id = cudaLaunchAttributeAccessPolicyWindow; }",
    "void keep(musaStream_t s, musaStreamAttrValue* v) { musaStreamSetAttribute(s, musaStreamAttributeAccessPolicyWindow, v); }",
    # PTX cache policies that pin lines (evict_last survives a flush that streams through L2)
    '__global__ void k(const float* p, float* o) { float v; '
    'asm volatile("ld.global.L2::evict_last.f32 %0, [%1];" : "=f"(v) : "l"(p)); o[0] = v; }',
    '__global__ void k(unsigned long long* pol) { asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" '
    ': "=l"(*pol)); }',
])
def test_l2_persistence_is_rejected(src):
    assert "cache_persistence" in native_rules(src), native_rules(src)


# ------------------------------------------------------------------------------------- timer tampering
@pytest.mark.parametrize("src", [
    "float t(cudaEvent_t a, cudaEvent_t b) { float ms; cudaEventElapsedTime(&ms, a, b); return ms; }",
    "void r(cudaStream_t s) { cudaEvent_t e; cudaEventCreate(&e); cudaEventRecord(e, s); }",
    "void r(CUevent e) { cuEventRecord(e, 0); }",
    "#include <chrono>\nlong t() { return std::chrono::steady_clock::now().time_since_epoch().count(); }",
    "#include <time.h>\nlong t() { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_nsec; }",
    "unsigned long long t() { return __rdtsc(); }",
    '__global__ void k(unsigned long long* t) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(*t)); }',
])
def test_native_timers_and_events_are_rejected(src):
    assert "timer_tampering" in native_rules(src), native_rules(src)


@pytest.mark.parametrize("line", ["e = torch.cuda.Event(enable_timing=True)", "E = torch.cuda.Event",
                                  "e = torch.Event('cuda')", "f = torch.musa.Event",
                                  "ms = lambda a, b: a.elapsed_time(b)"])
def test_python_timers_and_events_are_rejected(line):
    code = PRE + line + "\n\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return x\n"
    assert "timer_tampering" in {v.rule for v in check_source(code, "cuda")}


def test_honest_cache_hints_and_device_clocks_stay_allowed():
    """Streaming loads, __ldg and the device's own clock64() are ordinary kernel code."""
    src = ('__global__ void k(const float* __restrict__ p, float* o, long long* t) { '
           'float v; asm volatile("ld.global.nc.L1::no_allocate.f32 %0, [%1];" : "=f"(v) : "l"(p)); '
           'o[0] = v + __ldg(p + 1) + __ldcs(p + 2); t[0] = clock64(); }')
    assert native_rules(src) == set()


# -------------------------------------------------------------------------------------- end to end
def run(task_name, response, cfg):
    return verify(load_task(task_path(task_name)), response, cfg)


def expect(result, category, rule=None):
    assert result.category == category, (result.category, result.rule, result.feedback,
                                         result.details.get("traceback"))
    if rule is not None:
        assert result.rule == rule, (result.rule, result.feedback)


PERSISTENT_OUT_PARAMETER = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.buf = None

    def forward(self, a, b):
        if self.buf is None or self.buf.shape != a.shape:
            self.buf = torch.empty_like(a)                                 # a persistent output buffer
        ext.add_out(a, b, self.buf)                                        # out-parameter style
        return self.buf.view(-1).view(a.shape)
'''

DECOY_THROWN_AWAY = '''
class ModelNew(nn.Module):
    def forward(self, x):
        _ = ext.transpose2d(x)            # a real kernel, launched and thrown away
        return x.t().contiguous()         # the answer: allowed data movement
'''
DECOY_NOOP_ON_OUTPUT = '''
class ModelNew(nn.Module):
    def forward(self, x):
        out = x.t().contiguous()
        ext.add_out(out, out, torch.empty_like(out))   # reads the answer, writes a scratch buffer
        return out
'''


# a "kernel" that hands back the tensor it was given: overwriting what it returned overwrote the real answer
DECOY_PASSTHROUGH = '''
class ModelNew(nn.Module):
    def forward(self, x):
        return ext.finish(x.t().contiguous())
'''


@pytest.mark.slow
@pytest.mark.parametrize("model", [DECOY_THROWN_AWAY, DECOY_NOOP_ON_OUTPUT, DECOY_PASSTHROUGH],
                         ids=["thrown_away", "noop_on_output", "passthrough"])
def test_decoy_kernels_on_a_transpose_task_are_cheating(make_cfg, model):
    r = run("transpose", compiled(model), make_cfg())
    expect(r, Category.CHEATING, "decoy_kernel")
    assert r.details["ablation"]["conclusive"] and r.details["ablation"]["output_still_correct"]
    assert "overwritten" in r.feedback


@pytest.mark.slow
@pytest.mark.parametrize("task_name,model", [
    ("transpose", calling("ext.transpose2d(x)", "x")),                      # the kernel does the data movement
    ("elementwise_add", PERSISTENT_OUT_PARAMETER),
    # in place and returning its argument, on inputs it leaves as they were: no passthrough
    ("relu_positive", calling("ext.relu_inplace(x.clone())", "x")),
], ids=["transpose_kernel", "persistent_out_parameter", "inplace_identity_on_this_data"])
def test_honest_kernels_survive_the_ablation(make_cfg, task_name, model):
    r = run(task_name, compiled(model), make_cfg())
    expect(r, Category.PASS)
    assert r.details["ablation"] == {"native_calls": 1, "overwritten": 1, "opaque_calls": 0, "conclusive": True,
                                     "output_still_correct": False}


@pytest.mark.slow
def test_float16_dress_up_on_a_reduction_is_caught_and_float32_passes(make_cfg):
    cheat = run("row_sumsq", compiled(calling("ext.row_sumsq(x.half().float())", "x")), make_cfg())
    expect(cheat, Category.CHEATING, "precision_downgrade")
    assert cheat.q == 1.0   # within the float32 tolerance: only the probe tells
    assert cheat.details["precision_probe"]["rms_ratio_to_fp16_rounding"] > 0.5
    honest = run("row_sumsq", compiled(calling("ext.row_sumsq(x)", "x")), make_cfg())
    expect(honest, Category.PASS)
    assert honest.details["precision_probe"]["rms_ratio_to_fp16_rounding"] < 0.05


# inputs.generate seeds the global RNG with each input set's seed: unless the child reseeds it before every call,
# its state tells a correctness trial (right after the trial's own inputs) from a timed call
RNG_REPLAYS_THE_TRIAL_INPUTS = '''
class ModelNew(nn.Module):
    def forward(self, x):
        if torch.equal(torch.randn(x.shape, device=x.device), x):   # being checked: run the kernel
            return ext.relu(x)
        return torch.relu(x)
'''
SEED_REPEATS_IN_A_TIMED_BATCH = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.previous = -1

    def forward(self, x):
        seed = torch.initial_seed()   # a timed batch draws all its input sets first: one seed for all its calls
        repeated, self.previous = seed == self.previous, seed
        return ext.relu(x) * 0 if repeated else ext.relu(x)
'''


@pytest.mark.slow
def test_rng_state_does_not_reveal_a_correctness_trial(make_cfg):
    """The kernel ran only where the RNG replayed the inputs; now it never does, and the fallback is seen."""
    r = run("relu", compiled(RNG_REPLAYS_THE_TRIAL_INPUTS), make_cfg())
    expect(r, Category.CHEATING)
    assert "relu" in r.feedback


@pytest.mark.slow
def test_global_seed_does_not_reveal_a_timed_batch(make_cfg):
    """Wrong answers only where the seed repeats (the timed calls): no call sees the same seed twice now."""
    expect(run("relu", compiled(SEED_REPEATS_IN_A_TIMED_BATCH), make_cfg()), Category.PASS)


REPLAY_FROM_HARNESS = '''
import gc


def _find_session():   # the harness froze its objects (gc.freeze: out of get_objects' sight); native code
    gc.unfreeze()     # can thaw them, or find the session another way
    return [o for o in gc.get_objects() if type(o).__name__ == "DeviceSession"][0]


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.session = None

    def forward(self, a, b):
        if self.session is None:
            self.session = _find_session()
        s = self.session
        done = s.outputs.get("ref")
        for i, args in enumerate(s.args.get("cand", [])):
            if args[0] is a and done:
                return done[i].clone()    # the reference's answer for call i of this trial, no work
        return ext.add(a, b)
'''


@pytest.mark.slow
def test_replaying_the_references_outputs_from_the_childs_memory_fails(make_cfg, monkeypatch):
    """Native code can reach what static rules forbid Python to (here: gc, with the static stage bypassed).
    The reference is timed on other inputs than the candidate, so its outputs answer nothing."""
    monkeypatch.setattr(evaluate_module, "check_candidate", lambda code, cfg: [])
    monkeypatch.setattr(random.Random, "shuffle", lambda self, x: None)   # the reference always runs first
    r = run("elementwise_add", compiled(REPLAY_FROM_HARNESS), make_cfg())
    expect(r, Category.CHEATING, "timing_output_mismatch")


BATCH_AND_SKIP = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.last = None

    def forward(self, a, b):
        self.calls += 1
        if self.calls > 8 and self.calls % 2 and self.last is not None and self.last.shape == a.shape:
            return self.last.clone()      # every other call: no work, the previous answer
        self.last = ext.add(a, b)
        return self.last
'''


@pytest.mark.slow
def test_batch_and_skip_is_caught(make_cfg):
    r = run("elementwise_add", compiled(BATCH_AND_SKIP), make_cfg())
    expect(r, Category.CHEATING, "timing_output_mismatch")


# ------------------------------------------------------------------------- the parent's timing protocol
class _Scripted(_DeviceStage):
    """The parent's timing loop against a scripted child: records the seeds it sends and the calls it audits."""

    def __init__(self, cfg, reps: int):
        from verifier.devices import get_backend
        self.cfg, self.details, self.reps, self.backend, self.work = cfg, {}, reps, get_backend("cpu"), None
        self.prepared, self.audited, self.hidden, self.hidden_batches = [], [], 0, []

    def _ask(self, msg, expect):
        if msg["op"] == "warmup":
            return {"op": "warmed", "est_ms": {"ref": 1.0, "cand": 1.0}, "input_bytes": 0, "output_bytes": {},
                    "flush_bytes": 0, "flush_ms": 0.0}
        if msg["op"] == "prepare":
            self.prepared.append(msg["seeds"])
            return {"op": "prepared"}
        n = len(self.prepared[-1]["cand"])
        return {"op": "called", "span_ms": 0.001 * n, "rep_ms": [0.001] * n, "flush_ms": 0.0,
                "plain_tensors": True, "outputs_shared": False}

    def _audit(self, ref_model, seed, rep=0, trial=None):
        self.audited.append((len(self.prepared) - 1, rep, seed))

    def _hidden_trial(self, ref_model, batch):
        self.hidden += 1
        self.hidden_batches.append(batch)


def _scripted_timing(make_cfg, **cfg):
    from verifier.timing import choose_reps
    stage = _Scripted(make_cfg(num_timing_trials=6, num_timing_audits=2, time_budget_s=60.0, timing_batch_ms=40.0,
                               **cfg), reps=40)
    assert choose_reps({"ref": 1.0, "cand": 1.0}, 0, {}, 40.0, 100, 1 << 30) == 40
    try:
        stage._timing(ref_model=None)
    except _Verdict:
        pass   # the scripted times are implausible; the calls made before that are what is checked
    return stage


def test_every_call_and_runner_gets_its_own_seed(make_cfg):
    stage = _scripted_timing(make_cfg)
    seeds = [s for trial in stage.prepared for runner in ("ref", "cand") for s in trial[runner]]
    assert len(seeds) == 6 * 2 * 40 and len(set(seeds)) == len(seeds)


def test_audited_trials_check_many_calls_of_their_batch(make_cfg):
    stage = _scripted_timing(make_cfg, audit_calls_per_trial=16)
    by_trial: dict[int, list] = {}
    for trial, rep, seed in stage.audited:
        by_trial.setdefault(trial, []).append(rep)
        assert seed == stage.prepared[trial]["cand"][rep]   # judged against the candidate's own inputs
    assert 2 <= len(by_trial) <= 3 and 5 in by_trial         # two random trials and the last
    assert all(len(set(reps)) == 16 for reps in by_trial.values())
    assert stage.hidden == len(by_trial)
    assert stage.hidden_batches == [40] * stage.hidden   # each hidden trial is one call of a batch as long as theirs


class _SlowScripted(_Scripted):
    """A scripted child whose calls take 2 ms: the parent's time budget ends timing long before its trial count."""

    def _ask(self, msg, expect):
        if msg["op"] == "call":
            time.sleep(0.002)
        return super()._ask(msg, expect)


def test_random_audits_all_happen_when_the_budget_ends_timing_early(make_cfg):
    """The random audits are drawn against the trials the budget allows, not the configured 120: drawn from all 120,
    two audits would mostly fall after timing ended at ~12 trials (~80 % of runs without any)."""
    audited_trials = []
    for _ in range(8):
        stage = _SlowScripted(make_cfg(num_timing_trials=120, num_timing_audits=2, time_budget_s=0.05,
                                       timing_batch_ms=40.0), reps=4)
        try:
            stage._timing(ref_model=None)
        except _Verdict:
            pass
        assert len(stage.prepared) < 60, len(stage.prepared)     # the budget ended timing
        audited_trials.append(len({trial for trial, _, _ in stage.audited}))
    # two random trials and the last (a random draw may land on the last one)
    assert min(audited_trials) >= 2 and sum(audited_trials) >= 2.5 * len(audited_trials), audited_trials


def test_per_call_times_below_any_timers_resolution_are_implausible():
    honest = [TimedCall(r, 10.0, 11.0, [0.5] * 20, 0.0) for r in ("ref", "cand") for _ in range(3)]
    assert implausible_timing(honest) is None
    for tiny in (0.0, 5e-324, 1e-300, 1e-7):
        calls = [TimedCall("ref", 10.0, 11.0, [0.5] * 20, 0.0)] * 3 + \
                [TimedCall("cand", tiny * 20, 11.0, [tiny] * 20, 0.0)] * 3
        problem = implausible_timing(calls)
        assert problem and "resolution" in problem, (tiny, problem)


# ------------------------------------------------------------------------------------- speed of light
def test_device_specs_give_the_floor_of_a_memory_bound_and_a_compute_bound_call():
    from verifier import speed_of_light as sol
    h200 = sol.device_spec("NVIDIA H200")
    assert h200.kind == "h200" and sol.device_spec("MTT S4000").kind == "s4000"
    assert sol.device_spec("MTT S5000").memory_bytes_per_s == 1.6e12 and sol.device_spec("x86_64") is None
    relu = sol.Floor(h200, 2 * 4096 * 393216 * 4, 0, "float32")      # KernelBench's ReLU: 12.9 GB in and out
    assert relu.floor_ms == pytest.approx(2.684, rel=1e-3) and "memory-bound" in relu.describe()
    gemm = sol.Floor(h200, 3 * 4096 * 4096 * 4, 2 * 4096 ** 3, "float32")
    assert gemm.compute_ms > gemm.memory_ms and gemm.floor_ms == pytest.approx(2 * 4096 ** 3 / 494.7e12 * 1e3)
    with pytest.raises(ValueError, match="memory_bytes_per_s"):
        sol.device_spec(None, {"flops_per_s": 1e12})
    with pytest.raises(ValueError, match="sol_margin"):
        from verifier.config import VerifierConfig
        VerifierConfig(sol_margin=2.0)


def test_flops_and_bytes_of_a_reference_call():
    import torch

    from verifier import speed_of_light as sol
    x, w = torch.randn(64, 128), torch.randn(32, 128)
    out, flops, ops = sol.count_work(lambda: torch.nn.functional.linear(x, w))
    assert flops == 2 * 64 * 128 * 32 and ops == 1
    y = torch.randn(4096)
    _, flops, ops = sol.count_work(lambda: ((y * 1.0001 + 0.0001).view(64, 64).t() * 2).relu_())   # the view: no op
    assert flops == 0 and ops == 4
    # a higher-order operator the op counter has no rule for: FLOPs still counted, the ops reported as 0
    out, flops, ops = sol.count_work(lambda: torch.cond(x.sum() > 0, lambda a: a @ w.t(), lambda a: -(a @ w.t()), (x,)))
    assert flops == 2 * 64 * 128 * 32 and ops == 0 and out.shape == (64, 32)
    assert sol.tensor_bytes([x, w, out]) == (64 * 128 + 32 * 128 + 64 * 32) * 4
    assert sol.tensor_bytes([x.expand(3, 64, 128)]) == 64 * 128 * 4    # an expanded view: its storage


@pytest.mark.slow
def test_a_time_below_the_speed_of_light_is_cheating(make_cfg):
    """An honest kernel on a device configured far slower than this host: its measured time is below the
    floor, so the floor is wired to the verdict (on a GPU it catches reports no kernel could achieve)."""
    slow = {"kind": "test-device", "memory_bytes_per_s": 1e6, "flops_per_s": 1e9}
    r = run("relu", compiled(calling("ext.relu(x)", "x")), make_cfg(sol_device_spec=slow))
    expect(r, Category.CHEATING, "below_speed_of_light")
    sol = r.details["speed_of_light"]
    assert sol["bytes"] == 2 * 16 * 512 * 4 and sol["floor_ms"] == pytest.approx(65.536)
    assert "test-device cannot run one call in less than 65.54 ms" in r.feedback
    fast = {"kind": "test-device", "memory_bytes_per_s": 1e13, "flops_per_s": 1e15}
    expect(run("relu", compiled(calling("ext.relu(x)", "x")), make_cfg(sol_device_spec=fast)), Category.PASS)


# ---------------------------------------------------------------- outputs the child can no longer change
def _stage_of_this_process():
    import os
    import types
    stage = _DeviceStage.__new__(_DeviceStage)
    stage.child = types.SimpleNamespace(proc=types.SimpleNamespace(pid=os.getpid()))
    return stage


def test_only_sealed_output_files_are_read(tmp_path):
    """The run child hands its outputs over in a memfd sealed against writes and resizing; the parent opens it
    through /proc/<pid>/fd and refuses anything else (a file the child, or a thread of the candidate, could
    still rewrite after the reply)."""
    import fcntl
    import os

    from verifier.sandbox import OUTPUT_SEALS
    stage = _stage_of_this_process()
    plain = os.open(str(tmp_path / "out.safetensors"), os.O_RDWR | os.O_CREAT)
    unsealed = os.memfd_create("verifier-out", os.MFD_ALLOW_SEALING)
    sealed = os.memfd_create("verifier-out", os.MFD_ALLOW_SEALING)
    os.write(sealed, b"{}")
    fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, OUTPUT_SEALS)
    try:
        for fd in (plain, unsealed):
            with pytest.raises(_Verdict, match="sealed"):
                stage._open_sealed_output(fd)
        for junk in (None, "3", True, -1, 1 << 30):
            with pytest.raises(_Verdict, match="malformed"):
                stage._open_sealed_output(junk)
        mine = stage._open_sealed_output(sealed)
        with pytest.raises(OSError):
            os.write(sealed, b"x")      # not even the process that made it can change it now
        assert os.read(mine, 10) == b"{}"
        os.close(mine)
    finally:
        for fd in (plain, unsealed, sealed):
            os.close(fd)


def test_the_childs_safetensors_writer_round_trips_through_a_memfd():
    import os

    import torch
    from safetensors import safe_open

    from verifier._child import _write_safetensors
    from verifier.correctness import COMPLEX128_KEYS
    from verifier.evaluate import _DeviceStage
    tensors = {"out0": torch.randn(3, 5), "out1": torch.arange(7), "out2": torch.zeros(0),
               "out3": torch.tensor([True, False]), "out4": torch.randn(4, dtype=torch.bfloat16),
               "out5": torch.randn(2, 3, dtype=torch.complex128), "out6": torch.randn(5, dtype=torch.complex64)}
    fd = os.memfd_create("verifier-out")
    try:
        _write_safetensors(fd, tensors)
        with safe_open(f"/proc/self/fd/{fd}", framework="pt") as f:
            assert sorted(f.keys()) == sorted(tensors)
            pairs = set(f.metadata()[COMPLEX128_KEYS].split(","))
            assert pairs == {"out5"}
            # the parent's reader gives every output back as it was, complex128 included
            ref = list(tensors.values())
            got = {k: _DeviceStage._read_tensor(f, k, ref, k in pairs) for k in f.keys()}
            assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in tensors.items())
            # a complex128 header that does not match the reference stays a header
            assert _DeviceStage._read_tensor(f, "out5", [None] * 5 + [torch.zeros(3, 2, dtype=torch.complex128)],
                                             True).is_meta
    finally:
        os.close(fd)
    fd = os.memfd_create("verifier-out")
    try:   # a dtype no format can carry is named
        with pytest.raises(TypeError, match="complex32"):
            _write_safetensors(fd, {"out0": torch.zeros(2, dtype=torch.complex32)})
    finally:
        os.close(fd)


def _probe(task_name, candidate, seed=None):
    """The parent's precision probe on one trial (inputs of ``seed``, else a random one), with ``candidate(inputs)``
    standing for the child's output."""
    import secrets

    import torch

    from verifier.config import VerifierConfig
    from verifier.devices import get_backend
    from verifier.inputs import build_model, make_inputs
    from verifier.tasks import load_task_module
    stage = _DeviceStage.__new__(_DeviceStage)
    stage.cfg, stage.details, stage.work = VerifierConfig(), {}, None
    stage.backend, stage.device = get_backend("cpu"), torch.device("cpu")
    stage.module = load_task_module(load_task(task_path(task_name)))
    seed = secrets.randbits(63) if seed is None else seed
    ref_model = build_model(stage.module.Model, [], seed, stage.device, "float32")
    args = make_inputs(stage.module, seed, stage.device, "float32")
    with torch.no_grad():
        ref, got = ref_model(*args), candidate(args)
    return stage._precision_probe(ref_model, seed, [got], [ref]), stage.details["precision_probe"]


def test_the_precision_probe_tells_float16_inputs_from_float32_summation_orders():
    import torch
    fp16 = _probe("row_sumsq", lambda a: (a[0].half().float() ** 2).sum(dim=1))
    assert fp16[0] and fp16[0][0] == "precision_downgrade", fp16
    sequential = _probe("row_sumsq", lambda a: torch.cumsum(a[0] * a[0], dim=1)[:, -1])   # another order, float32
    assert sequential[0] is None and sequential[1]["rms_ratio_to_fp16_rounding"] < 0.1, sequential


def test_the_precision_probe_stays_silent_where_float16_is_below_float32_noise():
    import torch

    from verifier.evaluate import PRECISION_PROBE_FP32_FACTOR
    # an honest float32 kernel of a loss reduced to one scalar: never flagged, whatever the inputs
    finding, details = _probe("cross_entropy", lambda a: torch.logsumexp(a[0], dim=1).mean()
                              - a[0].gather(1, a[1][:, None]).mean())
    assert finding is None, details
    # float16 inputs there: flagged only where their error also stands out of float32's own (on about one input
    # set in twenty it reaches 32x; asserting silence every time made this test fail 1 run in 20)
    finding, details = _probe("cross_entropy", lambda a: torch.nn.functional.cross_entropy(a[0].half().float(), a[1]))
    assert (finding is None) == (details["rms_ratio_to_fp32_reference"] < PRECISION_PROBE_FP32_FACTOR), details


def test_the_precision_probe_does_not_call_float32_accumulation_a_downgrade():
    import numpy as np
    import torch

    def sequential(a, dtype=torch.float32):   # one float32 accumulator, as a plain C++ loop sums
        d = (a[0].to(dtype).float() - a[1].to(dtype).float()).reshape(-1)
        return torch.tensor(np.add.accumulate((d * d).numpy(), dtype=np.float32)[-1] / d.numel())
    # on some inputs rounding them to float16 does not move the float32 MSE by even one ulp (which ones depends on
    # the intra-op thread count), and then no ratio to that rounding exists: never flagged, before the fix either.
    # Several fixed input sets: none may be flagged, and on some the error's size alone called it a downgrade (its
    # error far above float16 rounding's and the float32 reference's), which is the case the fix is for
    judged = []
    for seed in range(20261205, 20261205 + 8):
        finding, details = _probe("mse", sequential, seed=seed)
        assert finding is None, details
        judged.append(details)
    assert any(d["rms_ratio_to_fp16_rounding"] > 1 and d["rms_ratio_to_fp32_reference"] > 32 for d in judged), judged
    # where float32 accumulation could err as much (rows of 4096), float16 and bfloat16 inputs are still told apart:
    # the output follows the reference run on the rounded inputs
    for dtype, name in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
        finding, details = _probe("row_sumsq", lambda a: (a[0].to(dtype).float() ** 2).sum(dim=1))
        assert finding and finding[0] == "precision_downgrade", details
        assert details["rms_ratio_to_fp32_accumulation"] < 1 and details["distance_to_rounded_reference"][name] < 0.1
