"""The farm does not resubmit an infra verdict that is the task's own fault (memory gate over the whole memory, a
task that does not load, a reference that raises); one of the moment (memory that is only busy now) it retries."""
from __future__ import annotations

import pytest

import farm_fakes as ff
from verifier.farm import FarmConfig, VerifierFarm
from verifier.types import Category, VerifyResult

RUNS: list[str] = []


def _run(task, code, build, cfg, device_index=None):
    RUNS.append(code)
    return VerifyResult(task_id=task.task_id, category=Category.INFRA, feedback=f"memory: {code}",
                        rule=None if code == "busy" else code)


@pytest.mark.parametrize("rule,attempts", [("task_too_large", 1), ("task_load_failed", 1), ("reference_failed", 1),
                                           ("busy", 3)])
def test_task_fault_verdicts_are_verified_once(tmp_path, rule, attempts):
    RUNS.clear()
    farm = VerifierFarm(ff.FakeConfig(build_cache_dir=str(tmp_path / "builds")),
                        FarmConfig(compile_workers=1, cpu_device_workers=1, compile_mode="thread",
                                   device_mode="thread", build_fn=ff.fake_build, run_fn=_run,
                                   precheck_fn=ff.fake_precheck, max_retries=2))
    with farm:
        r = farm.submit(ff.FakeTask(task_id="t"), rule).result(timeout=60)
    assert r.category == Category.INFRA and r.attempts == attempts and len(RUNS) == attempts
