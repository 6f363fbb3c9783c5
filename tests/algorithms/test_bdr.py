"""Buffered Dynamic Retry: capacity, FIFO order, replay rate, state round trip."""
import json
import math

import pytest

from megatron_rl.algorithms.bdr import BDRConfig, BufferedDynamicRetry, FailedPrompt
from verifier.types import Category, VerifyResult


def entry(i, attempts=0):
    return FailedPrompt(task_id=f"t{i}", failed_code=f"code {i}", category="compile_error", error=f"err {i}",
                        score=-1.0, attempts=attempts)


def test_capacity_and_fifo():
    bdr = BufferedDynamicRetry(BDRConfig(capacity=3, replay_prob=1.0), seed=0)
    for i in range(5):
        bdr.push(entry(i))
    assert [e.task_id for e in bdr.entries()] == ["t2", "t3", "t4"]
    assert bdr.counters["evicted"] == 2
    bdr.push(FailedPrompt("t3", "newer code", "runtime_error", "segfault", -1.0))  # refresh keeps its place
    assert [e.task_id for e in bdr.entries()] == ["t2", "t3", "t4"]
    assert bdr.entries()[1].failed_code == "newer code"
    replays = bdr.draw(5)
    assert [e.task_id for e in replays] == ["t2", "t3", "t4"] and len(bdr) == 0
    assert all(e.attempts == 1 for e in replays)
    assert bdr.push(entry(9, attempts=3)) is False and bdr.counters["retired"] == 1


def test_restore_gives_back_an_unused_replay():
    """A replay whose repair group was cancelled goes back to the front, its attempt not counted; a newer
    failure of the same task wins; a full buffer evicts the restored entry (it is the oldest)."""
    bdr = BufferedDynamicRetry(BDRConfig(capacity=3, replay_prob=1.0), seed=0)
    for i in range(3):
        bdr.push(entry(i))
    first, second = bdr.draw(2)
    assert (first.task_id, first.attempts) == ("t0", 1)
    bdr.restore(second)
    bdr.restore(first)
    assert [(e.task_id, e.attempts) for e in bdr.entries()] == [("t0", 0), ("t1", 0), ("t2", 0)]
    assert bdr.counters["returned"] == 2
    (again,) = bdr.draw(1)
    bdr.push(FailedPrompt("t0", "newer", "runtime_error", "boom", -1.0))
    bdr.restore(again)
    assert [e.failed_code for e in bdr.entries() if e.task_id == "t0"] == ["newer"]
    bdr.push(entry(5))                      # full: t1 evicted
    (oldest,) = bdr.draw(1)
    bdr.push(entry(6))
    bdr.restore(oldest)
    assert oldest.task_id not in [e.task_id for e in bdr.entries()] and bdr.counters["evicted"] == 2


def test_add_group_keeps_best_failure():
    def v(cat, q=0.0):
        return VerifyResult(task_id="t", category=cat, q=q, feedback=f"{cat.value} details")
    bdr = BufferedDynamicRetry(BDRConfig(capacity=4))
    verdicts = [v(Category.FORMAT_ERROR), v(Category.COMPILE_ERROR), v(Category.CORRECTNESS_ERROR, 0.4),
                v(Category.CORRECTNESS_ERROR, 0.4)]
    scores = [-1.0, -1.0, -0.3, -0.3]
    assert bdr.add_group("t", verdicts, scores, ["", "c1", "c2", "c3"], step=7)
    (e,) = bdr.entries()
    assert (e.failed_code, e.category, e.score, e.step) == ("c2", "correctness_error", -0.3, 7)
    assert e.error == "correctness_error details"
    assert not bdr.add_group("u", [v(Category.PASS, 1.0), v(Category.COMPILE_ERROR)], [1.0, -1.0], ["a", "b"])
    with pytest.raises(ValueError, match="sample 1: infra"):
        bdr.add_group("w", [v(Category.COMPILE_ERROR), v(Category.INFRA)], [-1.0, -1.0], ["a", "b"])
    with pytest.raises(ValueError, match="sample 0: missing verdict"):
        bdr.add_group("w", [None], [-1.0], ["a"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_rate_binomial(seed):
    n, p = 4000, 0.1
    bdr = BufferedDynamicRetry(BDRConfig(capacity=n, replay_prob=p), seed=seed)
    for i in range(n):
        bdr.push(entry(i))
    hits = len(bdr.draw(n))
    # Binomial(4000, 0.1): mean 400, sd 18.97; ±5 sd keeps a false alarm below 1e-6
    assert abs(hits - n * p) <= 5 * math.sqrt(n * p * (1 - p))
    assert len(bdr) == n - hits
    assert BufferedDynamicRetry(BDRConfig(replay_prob=0.0), seed=seed).draw(100) == []


def test_state_round_trip_is_json_and_deterministic():
    a = BufferedDynamicRetry(BDRConfig(capacity=50, replay_prob=0.3), seed=123)
    for i in range(40):
        a.push(entry(i))
    a.draw(10)
    state = json.loads(json.dumps(a.state_dict()))
    b = BufferedDynamicRetry(BDRConfig(capacity=50, replay_prob=0.3), seed=999)
    b.load_state_dict(state)
    assert b.entries() == a.entries() and b.counters == a.counters
    assert [e.task_id for e in a.draw(30)] == [e.task_id for e in b.draw(30)]
    c = BufferedDynamicRetry(BDRConfig(capacity=50, replay_prob=0.3), seed=123)
    for i in range(40):
        c.push(entry(i))
    c.draw(10)
    c.draw(30)
    assert c.state_dict() == a.state_dict()     # same seed, same ops -> same state


def test_bad_state_is_rejected():
    bdr = BufferedDynamicRetry(BDRConfig(capacity=2))
    with pytest.raises(ValueError, match="version"):
        bdr.load_state_dict({"version": 99})
    good = BufferedDynamicRetry(BDRConfig(capacity=5))
    for i in range(3):
        good.push(entry(i))
    with pytest.raises(ValueError, match="capacity"):
        bdr.load_state_dict(good.state_dict())
    st = good.state_dict()
    del st["entries"][0]["task_id"]
    with pytest.raises(ValueError, match="missing"):
        BufferedDynamicRetry(BDRConfig(capacity=5)).load_state_dict(st)
    with pytest.raises(ValueError):
        BDRConfig(replay_prob=1.5)
