"""Flow probe 36: SFT gets --auto-resume (shared with the RL trainer) and the slurm launcher runs SFT and passes it on
a requeue; bad input leaves an earlier run as it was; command-line paths are the shell's; a stopped distill is
continued by the same command instead of being redone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROW = {"messages": [{"role": "user", "content": "write relu"}, {"role": "assistant", "content": "x = relu(x)"}]}
TINY = ["model.tiny.hidden_size=32", "model.tiny.intermediate_size=64"]


def _earlier_run(run_dir: Path) -> Path:
    """A run dir as an earlier finished run leaves it: a checkpoint pointer at iteration 10 and ten metrics rows."""
    from megatron_rl.checkpoint import LATEST_FILE

    ckpt = run_dir / "ckpt"
    (ckpt / "iter_0000010").mkdir(parents=True)
    (ckpt / "iter_0000010" / "metadata.json").write_text("{}")
    (ckpt / LATEST_FILE).write_text("10")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(10)))
    return ckpt


# ------------------------------------------------------------------------------------------ SFT --auto-resume


def test_sft_auto_resume_starts_fresh_then_continues_a_killed_run(tmp_path):
    """The first run with --auto-resume has no checkpoint: it starts fresh (and is killed after its step-1 save);
    the requeued run, same command, continues from step 1 and finishes."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Write kernel {i}."},
                                                     {"role": "assistant", "content": f"x = {i} * {i}"}]}) + "\n"
                            for i in range(4)))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_rl.sft", "--config", str(ROOT / "configs/sft_tiny.yaml"), "--data",
           str(data), "--auto-resume", "train.steps=2", "train.global_batch_size=2", "train.save_interval=1",
           f"train.log_dir={run_dir}", "train.export=false", "train.kill_at_step=1", *TINY]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 3, first.stderr[-2000:]                 # the injected kill, after the step-1 save
    assert "--auto-resume: continuing" not in first.stderr and "from step 0" in first.stdout
    second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "--auto-resume: continuing" in second.stderr and "from step 1" in second.stdout
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["steps_this_run"] == 1
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1]


@pytest.mark.parametrize("module", ["megatron_rl.sft", "megatron_rl.train"])
def test_resume_and_auto_resume_together_are_refused(module, capsys):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).parse_args(["--resume", "--auto-resume"])
    assert e.value.code == 2 and "--auto-resume: not allowed with argument --resume" in capsys.readouterr().err


def test_sft_auto_resume_decides_by_the_checkpoint_pointer(tmp_path, monkeypatch):
    """What a requeued SFT job gets: resume when train.ckpt_dir holds a checkpoint, else a fresh start; an unreadable
    pointer is an error (exit 2), not a silent start over."""
    import megatron_rl.sft as sft

    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    seen = []
    monkeypatch.setattr(sft, "run", lambda cfg, resume=False: seen.append(resume) or {})
    monkeypatch.setattr("megatron_rl.observability.print_summary", lambda summary: None)
    args = ["--config", str(ROOT / "configs/sft_tiny.yaml"), "--data", str(data), "--auto-resume",
            f"train.log_dir={tmp_path / 'run'}"]
    assert sft.main(args) == 0
    _earlier_run(tmp_path / "run")
    assert sft.main(args) == 0
    (tmp_path / "run" / "ckpt" / "latest_checkpointed_iteration.txt").write_text("garbage")
    assert sft.main(args) == 2
    assert seen == [False, True]


# ------------------------------------------------------------------------------------------ SFT bad input


@pytest.mark.parametrize("content,extra", [("", []), ("{not json\n", []),
                                           (json.dumps(ROW) + "\n", ["data.max_seq_len=3"])])
def test_bad_sft_data_leaves_an_earlier_runs_checkpoint_pointer_and_metrics(tmp_path, capsys, content, extra):
    """A fresh SFT run in a used run dir set the earlier run's --resume pointer and metrics aside before it read its
    data: an empty or malformed data file, or a row that fails only once encoded (too long for data.max_seq_len),
    then cost that run its resume point, for a run that never started."""
    from megatron_rl.checkpoint import resume_problem
    from megatron_rl.sft import main

    data = tmp_path / "sft.jsonl"
    data.write_text(content)
    run_dir = tmp_path / "run"
    ckpt = _earlier_run(run_dir)
    rc = main(["--config", str(ROOT / "configs/sft_tiny.yaml"), "--data", str(data), f"train.log_dir={run_dir}",
               *TINY, *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("error: ") and str(data) in err[-1]
    assert resume_problem(ckpt) is None                                   # --resume still continues iteration 10
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 10
    assert not (run_dir / "metrics.prev.jsonl").exists()
    if not extra:   # a row read as bad needs no tokenizer: nothing is made for a run that cannot start
        rc = main(["--config", str(ROOT / "configs/sft_tiny.yaml"), "--data", str(data),
                   f"train.log_dir={tmp_path / 'fresh'}", *TINY])
        assert rc == 2 and not (tmp_path / "fresh").exists()


def test_sft_tokenizer_dir_without_tokenizer_files_is_a_config_error(tmp_path, capsys):
    """model.tokenizer naming a folder with no tokenizer in it ended in transformers' traceback after the run dir
    was set up; the RL config already names it."""
    from megatron_rl.sft import main

    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    (tmp_path / "tok").mkdir()
    rc = main(["--config", str(ROOT / "configs/sft_tiny.yaml"), "--data", str(data),
               f"train.log_dir={tmp_path / 'run'}", f"model.tokenizer={tmp_path / 'tok'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "has no tokenizer files" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["train.log_dir", "train.ckpt_dir", "train.export_dir"])
def test_sft_output_folder_under_a_file_is_a_config_error_naming_the_key(tmp_path, capsys, key):
    """As `megatron_rl.train`'s (`train.output_problem`): before the run dir is made, not at the first save."""
    from megatron_rl.sft import main

    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    (tmp_path / "afile").write_text("x")
    overrides = [f"train.log_dir={tmp_path / 'run'}", f"{key}={tmp_path / 'afile' / 'out'}"]
    rc = main(["--config", str(ROOT / "configs/sft_tiny.yaml"), "--data", str(data), *overrides])
    err = capsys.readouterr().err
    assert rc == 2 and f"{key}: cannot create {tmp_path / 'afile' / 'out'}: " in err and "is a file" in err
    assert "Traceback" not in err and sorted(os.listdir(tmp_path)) == ["afile", "sft.jsonl"]


def test_command_line_paths_are_from_the_working_dir(tmp_path, monkeypatch):
    """`--data sft.jsonl` / `--model hf` run from another folder were looked up under the repository root
    ("/repo/sft.jsonl does not exist"), unlike every other command's paths."""
    import megatron_rl.sft as sft
    import megatron_rl.train as train

    (tmp_path / "sft.jsonl").write_text(json.dumps(ROW) + "\n")
    monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.setattr(sft, "run", lambda cfg, resume=False: seen.append(cfg.data.files) or {})
    monkeypatch.setattr("megatron_rl.observability.print_summary", lambda summary: None)
    assert sft.main(["--config", str(ROOT / "configs/sft_tiny.yaml"), "--data", "sft.jsonl",
                     f"train.log_dir={tmp_path / 'run'}"]) == 0
    assert seen == [[str(tmp_path / "sft.jsonl")]]
    from megatron_rl.config import ConfigError

    captured = []

    def load(path, overrides):
        captured.extend(overrides)
        raise ConfigError("stop")

    monkeypatch.setattr("megatron_rl.config.load_config", load)
    assert train.main(["--config", "x.yaml", "--model", "hf"]) == 2
    assert f"model.path={tmp_path / 'hf'}" in captured


# ------------------------------------------------------------------------------------------ data_synth


def test_generate_refuses_a_candidate_limit_below_one_and_writes_no_empty_task_set(tmp_path, capsys):
    """`--max-candidates 0` silently meant the default, a negative one wrote a task set with no task (exit 0) that
    every later stage refuses."""
    from data_synth.cli import main

    for n, rc_want, msg in (("0", 2, "--max-candidates must be >= 1"), ("-1", 2, "--max-candidates must be >= 1")):
        rc = main(["generate", "--n", "1", "--out", str(tmp_path / "t"), "--max-candidates", n, "--no-progress",
                   "--no-validate", "--no-decontaminate"])
        assert rc == rc_want and msg in capsys.readouterr().err
    from data_synth import cli

    from data_synth.pipeline import CandidateRecord

    cli_generate = cli.generate_task_set
    skipped = [CandidateRecord(0, "gen_0", "skipped", "validate", "compile_failed: nvcc said no"),
               CandidateRecord(1, "gen_1", "skipped", "decontaminate", "kb_near_duplicate: level1/19")]
    try:
        cli.generate_task_set = lambda *a, **k: ([], [])
        rc = main(["generate", "--n", "1", "--out", str(tmp_path / "t"), "--no-progress", "--no-validate",
                   "--no-decontaminate"])
        assert rc == 3 and "no candidate was accepted" in capsys.readouterr().err
        assert not (tmp_path / "t").exists() and not (tmp_path / "t.generation_report.jsonl").exists()
        # every candidate skipped: the reasons (what the user changes next) are kept beside OUT, and named
        cli.generate_task_set = lambda *a, **k: ([], skipped)
        rc = main(["generate", "--n", "1", "--out", str(tmp_path / "t") + "/", "--no-progress", "--no-validate",
                   "--no-decontaminate"])
    finally:
        cli.generate_task_set = cli_generate
    err = capsys.readouterr().err
    report = tmp_path / "t.generation_report.jsonl"
    assert rc == 3 and "2 tried" in err and str(report) in err
    assert not (tmp_path / "t").exists()
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(r["task_id"], r["check"], r["reason"]) for r in rows] == [
        ("gen_0", "validate", "compile_failed: nvcc said no"), ("gen_1", "decontaminate", "kb_near_duplicate: level1/19")]


@pytest.mark.parametrize("flag,value,msg", [("--temperature", "-1", "--temperature must be >= 0"),
                                            ("--temperature", "nan", "--temperature must be >= 0")])
def test_distill_refuses_a_negative_temperature(tmp_path, capsys, flag, value, msg):
    from data_synth.cli import main

    (tmp_path / "tasks").mkdir()
    rc = main(["distill", "--tasks", str(tmp_path / "tasks"), "--endpoint", "http://127.0.0.1:9", "--out",
               str(tmp_path / "rows.jsonl"), flag, value, "--no-progress"])
    assert rc == 2 and msg in capsys.readouterr().err
    assert not list(tmp_path.glob("rows.jsonl*"))


class _Stopped(Exception):
    pass


class _StubFarm:
    """Stands in for the verifier farm (`verify` answers instead); `fail` makes starting it the stop."""
    fail = False

    def __init__(self, *a, **k):
        if _StubFarm.fail:
            raise _Stopped("killed while the farm starts")

    def close(self, drain=True):
        pass


def _distill_tasks(tmp_path, monkeypatch, n, verify):
    """`n` generated stage-1 tasks, read back as distill reads them, with the farm stubbed and each verification
    answered by ``verify(vt, answer)`` (async)."""
    import data_synth.distill as distill_mod
    from data_synth.generate import GenConfig
    from data_synth.pipeline import generate_task_set
    from data_synth.taskset import read_task_set, write_task_set

    tasks, _ = generate_task_set(GenConfig(stage=1, n=n, seed=5, teacher_only=True, dtypes={"float32": 1.0}),
                                 progress=False)
    monkeypatch.setattr(_StubFarm, "fail", False)
    monkeypatch.setattr(distill_mod, "VerifierFarm", _StubFarm)
    monkeypatch.setattr(distill_mod, "farm_verify_fn", lambda farm: verify)
    return read_task_set(write_task_set(tasks, str(tmp_path / "tasks")))


def test_a_stopped_distill_is_continued_by_the_same_command(tmp_path, monkeypatch):
    """distill wrote its finished samples to OUT.partial, and the next run opened OUT.partial for writing: a run
    stopped at 90% and started again redid everything (an endpoint's hours). Now the same command reuses them,
    and a run with other settings does not."""
    from data_synth.distill import DistillConfig, distill
    from verifier.types import Category, VerifyResult

    verified: list[str] = []
    stop_after = [2]

    async def verify(vt, answer):
        if stop_after[0] is not None and len(verified) >= stop_after[0]:
            raise _Stopped("killed")
        verified.append(vt.task_id)
        return VerifyResult(task_id=vt.task_id, category=Category.PASS, q=1.0, speedup=1.5, reward=1.0)

    tasks = _distill_tasks(tmp_path, monkeypatch, 4, verify)
    out = tmp_path / "rows.jsonl"
    cfg = DistillConfig(offline=True, concurrency=1)
    with pytest.raises(_Stopped):
        distill(tasks, str(out), cfg, progress=False)
    assert not out.exists() and len(verified) == 2
    first = list(verified)
    stop_after[0] = None
    summary = distill(tasks, str(out), cfg, progress=False, verdicts_path=str(tmp_path / "verdicts.jsonl"))
    assert len(verified) == 4 and not set(verified[2:]) & set(first)   # only the two unfinished tasks again
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["task_id"] for r in rows] == [t.task_id for t in tasks]
    assert summary.rows_written == 4 and summary.passed_samples == 4
    assert len((tmp_path / "verdicts.jsonl").read_text().splitlines()) == 4
    assert not any(k.startswith("_") for r in rows for k in r)
    assert not list(tmp_path.glob("rows.jsonl.partial*"))
    # stopped again, then run with another seed: nothing of the other settings is reused
    stop_after[0], verified[:] = 1, []
    os.unlink(out)
    with pytest.raises(_Stopped):
        distill(tasks, str(out), cfg, progress=False)
    stop_after[0] = None
    distill(tasks, str(out), DistillConfig(offline=True, concurrency=1, seed=7), progress=False)
    assert len(verified) == 1 + 4
    # stopped twice, the second time before any sample was written again: the first run's samples (only in the
    # aside file then) are still reused by the third run, not replaced by the second run's empty .partial
    stop_after[0], verified[:] = 2, []
    os.unlink(out)
    with pytest.raises(_Stopped):
        distill(tasks, str(out), cfg, progress=False)
    _StubFarm.fail = True
    with pytest.raises(_Stopped):
        distill(tasks, str(out), cfg, progress=False)
    _StubFarm.fail, stop_after[0] = False, None
    distill(tasks, str(out), cfg, progress=False)
    assert len(verified) == 2 + 2 and len(out.read_text().splitlines()) == 4


def test_ctrl_c_in_evaluate_and_distill_is_one_line_that_says_what_was_kept(tmp_path, monkeypatch, capsys):
    """Ctrl-C in `evaluate` ended in a KeyboardInterrupt traceback; in `data_synth distill` in exit 130 without a
    word. Each now says what happened to its outputs."""
    import data_synth.cli as ds_cli
    import megatron_rl.evaluate as ev

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ev, "evaluate", interrupted)
    assert ev.main(["--model", str(tmp_path), "--tasks", str(tmp_path), "--out", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("interrupted: nothing written to")
    monkeypatch.setitem(ds_cli.COMMANDS, "distill", interrupted)
    assert ds_cli.main(["distill", "--tasks", str(tmp_path), "--offline", "--out", str(tmp_path / "r.jsonl")]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "OUT.partial" in err[0] and "same command again" in err[0]


def test_a_stopped_distill_verifies_its_infra_samples_again(tmp_path, monkeypatch):
    """A stop is often a lost node, and the samples verified meanwhile come back infra: reused as they were, they
    stayed infra for good. They are sampled and verified again; the others are reused."""
    from data_synth.distill import DistillConfig, distill
    from verifier.types import Category, VerifyResult

    state = {"broken": set(), "calls": [], "stop_at": 2}

    async def verify(vt, answer):
        if state["stop_at"] is not None and vt.task_id not in state["calls"] \
                and len(set(state["calls"])) >= state["stop_at"]:   # stopped once two samples finished
            raise _Stopped("node lost")
        state["calls"].append(vt.task_id)
        if vt.task_id in state["broken"]:   # the device is failing: every attempt is infra
            return VerifyResult(task_id=vt.task_id, category=Category.INFRA, feedback="device lost")
        return VerifyResult(task_id=vt.task_id, category=Category.PASS, q=1.0, speedup=1.5, reward=1.0)

    tasks = _distill_tasks(tmp_path, monkeypatch, 3, verify)
    state["broken"] = {tasks[1].task_id}
    out = tmp_path / "rows.jsonl"
    cfg = DistillConfig(offline=True, concurrency=1)
    with pytest.raises(_Stopped):
        distill(tasks, str(out), cfg, progress=False)
    assert set(state["calls"]) == {tasks[0].task_id, tasks[1].task_id}, state
    state.update(broken=set(), stop_at=None, calls=[])   # the device is back; the same command again
    summary = distill(tasks, str(out), cfg, progress=False)
    assert state["calls"] == [tasks[1].task_id, tasks[2].task_id]    # the passed sample reused, the infra one not
    assert summary.infra_samples == 0 and summary.passed_samples == 3


def test_distill_does_not_retry_an_infra_verdict_of_the_tasks_own_fault(tmp_path, monkeypatch):
    """`reference_insensitive` / `reference_not_repeatable` come back on every retry: distill verified such a sample
    infra_retries + 1 times (the farm and the agent loop already stop at one)."""
    from data_synth.distill import DistillConfig, distill
    from verifier.types import Category, VerifyResult

    calls = []

    async def verify(vt, answer):
        calls.append(vt.task_id)
        return VerifyResult(task_id=vt.task_id, category=Category.INFRA, rule="reference_insensitive",
                            feedback="the task's reference gives the same output")

    tasks = _distill_tasks(tmp_path, monkeypatch, 1, verify)
    summary = distill(tasks, str(tmp_path / "rows.jsonl"), DistillConfig(offline=True, infra_retries=3),
                      progress=False)
    assert len(calls) == 1 and summary.infra_samples == 1


def test_ctrl_c_in_train_and_sft_is_one_line_that_says_how_to_continue(tmp_path, monkeypatch, capsys):
    """Ctrl-C in `megatron_rl.train` / `megatron_rl.sft` ended in a KeyboardInterrupt traceback; it now says which
    checkpoint the run left and how to continue from it."""
    import megatron_rl.sft as sft
    import megatron_rl.train as train

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "run", interrupted)
    monkeypatch.setattr(sft, "run", interrupted)
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    assert train.main(["--config", str(ROOT / "configs/quickstart.yaml"), f"train.log_dir={tmp_path / 'rl'}"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("interrupted before the first checkpoint") and "Traceback" not in "\n".join(err)
    ckpt = _earlier_run(tmp_path / "sft")
    assert sft.main(["--config", str(ROOT / "configs/sft_tiny.yaml"), "--data", str(data),
                     f"train.log_dir={tmp_path / 'sft'}"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("interrupted: the last checkpoint (iteration 10)") and str(ckpt) in err[-1]
    assert "--resume" in err[-1]
