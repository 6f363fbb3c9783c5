"""`python -m verifier check|eval` as a user runs it: output contract, exit codes, result files."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TASKS = os.path.join(ROOT, "verifier", "tasks")
RELU_TASK = os.path.join(TASKS, "level1", "7_ReLU.py")
EXAMPLES = os.path.join(TASKS, "examples", "samples.jsonl")
FIELDS = {"category", "q", "speedup", "reward", "feedback"}


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "verifier", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def example(sample_id: str) -> dict:
    with open(EXAMPLES) as f:
        return next(r for r in map(json.loads, f) if r["sample_id"] == sample_id)


STATIC_CHEAT = '''```python
import subprocess
import torch.nn as nn

class ModelNew(nn.Module):
    def forward(self, x):
        return subprocess.run(["true"])
```'''


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text) if isinstance(text, str) else p.write_bytes(text)
    return str(p)


def test_check_usage_errors_name_the_path(tmp_path):
    cand = _write(tmp_path, "c.md", "text")
    r = cli("check", "--task", str(tmp_path / "missing_task.py"), "--candidate", cand, "--json")
    assert r.returncode == 2 and "missing_task.py" in r.stderr and r.stdout == ""
    r = cli("check", "--task", RELU_TASK, "--candidate", str(tmp_path / "nope.md"))
    assert r.returncode == 2 and "nope.md" in r.stderr
    bad_task = _write(tmp_path, "bad_task.py", "import torch\nx = 1\n")
    r = cli("check", "--task", bad_task, "--candidate", cand)
    assert r.returncode == 2 and "bad_task.py" in r.stderr and "Model" in r.stderr
    r = cli("check", "--task", RELU_TASK, "--candidate", cand, "--trials", "0")
    assert r.returncode == 2 and "--trials must be >= 1" in r.stderr
    r = cli("check", "--task", RELU_TASK, "--candidate", cand, "--timing-trials", "0")
    assert r.returncode == 2 and "--timing-trials must be >= 1" in r.stderr
    r = cli("check", "--task", RELU_TASK, "--candidate", cand, "--size-profile", "fit:1:2:3")
    assert r.returncode == 2 and "--size-profile: size profile 'fit:1:2:3'" in r.stderr


def test_check_json_format_error_and_undecodable_bytes(tmp_path):
    r = cli("check", "--task", RELU_TASK, "--candidate", _write(tmp_path, "r.md", example("relu-no-code")["response"]),
            "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON object on stdout
    assert FIELDS <= set(out)
    assert out["category"] == "format_error" and out["reward"] == -1.0 and out["speedup"] is None
    assert out["q"] == 0.0 and out["feedback"]
    r = cli("check", "--task", RELU_TASK, "--candidate", _write(tmp_path, "b.bin", b"\xff\xfe```python\n"), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["category"] == "format_error"
    assert "UTF-8" in json.loads(r.stdout)["feedback"]


def test_check_cheating_candidates(tmp_path):
    r = cli("check", "--task", RELU_TASK, "--candidate", _write(tmp_path, "s.md", STATIC_CHEAT), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["category"] == "cheating" and out["rule"] == "process_or_thread" and out["reward"] == -1.0
    # a torch fallback without any native code: caught at run time by the profiler
    softmax = os.path.join(TASKS, "level1", "12_Softmax.py")
    r = cli("check", "--task", softmax, "--candidate",
            _write(tmp_path, "f.md", example("softmax-torch-fallback")["response"]))
    assert r.returncode == 0, r.stderr
    assert "verdict:  cheating" in r.stdout and "aten::softmax" in r.stdout  # human summary


@pytest.mark.slow
def test_real_candidate_check_then_eval(tmp_path, build_cache):
    """ONE real compiled C++ kernel end to end; eval reuses its build through the shared cache dir."""
    relu = example("relu-correct")["response"]
    r = cli("check", "--task", RELU_TASK, "--candidate", _write(tmp_path, "relu.md", relu), "--json",
            "--cache", build_cache, "--trials", "3", "--timing-trials", "5")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["category"] == "pass", out["feedback"]
    assert out["q"] == 1.0 and math.isfinite(out["speedup"]) and out["speedup"] > 0
    assert out["reward"] >= 1.0

    samples = tmp_path / "samples.jsonl"
    rows = [{"task_id": "7_ReLU", "response": relu, "sample_id": "r0"},
            {"task": RELU_TASK, "code": relu, "sample_id": "r1"},
            {"task_id": "7_ReLU", "response": example("relu-no-code")["response"], "sample_id": "prose"},
            {"task_id": "level2/1_Matmul_Bias_GELU", "response": STATIC_CHEAT, "sample_id": "cheat"}]
    samples.write_text("".join(json.dumps(x) + "\n" for x in rows))
    res = tmp_path / "out" / "results.jsonl"
    summary = tmp_path / "out" / "summary.json"
    r = cli("eval", "--tasks", TASKS, "--samples", str(samples), "--out", str(res), "--cache", build_cache,
            "--trials", "3", "--timing-trials", "5", "--k", "1", "2", "--compile-workers", "1",
            "--summary-json", str(summary))
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in res.read_text().splitlines()]
    assert [g["sample_id"] for g in got] == ["r0", "r1", "prose", "cheat"]
    assert [g["category"] for g in got] == ["pass", "pass", "format_error", "cheating"]
    assert [g["level"] for g in got] == [1, 1, 1, 2]
    assert got[1]["cached"]  # the identical second sample was verified once
    assert not os.path.exists(str(res) + ".partial")
    # the summary table: per-level rows with the metric columns
    assert "level1" in r.stdout and "level2" in r.stdout and "pass@2" in r.stdout and "fast_1.1" in r.stdout
    lv1 = json.loads(summary.read_text())["levels"]["level1"]
    assert lv1["correct_rate"] == pytest.approx(2 / 3) and lv1["pass_at_k"]["pass@2"] == 1.0
    assert "verify" in r.stderr  # the progress bar goes to stderr


def test_eval_rejects_unknown_tasks_and_bad_rows(tmp_path):
    s = _write(tmp_path, "s.jsonl", json.dumps({"task_id": "99_Nope", "response": "x"}) + "\n"
               + json.dumps({"task_id": "7_ReLU", "response": "x"}) + "\n")
    r = cli("eval", "--tasks", TASKS, "--samples", s, "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and "99_Nope" in r.stderr and not os.path.exists(tmp_path / "o.jsonl")
    s = _write(tmp_path, "t.jsonl", json.dumps({"task_id": "7_ReLU", "response": "x"}) + "\n{oops\n")
    r = cli("eval", "--tasks", TASKS, "--samples", s, "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and "t.jsonl:2" in r.stderr
    r = cli("eval", "--tasks", str(tmp_path / "no_such_dir"), "--samples", s, "--out", str(tmp_path / "o.jsonl"))
    assert r.returncode == 2 and "no_such_dir" in r.stderr
