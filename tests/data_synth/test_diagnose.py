"""Diagnosis: aten ops -> families from a profile of the reference, per-family pass rates -> weights that
``generate`` reads back."""
import json
import os

import pytest

from data_synth import cli
from data_synth.diagnose import DiagnoseConfig, aten_family, diagnose, profile_families, read_weights, write_weights
from data_synth.generate import GenConfig, generate_candidate
from data_synth.taskset import read_task_set
from data_synth.util import DataSynthError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUNDLED = os.path.join(ROOT, "verifier", "tasks")


@pytest.mark.parametrize("name, shapes, family", [
    ("aten::addmm", [], "gemm"), ("aten::linear", [], "gemm"), ("aten::convolution", [], "conv"),
    ("aten::relu", [[4, 8]], "elementwise"), ("aten::add", [[4, 8], [4, 8]], "elementwise"),
    ("aten::add", [[4, 8], [8]], "broadcast"), ("aten::sum", [[4, 8]], "reduction"), ("aten::amax", [], "reduction"),
    ("aten::_softmax", [], "softmax"), ("aten::native_layer_norm", [], "normalization"),
    ("aten::max_pool2d", [], "pooling"), ("aten::gather", [], "indexing"), ("aten::cumsum", [], "scan"),
    ("aten::scaled_dot_product_attention", [], "attention"), ("aten::mse_loss", [], "loss"),
    ("aten::view", [], None), ("aten::empty_like", [], None), ("aten::contiguous", [], None),
])
def test_aten_ops_map_to_families(name, shapes, family):
    assert aten_family(name, shapes) == family


def test_profiling_a_reference_finds_its_families():
    tasks = {t.task_id: t for t in read_task_set(BUNDLED)}
    fams, counts = profile_families(tasks["9_Gemm_GroupNorm_Tanh"])
    assert set(fams) == {"gemm", "normalization", "elementwise"}
    assert any("linear" in k or "addmm" in k for k in counts)
    fams, _ = profile_families(tasks["12_Softmax"])
    assert fams == ["softmax"]


def _rows(tasks, passing_family):
    rows = []
    for t in tasks:
        for k in range(4):
            ok = t.primary_family == passing_family or (k == 0 and t.primary_family == "elementwise")
            rows.append({"sample_id": f"{t.task_id}#{k}", "task_id": t.task_id,
                         "category": "pass" if ok else ("compile_error" if k % 2 else "correctness_error"),
                         "speedup": 1.5 if ok else None})
    rows.append({"sample_id": "infra#0", "task_id": tasks[0].task_id, "category": "infra", "speedup": None})
    return rows


def test_weights_upsample_failing_families_and_generate_reads_them(tmp_path, stage_sets):
    folder, tasks, _ = stage_sets[1]
    fams = {t.primary_family for t in tasks}
    passing = sorted(fams)[0]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in _rows(tasks, passing)))
    report = diagnose([str(results)], [folder], DiagnoseConfig(), progress=False)
    assert report.infra == 1 and report.samples == 4 * len(tasks)
    w = report.weights
    assert w[passing] < 1.0, w
    failing = [f for f in w if report.families[f].pass_rate == 0.0]
    assert failing and all(w[f] > w[passing] for f in failing)
    assert all(0.25 <= v <= 4.0 for v in w.values())
    for f, s in report.families.items():
        assert s.samples >= 4 and s.tasks >= 1 and s.compiled <= s.samples
    out = tmp_path / "weights.json"
    write_weights(str(out), report)
    assert read_weights(str(out)) == w
    # the next round samples by these weights
    cfg = GenConfig(stage=1, seed=0, weights={**{f: 0.0 for f in w}, failing[0]: 1.0})
    got = {generate_candidate(cfg, i).primary_family for i in range(15)}
    assert failing[0] in got and not got & set(w) - {failing[0]}


def test_cli_diagnose_end_to_end(tmp_path, stage_sets, capsys):
    folder, tasks, _ = stage_sets[1]
    results = tmp_path / "r.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in _rows(tasks, tasks[0].primary_family)))
    out = tmp_path / "w.json"
    assert cli.main(["--no-progress", "diagnose", "--results", str(results), "--tasks", folder, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["weights"] == json.load(open(out))["weights"]
    assert cli.main(["--no-progress", "generate", "--stage", "1", "--n", "2", "--weights", str(out), "--no-validate",
                     "--out", str(tmp_path / "next")]) == 0
    assert json.load(open(tmp_path / "next" / "manifest.json"))["info"]["weights"] == summary["weights"]


@pytest.mark.parametrize("row, message", [
    ({"task_id": "nope", "category": "pass"}, "not in"),
    ({"task_id": "X", "category": "great"}, "'category' must be one of"),
    ({"category": "pass"}, "missing 'task_id'"),
    ({"task_id": "X", "category": "pass", "speedup": "fast"}, "'speedup' must be a number"),
])
def test_bad_verdict_rows_are_named(tmp_path, stage_sets, row, message):
    folder, tasks, _ = stage_sets[1]
    row = {k: (tasks[0].task_id if v == "X" else v) for k, v in row.items()}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataSynthError, match=message):
        diagnose([str(path)], [folder], DiagnoseConfig(profile=False), progress=False)


def test_malformed_weights_and_results_files(tmp_path, stage_sets):
    folder, _, _ = stage_sets[1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_id": "a"\n')
    with pytest.raises(DataSynthError, match="bad.jsonl:1: not valid JSON"):
        diagnose([str(bad)], [folder], DiagnoseConfig(profile=False), progress=False)
    w = tmp_path / "w.json"
    w.write_text(json.dumps({"weights": {"conv": -1}}))
    with pytest.raises(DataSynthError, match="weight of 'conv'"):
        read_weights(str(w))
    w.write_text(json.dumps({"telepathy": 2.0}))
    with pytest.raises(DataSynthError, match="unknown family 'telepathy'"):
        read_weights(str(w))


_KB_HEAD = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
_KB_TASKS = {   # KernelBench-shaped references (they name no family) at full GPU sizes: read on meta tensors only
    "conv_relu_bias": ("class Model(nn.Module):\n"
                       "    def __init__(self, c, o, k):\n        super().__init__()\n        self.conv = nn.Conv2d(c, o, k)\n"
                       "        self.bias = nn.Parameter(torch.randn(o, 1, 1))\n"
                       "    def forward(self, x):\n        return torch.relu(self.conv(x)) + self.bias\n"
                       "def get_inputs():\n    return [torch.randn(128, 64, 256, 256)]\n"
                       "def get_init_inputs():\n    return [64, 128, 3]\n",
                       ["conv", "broadcast", "elementwise"]),
    "leaky_relu": ("class Model(nn.Module):\n    def forward(self, x):\n        return F.leaky_relu(x, 0.01)\n"
                   "def get_inputs():\n    return [torch.randn(4096, 393216)]\ndef get_init_inputs():\n    return []\n",
                   ["elementwise"]),
    "sdpa": ("class Model(nn.Module):\n    def forward(self, q, k, v):\n"
             "        return F.scaled_dot_product_attention(q, k, v)\n"
             "def get_inputs():\n    return [torch.randn(32, 32, 4096, 128) for _ in range(3)]\n"
             "def get_init_inputs():\n    return []\n", ["attention"]),
    "lstm": ("class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
             "        self.lstm = nn.LSTM(128, 256, 6, batch_first=True)\n"
             "    def forward(self, x):\n        return self.lstm(x)[0]\n"
             "def get_inputs():\n    return [torch.randn(10, 512, 128)]\ndef get_init_inputs():\n    return []\n",
             ["gemm"]),
    "data_dependent": ("class Model(nn.Module):\n    def forward(self, x):\n        return x[x > 0].sum()\n"
                       "def get_inputs():\n    return [torch.randn(64)]\ndef get_init_inputs():\n    return []\n", []),
}


@pytest.mark.parametrize("name", sorted(_KB_TASKS))
def test_a_task_without_a_family_gets_its_references_families_dominant_first(tmp_path, name):
    """KernelBench tasks carry no op family: evaluate's per-family table read "unknown" for all of them. The
    reference's torch calls on meta tensors name them (nothing allocated at full size); an RNN's per-step meta
    decomposition (10-20 s for KernelBench's LSTMs) is cut by the time limit."""
    import time

    from data_synth.diagnose import reference_families
    from megatron_rl.evaluate import _family
    from verifier.tasks import load_task

    source, want = _KB_TASKS[name]
    path = tmp_path / f"1_{name}.py"
    path.write_text(_KB_HEAD + source)
    task = load_task(str(path))
    t0 = time.monotonic()
    assert reference_families(task, seconds=1.0) == want
    assert time.monotonic() - t0 < 5
    assert _family(task) == (want[0] if want else "unknown")
