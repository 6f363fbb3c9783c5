"""bench/recipe_probe.py: the teacher-forced probe that tells whether an SFT model reads the op from the task."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from data_synth.generate import GenConfig, generate_candidate
from data_synth.taskset import write_task_set
from megatron_rl.check_sync import write_tiny_model
from megatron_rl.tokenizer import load_tokenizer, train_bpe

ROOT = Path(__file__).resolve().parents[2]


def _probe_module():
    spec = importlib.util.spec_from_file_location("recipe_probe", ROOT / "bench" / "recipe_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_probe_scores_each_tasks_plan_lines_and_sees_a_random_model_depend_on_the_prompt(tmp_path):
    ops = ("relu", "neg", "sigmoid")
    cfg = GenConfig(stage=1, seed=3, families=("elementwise",), dtypes={"float32": 1.0}, ops=ops)
    tasks = [generate_candidate(cfg, i) for i in range(4)]
    chain = generate_candidate(GenConfig(stage=2, seed=3, families=("elementwise",), dtypes={"float32": 1.0}, ops=ops,
                                         min_ops=2, max_ops=2), 0)
    tdir = write_task_set(tasks + [chain], str(tmp_path / "tasks"))
    tok = load_tokenizer("qwen3-offline")
    model = write_tiny_model(str(tmp_path / "model"), arch="qwen3_5", vocab_size=len(tok), hidden_size=32,
                             intermediate_size=64, head_dim=16, linear_value_head_dim=16)
    tok.save_pretrained(model)
    probe = _probe_module()
    out = probe.main(["--model", model, "--tasks", tdir])
    assert out["n"] == 5 and {r["ops"][0] for r in out["per_task"]} <= set(ops)
    assert sorted(out["per_task"][0]["p"]) == sorted({o for t in tasks + [chain] for o in t.ops})
    for r in out["per_task"]:
        # one distribution per plan line (a chain's second line is scored after its correct first line)
        assert len(r["p_lines"]) == len(r["ops"]) and r["p"] == r["p_lines"][0]
        assert all(abs(sum(p.values()) - 1) < 1e-3 for p in r["p_lines"])
    assert 0 <= out["line_accuracy"] <= 1 and len(out["per_task"][-1]["ops"]) == 2
    # a random model attends to whatever is in its context: different tasks give different distributions
    assert out["spread"] > 1e-5
    short = probe.main(["--model", model, "--tasks", tdir, "--view", "forward"])
    assert all(s["prompt_tokens"] < f["prompt_tokens"] for s, f in zip(short["per_task"], out["per_task"]))
    # line scoring works with any tokenizer, also one whose tokens are whole lines (the recipe's own BPE)
    lines_tok = train_bpe([t.source for t in tasks] * 2, 600, merge_within="lines")
    lines_model = write_tiny_model(str(tmp_path / "model_lines"), arch="qwen3_5", vocab_size=len(lines_tok),
                                   hidden_size=32, intermediate_size=64, head_dim=16, linear_value_head_dim=16)
    lines_tok.save_pretrained(lines_model)
    assert probe.main(["--model", lines_model, "--tasks", tdir])["n"] == 5
    assert "def forward" in probe.forward_source(tasks[0].source)


def test_the_forward_view_is_the_models_own_forward_not_a_helpers():
    source = ("import torch\nclass Helper(torch.nn.Module):\n    def forward(self, x):\n        return torch.abs(x)\n"
              "class Model(torch.nn.Module):\n    def forward(self, x):\n        return torch.relu(x)\n")
    forward_source = _probe_module().forward_source
    assert "torch.relu" in forward_source(source) and "abs" not in forward_source(source)
    with pytest.raises(ValueError, match="Model.forward"):
        forward_source("def forward(x):\n    return x\n")
