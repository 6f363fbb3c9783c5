"""`python -m megatron_rl.evaluate` keeps finished tasks in OUT/results.partial.jsonl and the same command continues:
a Ctrl-C or a kill loses at most the task being written, a run with other settings is refused (exit 2, the file as it
was), `--fresh` moves the file aside. The engine, the verifier farm and the agent are faked (a group's samples are a
pure function of --seed, the task and the sample index, as the real per-request sampling seeds are), so each run takes
a fraction of a second; everything else (`evaluate`, `main`, `_write`) is the real code."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import types
import zlib
from pathlib import Path

import pytest

from megatron_rl.evaluate import PROGRESS_FILE, EvalConfig, _group_record, _tasks, _write, main
from megatron_rl.rollout.agent import GroupResult, RolloutRequest
from tests.sft.test_evaluate_cli import _hf_stub, _kernelbench
from verifier.types import Category, VerifyResult

UNSCORED = "level2/1_Conv2D_ReLU_BiasAdd"    # its group comes back unscored (persistent infra verdicts)
ORDER = ["level1/1_Square_matrix_multiplication_", "level1/5_Matrix_scalar_multiplication", "level1/19_ReLU", UNSCORED]


class FakeAgent:
    """`AgentLoop` as `evaluate` drives it. ``stop_after``: once that many groups ran (in this process), the next
    one stops the run with ``stop`` ("sigint": a real Ctrl-C, through asyncio.run's handler; else raised)."""

    ran: list[str] = []
    stop_after: int | None = None
    stop: str | BaseException = "sigint"

    def __init__(self, tokenizer, generate, env, cfg):
        self.cfg = cfg

    async def run_group(self, request):
        tid = request.task.task_id
        if FakeAgent.stop_after is not None and len(FakeAgent.ran) >= FakeAgent.stop_after:
            if FakeAgent.stop != "sigint":
                raise FakeAgent.stop
            if callable(signal.getsignal(signal.SIGINT)):   # asyncio.run's handler: cancels the run, as Ctrl-C does
                signal.raise_signal(signal.SIGINT)
                await asyncio.sleep(10)
            raise KeyboardInterrupt      # SIGINT ignored here (a test worker): raised as the handler would
        FakeAgent.ran.append(tid)
        if tid == UNSCORED:
            return GroupResult(request=request, trajectories=[], status="infra", error="the farm lost a worker")
        trajectories = []
        for i in range(self.cfg.group_size):
            h = zlib.crc32(f"{self.cfg.seed}/{tid}/{i}".encode())
            passed = h % 3 != 0
            verdict = VerifyResult(task_id=tid, category=Category.PASS if passed else Category.CORRECTNESS_ERROR,
                                   q=1.0 if passed else 0.25, speedup=0.5 + (h % 200) / 50 if passed else None,
                                   feedback="" if passed else f"mismatch {h % 97}")
            turn = types.SimpleNamespace(turn=1, verdict=verdict, response_ids=list(range(h % 7 + 1)),
                                         finish_reason="stop", response_text=f"answer {h}")
            trajectories.append(types.SimpleNamespace(sample_index=i, turns=[turn]))
        return GroupResult(request=request, trajectories=trajectories)


class FakeFarm:
    def __init__(self, *args, **kwargs):
        pass

    def close(self, drain: bool = True) -> None:
        pass


@contextlib.contextmanager
def _fake_engine(model_dir, **kwargs):
    yield "http://127.0.0.1:9"


@pytest.fixture
def setup(tmp_path, monkeypatch):
    import megatron_rl.rollout.agent
    import megatron_rl.rollout.local_engine
    import megatron_rl.tokenizer
    import verifier.farm

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(megatron_rl.rollout.agent, "AgentLoop", FakeAgent)
    monkeypatch.setattr(megatron_rl.rollout.local_engine, "serve_embedded", _fake_engine)
    monkeypatch.setattr(verifier.farm, "VerifierFarm", FakeFarm)
    monkeypatch.setattr(megatron_rl.tokenizer, "load_tokenizer", lambda path: ["tok"] * 10)
    monkeypatch.setattr(FakeAgent, "ran", [])
    monkeypatch.setattr(FakeAgent, "stop_after", None)
    monkeypatch.setattr(FakeAgent, "stop", "sigint")
    kb = _kernelbench(tmp_path / "kb", with_level4=False)
    model = _hf_stub(tmp_path / "model")

    def argv(out: str, *extra: str) -> list[str]:
        return ["--model", str(model), "--tasks", str(kb), "--out", str(tmp_path / out), "--samples", "2",
                "--turns", "1", "--concurrency", "2", "--no-progress", *extra]   # one group at a time

    return types.SimpleNamespace(tmp=tmp_path, kb=kb, model=model, argv=argv)


def _run(s, capsys, out: str, *extra: str, stop_after: int | None = None) -> tuple[int, str, list[str]]:
    """main() once; returns its exit status, its stderr and the tasks whose groups it ran."""
    FakeAgent.ran = []
    FakeAgent.stop_after = stop_after
    rc = main(s.argv(out, *extra))
    return rc, capsys.readouterr().err, list(FakeAgent.ran)


def _progress(out: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(x) for x in (out / PROGRESS_FILE).read_text().splitlines()]
    return lines[0], lines[1:]


def _final(out: Path) -> tuple[str, dict]:
    summary = json.loads((out / "summary.json").read_text())
    for k in ("wall_seconds", "resumed_tasks"):
        summary.pop(k)
    return (out / "results.jsonl").read_text(), summary


def test_an_interrupted_run_keeps_its_finished_tasks_and_the_same_command_finishes_it(setup, capsys):
    rc, err, ran = _run(setup, capsys, "whole")
    assert rc == 0 and ran == ORDER, err
    assert not (setup.tmp / "whole" / PROGRESS_FILE).exists()        # a finished OUT looks as it always did
    whole_rows, whole_summary = _final(setup.tmp / "whole")

    out = setup.tmp / "out"
    rc, err, ran = _run(setup, capsys, "out", stop_after=2)           # Ctrl-C while the third group runs
    assert rc == 130 and ran == ORDER[:2]
    assert f"interrupted: 2 tasks finished are kept in {out / PROGRESS_FILE}; run the same command (without --fresh) to continue" in err
    header, records = _progress(out)
    assert header["fingerprint"]["samples"] == 2 and [r["task_id"] for r in records] == ORDER[:2]
    assert not (out / "results.jsonl").exists() and not (out / "summary.json").exists()

    rc, err, ran = _run(setup, capsys, "out")
    assert rc == 0 and ran == ORDER[2:], err                          # only the tasks not done yet
    assert f"resuming: 2 of 4 tasks already done in {out / PROGRESS_FILE}" in err
    assert not (out / PROGRESS_FILE).exists()
    rows, summary = _final(out)
    assert rows == whole_rows and summary == whole_summary            # as the uninterrupted run, row for row
    assert json.loads((out / "summary.json").read_text())["resumed_tasks"] == 2
    assert summary["unscored"] == {UNSCORED: "infra: the farm lost a worker"} and summary["scored_tasks"] == 3

    rc, err, ran = _run(setup, capsys, "out")                         # a finished OUT: a new evaluation
    assert rc == 0 and ran == ORDER and "resuming" not in err
    assert _final(out) == (whole_rows, whole_summary)


def test_a_crash_then_a_kill_mid_line_lose_only_that_task(setup, capsys, caplog):
    out = setup.tmp / "out"
    FakeAgent.stop = RuntimeError("the engine thread died")
    with pytest.raises(RuntimeError, match="engine thread died"):
        _run(setup, capsys, "out", stop_after=3)
    text = (out / PROGRESS_FILE).read_text()
    assert [r["task_id"] for r in _progress(out)[1]] == ORDER[:3]
    cut = text.rstrip("\n").rfind("\n") + 1 + 40                     # killed 40 bytes into the third task's line
    (out / PROGRESS_FILE).write_text(text[:cut])

    FakeAgent.stop = "sigint"
    with caplog.at_level(logging.WARNING, logger="megatron_rl.evaluate"):
        rc, err, ran = _run(setup, capsys, "out", stop_after=1)      # and stopped again after one more task
    assert rc == 130 and ran == ORDER[2:3], err                       # the torn task is evaluated again
    assert "resuming: 2 of 4 tasks already done" in err
    assert any("last line was cut off" in r.getMessage() for r in caplog.records), caplog.text
    assert [r["task_id"] for r in _progress(out)[1]] == ORDER[:3]     # every line whole: nothing glued to the tear
    rc, err, ran = _run(setup, capsys, "out")
    assert rc == 0 and ran == ORDER[3:] and "resuming: 3 of 4 tasks already done" in err, err
    rc, _, ran = _run(setup, capsys, "whole")
    assert rc == 0 and _final(out) == _final(setup.tmp / "whole")


def test_other_settings_are_refused_and_the_progress_file_is_left_as_it_was(setup, capsys):
    out = setup.tmp / "out"
    rc, _, _ = _run(setup, capsys, "out", stop_after=1)
    assert rc == 130
    before = (out / PROGRESS_FILE).read_bytes()
    for extra, named in ((["--samples", "3"], "samples: 2 then, 3 now"), (["--seed", "7"], "seed: 0 then, 7 now"),
                         (["--limit", "3"], "limit: null then, 3 now")):
        rc, err, ran = _run(setup, capsys, "out", *extra)
        lines = err.strip().splitlines()
        assert rc == 2 and not ran and len(lines) == 1 and lines[0].startswith(f"error: --out {out} holds an "
                                                                               f"unfinished evaluation"), err
        assert named in lines[0] and "--fresh" in lines[0], err
        assert (out / PROGRESS_FILE).read_bytes() == before
    os.utime(setup.model / "model.safetensors", ns=(1, 1))          # the weights were rewritten in place
    rc, err, _ = _run(setup, capsys, "out")
    assert rc == 2 and "weights: the model's files changed" in err and (out / PROGRESS_FILE).read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == [PROGRESS_FILE]


def test_fresh_moves_the_unfinished_run_aside_and_starts_over(setup, capsys):
    out = setup.tmp / "out"
    _run(setup, capsys, "out", stop_after=2)
    before = (out / PROGRESS_FILE).read_bytes()
    rc, err, ran = _run(setup, capsys, "out", "--samples", "3", "--fresh")
    assert rc == 0 and ran == ORDER, err
    aside = [p for p in out.glob("results.partial-*.jsonl")]
    assert len(aside) == 1 and aside[0].read_bytes() == before and f"aside to {aside[0]}" in err
    assert not (out / PROGRESS_FILE).exists()
    assert json.loads((out / "summary.json").read_text())["samples"] == 3


def test_only_the_tasks_still_selected_and_unchanged_are_reused(setup, capsys, caplog):
    """--pass-k and --label only shape the reports: no refusal. A task file edited since is evaluated again; a
    finished task no longer in --tasks stays out of the reports."""
    out = setup.tmp / "out"
    _run(setup, capsys, "out", stop_after=3)
    relu = setup.kb / "level1" / "19_ReLU.py"
    relu.write_text(relu.read_text().replace("torch.relu(A + B)", "torch.relu(A - B)"))
    (setup.kb / "level1" / "1_Square_matrix_multiplication_.py").unlink()
    with caplog.at_level(logging.WARNING, logger="megatron_rl.evaluate"):
        rc, err, ran = _run(setup, capsys, "out", "--pass-k", "1,2", "--label", "x")
    assert rc == 0 and ran == ["level1/19_ReLU", UNSCORED], err
    assert "resuming: 1 of 3 tasks already done" in err
    assert "changed since" in caplog.text and "no longer in --tasks" in caplog.text
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in rows][::2] == ["level1/5_Matrix_scalar_multiplication", "level1/19_ReLU"]


def test_a_torn_header_alone_is_a_fresh_start(setup, capsys, caplog):
    out = setup.tmp / "out"
    out.mkdir()
    (out / PROGRESS_FILE).write_text('{"evaluate_progress": 1, "finger')
    with caplog.at_level(logging.WARNING, logger="megatron_rl.evaluate"):
        rc, err, ran = _run(setup, capsys, "out")
    assert rc == 0 and ran == ORDER and "last line was cut off" in caplog.text, err
    assert not (out / PROGRESS_FILE).exists()


def test_a_damaged_line_before_the_last_is_refused(setup, capsys):
    out = setup.tmp / "out"
    _run(setup, capsys, "out", stop_after=2)
    lines = (out / PROGRESS_FILE).read_text().splitlines(keepends=True)
    (out / PROGRESS_FILE).write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
    rc, err, ran = _run(setup, capsys, "out")
    assert rc == 2 and not ran and "line 2 is damaged" in err and "--fresh" in err, err


def test_write_reads_progress_records_like_groups(tmp_path, monkeypatch):
    """`_write` from groups (the old call) and from `Progress` records gives the same files."""
    monkeypatch.setattr(FakeAgent, "ran", [])
    tasks = _tasks(EvalConfig(model="m", tasks=str(_kernelbench(tmp_path / "kb", with_level4=False)), out="o"))
    agent = FakeAgent(None, None, None, types.SimpleNamespace(group_size=3, seed=0))
    groups = [asyncio.run(agent.run_group(RolloutRequest(task=t, group_id=t.task_id))) for t in tasks]
    cfg = EvalConfig(model="m", tasks="t", out="o", samples=3)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    sa = _write(cfg, a, tasks, groups, "m", "tok", 1.0)
    records = {t.task_id: json.loads(json.dumps(_group_record(t, g))) for t, g in zip(tasks, groups)}
    sb = _write(cfg, b, tasks, [], "m", "tok", 1.0, records=records, resumed=4)
    assert (a / "results.jsonl").read_text() == (b / "results.jsonl").read_text()
    assert {**sa, "resumed_tasks": 4} == sb and (a / "report.md").read_text() == (b / "report.md").read_text()
    row = json.loads((a / "results.jsonl").read_text().splitlines()[0])
    assert list(row) == ["task_id", "level", "family", "passed", "first_turn_passed", "speedup", "speedup_compile",
                         "turns", "category", "sample_index", "turn_verdicts", "response"]


def test_ctrl_c_before_any_task_finished_keeps_nothing_and_says_so(setup, capsys):
    out = setup.tmp / "out"
    rc, err, ran = _run(setup, capsys, "out", stop_after=0)
    assert rc == 130 and not ran and err.strip().splitlines()[-1] == (
        f"interrupted: nothing written to {out}'s results or reports (a previous run's are as they were): no task "
        f"had finished")
    assert not (out / PROGRESS_FILE).exists()


def test_a_group_lost_to_infra_is_evaluated_again_on_resume(setup, capsys, monkeypatch):
    """A task unscored for the run's own trouble (persistent infra verdicts: the farm died with the run) is no result
    to keep: the resumed run evaluates it again, the finished ones not."""
    import megatron_rl.evaluate as ev

    monkeypatch.setattr(ev, "_task_key", lambda task, precision: "k")   # a record written by hand matches
    out = setup.tmp / "infra"
    rc, err, ran = _run(setup, capsys, "infra", stop_after=2)
    assert rc == 130 and ran == ORDER[:2], err
    lost = {"task_id": ORDER[2], "key": "k", "family": None, "unscored": "infra: the farm died with the run",
            "rows": []}
    with open(out / PROGRESS_FILE, "a") as f:
        f.write(json.dumps(lost) + "\n")
    rc, err, ran = _run(setup, capsys, "infra")
    assert rc == 0 and ran == ORDER[2:], err                       # the lost task again, the kept ones not
    assert f"resuming: 2 of 4 tasks already done in {out / PROGRESS_FILE}" in err
