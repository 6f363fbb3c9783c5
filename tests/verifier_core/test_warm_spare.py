"""Warm spare children: the device stage takes a child started ahead of time, and every candidate still
runs in a fresh process that no other candidate touched."""
import dataclasses
import os
import signal
import time

import pytest

from verifier.build import build_candidate
from verifier.device_lock import DeviceLock
from verifier.evaluate import _DeviceStage, precheck, run_candidate
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
                steps = r.details["child"]["startup_s"]   # imports, its wait for the lock, the device's start
                assert steps["imports"] > 0 and steps["lock_wait"] >= 0 and steps["device"] > 0, steps
            assert not _alive(r.details["child"]["pid"])   # the process that ran the candidate is gone
            assert _spare_pid(spares) not in pids           # and a new one waits for the next candidate
        assert [r.category for r in results] == [Category.PASS, Category.CORRECTNESS_ERROR, Category.PASS]
        assert len(set(pids)) == 3
        assert results[0].details["child"]["started_s_before_stage"] == 0.0
        own = results[0].details["child"]["startup_s"]   # the stage's own child: its lock wait is the stage's
        assert own["imports"] > 0 and own["lock_wait"] is None and own["device"] > 0, own
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
        def replenish(self, key, start, *args, **kwargs):
            def fail():
                raise OSError(11, "Resource temporarily unavailable")
            super().replenish(key, fail, *args, **kwargs)

    spares = WarmSpares()
    try:
        r = run_candidate(task, good, build, cfg, spares=spares)
        assert r.category == Category.PASS and "spare_wait" in r.details["phase_seconds"]
        (spare,) = spares.started()
        assert spare.ready and [m["op"] for m in spare.messages] == ["hello", "imported", "ready"]  # before timing
        assert spare.device_granted
    finally:
        spares.close()
    broken = NoNewSpares()
    r = run_candidate(task, good, build, cfg, spares=broken)
    assert r.category == Category.PASS, r.feedback
    assert broken.started() == []


def test_a_spare_imports_without_the_device_lock_and_starts_its_device_only_under_it(relu, tmp_path):
    """The spare's interpreter and torch import (CPU only) run while another worker times (holds the device alone);
    its device start-up waits for the shared lock, and it is ready once the lock is free. A stage that takes a spare
    the device was already granted to does not grant it twice, and one that takes none grants its own child."""
    cfg, task, good, _ = relu
    cfg = dataclasses.replace(cfg, device_lock_dir=str(tmp_path / "locks"))
    build = build_candidate(task, good, cfg)
    stage = _DeviceStage(task, good, build, cfg, None)
    spares = WarmSpares()
    timing = DeviceLock(cfg.backend, None, cfg.device_lock_dir).exclusive(10.0)   # another worker's timing
    started = []

    def start():
        started.append(stage._start_child())
        return started[-1]

    try:
        spares.replenish(stage._spare_key, start, cfg.startup_timeout_s, stage._spare_lease)
        pending = spares._spares[stage._spare_key]
        deadline = time.monotonic() + 120
        while not (started and started[0].imported) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started and started[0].imported   # torch imported while the device was held alone by another
        time.sleep(1.0)   # what it would need to start its device, were it allowed to
        assert not pending.done.is_set() and not started[0].ready and not started[0].device_granted
        timing.release()
        (spare,) = spares.started()
        assert spare is started[0]
        assert [m["op"] for m in spare.messages] == ["hello", "imported", "ready"] and spare.device_granted
        r = run_candidate(task, good, build, cfg, spares=spares)   # takes that spare: no second grant
        assert r.category == Category.PASS, r.feedback
        assert r.details["child"]["pid"] == spare.child.proc.pid
    finally:
        timing.release()
        spares.close()
    r = run_candidate(task, good, build, cfg)   # no spares: the stage grants its own child the device
    assert r.category == Category.PASS, r.feedback


def test_a_spare_waiting_for_the_device_ends_on_close_and_with_lease_imports_it_waits_to_import(relu, tmp_path):
    """A spare that imported and waits for the device's lock (another worker times for minutes) is a live process
    with a directory: closing the spares ends it and removes the directory at once, not when the lock comes. With
    ``lease_imports`` (the cpu backend, whose device is the host's CPU) the child does not even start before the
    lock is free."""
    cfg, task, good, _ = relu
    cfg = dataclasses.replace(cfg, device_lock_dir=str(tmp_path / "locks"))
    stage = _DeviceStage(task, good, build_candidate(task, good, cfg), cfg, None)
    timing = DeviceLock(cfg.backend, None, cfg.device_lock_dir).exclusive(10.0)
    waiting, leased_imports = [], []

    def starter(into):
        def start():
            into.append(stage._start_child())
            return into[-1]
        return start

    spares, cpu_spares = WarmSpares(), WarmSpares()
    try:
        cpu_spares.replenish(stage._spare_key, starter(leased_imports), cfg.startup_timeout_s, stage._spare_lease,
                             lease_imports=True)
        spares.replenish(stage._spare_key, starter(waiting), cfg.startup_timeout_s, stage._spare_lease)
        deadline = time.monotonic() + 120
        while not (waiting and waiting[0].imported) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting and waiting[0].imported and not waiting[0].device_granted
        assert leased_imports == []   # its imports wait for the lock as well
        t0 = time.monotonic()
        spares.close()
        assert time.monotonic() - t0 < 30
        child = waiting[0]
        deadline = time.monotonic() + 10
        while not child.child.exited() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.child.exited() and not os.path.exists(child.workdir)
        timing.release()
        (spare,) = cpu_spares.started()
        assert spare is leased_imports[0] and spare.ready and spare.device_granted
    finally:
        timing.release()
        spares.close()
        cpu_spares.close()


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


def _triton_cache(monkeypatch, workdir, key: str):
    """Triton's own file cache at ``workdir``/triton, as a run child's (``sandbox.child_env``), for entry ``key``."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager
    monkeypatch.setattr(knobs.cache, "dir", str(workdir / "triton"))
    return FileCacheManager(key)


def test_child_caches_are_kept_once_from_a_ready_child_and_written_into_each_new_one(tmp_path, monkeypatch):
    """The harness's Triton kernels (the digests) were built again in every run child's fresh cache: four builds under
    the device's shared lock per child. The first ready child's cache is kept in the parent's memory and written into
    each later child's cache. Triton's group files name their files by absolute path (what ``compile`` writes and
    reads back on a hit): a review found the seeded children reading the first child's files, which its candidate
    could overwrite (a forged digest kernel in every later child). They now resolve inside each child's own cache."""
    from verifier import warm_spare
    key = ("test-key", str(tmp_path))
    first = tmp_path / "first"
    cache = _triton_cache(monkeypatch, first, "0123abcd")
    group = {"digest_blocks.cubin": cache.put(b"\x7fELF honest kernel", "digest_blocks.cubin"),
             "digest_blocks.json": cache.put('{"name": "digest_blocks"}', "digest_blocks.json", binary=False)}
    cache.put_group("digest_blocks.json", group)   # as triton.compiler.compile does
    os.symlink(tmp_path, first / "triton" / "0123abcd" / "link")
    later = tmp_path / "later"
    later.mkdir()
    assert warm_spare.seed_child_caches(key, str(later)) is False   # nothing kept yet: the child builds its own
    assert warm_spare.keep_child_caches(key, str(first)) is True
    with open(group["digest_blocks.cubin"], "wb") as f:   # the first child's candidate, after the keep
        f.write(b"\x7fELF FORGED kernel")
    assert warm_spare.keep_child_caches(key, str(first)) is False   # kept once
    for name in ("one", "two"):
        workdir = tmp_path / name
        workdir.mkdir()
        assert warm_spare.seed_child_caches(key, str(workdir)) is True
        mine = _triton_cache(monkeypatch, workdir, "0123abcd")
        got = mine.get_group("digest_blocks.json")
        assert set(got) == {"digest_blocks.cubin", "digest_blocks.json"}
        assert all(os.path.dirname(p) == mine.cache_dir for p in got.values())   # its own files, no other's
        with open(got["digest_blocks.cubin"], "rb") as f:
            assert f.read() == b"\x7fELF honest kernel"
        assert not os.path.lexists(os.path.join(mine.cache_dir, "link"))   # a link is not carried
        assert not [n for n in os.listdir(workdir) if n.startswith(".seed-")]   # renamed into place whole
    with open(tmp_path / "one" / "triton" / "0123abcd" / "digest_blocks.cubin", "wb") as f:
        f.write(b"poisoned by the candidate of child one")
    third = tmp_path / "three"
    third.mkdir()
    warm_spare.seed_child_caches(key, str(third))
    with open(third / "triton" / "0123abcd" / "digest_blocks.cubin", "rb") as f:
        assert f.read() == b"\x7fELF honest kernel"   # one copy per child
    empty = tmp_path / "empty"
    (empty / "triton").mkdir(parents=True)
    assert warm_spare.keep_child_caches(("other", 1), str(empty)) is False   # nothing built: nothing kept


def test_a_group_naming_files_outside_its_entry_is_not_kept(tmp_path, monkeypatch):
    from verifier import warm_spare
    first = tmp_path / "first"
    cache = _triton_cache(monkeypatch, first, "feed")
    outside = tmp_path / "elsewhere.cubin"
    outside.write_bytes(b"not the harness's")
    cache.put_group("k.json", {"k.cubin": str(outside)})
    cache.put(b"kernel", "plain.bin")
    assert warm_spare.keep_child_caches(("outside",), str(first)) is True
    later = tmp_path / "later"
    later.mkdir()
    assert warm_spare.seed_child_caches(("outside",), str(later)) is True
    mine = _triton_cache(monkeypatch, later, "feed")
    assert mine.get_group("k.json") is None and mine.get_file("plain.bin") is not None


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
