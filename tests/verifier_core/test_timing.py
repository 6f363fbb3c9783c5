"""Timer captured before candidate code; the parent's plausibility rules on reported times."""
import time

import pytest

from verifier.devices import get_backend
from verifier.timing import (MIN_GPU_FLUSH_BYTES, CacheFlusher, CapturedTimer, TimedCall, flush_bytes, floor_flush,
                             implausible_timing, stats)


def test_patching_time_after_capture_changes_nothing(monkeypatch):
    backend = get_backend("cpu")
    timer = CapturedTimer(backend)
    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)  # what a candidate would try
    _, ms, host_ms = timer.time_call(lambda: time.sleep(0.02))
    assert ms >= 19.0 and host_ms >= 19.0
    assert timer.patched(backend) == ["time.perf_counter"]
    monkeypatch.undo()
    assert timer.patched(backend) == []


def calls(ref, cand, wall_ref, wall_cand):
    return ([TimedCall("ref", r, w) for r, w in zip(ref, wall_ref)] +
            [TimedCall("cand", c, w) for c, w in zip(cand, wall_cand)])


def test_honest_reports_are_plausible():
    assert implausible_timing(calls([5.0, 5.1, 5.2], [2.0, 2.1, 2.0], [5.3, 5.4, 5.5], [2.3, 2.4, 2.3])) is None


def test_reported_time_above_parent_wall_clock_is_impossible():
    msg = implausible_timing(calls([50.0, 50.0], [1.0, 1.0], [5.0, 5.0], [1.2, 1.2]))
    assert msg and "ref call reported 50.000 ms" in msg


def test_understated_candidate_time_is_caught():
    # reference overhead 0.3 ms; candidate calls take 10 ms of wall time but claim 0.1 ms
    msg = implausible_timing(calls([5.0] * 5, [0.1] * 5, [5.3] * 5, [10.0, 10.2, 10.1, 10.0, 11.0]))
    assert msg and "best: 10.000 ms" in msg


def test_scheduling_noise_is_not_understatement():
    # an honest candidate preempted on most calls (loaded host): one clean call is enough
    assert implausible_timing(calls([0.05] * 5, [0.05] * 5, [0.25, 0.9, 0.3, 0.25, 1.2],
                                    [0.96, 1.5, 0.26, 2.0, 0.9])) is None


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_non_finite_or_negative_reports(bad):
    assert implausible_timing(calls([1.0], [bad], [2.0], [2.0]))


def test_stats():
    s = stats([3.0, 1.0, 2.0, 10.0])
    assert s["n"] == 4 and s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 10.0 and s["mean"] == 4.0
    assert stats([]) == {"n": 0}


def test_batch_times_each_call_apart_from_its_flush():
    timer = CapturedTimer(get_backend("cpu"))
    batch = timer.time_batch([lambda i=i: (time.sleep(0.004), i)[1] for i in range(4)], _SleepFlusher(0.002))
    assert batch.outputs == [0, 1, 2, 3]                       # every call's output is kept, in order
    assert len(batch.rep_ms) == 4 and all(3.9 <= ms < 40 for ms in batch.rep_ms)
    assert batch.flush_ms >= 4 * 1.9
    assert batch.span_ms >= sum(batch.rep_ms) + batch.flush_ms
    call = TimedCall("cand", batch.span_ms, batch.span_ms + 1.0, batch.rep_ms, batch.flush_ms)
    assert 3.9 <= call.call_ms < 40 and implausible_timing([call]) is None


class _SleepFlusher(CacheFlusher):
    """A flush that sleeps (and, with ``spin_s``, a dispatch-hiding spin that sleeps a varying time)."""

    def __init__(self, clear_s: float, spin_s: tuple[float, ...] = ()):
        super().__init__("cpu", 0)
        self.clear_s, self.spin_s, self.n = clear_s, spin_s, 0
        if spin_s:
            self.hide_cycles, self._spin = 1, lambda cycles: None

    def clear(self):
        time.sleep(self.clear_s)

    def spin(self):
        if self.spin_s:
            time.sleep(self.spin_s[self.n % len(self.spin_s)])
            self.n += 1


class _HostEvents:
    """A backend whose "device" events read the host clock: the event path of ``time_batch`` on a CPU."""
    name, is_gpu = "fake", True

    class Event:
        def __init__(self, enable_timing=True):
            self.t = None

    @staticmethod
    def _record(ev):
        ev.t = time.perf_counter()

    @staticmethod
    def _elapsed(a, b):
        return (b.t - a.t) * 1e3

    def synchronize_fn(self):
        return lambda: None

    def event_api(self):
        return self.Event, self._record, self._elapsed


def test_spins_are_timed_apart_and_their_jitter_is_not_charged_to_the_call():
    timer = CapturedTimer(_HostEvents())
    spins = (0.004, 0.010)   # one spin in two runs 6 ms longer: jitter, not the call's time
    batch = timer.time_batch([lambda: time.sleep(0.001)] * 4, _SleepFlusher(0.001, spins))
    assert 4 * 0.0069 * 1e3 <= batch.spin_ms <= batch.flush_ms and batch.flush_ms >= batch.spin_ms + 4 * 0.9
    ref = TimedCall("ref", 4 * 6.0 + 4 * 1.0, 100.0, [1.0] * 4, 4 * 6.0, spin_ms=4 * 5.0)   # its spins: 5 ms mean
    cand = TimedCall("cand", batch.span_ms, batch.span_ms + 1.0, batch.rep_ms, batch.flush_ms, spin_ms=batch.spin_ms)
    cand.floor_flush_ms = floor_flush(ref, cand, spin_bound_ms=11.0)
    assert cand.call_ms < 3.0           # the call's ~1 ms (+ host overhead), not the spins' 1-5 ms of jitter
    cand.floor_flush_ms = ref.flush_ms  # the old floor: the reference's mean flush, spins included
    assert cand.call_ms > 3.0
    # a forged spin figure buys at most the bound per call
    forged = TimedCall("cand", 40.0, 41.0, [0.01] * 4, 39.0, spin_ms=39.0)
    forged.floor_flush_ms = floor_flush(ref, forged, spin_bound_ms=2.0)
    assert forged.call_ms == pytest.approx((40.0 - 4 * 1.0 - 4 * 2.0) / 4)


def test_the_gpu_flush_keeps_the_device_busy_while_the_next_call_is_enqueued():
    class Gpu:
        is_gpu = True

        def __init__(self, l2):
            self.l2 = l2

        def l2_cache_bytes(self, index):
            return self.l2

    class Cfg:
        cpu_flush_bytes = 8 << 20

    assert flush_bytes(Gpu(50 << 20), Cfg()) == MIN_GPU_FLUSH_BYTES == 256 << 20   # an H200: not 2x its L2
    assert flush_bytes(Gpu(200 << 20), Cfg()) == 400 << 20
    assert flush_bytes(Gpu(None), Cfg()) == MIN_GPU_FLUSH_BYTES
    assert flush_bytes(get_backend("cpu"), Cfg()) == 8 << 20


def test_span_floors_work_hidden_outside_the_call_events():
    # ten calls whose own events show 0.01 ms, inside a 10 ms span of which 0.5 ms were flushes: the work
    # ran somewhere the per-call events did not see (another stream, after the end event)
    hidden = TimedCall("cand", 10.0, 11.0, [0.01] * 10, 0.5)
    assert hidden.call_ms == pytest.approx(0.95)
    honest = TimedCall("cand", 10.2, 11.0, [0.95] * 10, 0.6)
    assert honest.call_ms == pytest.approx(0.96)
    assert TimedCall("ref", 2.0, 3.0).call_ms == 2.0          # a single call without per-call times


@pytest.mark.parametrize("rep_ms, flush_ms", [([1.0] * 10, 1.0), ([float("nan")] * 3, 0.0), ([0.1, -0.1], 0.0),
                                              ([0.1], float("inf"))])
def test_per_call_times_that_cannot_fit_in_the_span(rep_ms, flush_ms):
    assert implausible_timing([TimedCall("cand", 5.0, 6.0, rep_ms, flush_ms)])


def test_choose_reps():
    from verifier.timing import choose_reps
    assert choose_reps({"ref": 0.2, "cand": 0.1}, 1 << 20, {"ref": 1 << 20, "cand": 1 << 20}, 20.0, 100, 1 << 30) == 100
    assert choose_reps({"ref": 0.2, "cand": 4.0}, 1 << 20, {}, 20.0, 100, 1 << 30) == 5       # the slowest runner
    assert choose_reps({"ref": 0.01, "cand": 0.01}, 100 << 20, {"ref": 50 << 20, "cand": 50 << 20}, 20.0, 100,
                       1 << 30) == 3                                                          # memory-bound
    assert choose_reps({"ref": 500.0, "cand": 0.1}, 0, {}, 20.0, 100, 1 << 30) == 1
    assert choose_reps({"ref": float("nan"), "cand": float("nan")}, 0, {}, 20.0, 100, 1 << 30) == 1
    assert choose_reps({"ref": 0.2, "cand": 0.1}, 0, {}, 20.0, 100, 1 << 30, flush_ms=0.8) == 20  # flushes count too


def test_a_forged_flush_figure_cannot_shrink_the_span_floor():
    # the child claims 9.9 ms of flushes in a 10 ms span and 1 us calls; the parent subtracts the
    # reference's flush of the same trial (0.05 ms per call) instead
    forged = TimedCall("cand", 10.0, 10.5, [0.001] * 10, 9.9)
    assert implausible_timing([forged]) is None          # self-consistent on its face...
    assert forged.call_ms < 0.02
    forged.floor_flush_ms = 0.5
    assert forged.call_ms == pytest.approx(0.95)          # ...but the floor charges the span


@pytest.mark.parametrize("value", [10 ** 400, float("inf"), float("nan"), "1", None, True])
def test_malformed_child_numbers_never_raise(value):
    import math

    from verifier.evaluate import _count, _number
    assert math.isnan(_number(value)) or _number(value) == float("inf")
    assert _count(value) == 0


def test_stats_of_non_finite_reports_do_not_raise():
    assert stats([1.0, float("nan"), float("inf")]) == {"n": 3, "non_finite": 2}


def test_a_noisy_overhead_check_times_again_before_calling_it_cheating(make_cfg, monkeypatch):
    """The wall-clock overhead rule is statistical (a loaded host delays honest calls too): a stage that
    trips it times once more and judges the second measurement; a candidate that keeps tripping it is
    cheating."""
    from verifier import evaluate
    from verifier.build import build_candidate
    from verifier.evaluate import precheck, run_candidate
    from verifier.tasks import load_task
    from verifier.types import Category

    from .candidates import RELU, compiled, task_path

    cfg = make_cfg(num_timing_trials=3)
    task = load_task(task_path("relu"))
    code = precheck(task, compiled(RELU), cfg)
    build = build_candidate(task, code, cfg)
    seen = []

    def flaky(calls):
        seen.append(len(calls))
        return "every candidate call took far more wall time than it reported" if len(seen) == 1 else None

    monkeypatch.setattr(evaluate, "implausible_timing", flaky)
    r = run_candidate(task, code, build, cfg)
    assert r.category == Category.PASS, r.feedback
    assert len(seen) == 2 and "far more wall time" in r.details["timing_repeated"]["reason"]
    first = r.details["timing_repeated"]["first_round"]
    assert r.speedup <= first["ref"]["median"] / first["cand"]["median"] + 1e-12   # the slower round counts

    seen.clear()
    monkeypatch.setattr(evaluate, "implausible_timing", lambda calls: seen.append(1) or "hidden work")
    r = run_candidate(task, code, build, cfg)
    assert r.category == Category.CHEATING and r.rule == "implausible_timing" and len(seen) == 2


def test_the_last_timed_trial_is_always_audited(make_cfg):
    """Random audits may all fall early; the trial that ends timing is audited too, so a candidate that
    behaves only in early trials gains nothing."""
    from verifier.build import build_candidate
    from verifier.evaluate import precheck, run_candidate
    from verifier.tasks import load_task
    from verifier.types import Category

    from .candidates import RELU, compiled, task_path

    cfg = make_cfg(num_timing_trials=4, num_timing_audits=0)
    task = load_task(task_path("relu"))
    code = precheck(task, compiled(RELU), cfg)
    r = run_candidate(task, code, build_candidate(task, code, cfg), cfg)
    assert r.category == Category.PASS, r.feedback
    assert r.details["timing"]["trials"] == 4 and {a["trial"] for a in r.details["audits"]} == {3}


THREAD_COUNTING_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x) * torch.get_num_threads()


def get_inputs():
    return [torch.randn(16, 512)]


def get_init_inputs():
    return []
"""


def test_the_parent_computes_references_with_the_childs_threads_and_gives_its_own_back(make_cfg, tmp_path):
    """On the cpu backend the parent's intra-op threads are the child's (``cpu_threads``) while it checks: more
    would wait at OpenMP barriers for cores the child and the next warm spare use. A reference that reads its
    thread count shows which count the parent used (the child runs the candidate with one); the caller's own
    setting is restored afterwards."""
    import torch

    from verifier.build import build_candidate
    from verifier.evaluate import precheck, run_candidate
    from verifier.tasks import load_task
    from verifier.types import Category

    from .candidates import RELU, compiled

    path = tmp_path / "relu_times_threads.py"
    path.write_text(THREAD_COUNTING_TASK)
    cfg = make_cfg(num_timing_trials=3)
    task = load_task(str(path))
    code = precheck(task, compiled(RELU), cfg)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        r = run_candidate(task, code, build_candidate(task, code, cfg), cfg)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert cfg.cpu_threads == 1 and r.category == Category.PASS, r.feedback


STALL_ONCE = '''
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == STALL_AT:    # one long call, early in timing (several seconds)
            spin = 0
            for i in range(80000000):
                spin += i
        return ext.relu(x)
'''


def test_one_stalled_call_does_not_end_timing_early(make_cfg):
    """The time budget counts trials at their median pace: a candidate cannot cut timing short (and the
    audits with it) by stalling once."""
    from verifier.build import build_candidate
    from verifier.evaluate import precheck, run_candidate
    from verifier.tasks import load_task
    from verifier.types import Category

    from .candidates import compiled, task_path

    # 3 s: room for 6 trials on a loaded host (each trial creates its inputs per runner), well under the stall
    # a budget that summed trial times would have charged in full
    cfg = make_cfg(num_timing_trials=6, time_budget_s=3.0)
    task = load_task(task_path("relu"))
    # The candidate cannot tell a timed call from an untimed one (a hidden trial's round, the warm-up): neither can
    # the test, so where its stall landed outside the timed trials (once in a loaded suite run) the stall moves on
    stalls_timed = []
    for stall_at in (40, 56, 72):
        code = precheck(task, compiled(STALL_ONCE.replace("STALL_AT", str(stall_at))), cfg)
        r = run_candidate(task, code, build_candidate(task, code, cfg), cfg)
        assert r.category == Category.PASS, r.feedback
        assert r.details["timing"]["trials"] == 6
        stalls_timed.append(max(r.details["timing"]["wall_ms"]["max"], 0) > 1000)
        if stalls_timed[-1]:
            break
    assert stalls_timed[-1], stalls_timed     # the stall did happen inside timing, and timing went on


def test_the_dispatch_spin_covers_the_enqueue_time_within_a_cap():
    from verifier.timing import hide_cycles
    assert hide_cycles(0.1, 2e6) == int((1.5 * 0.1 + 0.02) * 2e6)   # 2 GHz: cycles per ms = 2e6
    assert hide_cycles(50.0, 2e6) == int(5.0 * 2e6)                 # never more than 5 ms per call
    assert hide_cycles(0.0, 1.98e6) == int(0.02 * 1.98e6)


@pytest.mark.parametrize("events", [False, True], ids=["host clock", "device events"])
def test_a_watched_call_is_bracketed_alone_after_its_flush_and_spin(events):
    """A hidden trial is one call of a batch: the harness's watch starts after that call's flush, hook and spin (a
    profiler started sooner would count the spin as the call's kernel) and stops right after it, with its output,
    before the next call's flush."""
    log = []

    class Flusher(_SleepFlusher):
        def clear(self):
            log.append("flush")

        def spin(self):
            if self.spin_s:
                log.append("spin")

    flusher = Flusher(0.0, (0.0,) if events else ())
    timer = CapturedTimer(_HostEvents() if events else get_backend("cpu"))
    calls = [lambda i=i: log.append(f"call{i}") or i for i in range(4)]
    batch = timer.time_batch(calls, flusher, lambda: log.append("hook"),
                             watch={2: (lambda: log.append("start"), lambda out: log.append(f"stop{out}"))})
    assert batch.outputs == [0, 1, 2, 3]
    spin = ["spin"] if events else []
    assert log == (["flush", "hook", *spin, "call0", "flush", "hook", *spin, "call1",
                    "flush", "hook", *spin, "start", "call2", "stop2", "flush", "hook", *spin, "call3"])
