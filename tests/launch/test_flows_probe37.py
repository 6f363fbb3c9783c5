"""Flow probe 37: nothing lost, nothing half-written, under concurrency and a full disk.

- Two runs on one output: the second is refused at once, naming the first (`fsutil.output_lock`, a flock the kernel
  drops when its process dies), before it touches anything. Seen before: a second SFT run in a used run dir dropped
  the first's resume pointer, moved its metrics aside and removed its checkpoint temp dir (the first crashed); a second
  distill moved the first's OUT.partial aside; a second evaluate appended to the first's progress file.
- A full disk (ENOSPC injected at the OS write, as a real one fails; as root a chmod cannot make a folder read-only)
  or a read-only or vanished folder: one line naming the path and the reason, a non-zero exit, the previous good
  state kept (the checkpoint pointer, whole JSONL lines that a resume reads), and no temp left filling the disk.
- An output folder under a file is a usage error before the run, not a failure at its first save or export.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.launch.test_flows_probe36 import ROW, TINY, _distill_tasks, _earlier_run  # noqa: E402
from tests.sft.test_evaluate_resume import ORDER, UNSCORED, FakeAgent, _progress, _run, setup  # noqa: E402,F401 (a fixture)

NO_SPACE = "No space left on device"


@contextlib.contextmanager
def _holder(target: Path, what: str = "run"):
    """Another process that holds ``target``'s output lock (a live run), killed with SIGKILL at the end."""
    code = ("import sys, time; from megatron_rl.fsutil import output_lock\n"
            f"with output_lock({str(target)!r}, {what!r}):\n"
            "    print('held', flush=True); time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert p.stdout.readline().strip() == "held"
        yield p
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def _full_disk(monkeypatch, under: Path) -> None:
    """Writes (``os.write``) to files under ``under`` get ENOSPC; writes elsewhere (pytest's own) pass."""
    real = os.write

    def write(fd, data):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if path.startswith(str(under)):
            raise OSError(errno.ENOSPC, NO_SPACE)
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


# ------------------------------------------------------------------------------------------ the lock


def test_a_second_holder_is_refused_by_name_and_a_killed_holder_leaves_no_stale_lock(tmp_path):
    from megatron_rl.fsutil import OutputBusyError, lock_file, output_lock

    out = tmp_path / "run"
    with _holder(out, "SFT run") as p:
        with pytest.raises(OutputBusyError) as e:
            with output_lock(out, "SFT run"):
                pass
        assert f"pid {p.pid}" in str(e.value) and str(out) in str(e.value) and " -c" in str(e.value)
        os.kill(p.pid, signal.SIGKILL)   # killed: no cleanup of its own, the kernel drops the lock
        p.wait()
        assert lock_file(out).exists()
    with output_lock(out, "SFT run"):
        with pytest.raises(OutputBusyError):   # a second descriptor of this process is refused as well
            with output_lock(out, "SFT run"):
                pass
    assert not lock_file(out).exists() and not out.exists()   # released: no file left, no output made


def test_a_requeued_job_waits_for_its_dead_predecessors_lock(tmp_path, monkeypatch):
    """On a shared filesystem a dead node's lock lasts until its lease ends (NFS: ~90 s): a requeued job
    (SLURM_RESTART_COUNT > 0) waits for it instead of failing with exit 2, which slurm would not requeue again; a first
    run does not wait."""
    import time

    from megatron_rl import train
    from megatron_rl.fsutil import OutputBusyError

    out = tmp_path / "run"
    monkeypatch.setattr(train, "REQUEUE_LOCK_WAIT_S", 30.0)
    with _holder(out, "training run") as p:
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
        with pytest.raises(OutputBusyError):
            with train.lock_outputs("training run", out):
                pass
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        subprocess.Popen(["bash", "-c", f"sleep 3; kill -9 {p.pid}"])   # the lease ends 3 s into the wait
        t = time.monotonic()
        with train.lock_outputs("training run", out):
            waited = time.monotonic() - t
    assert 2 < waited < 30


@pytest.mark.parametrize("shared", ["log_dir", "ckpt_dir"])
@pytest.mark.parametrize("module", ["megatron_rl.sft", "megatron_rl.train"])
def test_a_second_run_on_a_run_or_checkpoint_dir_in_use_is_refused_before_it_touches_it(tmp_path, capsys, module,
                                                                                     shared):
    """A fresh run beside a live one removed that run's resume pointer, moved its metrics.jsonl aside and deleted
    its checkpoint temp dir mid-save (it crashed with FileNotFoundError). Now exit 2 naming the live run."""
    import importlib

    first = tmp_path / "first"
    ckpt = _earlier_run(first)   # what the live run has written so far

    def files() -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in first.rglob("*") if p.is_file() and not p.name.endswith(".lock")}

    before = files()
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    second = first if shared == "log_dir" else tmp_path / "second"
    args = ["--config", str(ROOT / ("configs/sft_tiny.yaml" if module.endswith("sft") else "configs/quickstart.yaml")),
            f"train.log_dir={second}", f"train.ckpt_dir={ckpt}", *TINY]
    if module.endswith("sft"):
        args += ["--data", str(data)]
    with _holder(first if shared == "log_dir" else ckpt) as p:
        rc = importlib.import_module(module).main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and f"pid {p.pid}" in err[-1] and "in use by another" in err[-1], err
    assert files() == before
    assert not (tmp_path / "second").exists()


def test_a_second_evaluate_on_an_out_in_use_is_refused_and_leaves_its_progress_file(setup, capsys):
    rc, err, ran = _run(setup, capsys, "out", stop_after=2)   # a first run, stopped with 2 tasks finished
    assert rc == 130 and len(ran) == 2
    progress = (setup.tmp / "out" / "results.partial.jsonl").read_bytes()
    with _holder(setup.tmp / "out", "evaluation") as p:   # ... and running again
        rc, err, ran = _run(setup, capsys, "out")
        assert rc == 2 and ran == [] and f"pid {p.pid}" in err.strip().splitlines()[-1], err
        rc, err, ran = _run(setup, capsys, "out", "--fresh")   # --fresh would move its file aside: refused too
        assert rc == 2 and ran == []
    assert (setup.tmp / "out" / "results.partial.jsonl").read_bytes() == progress
    rc, err, ran = _run(setup, capsys, "out")   # the first run's own command continues it
    assert rc == 0 and len(ran) == 2, err


def test_a_second_distill_into_an_out_in_use_is_refused_and_leaves_its_partial_file(tmp_path, monkeypatch, capsys):
    """The second run moved OUT.partial aside while the first appended to it (into the moved file), and the first
    removed the second's OUT.partial and the aside file at its end."""
    from data_synth.cli import main

    async def verify(vt, answer):
        raise AssertionError("nothing is verified by a refused run")

    _distill_tasks(tmp_path, monkeypatch, 1, verify)
    out = tmp_path / "rows.jsonl"
    (tmp_path / "rows.jsonl.partial").write_text('{"sample_id": "t#0"}\n')   # the live run's finished samples
    with _holder(out, "distill") as p:
        rc = main(["distill", "--tasks", str(tmp_path / "tasks"), "--offline", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and f"pid {p.pid}" in err[-1], err
    assert sorted(x.name for x in tmp_path.glob("rows.jsonl*")) == ["rows.jsonl.partial"]
    assert (tmp_path / "rows.jsonl.partial").read_text() == '{"sample_id": "t#0"}\n'


def test_a_second_conversion_into_an_out_in_use_is_refused_before_it_converts(tmp_path):
    """Two `mcore-to-hf` into one --out could not mix (each works in its own temp), but the second found out only at
    its final rename, its conversion lost. It is refused at the start now."""
    from ckpt_tools.ranks import ToolError, staged_output

    out = tmp_path / "exports" / "hf"
    with _holder(out, "conversion") as p:
        with pytest.raises(ToolError, match=f"in use by another conversion \\(pid {p.pid}"):
            with staged_output(out):
                raise AssertionError("not reached")
        assert os.listdir(tmp_path / "exports") == [".hf.lock"]   # the holder's: no output, no temp


# ------------------------------------------------------------------------------------------ a full disk


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_save_keeps_the_last_checkpoint_and_auto_resume_continues(tmp_path):
    """torch's checkpoint writer reported a full disk as ``[enforce fail at inline_container.cc:672] unexpected pos
    704 vs 598`` inside two tracebacks (CheckpointException, a BaseException, got past the save's error handling), and
    left the partial ``.iter_*.tmp`` filling the disk. Now: one line naming the checkpoint, the reason and the
    checkpoint ``--resume`` continues from; the temp removed; the pointer untouched; --auto-resume continues."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Write kernel {i}."},
                                                     {"role": "assistant", "content": f"x = {i} * {i}"}]}) + "\n"
                            for i in range(4)))
    run_dir, ckpt = tmp_path / "run", tmp_path / "run" / "ckpt"
    argv = ["--config", str(ROOT / "configs/sft_tiny.yaml"), "--data", str(data), "--auto-resume", "train.steps=2",
            "train.global_batch_size=2", "train.save_interval=1", f"train.log_dir={run_dir}", "train.export=false",
            *TINY]
    # the second save writes part of a shard, then the disk is full (every write under ckpt/ fails from then on)
    fault = f"""
import errno, os, sys
from pathlib import Path
from megatron.core import dist_checkpointing
real_save, real_write, calls = dist_checkpointing.save, os.write, []
def write(fd, data):
    try:
        path = os.readlink(f"/proc/self/fd/{{fd}}")
    except OSError:
        path = ""
    if path.startswith({str(ckpt)!r}):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_write(fd, data)
def save(state, path, **kw):
    calls.append(path)
    if len(calls) == 2:
        (Path(path) / "__0_0.distcp").write_bytes(b"x" * 4096)
        os.write = write
        raise RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    return real_save(state, path, **kw)
dist_checkpointing.save = save
from megatron_rl.sft import main
sys.exit(main({argv!r}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    first = subprocess.run([sys.executable, "-c", fault], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    last = first.stderr.strip().splitlines()[-1]
    assert first.returncode == 1 and "Traceback" not in first.stderr, first.stderr[-3000:]
    assert last == (f"error: saving {ckpt / 'iter_0000002'} failed: {NO_SPACE}; the latest checkpoint is still "
                    f"iteration 1 ({ckpt / 'latest_checkpointed_iteration.txt'})"), last
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]   # no temp left
    assert not list(tmp_path.glob("**/.*.lock"))
    second = subprocess.run([sys.executable, "-m", "megatron_rl.sft", *argv], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "from step 1" in second.stdout, second.stderr[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_metrics_row_is_written_whole_or_not_at_all_and_a_resume_appends_after_whole_rows(tmp_path, monkeypatch,
                                                                                             caplog, code):
    """metrics.jsonl was a buffered text file: a full disk (or a kill) mid-row left half a row, the resumed run's
    next row was glued to it, and `megatron_rl.report` refused the whole file ("not JSON"). The error named no file."""
    from megatron_rl.observability import RunLogger
    from megatron_rl.report import load_rows

    logger = RunLogger(tmp_path, tensorboard=False)
    logger.log_step(0, {"train/loss": 1.0}, {"train": 1.0}, 3)
    real = os.write

    def failing(fd, data):   # half of the row goes to disk, then the device refuses
        real(fd, bytes(data)[:len(data) // 2])
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "write", failing)
    with pytest.raises(OSError) as e:
        logger.log_step(1, {"train/loss": 0.5}, {"train": 1.0}, 3)
    monkeypatch.setattr(os, "write", real)
    logger.close()
    assert e.value.errno == code and e.value.filename == str(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in load_rows(tmp_path)] == [0]
    # a kill mid-row (no chance to take it back): the resumed run's logger cuts it off before its first row
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "train/lo')
    resumed = RunLogger(tmp_path, tensorboard=False)
    resumed.log_step(1, {"train/loss": 0.5}, {"train": 1.0}, 3)
    assert [r["step"] for r in load_rows(tmp_path)] == [0, 1] and "cut off" in caplog.text
    # the run dir removed while the run goes on: the rows go to a new file, not into the deleted one
    for p in tmp_path.iterdir():
        p.unlink()
    tmp_path.rmdir()
    resumed.log_step(2, {"train/loss": 0.25}, {"train": 1.0}, 3)
    resumed.close()
    assert [r["step"] for r in load_rows(tmp_path)] == [2] and "was removed" in caplog.text


@pytest.mark.parametrize("module", ["megatron_rl.sft", "megatron_rl.train"])
def test_a_write_failure_in_a_run_is_one_line_naming_the_path(tmp_path, monkeypatch, capsys, module):
    """A full disk in a run ended in a traceback; from a Ray rank, in the worker's traceback wrapped in Ray's."""
    import importlib

    import ray.exceptions

    from megatron_rl.checkpoint import CheckpointError

    m = importlib.import_module(module)
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    args = ["--config", str(ROOT / ("configs/sft_tiny.yaml" if module.endswith("sft") else "configs/quickstart.yaml")),
            f"train.log_dir={tmp_path / 'run'}", *TINY] + (["--data", str(data)] if module.endswith("sft") else [])
    failures = [OSError(errno.ENOSPC, NO_SPACE, str(tmp_path / "run" / "metrics.jsonl")),
                ray.exceptions.RayTaskError("save", "Traceback ...\nlong", CheckpointError(
                    "saving /c/iter_0000002 failed: No space left on device; the latest checkpoint is still iteration "
                    "1 (/c/latest_checkpointed_iteration.txt)")).as_instanceof_cause()]
    lines = []
    for failure in failures:
        monkeypatch.setattr(m, "run", lambda *a, **k: (_ for _ in ()).throw(failure))
        assert m.main(args) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0]
        lines.append(err[0])
    assert lines == [f"error: {tmp_path / 'run' / 'metrics.jsonl'}: {NO_SPACE}",
                     f"error: saving /c/iter_0000002 failed: {NO_SPACE}; the latest checkpoint is still iteration 1 "
                     f"(/c/latest_checkpointed_iteration.txt)"]
    monkeypatch.setattr(m, "run", lambda *a, **k: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):   # anything else keeps its traceback
        m.main(args)


def test_a_full_disk_in_evaluate_keeps_the_finished_tasks_and_the_same_command_finishes(setup, capsys, monkeypatch):
    """A full disk while a task's progress line was written: a traceback naming no file, and the half line stayed.
    The next task's line, written as the run stopped, came after it: a damaged line before the last, which the rerun
    refused ("line 3 is damaged; --fresh moves the file aside"), every finished task lost."""
    rc, err, _ = _run(setup, capsys, "whole")
    assert rc == 0, err
    whole = (setup.tmp / "whole" / "results.jsonl").read_text()

    real, lines = os.write, [0]

    def write(fd, data):   # the progress file: its third line (the second task) hits a full disk halfway
        if os.readlink(f"/proc/self/fd/{fd}").endswith("results.partial.jsonl"):
            lines[0] += 1
            if lines[0] == 3:
                real(fd, bytes(data)[:len(data) // 2])
                raise OSError(errno.ENOSPC, NO_SPACE)
        return real(fd, data)

    with monkeypatch.context() as m:
        m.setattr(os, "write", write)
        rc, err, ran = _run(setup, capsys, "out")
    out = setup.tmp / "out"
    assert rc == 2 and err.strip().splitlines()[-1] == f"error: {out / 'results.partial.jsonl'}: {NO_SPACE}", err
    assert not (out / "results.jsonl").exists()
    header, records = _progress(out)   # whole lines only: the half line was taken back
    done = [r["task_id"] for r in records]
    assert FakeAgent.ran[0] in done and FakeAgent.ran[1] not in done
    rc, err, ran = _run(setup, capsys, "out")   # space again: the same command continues
    kept = [t for t in done if t != UNSCORED]   # an infra-unscored task is evaluated again
    assert rc == 0 and sorted(ran + kept) == sorted(ORDER), err
    assert (out / "results.jsonl").read_text() == whole


def test_a_full_disk_in_distill_names_out_partial_and_the_same_command_reuses_the_finished_samples(
        tmp_path, monkeypatch, capsys):
    from data_synth.cli import main
    from verifier.types import Category, VerifyResult

    verified: list[str] = []

    async def verify(vt, answer):
        verified.append(vt.task_id)
        return VerifyResult(task_id=vt.task_id, category=Category.PASS, q=1.0, speedup=1.5, reward=1.0)

    tasks = _distill_tasks(tmp_path, monkeypatch, 3, verify)
    out = tmp_path / "rows.jsonl"
    argv = ["distill", "--tasks", str(tmp_path / "tasks"), "--offline", "--out", str(out), "--concurrency", "1",
            "--no-progress"]

    real, rows = os.write, [0]

    def write(fd, data):   # OUT.partial: its second sample hits a full disk halfway
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if path == f"{out}.partial":
            rows[0] += 1
            if rows[0] == 2:
                real(fd, bytes(data[:len(data) // 2]))
                raise OSError(errno.ENOSPC, NO_SPACE)
        return real(fd, data)

    with monkeypatch.context() as m:
        m.setattr(os, "write", write)
        rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3 and err[-1] == f"error: {out}.partial: {NO_SPACE}", err
    assert not out.exists()
    first = len(verified)
    rc = main(argv)
    assert rc == 0, capsys.readouterr().err
    assert tasks[0].task_id not in verified[first:] and tasks[1].task_id in verified[first:]   # reused; torn: redone
    assert [json.loads(x)["task_id"] for x in out.read_text().splitlines()] == [t.task_id for t in tasks]


def test_a_full_disk_in_an_export_names_the_output_and_keeps_the_old_one(tmp_path, monkeypatch):
    """safetensors says ``I/O error: No space left on device (os error 28)`` with no path; the SFT export (and the
    run's model and tokenizer dirs: `rebuild_dir`, `publish_dir`) and `mcore-to-hf` now say which output, while the
    partial files (and no more) are gone."""
    from ckpt_tools.ranks import ToolError, staged_output
    from megatron_rl.fsutil import rebuild_dir

    export = tmp_path / "hf"
    export.mkdir()
    (export / "model.safetensors").write_text("the previous export")
    _full_disk(monkeypatch, tmp_path)

    def build(d: str) -> None:
        (Path(d) / "model.safetensors").write_bytes(b"part of a shard")
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError) as e:
        rebuild_dir(build, export)
    assert e.value.filename == str(export) and e.value.strerror == NO_SPACE
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    assert (export / "model.safetensors").read_text() == "the previous export"
    with pytest.raises(ToolError) as e:
        with staged_output(tmp_path / "out"):   # a rank's failure, as `run_ranks` reports it
            raise ToolError(f"SafetensorError: Error while serializing: I/O error: {NO_SPACE} (os error 28)")
    assert str(e.value).startswith(f"writing {tmp_path / 'out'}: {NO_SPACE} (nothing was written; SafetensorError")
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    from data_synth.util import atomic_dir

    with pytest.raises(OSError) as e:   # a generated task set
        with atomic_dir(str(tmp_path / "tasks")) as d:
            (Path(d) / "task_0.py").write_text("import torch\n")
            raise OSError(errno.ENOSPC, NO_SPACE)
    assert e.value.filename == str(tmp_path / "tasks") and sorted(os.listdir(tmp_path)) == ["hf"]


def test_a_read_only_output_folder_is_one_line_naming_the_file(setup, tmp_path, monkeypatch, capsys):
    """As root a chmod does not stop a write, so the open fails as the kernel's would on a read-only mount. distill
    ended in a traceback; evaluate too once its first task finished."""
    from data_synth.cli import main

    async def verify(vt, answer):
        from verifier.types import Category, VerifyResult

        return VerifyResult(task_id=vt.task_id, category=Category.PASS, q=1.0, speedup=1.5, reward=1.0)

    _distill_tasks(tmp_path / "d", monkeypatch, 1, verify)
    out = tmp_path / "d" / "rows.jsonl"
    real_open = os.open

    def os_open_read_only(path, flags, *a, **k):   # ResultsWriter and evaluate's LineLog open with os.open
        if str(path) in (f"{out}.partial", str(setup.tmp / "out" / "results.partial.jsonl")) \
                and flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(os, "open", os_open_read_only)
        rc = main(["distill", "--tasks", str(tmp_path / "d" / "tasks"), "--offline", "--out", str(out),
                   "--no-progress"])
        assert rc == 3 and capsys.readouterr().err.strip().splitlines()[-1] == \
            f"error: {out}.partial: {os.strerror(errno.EROFS)}"
        rc, err, ran = _run(setup, capsys, "out")
        assert rc == 2 and err.strip().splitlines()[-1] == \
            f"error: {setup.tmp / 'out' / 'results.partial.jsonl'}: {os.strerror(errno.EROFS)}", err


def test_an_atomic_write_on_a_full_disk_names_the_file(tmp_path):
    """summary.json, the checkpoint pointer, samples/step_*.jsonl: the error said "No space left on device" only."""
    from megatron_rl.fsutil import write_atomic

    def full(f):
        f.write(b"half")
        raise OSError(errno.ENOSPC, NO_SPACE)

    with pytest.raises(OSError) as e:
        write_atomic(tmp_path / "summary.json", full)
    assert str(e.value) == f"[Errno {errno.ENOSPC}] {NO_SPACE}: '{tmp_path / 'summary.json'}'"
    assert os.listdir(tmp_path) == []


def test_ckpt_tools_reports_a_write_failure_of_its_own_share_in_one_line(tmp_path, monkeypatch, capsys):
    """config.json and the tokenizer files are written by the parent: a full disk there was a traceback."""
    import ckpt_tools.convert
    from ckpt_tools.__main__ import main

    def full(job):
        raise OSError(errno.ENOSPC, NO_SPACE, str(tmp_path / ".hf.tmp-1" / "config.json"))

    monkeypatch.setattr(ckpt_tools.convert, "mcore_to_hf", full)
    assert main(["mcore-to-hf", "--ckpt", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / '.hf.tmp-1' / 'config.json'}: {NO_SPACE}\n"


# ------------------------------------------------------------------------------------------ outputs under a file


@pytest.mark.parametrize("key", ["train.log_dir", "train.ckpt_dir", "train.export_dir"])
def test_an_sft_output_dir_under_a_file_is_a_usage_error_before_the_run(tmp_path, capsys, key):
    """train.log_dir under a file ended in NotADirectoryError's traceback after the data was read; train.ckpt_dir
    trained a step and failed at the first save; train.export_dir trained the whole run and failed at the export."""
    from megatron_rl.sft import main

    (tmp_path / "afile").write_text("x")
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    overrides = {"train.log_dir": str(tmp_path / "run"), key: str(tmp_path / "afile" / "sub")}
    rc = main(["--config", str(ROOT / "configs/sft_tiny.yaml"), "--data", str(data), *TINY,
               *(f"{k}={v}" for k, v in overrides.items())])
    err = capsys.readouterr().err
    assert rc == 2 and f"{key}: cannot create {tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} is a file" in err, err
    assert sorted(os.listdir(tmp_path)) == ["afile", "sft.jsonl"]


def test_an_rl_checkpoint_dir_under_a_file_is_a_usage_error_before_the_run(tmp_path, capsys):
    """It ran the engines and a whole step (42 s on the quickstart) before the first save failed with a traceback."""
    from megatron_rl.train import main

    (tmp_path / "afile").write_text("x")
    rc = main(["--config", str(ROOT / "configs/quickstart.yaml"), f"train.log_dir={tmp_path / 'run'}",
               f"train.ckpt_dir={tmp_path / 'afile' / 'ckpt'}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"train.ckpt_dir: cannot create {tmp_path / 'afile' / 'ckpt'}" in err, err
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_evaluate_out_under_a_file_is_refused_before_the_run(setup, capsys):
    (setup.tmp / "afile").write_text("x")
    rc, err, ran = _run(setup, capsys, "afile/out")
    assert rc == 2 and ran == [] and "--out" in err and "cannot create the folder" in err, err


def test_an_output_under_a_read_only_parent_is_locked_inside_itself_or_runs_unlocked(tmp_path, monkeypatch):
    """A provisioned output folder whose parent is not writable (a container mount under a read-only /) was refused:
    the lock file beside it could not be made. It is locked inside the folder then, and a second run is still
    refused; an output that does not exist yet runs unlocked, with a warning."""
    from megatron_rl.fsutil import OutputBusyError, output_lock

    out = tmp_path / "ro" / "run"
    out.mkdir(parents=True)
    real_open = os.open

    def no_create_in_ro(path, flags, *a, **k):
        if Path(path).parent == tmp_path / "ro" and flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_create_in_ro)
    with output_lock(out, "SFT run") as path:
        assert path == out / ".lock"
        with pytest.raises(OutputBusyError, match="remove"):
            with output_lock(out, "SFT run"):
                pass
    with output_lock(tmp_path / "ro" / "new", "SFT run") as path:   # no folder to lock inside: unlocked
        assert not path.exists()
