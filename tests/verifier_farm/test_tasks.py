"""The bundled task set, its manifest and size profiles, and loading KernelBench-style folders."""
from __future__ import annotations

import ast
import json
import os

import pytest
import torch

from verifier.size_profiles import (ManifestError, apply_size_profile, find_manifest_entry, load_tasks,
                                    module_constants, read_manifest, rewrite_constants)
from verifier.tasks import load_task_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS = os.path.join(ROOT, "verifier", "tasks")


@pytest.fixture(scope="module")
def bundled():
    return load_tasks(TASKS)


def test_bundled_set_covers_three_levels(bundled):
    assert len(bundled) >= 30
    levels = {t.level for t in bundled}
    assert levels == {1, 2, 3}
    assert len({t.task_id for t in bundled}) == len(bundled)
    assert all(t.op_family for t in bundled)
    families = {t.op_family for t in bundled if t.level == 1}
    for fam in ("elementwise", "activation", "reduction", "softmax", "normalization", "matmul", "conv",
                "pooling", "scan", "indexing", "loss"):
        assert fam in families, fam
    on_disk = {os.path.abspath(os.path.join(d, f)) for d, _, fs in os.walk(TASKS) for f in fs if f.endswith(".py")}
    assert on_disk == {os.path.abspath(t.path) for t in bundled}  # every file is in the manifest, once
    for t in bundled:  # KernelBench naming: <number>_<Name>.py under levelN/
        name = os.path.basename(t.path)
        assert name.split("_", 1)[0].isdigit() and os.path.basename(os.path.dirname(t.path)) == f"level{t.level}"


def test_manifest_sizes_match_module_constants():
    for e in read_manifest(TASKS):
        with open(e.path) as f:
            consts = module_constants(f.read())
        assert e.backend in ("cpu", "cuda", "any")
        assert set(e.sizes) == {"cpu", "gpu"}, e.path
        assert {k: consts[k] for k in e.sizes["cpu"]} == dict(e.sizes["cpu"]), e.path
        assert set(e.sizes["gpu"]) <= set(consts), e.path
        assert set(e.precisions) <= {"float32", "float16", "bfloat16"} and "float32" in e.precisions


def _numel(x):
    return x.numel() if isinstance(x, torch.Tensor) else 0


def test_every_reference_runs_on_cpu_at_small_sizes(bundled):
    torch.manual_seed(0)
    for t in bundled:
        mod = load_task_module(t)
        model = mod.Model(*mod.get_init_inputs())
        inputs = mod.get_inputs()
        # the CPU profile stays small: inputs and parameters well under 2M elements each
        assert sum(_numel(x) for x in inputs) <= 1 << 21, t.task_id
        assert sum(p.numel() for p in model.parameters()) <= 1 << 21, t.task_id
        with torch.no_grad():
            out = model(*inputs)
        assert isinstance(out, torch.Tensor), t.task_id
        assert torch.isfinite(out.float()).all(), t.task_id
        if out.numel() > 1:  # not a degenerate (constant) output
            assert out.float().std() > 0, t.task_id


def test_gpu_profile_rewrites_only_the_constants(bundled):
    for t in bundled:
        entry = find_manifest_entry(t.path)
        gpu = apply_size_profile(t, "gpu")
        consts = module_constants(gpu.source)
        assert {k: consts[k] for k in entry.sizes["gpu"]} == dict(entry.sizes["gpu"])
        assert gpu.task_id == t.task_id and gpu.path == t.path
        # writing the CPU sizes back gives the original file byte for byte
        assert rewrite_constants(gpu.source, entry.sizes["cpu"]) == t.source
        ast.parse(gpu.source)
        assert apply_size_profile(t, "cpu") is t and apply_size_profile(t, None) is t
    relu = next(t for t in bundled if t.task_id == "7_ReLU")
    mod = load_task_module(apply_size_profile(relu, "gpu"))  # executes the module, not get_inputs
    assert (mod.batch_size, mod.dim) == (4096, 16384)


def test_rewrite_constants_keeps_the_rest_and_rejects_bad_input():
    src = "import torch\n\nN = 16  # rows\nM: int = 8\nscale = 0.5\ndims = [1, 2]\n\ndef f():\n    N = 3\n    return N\n"
    out = rewrite_constants(src, {"N": 4096, "M": 2, "dims": [3, 4]})
    assert out == ("import torch\n\nN = 4096  # rows\nM: int = 2\nscale = 0.5\ndims = [3, 4]\n\n"
                   "def f():\n    N = 3\n    return N\n")
    with pytest.raises(KeyError, match="K"):
        rewrite_constants(src, {"K": 1})
    with pytest.raises(ValueError, match="literal"):
        rewrite_constants(src, {"N": object()})


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


KB_MATMUL = '''import torch
import torch.nn as nn

N = 2048 * 2

class Model(nn.Module):
    """Single square matrix multiplication (C = A * B)"""
    def __init__(self):
        super(Model, self).__init__()

    def forward(self, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        return torch.matmul(A, B)

def get_inputs():
    open({marker!r}, "w").write("get_inputs ran")
    A = torch.rand(N, N)
    B = torch.rand(N, N)
    return [A, B]

def get_init_inputs():
    return []  # No special initialization inputs needed
'''

KB_SOFTMAX = '''import torch
import torch.nn as nn
import torch.nn.functional as F

open({marker!r}, "w").write("module body ran")

batch_size = 4096
dim = 393216


def _stable(x):
    return x - x.max(dim=1, keepdim=True).values


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return F.softmax(_stable(x), dim=1)


def get_inputs():
    x = torch.rand(batch_size, dim)  # 6.4 GB
    return [x]


def get_init_inputs():
    return []
'''


def test_kernelbench_style_folder_loads_without_running_anything(tmp_path):
    marker = str(tmp_path / "ran")
    lvl = tmp_path / "KernelBench" / "level1"
    _write(str(lvl / "1_Square_matrix_multiplication_.py"), KB_MATMUL.format(marker=marker))
    _write(str(lvl / "23_Softmax.py"), KB_SOFTMAX.format(marker=marker))
    tasks = load_tasks(str(lvl))
    assert sorted(os.path.basename(t.path) for t in tasks) == ["1_Square_matrix_multiplication_.py", "23_Softmax.py"]
    assert all(t.level == 1 for t in tasks)
    assert not os.path.exists(marker)  # neither the module body nor get_inputs was executed
    consts = module_constants(tasks[1].source if tasks[1].path.endswith("Softmax.py") else tasks[0].source)
    assert consts == {"batch_size": 4096, "dim": 393216}
    # no manifest: size profiles leave a plain KernelBench problem alone
    assert all(apply_size_profile(t, "gpu") is t for t in tasks)


def test_manifest_errors_name_the_problem(tmp_path):
    _write(str(tmp_path / "a" / "manifest.json"), "{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(str(tmp_path / "a"))
    _write(str(tmp_path / "b" / "manifest.json"), json.dumps({"tasks": [{"level": 1}]}))
    with pytest.raises(ManifestError, match="no 'path'"):
        read_manifest(str(tmp_path / "b"))
    _write(str(tmp_path / "c" / "manifest.json"), json.dumps({"tasks": [{"path": "x.py", "backend": "tpu"}]}))
    with pytest.raises(ManifestError, match="backend"):
        read_manifest(str(tmp_path / "c" / "manifest.json"))
    _write(str(tmp_path / "d" / "t.py"), KB_MATMUL.format(marker=str(tmp_path / "m")))
    _write(str(tmp_path / "d" / "manifest.jsonl"),
           json.dumps({"path": "t.py", "task_id": "x"}) + "\n" + json.dumps({"path": "t.py", "task_id": "x"}) + "\n")
    with pytest.raises(ManifestError, match="duplicate task_id"):
        load_tasks(str(tmp_path / "d"))
    with pytest.raises(ManifestError, match="no manifest"):
        read_manifest(str(tmp_path))
