"""Several device-stage workers on one device: start-ups and correctness side by side, timing alone."""
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from verifier import device_lock
from verifier.device_lock import DeviceLock, DeviceLockTimeout, DeviceUse
from verifier.farm import FarmConfig, VerifierFarm
from verifier.tasks import load_task
from verifier.types import Category

from .candidates import RELU, calling, compiled, task_path


def _hold_in_child(lock_dir, mode, ready, stop):
    lock = DeviceLock("cuda", 0, lock_dir)
    use = lock.shared(10) if mode == "shared" else lock.exclusive(10)
    ready.set()
    stop.wait(60)
    use.release()


def test_shared_holders_coexist_and_exclusive_waits_for_them(tmp_path):
    lock = DeviceLock("cuda", 0, str(tmp_path))
    a, b = lock.shared(1), lock.shared(1)          # two holders at once
    with pytest.raises(DeviceLockTimeout, match="cuda-0"):
        lock.exclusive(0.2)
    a.release()
    a.release()                                    # idempotent
    with pytest.raises(DeviceLockTimeout):
        lock.exclusive(0.2)
    b.release()
    with lock.exclusive(1) as ex:
        assert ex.held and ex.mode == "exclusive"
        with pytest.raises(DeviceLockTimeout):
            lock.shared(0.2)
    assert not ex.held
    lock.shared(1).release()


def test_a_waiting_timer_keeps_new_holders_out(tmp_path):
    """Writer preference: while a worker waits to time, nobody new starts on the device, so it waits only
    for the holders that were already in."""
    lock = DeviceLock("cuda", 0, str(tmp_path))
    first = lock.shared(1)
    got = {}

    def timer():
        use = lock.exclusive(10)
        got["exclusive_at"] = time.monotonic()
        time.sleep(0.3)
        use.release()

    t = threading.Thread(target=timer)
    t.start()
    time.sleep(0.2)                                # the timer now waits for `first`
    late = {}

    def latecomer():
        use = lock.shared(10)
        late["shared_at"] = time.monotonic()
        use.release()

    t2 = threading.Thread(target=latecomer)
    t2.start()
    time.sleep(0.2)
    assert "shared_at" not in late and "exclusive_at" not in got
    first.release()
    t.join(5)
    t2.join(5)
    assert late["shared_at"] >= got["exclusive_at"] + 0.25   # came in only after the timing


def test_a_killed_holder_frees_the_device(tmp_path):
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold_in_child, args=(str(tmp_path), "exclusive", ready, stop))
    p.start()
    assert ready.wait(60)
    lock = DeviceLock("cuda", 0, str(tmp_path))
    with pytest.raises(DeviceLockTimeout):
        lock.shared(0.3)
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    lock.shared(5).release()


def test_one_physical_gpu_has_one_lock_whatever_the_visible_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    a = DeviceLock("cuda", 0, str(tmp_path))             # GPU 3 seen as device 0 (Ray, slurm)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    b = DeviceLock("cuda", 3, str(tmp_path))             # GPU 3 seen as device 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    c, d = DeviceLock("cuda", 0, str(tmp_path)), DeviceLock("cuda", 1, str(tmp_path))
    assert a.path == b.path and len({a.path, c.path, d.path}) == 3
    with a.exclusive(1):
        with pytest.raises(DeviceLockTimeout):
            b.shared(0.2)
        with c.exclusive(1), d.exclusive(1):
            pass


def test_the_lock_directory_does_not_follow_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert not device_lock.default_lock_dir().startswith(str(tmp_path))


def test_two_device_workers_share_the_device_but_never_while_timing(make_cfg, tmp_path, monkeypatch):
    """A real farm with two device workers on one (CPU) device: every hold is recorded; no exclusive hold
    overlaps any other hold, shared ones do overlap, and every verdict is the one a lone worker gives."""
    holds, mu = [], threading.Lock()
    real_hold, real_release = DeviceLock._hold, DeviceUse.release

    def hold(self, mode, timeout_s):
        use = real_hold(self, mode, timeout_s)
        use.acquired_at, use.owner = time.monotonic(), id(use)
        return use

    def release(self):
        if self.fd is not None:
            with mu:
                holds.append((self.mode, self.acquired_at, time.monotonic()))
        real_release(self)

    monkeypatch.setattr(DeviceLock, "_hold", hold)
    monkeypatch.setattr(DeviceUse, "release", release)
    cfg = make_cfg(num_timing_trials=3, device_lock_dir=str(tmp_path / "locks"))
    task = load_task(task_path("relu"))
    good, wrong = compiled(RELU), compiled(calling("ext.add(x, x)", "x"))
    items = [(task, c) for c in (good, wrong, good + "\n# 2", wrong + "\n# 2", good + "\n# 3", good + "\n# 4")]
    farm = VerifierFarm(cfg, FarmConfig(compile_workers=2, cpu_device_workers=2, device_mode="thread",
                                        result_cache=False))
    try:
        results = farm.verify_batch(items)
    finally:
        farm.close()
    assert [r.category for r in results] == [Category.PASS, Category.CORRECTNESS_ERROR, Category.PASS,
                                             Category.CORRECTNESS_ERROR, Category.PASS, Category.PASS], \
        [(r.category.value, r.rule, r.feedback[-400:], r.details.get("timing_repeated")) for r in results]
    assert all(r.details["device_use"] == "shared, exclusive while timing" for r in results)
    exclusive = [h for h in holds if h[0] == "exclusive"]
    assert len(exclusive) == 4                      # one timing phase per correct candidate
    for i, (mode, t0, t1) in enumerate(holds):
        for j, (mode2, u0, u1) in enumerate(holds):
            if i != j and "exclusive" in (mode, mode2):
                assert t1 <= u0 or u1 <= t0, (holds[i], holds[j])
    shared = sorted(h for h in holds if h[0] == "shared")
    assert any(b[1] < a[2] for a, b in zip(shared, shared[1:])), "no two shared holds overlapped"


def test_a_task_too_large_to_share_has_the_device_alone(make_cfg, tmp_path):
    cfg = make_cfg(num_timing_trials=3, device_lock_dir=str(tmp_path), shared_device_max_bytes=1)
    task = load_task(task_path("relu"))
    from verifier.build import build_candidate
    from verifier.evaluate import precheck, run_candidate
    code = precheck(task, compiled(RELU), cfg)
    build = build_candidate(task, code, cfg)
    other = DeviceLock("cpu", 0, str(tmp_path)).shared(1)       # another worker is using the device
    asked, real_hold = threading.Event(), DeviceLock._hold

    def hold(self, mode, timeout_s):
        if mode == "exclusive":
            asked.set()
        return real_hold(self, mode, timeout_s)

    box = {}
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(DeviceLock, "_hold", hold)
        t = threading.Thread(target=lambda: box.update(r=run_candidate(task, code, build, cfg)))
        t.start()
        assert asked.wait(120)
        time.sleep(1.0)
        assert "r" not in box                                   # the stage waits to have it alone
        other.release()
        t.join(120)
    r = box["r"]
    assert r.category == Category.PASS, r.feedback
    assert r.details["device_use"] == "exclusive" and r.details["device_wait_s"]["exclusive"] >= 0.9


def test_lock_names_are_safe_file_names():
    assert "/" not in device_lock.lock_name("cuda", 0) and device_lock.lock_name("cpu", None) == "cpu-host"


def test_small_tasks_share_and_the_limit_follows_the_device_size():
    from verifier.inputs import Footprint, shares_device
    GiB = 1 << 30
    small, big = Footprint(1 << 20, 1 << 20, 0), Footprint(2 * GiB, 2 * GiB, 0)   # 6 MiB / 12 GiB per trial
    assert shares_device(small, 8 * GiB, 141 * GiB) and shares_device(small, 8 * GiB, None)
    assert not shares_device(big, 8 * GiB, 141 * GiB)
    assert shares_device(Footprint(GiB // 2, GiB // 2, 0), 8 * GiB, 141 * GiB)     # 3 GiB: fits an H200's eighth
    assert not shares_device(Footprint(GiB // 2, GiB // 2, 0), 8 * GiB, 16 * GiB)  # not a 16 GiB card's
    assert not shares_device(None, 8 * GiB, 141 * GiB)                             # unknown size: alone


def _oom_candidate(cfg):
    from verifier.build import build_candidate
    from verifier.evaluate import precheck
    task = load_task(task_path("relu"))
    oom = compiled(calling("boom(ext.relu(x))", "x"), prelude=(
        "def boom(y):\n    raise RuntimeError('CUDA out of memory. Tried to allocate 20.00 GiB')\n"))
    code = precheck(task, oom, cfg)
    assert isinstance(code, str), code
    return task, code, build_candidate(task, code, cfg)


def test_out_of_memory_text_alone_buys_no_second_run(make_cfg, tmp_path):
    """The candidate writes its error message: without the parent's own evidence that other processes
    hold the device's memory, an out-of-memory error is the candidate's runtime error, judged once."""
    from verifier.evaluate import run_candidate
    cfg = make_cfg(num_timing_trials=3, device_lock_dir=str(tmp_path))
    task, code, build = _oom_candidate(cfg)
    r = run_candidate(task, code, build, cfg)
    assert r.category == Category.RUNTIME_ERROR and "out of memory" in r.feedback and "rerun_alone" not in r.details


def test_memory_held_by_others_reruns_alone_then_is_infra(make_cfg, tmp_path, monkeypatch):
    """When the parent finds the device's free memory too small for the task once its child is gone, the
    shortage was other processes': a shared stage is judged again alone; alone, it is infra (retried)."""
    from verifier import evaluate
    from verifier.evaluate import run_candidate
    cfg = make_cfg(num_timing_trials=3, device_lock_dir=str(tmp_path))
    task, code, build = _oom_candidate(cfg)
    calls = []

    def others_hold_it(result, cfg_, index):           # what a full GPU would show (mem_get_info)
        calls.append(result.details.get("device_use"))
        return result.category == Category.RUNTIME_ERROR and len(calls) == 1

    monkeypatch.setattr(evaluate, "_out_of_memory_because_of_others", others_hold_it)
    r = run_candidate(task, code, build, cfg)
    assert r.category == Category.RUNTIME_ERROR and r.details["device_use"] == "exclusive"
    assert "while sharing the device" in r.details["rerun_alone"] and calls[0] == "shared, exclusive while timing"
    calls.clear()
    monkeypatch.setattr(evaluate, "_out_of_memory_because_of_others",
                        lambda result, cfg_, index: result.category == Category.RUNTIME_ERROR)
    r = run_candidate(task, code, build, cfg)
    assert r.category == Category.INFRA and "other workers" in r.feedback and r.reward is None


def test_the_memory_evidence_is_the_parents_own_reading():
    from verifier.inputs import memory_taken_by_others
    GiB = 1 << 30
    fp = {"input_bytes": GiB, "output_bytes": GiB, "param_bytes": 0}       # 4 + 5 GiB per trial
    assert memory_taken_by_others(fp, 2 * GiB) and not memory_taken_by_others(fp, 40 * GiB)
    assert not memory_taken_by_others(None, 0) and not memory_taken_by_others(fp, None)


def test_a_sandboxed_candidate_cannot_take_the_device_lock(tmp_path):
    """A candidate that flocks the device's lock file would stall every other worker's timing."""
    from .sandbox_probe import probe
    lock = DeviceLock("cpu", 0, str(tmp_path / "locks"))
    lock.shared(1).release()                        # the files exist
    code = ("import fcntl, os\nres = {}\nfor p in %r:\n    for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR):\n"
            "        try:\n            fd = os.open(p, flags)\n            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            "            res[p + str(flags)] = 'locked'\n        except OSError as e:\n"
            "            res[p + str(flags)] = type(e).__name__\nchan.send({'op': 'lock', 'res': res})\n"
            % [lock.path, lock.turnstile_path])
    hello, msgs, _ = probe(tmp_path, code)
    if not hello["isolation"]["landlock"]["applied"]:
        pytest.skip("landlock unavailable: only the file mode protects the lock")
    res = msgs["lock"]["res"]
    assert len(res) == 6 and "locked" not in res.values(), res
    # a candidate may still chmod the files (Landlock does not cover that): the parent puts them right
    os.chmod(lock.path, 0)
    os.chmod(lock.dir, 0)
    try:
        lock.exclusive(1).release()
    finally:
        os.chmod(lock.dir, 0o700)
    assert os.stat(lock.path).st_mode & 0o777 == 0o200
