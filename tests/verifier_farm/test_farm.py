"""Farm logic with injected fakes: exactly one verdict per submission, retries, cache, backpressure."""
from __future__ import annotations

import threading

import pytest

import farm_fakes as ff
from verifier.farm import FarmConfig, FarmFull, VerifierFarm
from verifier.types import Category


def _markers(tmp_path):
    (tmp_path / "m").mkdir(exist_ok=True)
    return str(tmp_path / "m")


def _farm(tmp_path, mode="thread", **kw):
    fc = dict(compile_workers=2, cpu_device_workers=2, compile_mode=mode, device_mode=mode,
              build_fn=ff.fake_build, run_fn=ff.fake_run, precheck_fn=ff.fake_precheck, max_retries=2)
    fc.update(kw)
    return VerifierFarm(ff.FakeConfig(build_cache_dir=str(tmp_path / "builds")), FarmConfig(**fc))


def test_every_submission_gets_one_verdict_with_thread_slots(tmp_path):
    m = _markers(tmp_path)
    items = []
    for i in range(6):
        t = ff.FakeTask(task_id=f"t{i}")
        items += [(t, "ok"), (t, f"infra_once:{m}{i}"), (t, f"raise_once:{m}{i}"), (t, "wrong"),
                  (t, "build_fail"), (t, "build_timeout"), (t, f"build_raise_once:{m}{i}"), (t, "FORMAT x"),
                  (t, "infra_always"), (t, f"build_infra_once:{m}{i}")]
    with _farm(tmp_path) as farm:
        futs = farm.submit_batch(items)
        results = [f.result(timeout=60) for f in futs]
        stats = farm.stats()
    assert len(results) == len(items)
    by_kind = {}
    for (t, code), r in zip(items, results):
        assert r.task_id == t.task_id
        by_kind.setdefault(code.split(":")[0].split(" ")[0], []).append(r)
    assert all(r.category == Category.PASS and r.attempts == 1 for r in by_kind["ok"])
    assert all(r.category == Category.PASS and r.attempts == 2 for r in by_kind["infra_once"])
    assert all(r.category == Category.PASS and r.attempts == 2 for r in by_kind["raise_once"])
    assert all(r.category == Category.PASS and r.attempts == 2 for r in by_kind["build_raise_once"])
    assert all(r.category == Category.PASS and r.attempts == 2 and "SIGTERM" in r.details["infra_history"][0]
               for r in by_kind["build_infra_once"])
    assert all(r.category == Category.CORRECTNESS_ERROR for r in by_kind["wrong"])
    assert all(r.category == Category.COMPILE_ERROR and "expected ';'" in r.feedback for r in by_kind["build_fail"])
    assert all(r.category == Category.TIMEOUT for r in by_kind["build_timeout"])
    assert all(r.category == Category.FORMAT_ERROR and r.details["farm_stage"] == "precheck"
               for r in by_kind["FORMAT"])
    # infra after 1 + max_retries attempts, returned as infra (no reward), never as a model failure
    for r in by_kind["infra_always"]:
        assert r.category == Category.INFRA and r.attempts == 3 and r.reward is None
        assert len(r.details["infra_history"]) == 3
    assert stats["completed"] == len(items) and stats["in_flight"] == 0
    assert stats["precheck_rejects"] == 6
    assert stats["categories"]["infra"] == 6


def test_an_infra_verdict_that_is_the_tasks_fault_is_not_retried(tmp_path):
    """A reference that does not repeat gives the same infra verdict on every attempt: one attempt, not three."""
    with _farm(tmp_path) as farm:
        r = farm.submit(ff.FakeTask(task_id="t"), "task_fault").result(timeout=60)
    assert r.category == Category.INFRA and r.rule == "reference_not_repeatable" and r.attempts == 1


def test_precheck_rejects_never_reach_the_compile_pool(tmp_path):
    with _farm(tmp_path) as farm:
        rs = farm.verify_batch([(ff.FakeTask("a"), "FORMAT no code")] * 5)
        st = farm.stats()
    assert [r.category for r in rs] == [Category.FORMAT_ERROR] * 5
    assert st["compile"]["calls"] == 0 and st["device"]["calls"] == 0


def test_worker_crash_and_hang_are_replaced_and_requeued(tmp_path):
    m = _markers(tmp_path)
    items = [(ff.FakeTask(f"t{i}"), code) for i, code in enumerate(
        ["ok", f"crash_once:{m}a", f"hang_once:{m}b", f"build_crash_once:{m}c", "ok", "wrong", "crash_always"])]
    farm = _farm(tmp_path, mode="process", device_deadline_s=4.0, max_retries=1)
    try:
        results = farm.verify_batch(items)
        st = farm.stats()
    finally:
        farm.close()
    cats = [r.category for r in results]
    assert cats == [Category.PASS, Category.PASS, Category.PASS, Category.PASS, Category.PASS,
                    Category.CORRECTNESS_ERROR, Category.INFRA]
    assert [r.attempts for r in results] == [1, 2, 2, 2, 1, 1, 2]
    assert "died" in results[1].details["infra_history"][0]
    assert "no answer" in results[2].details["infra_history"][0]
    assert st["device"]["restarts"] >= 4 and st["compile"]["restarts"] >= 1
    # the hung candidate ran twice (the killed attempt and the retry), the crash-once one too
    assert ff.counted(f"{m}b", "run") == 2 and ff.counted(f"{m}a", "run") == 2
    # process workers really run out of process
    assert results[0].details["pid"] != __import__("os").getpid()


def test_cache_hits_and_inflight_dedup(tmp_path):
    m = _markers(tmp_path)
    db = str(tmp_path / "cache.sqlite")
    t = ff.FakeTask("t0")
    with _farm(tmp_path, result_cache_path=db) as farm:
        rs = farm.verify_batch([(t, f"slow:{m}/0.3_x")] * 4)
        again = farm.verify_batch([(t, f"slow:{m}/0.3_x")])
        st = farm.stats()
    assert all(r.category == Category.PASS for r in rs + again)
    assert ff.counted(f"{m}/0.3_x", "build") == 1  # four identical submissions compiled once
    assert sum(r.cached for r in rs) == 3 and again[0].cached
    assert st["dedup_hits"] == 3 and st["cache_hits"] == 1
    # persisted: a new farm (new process state) answers from the SQLite file without building
    with _farm(tmp_path, result_cache_path=db) as farm2:
        r2 = farm2.verify_batch([(t, f"slow:{m}/0.3_x")])[0]
        # a different task source is a different key
        r3 = farm2.verify_batch([(ff.FakeTask("t0", source="x = 2\n"), f"slow:{m}/0.3_x")])[0]
    assert r2.cached and r2.category == Category.PASS and not r3.cached
    assert ff.counted(f"{m}/0.3_x", "build") == 2


def test_infra_is_never_cached(tmp_path):
    m = _markers(tmp_path)
    t = ff.FakeTask("t0")
    with _farm(tmp_path, max_retries=0) as farm:
        r1 = farm.verify_batch([(t, f"infra_once:{m}")])[0]
        r2 = farm.verify_batch([(t, f"infra_once:{m}")])[0]
    assert r1.category == Category.INFRA and r2.category == Category.PASS and not r2.cached


def test_backpressure_blocks_or_refuses(tmp_path):
    m = _markers(tmp_path)
    t = ff.FakeTask("t")
    farm = _farm(tmp_path, max_in_flight=2, result_cache=False, compile_workers=1)
    try:
        f1 = farm.submit(t, f"slow:{m}/1.0_a")
        f2 = farm.submit(t, f"slow:{m}/1.0_b")
        with pytest.raises(FarmFull):
            farm.submit(t, "ok", block=False)
        assert farm.stats()["in_flight"] == 2
        done = threading.Event()
        box = {}

        def blocked_submit():
            box["f"] = farm.submit(t, "ok")  # blocks until a slot frees
            done.set()

        th = threading.Thread(target=blocked_submit)
        th.start()
        assert not done.wait(0.3)  # still blocked while both slots are busy
        assert not f1.done()
        th.join(30)
        assert done.is_set() and f1.done()
        assert box["f"].result(30).category == Category.PASS
        assert f2.result(30).category == Category.PASS
    finally:
        farm.close()


def test_close_resolves_everything_left_as_infra(tmp_path):
    m = _markers(tmp_path)
    farm = _farm(tmp_path, compile_workers=1, result_cache=False)
    futs = [farm.submit(ff.FakeTask(f"t{i}"), f"slow:{m}/0.5_{i}") for i in range(4)]
    farm.close(drain=False)
    results = [f.result(10) for f in futs]
    assert len(results) == 4
    assert any(r.category == Category.INFRA and r.details["farm_stage"] == "closed" for r in results)
    with pytest.raises(RuntimeError):
        farm.submit(ff.FakeTask("x"), "ok")


def test_stats_busy_fractions(tmp_path):
    m = _markers(tmp_path)
    with _farm(tmp_path, compile_workers=2, result_cache=False) as farm:
        farm.verify_batch([(ff.FakeTask(f"t{i}"), f"slow:{m}/0.2_{i}") for i in range(4)])
        st = farm.stats()
    assert 0.0 < st["compile"]["busy_fraction"] <= 1.0
    assert 0.0 <= st["device"]["busy_fraction"] <= 1.0
    assert st["compile"]["calls"] == 4 and st["device"]["calls"] == 4
    assert st["queues"] == {"compile": 0, "device": 0}


def test_gpu_occupancy_counts_from_the_first_build_that_gives_the_devices_work(tmp_path):
    # a fast compile error comes back first, then a build that takes 0.5 s and runs for 0.5 s: the device was
    # occupied ~half the time since the first build, and all of it since the first job it was given
    m = _markers(tmp_path)
    with _farm(tmp_path, compile_workers=1, cpu_device_workers=1, result_cache=False) as farm:
        out = farm.verify_batch([(ff.FakeTask("a"), "build_fail"), (ff.FakeTask("b"), f"slow_both:{m}/0.5_b")])
        dev = farm.stats()["device"]
    assert [r.category for r in out] == [Category.COMPILE_ERROR, Category.PASS]
    assert dev["device_occupied_fraction"] < 0.7
    assert dev["device_occupied_fraction_since_first_job"] > 0.75


def test_cache_key_tracks_verdict_config_not_paths(tmp_path):
    from verifier.config import VerifierConfig
    from verifier.result_cache import ResultCache, config_fingerprint
    a = config_fingerprint(VerifierConfig(build_cache_dir=str(tmp_path / "a")))
    b = config_fingerprint(VerifierConfig(build_cache_dir=str(tmp_path / "b")))
    c = config_fingerprint(VerifierConfig(num_correct_trials=3))
    d = config_fingerprint(VerifierConfig(precision="bfloat16"))
    assert a == b and len({a, c, d}) == 3
    bad = tmp_path / "not.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ValueError, match="not.sqlite"):
        ResultCache(str(bad))


def test_device_workers_per_gpu_and_how_long_each_gpu_was_occupied():
    from verifier.farm import _Stage
    farm = object.__new__(VerifierFarm)
    farm.backend = "cuda"
    for fc, want in ((FarmConfig(device_indices=[0, 1]), [0, 0, 0, 1, 1, 1]),
                     (FarmConfig(device_indices=[0, 1], workers_per_device=1), [0, 1]),
                     (FarmConfig(device_indices=[0, 1], device_workers=3), [0, 1, 0])):
        farm.farm = fc
        assert farm._resolve_devices() == want
    with pytest.raises(ValueError, match="workers_per_device"):
        FarmConfig(workers_per_device=0).validate()
    # two slots on GPU 0, one on GPU 1: GPU 0 is occupied while either of its slots is busy
    stage = _Stage("device", [None, None, None], None, groups=[0, 0, 1])
    with stage.lock:
        stage.mark_busy(0, 0.0)
        stage.mark_busy(1, 1.0)
        stage.mark_idle(0, 2.0)
        stage.mark_idle(1, 3.0)      # GPU 0: occupied 0..3
        stage.mark_busy(2, 5.0)      # GPU 1: busy from 5
    assert stage.busy_total(6.0) == pytest.approx(2 + 2 + 1)
    assert stage.occupied_total(6.0) == pytest.approx(3 + 1)
