"""Task loading: static validation, folders, manifests, list files."""
import json
import os

import pytest

from verifier.tasks import TaskError, load_task, load_task_module, load_task_set

from .candidates import TASKS, task_path

TASK = ("import torch\nimport torch.nn as nn\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
        "        return x\n\ndef get_inputs():\n    return [torch.randn(2)]\n\ndef get_init_inputs():\n    return []\n")


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def test_load_task_validates_without_running(tmp_path):
    t = load_task(task_path("batchnorm"))
    assert t.task_id == "batchnorm" and t.level is None and "BatchNorm2d" in t.train_mode_layers
    assert load_task(task_path("relu")).train_mode_layers == ()
    # never executed: a task that would raise at import still loads
    boom = write(str(tmp_path / "level2" / "7_boom.py"), "raise SystemExit('ran!')\n" + TASK)
    t2 = load_task(boom)
    assert t2.level == 2
    with pytest.raises(SystemExit):
        load_task_module(t2)


@pytest.mark.parametrize("text,msg", [
    ("def get_inputs(): pass\ndef get_init_inputs(): pass\n", "no module-level `class Model"),
    (TASK.replace("def get_inputs", "def other"), "get_inputs"),
    (TASK.replace("def forward", "def fwd"), "no forward"),
    ("class Model(:\n", "does not parse"),
])
def test_malformed_tasks_name_the_problem(tmp_path, text, msg):
    p = write(str(tmp_path / "bad.py"), text)
    with pytest.raises(TaskError, match=msg) as e:
        load_task(p)
    assert "bad.py" in str(e.value)
    with pytest.raises(TaskError, match="not found"):
        load_task(str(tmp_path / "missing.py"))


def test_folder_manifest_and_list(tmp_path):
    tasks = load_task_set(TASKS)
    ids = [t.task_id for t in tasks]
    assert "elementwise_add" in ids and "softmax_wide" in ids and len(ids) == len(set(ids))

    root = tmp_path / "KernelBench"
    for name in ("level1/10_b.py", "level1/2_a.py", "level2/1_c.py"):
        write(str(root / name), TASK)
    write(str(root / "level1" / "__init__.py"), "")
    ks = load_task_set(str(root / "level1"))
    assert [t.task_id for t in ks] == ["level1/2_a", "level1/10_b"] and all(t.level == 1 for t in ks)
    assert len(load_task_set(str(root))) == 3

    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({"path": "KernelBench/level2/1_c.py", "level": 2, "op_family": "conv",
                                    "backend": "cuda"}) + "\n")
    (t,) = load_task_set(str(manifest))
    assert (t.level, t.op_family, t.backend) == (2, "conv", "cuda")
    mj = tmp_path / "set" / "manifest.json"
    write(str(mj), json.dumps({"tasks": [{"path": "../KernelBench/level1/2_a.py", "op_family": "ew"}]}))
    assert load_task_set(str(tmp_path / "set"))[0].op_family == "ew"  # a folder with a manifest uses it

    lst = tmp_path / "tasks.txt"
    lst.write_text("# two tasks\nKernelBench/level1/2_a.py\n\nKernelBench/level2\n")
    assert len(load_task_set(str(lst))) == 2

    write(str(tmp_path / "extra.json"), json.dumps([{"path": "KernelBench/level1/2_a.py", "backend": "any",
                                                     "sizes": {"gpu": {"N": 4096}}}]))
    (e,) = load_task_set(str(tmp_path / "extra.json"))
    assert e.backend is None and e.meta == {"sizes": {"gpu": {"N": 4096}}}
    write(str(tmp_path / "bad_manifest.json"), json.dumps([{"colour": "red"}]))
    with pytest.raises(TaskError, match="needs a string `path`"):
        load_task_set(str(tmp_path / "bad_manifest.json"))
    with pytest.raises(TaskError, match="backend"):
        load_task(str(root / "level1" / "2_a.py"), backend="rocm")
