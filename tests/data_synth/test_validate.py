"""Validation: generated tasks pass their own checks; broken references are skipped with the failing check."""
import json

import pytest

from data_synth import cli
from data_synth.generate import GeneratedTask, generate_candidate, GenConfig
from data_synth.pipeline import validate_tasks
from data_synth.taskset import read_task_set
from data_synth.validate import ValidationConfig, validate_task

HEAD = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\nclass Model(nn.Module):\n" \
       "    def __init__(self):\n        super().__init__()\n\n    def forward(self, x):\n        return {expr}\n\n\n" \
       "def get_inputs():\n    return [torch.randn({shape})]\n\n\ndef get_init_inputs():\n    return []\n"


def _task(expr: str, shape: str = "64, 512") -> GeneratedTask:
    return GeneratedTask(task_id=f"t_{abs(hash(expr))}", stage=1, index=0, source=HEAD.format(expr=expr, shape=shape),
                         description="", families=["elementwise"], primary_family="elementwise", ops=[], sizes={},
                         precisions=["float32"])


def test_every_generated_task_passes_its_own_validation(stage_sets):
    """Re-validate the written sets from disk (a sample of every stage), independently of generation."""
    for stage, (folder, tasks, records) in stage_sets.items():
        accepted = [r for r in records if r.status == "accepted"]
        assert len(accepted) == len(tasks)
        assert all(r.validation and r.validation["ok"] for r in accepted)
        ok, results = validate_tasks(read_task_set(folder), ValidationConfig(), progress=False)
        assert len(ok) == len(tasks), [r.reason for r in results if not r.ok]
        for r in results:
            assert all(r.checks[c] == "ok" for c in ("runs", "finite", "deterministic", "input_dependent",
                                                       "not_constant", "runtime", "prompt_metadata"))


def test_torch_compile_check_runs_inductor_and_catches_a_mismatch():
    task = _task("torch.tanh(x) * 2.0", shape="16, 64")
    res = validate_task(task, ValidationConfig(compile_fraction=1.0, min_ms=0.0))   # the real Inductor (C++)
    assert res.ok, res.reason
    assert res.checks["compile_agrees"] == "ok"

    def off_by_a_bit(gm, example_inputs):        # a compiler whose output disagrees with eager
        def run(*args):
            return [o * 1.01 for o in gm(*args)]
        return run

    res = validate_task(task, ValidationConfig(compile_fraction=1.0, min_ms=0.0, compile_backend=off_by_a_bit))
    assert not res.ok and res.reason.startswith("compile_agrees:") and "max |eager - compiled|" in res.reason


def test_compile_sample_is_deterministic_by_task_id():
    cfg = ValidationConfig(compile_fraction=0.3)
    picked = [cfg.compile_selected(f"task{i}") for i in range(400)]
    assert 80 < sum(picked) < 160 and picked == [cfg.compile_selected(f"task{i}") for i in range(400)]


@pytest.mark.parametrize("expr, check", [
    ("F.dropout(x, 0.5, training=True)", "deterministic"),       # random in forward (KernelBench L2/66's flaw)
    ("x * 0.0 + 1.0", "input_dependent"),                        # ignores its input
    ("torch.log(x)", "finite"),                                  # NaN on negative inputs
    ("x.sum() * 0 + torch.ones(64, 512)", "input_dependent"),
    ("torch.ones_like(x) * x.mean().clamp(min=10.0)", "input_dependent"),
    ("x.reshape(7, -1)", "runs"),                                # raises
    ("x.mean() + torch.zeros_like(x)", "not_constant"),           # one value everywhere
])
def test_broken_references_are_skipped_with_the_failing_check(expr, check, caplog):
    res = validate_task(_task(expr))
    assert not res.ok
    assert res.reason.startswith(check + ":"), res.reason
    assert any("skip" in r.message and res.task_id in r.message for r in caplog.records)


def test_runtime_band_rejects_too_fast_and_too_slow():
    task = _task("torch.relu(x)")
    assert not validate_task(task, ValidationConfig(min_ms=50.0, max_ms=100.0)).ok
    res = validate_task(task, ValidationConfig(min_ms=0.0, max_ms=1e-6))
    assert res.reason.startswith("runtime:") and "outside" in res.reason
    assert validate_task(task, ValidationConfig(min_ms=0.0, max_ms=1000.0)).ok


def test_gpu_profile_sizes_are_validated_when_asked():
    t = generate_candidate(GenConfig(stage=1, seed=1, families=("elementwise",), dtypes={"float32": 1.0}), 0)
    res = validate_task(t, ValidationConfig(profile="gpu", max_ms=10_000))
    assert res.ok, res.reason
    assert res.outputs[0]["shape"] != validate_task(t, ValidationConfig()).outputs[0]["shape"]


def test_cli_validate_reports_and_filters(tmp_path, stage_sets, capsys):
    folder, tasks, _ = stage_sets[2]
    report, out = tmp_path / "report.jsonl", tmp_path / "valid"
    assert cli.main(["--no-progress", "validate", "--tasks", folder, "--report", str(report), "--out", str(out),
                     "--compile-fraction", "0"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["valid"] == summary["tasks"] == len(tasks)
    rows = [json.loads(x) for x in open(report)]
    assert len(rows) == len(tasks) and all(r["ok"] and r["eager_ms"] > 0 for r in rows)
    assert len(read_task_set(str(out))) == len(tasks)
    assert cli.main(["--no-progress", "validate", "--tasks", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err
