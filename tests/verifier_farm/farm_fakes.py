"""Injectable stand-ins for build_candidate / run_candidate / precheck, to test farm logic fast.

A fake candidate's "code" is a directive string: ``kind[:marker-path]``. Directives that fail
"once" create their marker file on the first call and behave on later calls, so a retry on a
fresh worker (another process) sees that the failure already happened.
"""
from __future__ import annotations

import os
import time

from verifier.build import BuildResult
from verifier.config import VerifierConfig
from verifier.tasks import Task
from verifier.types import Category, VerifyResult, reward_eq2


def FakeBuild(ok: bool, code_hash: str, log_tail: str = "", timed_out: bool = False, error: str | None = None):
    return BuildResult(ok=ok, code_hash=code_hash, build_dir="", log_tail=log_tail, seconds=0.0,
                       timed_out=timed_out, error=error)


def _first_time(marker: str) -> bool:
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _count(marker: str) -> None:
    with open(marker + ".count", "a") as f:
        f.write("x")


def fake_precheck(task, response, cfg):
    if response.startswith("FORMAT"):
        return VerifyResult(task_id=task.task_id, category=Category.FORMAT_ERROR, reward=-1.0,
                            feedback="no code block", backend=cfg.backend)
    return response


def _sleep_s(marker: str) -> float:
    """The seconds a slow fake takes: ``<marker dir>/<seconds>_<tag>``, 0.2 without a marker."""
    return float(marker.rsplit("/", 1)[-1].split("_")[0]) if marker else 0.2


def fake_build(task, code, cfg):
    kind, _, marker = code.partition(":")
    if marker:
        _count(marker + ".build")
    if kind == "build_fail":
        return FakeBuild(ok=False, code_hash=code, log_tail="error: expected ';'", error="compile")
    if kind == "build_timeout":
        return FakeBuild(ok=False, code_hash=code, timed_out=True, log_tail="killed after 600 s", error="timeout")
    if kind == "build_infra_once" and _first_time(marker + ".binfra"):
        return FakeBuild(ok=False, code_hash=code, log_tail="compile child killed by SIGTERM", error="infra")
    if kind == "build_raise_once" and _first_time(marker + ".braise"):
        raise RuntimeError("compiler pool lost its temp dir")
    if kind == "build_crash_once" and _first_time(marker + ".bcrash"):
        os._exit(9)
    if kind in ("slow", "slow_both"):
        time.sleep(_sleep_s(marker))
    return FakeBuild(ok=True, code_hash=code)


def fake_run(task, code, build, cfg, device_index=None):
    kind, _, marker = code.partition(":")
    if marker:
        _count(marker + ".run")
    if kind == "infra_once" and _first_time(marker + ".infra"):
        return VerifyResult(task_id=task.task_id, category=Category.INFRA, feedback="device lost")
    if kind == "infra_always":
        return VerifyResult(task_id=task.task_id, category=Category.INFRA, feedback="device lost")
    if kind == "task_fault":   # the task's reference does not repeat: the same on every attempt
        return VerifyResult(task_id=task.task_id, category=Category.INFRA, feedback="reference not repeatable",
                            rule="reference_not_repeatable")
    if kind == "crash_once" and _first_time(marker + ".crash"):
        os._exit(11)
    if kind == "crash_always":
        os._exit(11)
    if kind == "hang_once" and _first_time(marker + ".hang"):
        time.sleep(3600)
    if kind == "raise_once" and _first_time(marker + ".raise"):
        raise RuntimeError("harness bug")
    if kind == "slow_both":   # as long on the device as in the build
        time.sleep(_sleep_s(marker))
    if kind == "wrong":
        return VerifyResult(task_id=task.task_id, category=Category.CORRECTNESS_ERROR, q=0.4,
                            reward=reward_eq2(Category.CORRECTNESS_ERROR, 0.4, None), backend=cfg.backend)
    speedup = 1.5
    return VerifyResult(task_id=task.task_id, category=Category.PASS, q=1.0, speedup=speedup,
                        reward=reward_eq2(Category.PASS, 1.0, speedup), backend=cfg.backend,
                        details={"device_index": device_index, "pid": os.getpid()})


def counted(marker: str, stage: str) -> int:
    try:
        return len(open(f"{marker}.{stage}.count").read())
    except FileNotFoundError:
        return 0


def FakeTask(task_id: str, path: str = "/nonexistent/fake_task.py", source: str = "class Model: pass\n",
             level: int | None = 1) -> Task:
    return Task(task_id=task_id, path=path, source=source, level=level, op_family="elementwise")


def FakeConfig(**kw) -> VerifierConfig:
    return VerifierConfig(**kw)
