"""Timer captured before candidate code; the parent's plausibility rules on reported times."""
import time

import pytest

from verifier.devices import get_backend
from verifier.timing import CapturedTimer, TimedCall, implausible_timing, stats


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
