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


def test_child_caches_are_kept_once_from_a_ready_child_and_copied_into_each_new_one(tmp_path):
    """The harness's Triton kernels (the digests) were built again in every run child's fresh cache: four builds under
    the device's shared lock per child. The first ready child's cache is kept (regular files only: a link is not
    followed) and copied into each later child's directory, one copy per child."""
    from verifier import warm_spare
    key = ("test-key", str(tmp_path))
    first = tmp_path / "first"
    (first / "triton" / "abc").mkdir(parents=True)
    (first / "triton" / "abc" / "digest.cubin").write_bytes(b"\x7fELF kernel")
    (first / "triton" / "abc" / "digest.json").write_text('{"name": "digest"}')
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    os.symlink(secret, first / "triton" / "abc" / "link.json")
    later = tmp_path / "later"
    later.mkdir()
    assert warm_spare.seed_child_caches(key, str(later)) is False   # nothing kept yet: the child builds its own
    assert warm_spare.keep_child_caches(key, str(first)) is True
    (first / "triton" / "abc" / "digest.cubin").write_bytes(b"changed")   # kept once: a later change is not seen
    assert warm_spare.keep_child_caches(key, str(first)) is False
    for name in ("one", "two"):
        workdir = tmp_path / name
        workdir.mkdir()
        assert warm_spare.seed_child_caches(key, str(workdir)) is True
        got = workdir / "triton" / "abc"
        assert (got / "digest.cubin").read_bytes() == b"\x7fELF kernel"
        assert (got / "digest.json").read_text() == '{"name": "digest"}'
        assert not (got / "link.json").exists()
    (tmp_path / "one" / "triton" / "abc" / "digest.cubin").write_bytes(b"poisoned by a candidate")
    third = tmp_path / "three"
    third.mkdir()
    warm_spare.seed_child_caches(key, str(third))
    assert (third / "triton" / "abc" / "digest.cubin").read_bytes() == b"\x7fELF kernel"   # copies, not shared
    empty = tmp_path / "empty"
    (empty / "triton").mkdir(parents=True)
    assert warm_spare.keep_child_caches(("other", 1), str(empty)) is False   # nothing built: nothing kept


def test_caches_are_kept_before_any_candidate_file_reaches_the_child(relu, monkeypatch):
    """Keeping a child's cache is safe only before candidate code could have run in it: the stage keeps it once the
    child reported ready and before it writes candidate.py and task.py into the child's directory."""
    from verifier import evaluate
    cfg, task, good, _ = relu
    seen = []
    monkeypatch.setattr(evaluate, "keep_child_caches",
                        lambda key, workdir: seen.append(sorted(os.listdir(workdir))) or False)
    r = run_candidate(task, good, build_candidate(task, good, cfg), cfg)
    assert r.category == Category.PASS, r.feedback
    assert len(seen) == 1 and "candidate.py" not in seen[0] and "task.py" not in seen[0]
