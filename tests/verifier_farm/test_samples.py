"""Samples JSONL parsing, task matching, and crash-safe result writing."""
from __future__ import annotations

import json
import os

import pytest

from farm_fakes import FakeTask
from verifier.samples import ResultsWriter, SamplesError, match_samples, read_result_rows, read_samples


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def test_read_samples_fields_and_default_ids(tmp_path):
    p = _jsonl(tmp_path / "s.jsonl", [{"task_id": "7_ReLU", "response": "a"}, {"task": "7_ReLU", "code": "b"},
                                      "", {"task_id": "x", "response": "c", "sample_id": 5, "temperature": 0.7}])
    s = read_samples(p)
    assert [x.sample_id for x in s] == ["7_ReLU#0", "7_ReLU#1", "5"]
    assert [x.response for x in s] == ["a", "b", "c"]
    assert s[2].meta == {"temperature": 0.7} and s[2].line_no == 4


@pytest.mark.parametrize("line,msg", [
    ("{bad", ":1: not valid JSON"),
    ("[1, 2]", ":1: each line must be a JSON object"),
    (json.dumps({"response": "x"}), ":1: missing 'task_id'"),
    (json.dumps({"task_id": "t"}), ":1: missing 'response'"),
    (json.dumps({"task_id": "t", "response": 3}), ":1: missing 'response'"),
])
def test_read_samples_errors_name_the_line(tmp_path, line, msg):
    p = _jsonl(tmp_path / "s.jsonl", [line])
    with pytest.raises(SamplesError, match=msg.replace("[", r"\[")):
        read_samples(p)


def test_duplicate_sample_ids_and_missing_file(tmp_path):
    p = _jsonl(tmp_path / "s.jsonl", [{"task_id": "t", "response": "", "sample_id": "a"},
                                      {"task_id": "t", "response": "", "sample_id": "a"}])
    with pytest.raises(SamplesError, match=":2: duplicate sample_id 'a'"):
        read_samples(p)
    with pytest.raises(SamplesError, match="not found"):
        read_samples(str(tmp_path / "nope.jsonl"))


def test_match_by_id_stem_and_path(tmp_path):
    a = FakeTask("level1/7_ReLU", path=str(tmp_path / "level1" / "7_ReLU.py"))
    b = FakeTask("level2/1_Matmul_Bias_GELU", path=str(tmp_path / "level2" / "1_Matmul_Bias_GELU.py"))
    p = _jsonl(tmp_path / "s.jsonl", [{"task_id": "7_ReLU", "response": ""},
                                      {"task_id": "level2/1_Matmul_Bias_GELU", "response": ""},
                                      {"task": b.path, "response": ""},
                                      {"task": "level1/7_ReLU.py", "response": ""}])
    got = match_samples(read_samples(p), [a, b], root=str(tmp_path))
    assert got == [a, b, b, a]


def test_unknown_and_ambiguous_references_are_reported_together(tmp_path):
    a = FakeTask("level1/1_Add", path=str(tmp_path / "level1" / "1_Add.py"))
    b = FakeTask("level2/1_Add", path=str(tmp_path / "level2" / "1_Add.py"))
    p = _jsonl(tmp_path / "s.jsonl", [{"task_id": "9_Nope", "response": ""}, {"task_id": "8_Gone", "response": ""},
                                      {"task_id": "1_Add", "response": ""}])
    with pytest.raises(SamplesError) as e:
        match_samples(read_samples(p), [a, b])
    msg = str(e.value)
    assert "'9_Nope' (line 1)" in msg and "'8_Gone' (line 2)" in msg and "ambiguous" in msg and "1_Add" in msg


def test_results_writer_partial_then_atomic_publish(tmp_path):
    out = str(tmp_path / "runs" / "r.jsonl")
    w = ResultsWriter(out)
    w.append({"sample_id": "b", "n": 2})
    w.append({"sample_id": "a", "n": 1})
    assert read_result_rows(out + ".partial") == [{"sample_id": "b", "n": 2}, {"sample_id": "a", "n": 1}]
    assert not os.path.exists(out)
    w.finish([{"sample_id": "a", "n": 1}, {"sample_id": "b", "n": 2}])
    assert read_result_rows(out) == [{"sample_id": "a", "n": 1}, {"sample_id": "b", "n": 2}]
    assert not os.path.exists(out + ".partial") and not os.path.exists(out + ".tmp")


def test_crash_keeps_partial_rows_and_torn_line_is_skipped(tmp_path):
    out = str(tmp_path / "r.jsonl")
    w = ResultsWriter(out)
    w.append({"sample_id": "a"})
    w.close()  # the run died before finish()
    with open(out + ".partial", "a") as f:
        f.write('{"sample_id": "b", "catego')  # torn by the crash
    assert read_result_rows(out + ".partial") == [{"sample_id": "a"}]
    assert not os.path.exists(out)


def test_a_publish_that_fails_keeps_the_partial_rows_and_leaves_no_temp_file(tmp_path):
    out = tmp_path / "r.jsonl"
    out.mkdir()   # the final rename cannot replace a folder
    w = ResultsWriter(str(out))
    w.append({"sample_id": "a"})
    with pytest.raises(OSError):
        w.finish([{"sample_id": "a"}])
    assert read_result_rows(str(out) + ".partial") == [{"sample_id": "a"}]
    assert sorted(os.listdir(tmp_path)) == ["r.jsonl", "r.jsonl.partial"]   # no temp file left


def test_a_row_the_disk_takes_half_of_is_taken_back_and_the_next_row_lands_whole(tmp_path, monkeypatch):
    """A full disk that took half a row, then space freed for the next one: the half row glued the next one to it,
    and a resume dropped both. The half is taken back; the error names the partial file; OUT gets its own file mode."""
    import errno

    out = str(tmp_path / "r.jsonl")
    w = ResultsWriter(out)
    w.append({"sample_id": "a"})
    real, full = os.write, [True]

    def write(fd, data):
        if fd == w._fd and full[0]:
            real(fd, bytes(data[:7]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(OSError, match="No space left") as e:
        w.append({"sample_id": "b", "pad": "x" * 100})
    assert e.value.filename == out + ".partial"
    full[0] = False
    w.append({"sample_id": "c"})
    assert read_result_rows(out + ".partial") == [{"sample_id": "a"}, {"sample_id": "c"}]
    assert len(open(out + ".partial").read().splitlines()) == 2
    os.unlink(out + ".partial")   # removed by hand meanwhile: OUT is still published
    w.finish([{"sample_id": "a"}, {"sample_id": "c"}])
    assert read_result_rows(out) == [{"sample_id": "a"}, {"sample_id": "c"}]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~umask   # a plain open's mode, not mkstemp's 0600
