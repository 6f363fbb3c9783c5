"""bench/recipe_probe.py: the teacher-forced probe that tells whether an SFT model reads the op from the task."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from data_synth.generate import GenConfig, generate_candidate
from data_synth.taskset import write_task_set
from megatron_rl.check_sync import write_tiny_model
from megatron_rl.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _probe_module():
    spec = importlib.util.spec_from_file_location("recipe_probe", ROOT / "bench" / "recipe_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_probe_scores_each_tasks_first_op_and_sees_a_random_model_depend_on_the_prompt(tmp_path):
    ops = ("relu", "neg", "sigmoid")
    cfg = GenConfig(stage=1, seed=3, families=("elementwise",), dtypes={"float32": 1.0}, ops=ops)
    tasks = [generate_candidate(cfg, i) for i in range(4)]
    tdir = write_task_set(tasks, str(tmp_path / "tasks"))
    tok = load_tokenizer("qwen3-offline")
    model = write_tiny_model(str(tmp_path / "model"), arch="qwen3_5", vocab_size=len(tok), hidden_size=32,
                             intermediate_size=64, head_dim=16, linear_value_head_dim=16)
    tok.save_pretrained(model)
    probe = _probe_module()
    out = probe.main(["--model", model, "--tasks", tdir])
    assert out["n"] == 4 and {r["first_op"] for r in out["per_task"]} <= set(ops)
    assert sorted(out["per_task"][0]["p"]) == sorted({t.ops[0] for t in tasks})
    for r in out["per_task"]:
        assert abs(sum(r["p"].values()) - 1) < 1e-3
    # a random model attends to whatever is in its context: different tasks give different distributions
    assert out["spread"] > 1e-5
    short = probe.main(["--model", model, "--tasks", tdir, "--view", "forward"])
    assert all(s["prompt_tokens"] < f["prompt_tokens"] for s, f in zip(short["per_task"], out["per_task"]))
    assert "def forward" in probe.forward_source(tasks[0].source)


def test_the_forward_view_is_the_models_own_forward_not_a_helpers():
    source = ("import torch\nclass Helper(torch.nn.Module):\n    def forward(self, x):\n        return torch.abs(x)\n"
              "class Model(torch.nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n")
    forward_source = _probe_module().forward_source
    assert "torch.relu" in forward_source(source) and "abs" not in forward_source(source)
    with pytest.raises(ValueError, match="Model.forward"):
        forward_source("def forward(x):\n    return x\n")
