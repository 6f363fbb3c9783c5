"""`fsutil.write_text_atomic`: every summary, report, latest-checkpoint pointer and HF asset goes through it."""
from __future__ import annotations

import os
import stat
import threading

import pytest

from megatron_rl.fsutil import write_atomic, write_text_atomic


def test_concurrent_writers_never_share_a_temp_and_a_reader_sees_one_whole_text(tmp_path):
    """Threads of one process (evaluate's writer beside a progress thread, two ranks' helpers) once shared the
    temp name `.NAME.tmpPID`: the second rename found the file gone (FileNotFoundError) or a mix of both texts."""
    target = tmp_path / "summary.json"
    texts = [f"{i}:" + str(i) * 200_000 + "\n" for i in range(8)]
    errors: list[BaseException] = []

    def write(text: str) -> None:
        try:
            for _ in range(5):
                write_text_atomic(target, text)
        except BaseException as e:  # noqa: BLE001 - collected for the assert below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert target.read_text() in texts
    assert sorted(os.listdir(tmp_path)) == ["summary.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "latest_checkpointed_iteration.txt"
    write_text_atomic(target, "7")
    with pytest.raises(AttributeError):
        write_text_atomic(target, b"8")   # not text: the write fails after the temp exists
    assert target.read_text() == "7"
    assert sorted(os.listdir(tmp_path)) == [target.name]


def test_a_writer_failing_halfway_leaves_the_old_bytes_and_no_temp(tmp_path):
    """`write_atomic` is what a plot's PNG goes through: a save that dies after writing part of the image."""
    target = tmp_path / "reward.png"
    write_atomic(target, lambda f: f.write(b"old image"))

    def half_then_fail(f):
        f.write(b"\x89PNG half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, half_then_fail)
    assert target.read_bytes() == b"old image"
    assert sorted(os.listdir(tmp_path)) == [target.name]


def test_the_file_gets_the_umask_mode_and_its_folder_is_created(tmp_path):
    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "new" / "report.md", "# report\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new" / "report.md").stat().st_mode) == 0o640


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux shows the umask in /proc/self/status")
def test_reading_the_umask_never_sets_it(tmp_path, monkeypatch):
    """Reading the umask by setting it and back left a moment in which every file another thread created (the
    TensorBoard writer, an async checkpoint) got umask 022's mode (0644 for a group-shared 002 setup)."""
    old = os.umask(0o002)
    try:
        def no_umask(_mask):
            raise AssertionError("os.umask called")
        monkeypatch.setattr(os, "umask", no_umask)
        write_text_atomic(tmp_path / "shared.txt", "x")
        monkeypatch.undo()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "shared.txt").stat().st_mode) == 0o664


def test_a_run_failing_under_its_output_lock_leaves_no_folder_the_lock_made(tmp_path):
    """Bad input found once the lock is held (an rft model dir without config.json) left the empty folders the lock
    file needed behind; a run that wrote there, or ended well, keeps them."""
    from megatron_rl.fsutil import output_lock

    out = tmp_path / "a" / "b" / "rows.jsonl"
    with pytest.raises(ValueError):
        with output_lock(out, "test"):
            assert (tmp_path / "a" / "b").is_dir()
            raise ValueError("bad input")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError):
        with output_lock(out, "test"):
            (tmp_path / "a" / "notes.txt").write_text("kept")
            raise ValueError("after writing")
    assert os.listdir(tmp_path / "a") == ["notes.txt"]   # b/ went, a/ holds a file
    with output_lock(out, "test"):
        pass
    assert os.listdir(tmp_path / "a" / "b") == []   # a run that ended well keeps its folder (its lock file went)


def test_a_line_log_with_a_header_starts_every_new_file_with_it(tmp_path, monkeypatch):
    """`evaluate`'s progress file: fresh empties an old file, the header line opens the file whenever it starts empty
    (also when it was removed mid-run: rows without their header would be refused on resume), each line is fsynced,
    and a line that fails is taken back whole."""
    import errno

    from megatron_rl.fsutil import LineLog

    path = tmp_path / "p.jsonl"
    path.write_text('{"old": 1}\n')
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    log = LineLog(path, fresh=True, header='{"h": 1}', fsync=True)
    log.write('{"a": 1}')
    assert path.read_text() == '{"h": 1}\n{"a": 1}\n' and len(synced) == 2
    path.unlink()
    log.write('{"b": 2}')
    assert path.read_text() == '{"h": 1}\n{"b": 2}\n'
    real_write = os.write

    def half(fd, data):
        real_write(fd, bytes(data)[:3])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half)
    with pytest.raises(OSError) as e:
        log.write('{"c": 3}')
    assert e.value.filename == str(path) and path.read_text() == '{"h": 1}\n{"b": 2}\n'
    monkeypatch.setattr(os, "write", real_write)
    log.close()
    again = LineLog(path, header='{"h": 1}')   # appending to a file that has its header: none added
    again.write('{"d": 4}')
    again.close()
    assert path.read_text() == '{"h": 1}\n{"b": 2}\n{"d": 4}\n'


def test_a_lock_whose_folder_vanishes_before_its_file_is_opened_makes_it_again(tmp_path, monkeypatch):
    """Another run that failed removes the empty folder it made for its lock file, between this run's mkdir and its
    open: that open's ENOENT is retried, not reported."""
    import errno

    from megatron_rl import fsutil

    out = tmp_path / "a" / "out"
    real_open, calls = os.open, []

    def vanishing(path, flags, *a, **k):
        if str(path).endswith(".out.lock") and not calls:
            calls.append(path)
            os.rmdir(tmp_path / "a")
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", vanishing)
    with fsutil.output_lock(out, "test") as lock:
        assert lock.is_file() and calls
