"""Warm spare children: the device stage takes a child started ahead of time, and every candidate still
runs in a fresh process that no other candidate touched."""
import dataclasses
import os
import signal
import time

import pytest

from verifier.build import build_candidate
from verifier.evaluate import precheck, run_candidate
from verifier.tasks import load_task
from verifier.types import Category
from verifier.warm_spare import WarmSpares

from .candidates import RELU, calling, compiled, task_path


@pytest.fixture
def relu(make_cfg):
    cfg = make_cfg(num_timing_trials=3)
    task = load_task(task_path("relu"))
    good = precheck(task, compiled(RELU), cfg)
    wrong = precheck(task, compiled(calling("ext.add(x, x)", "x")), cfg)
    assert isinstance(good, str) and isinstance(wrong, str)
    return cfg, task, good, wrong


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # a zombie is not running anything
        return f.read().split(")")[-1].split()[0] != "Z"


def _spare_pid(spares: WarmSpares) -> int:
    (spare,) = spares.started()
    return spare.child.proc.pid


def test_each_candidate_gets_a_fresh_prestarted_child(relu):
    cfg, task, good, wrong = relu
    spares = WarmSpares()
    try:
        builds = {c: build_candidate(task, c, cfg) for c in (good, wrong)}
        results, pids = [], []
        for code in (good, wrong, good):
            expected_pid = _spare_pid(spares) if spares._spares else None
            r = run_candidate(task, code, builds[code], cfg, spares=spares)
            results.append(r)
            pids.append(r.details["child"]["pid"])
            if expected_pid is not None:   # the stage used the spare started during the previous candidate
                assert r.details["child"]["pid"] == expected_pid
                assert r.details["child"]["started_s_before_stage"] > 0
            assert not _alive(r.details["child"]["pid"])   # the process that ran the candidate is gone
            assert _spare_pid(spares) not in pids           # and a new one waits for the next candidate
        assert [r.category for r in results] == [Category.PASS, Category.CORRECTNESS_ERROR, Category.PASS]
        assert len(set(pids)) == 3
        assert results[0].details["child"]["started_s_before_stage"] == 0.0
    finally:
        spares.close()


def test_a_dead_spare_is_replaced_and_close_cleans_up(relu):
    cfg, task, good, _ = relu
    spares = WarmSpares()
    try:
        build = build_candidate(task, good, cfg)
        assert run_candidate(task, good, build, cfg, spares=spares).category == Category.PASS
        (spare,) = spares.started()
        os.killpg(spare.child.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not spare.child.exited() and time.monotonic() < deadline:
            time.sleep(0.05)
        r = run_candidate(task, good, build, cfg, spares=spares)
        assert r.category == Category.PASS, r.feedback
        assert r.details["child"]["pid"] != spare.child.proc.pid
        assert not os.path.exists(spare.workdir)

        (spare,) = spares.started()
        other = dataclasses.replace(cfg, num_correct_trials=cfg.num_correct_trials + 1)   # another config: not reused
        r = run_candidate(task, good, build, other, spares=spares)
        assert r.category == Category.PASS and r.details["child"]["pid"] != spare.child.proc.pid
        assert spare.child.exited() and not os.path.exists(spare.workdir)
    finally:
        (last,) = spares.started()
        spares.close()
    assert last.child.exited() and not os.path.exists(last.workdir)


def test_spare_is_up_before_timing_and_failures_to_start_one_are_harmless(relu):
    cfg, task, good, _ = relu
    build = build_candidate(task, good, cfg)

    class NoNewSpares(WarmSpares):
        def replenish(self, key, start, *args):
            def fail():
                raise OSError(11, "Resource temporarily unavailable")
            super().replenish(key, fail, *args)

    spares = WarmSpares()
    try:
        r = run_candidate(task, good, build, cfg, spares=spares)
        assert r.category == Category.PASS and "spare_wait" in r.details["phase_seconds"]
        (spare,) = spares.started()
        assert spare.ready and [m["op"] for m in spare.messages] == ["hello", "ready"]   # read before timing
    finally:
        spares.close()
    broken = NoNewSpares()
    r = run_candidate(task, good, build, cfg, spares=broken)
    assert r.category == Category.PASS, r.feedback
    assert broken.started() == []


def test_an_orphaned_spare_exits_and_removes_its_directory(relu):
    cfg, task, good, _ = relu
    spares = WarmSpares()
    build = build_candidate(task, good, cfg)
    run_candidate(task, good, build, cfg, spares=spares)
    (spare,) = spares.started()
    spares._spares.clear()
    spare.child.proc.stdin.close()          # what the child sees when the worker that started it dies
    deadline = time.monotonic() + 60
    while not spare.child.exited() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert spare.child.exited()
    # the sandbox may let it empty its directory but not unlink the directory itself
    assert not os.path.exists(spare.workdir) or os.listdir(spare.workdir) == []
    spare.discard()
