"""`python -m megatron_rl.evaluate --backend cpu` on KernelBench's own (GPU) sizes: a task too large for the host is
named before the model is loaded and nothing is generated for it.

Before, each of its samples was generated, then verified into the same ``infra`` verdict (the verifier's memory gate),
re-verified 4 times, its trajectory generated again twice more: 3x the generation per sample for nothing, on 47 of
level 1's 100 tasks on a 24 GB host; the reason in the report was cut at 300 characters, before the sizes' remedy; a
resumed run did it all again. The engine, the farm and the agent are faked; `evaluate`, its preflight and the
verifier's memory gate are real."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from megatron_rl.evaluate import EvalConfig, _preflight, main
from megatron_rl.rollout.agent import GroupResult
from tests.sft.test_evaluate_resume import FakeFarm, _fake_engine
from verifier.types import Category, VerifyResult

GiB = 1 << 30

TASK = '''import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super(Model, self).__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)

batch_size = BATCH
dim = DIM

def get_inputs():
    x = torch.rand(batch_size, dim)
    return [x]

def get_init_inputs():
    return []  # No special initialization inputs needed
'''

RELU = "level1/19_ReLU"            # KernelBench's own sizes: a 6 GiB input
SMALL = "level1/20_LeakyReLU"      # a few KiB


def _kernelbench(root: Path) -> Path:
    (root / "level1").mkdir(parents=True)
    (root / "level1" / "19_ReLU.py").write_text(TASK.replace("BATCH", "4096").replace("DIM", "393216"))
    (root / "level1" / "20_LeakyReLU.py").write_text(TASK.replace("BATCH", "16").replace("DIM", "64"))
    return root


class FakeAgent:
    ran: list[str] = []

    def __init__(self, tokenizer, generate, env, cfg):
        self.cfg = cfg

    async def run_group(self, request):
        tid = request.task.task_id
        FakeAgent.ran.append(tid)
        verdict = VerifyResult(task_id=tid, category=Category.CORRECTNESS_ERROR, q=0.0, feedback="mismatch")
        turn = types.SimpleNamespace(turn=1, verdict=verdict, response_ids=[1], finish_reason="stop",
                                     response_text="answer")
        return GroupResult(request=request, trajectories=[types.SimpleNamespace(sample_index=i, turns=[turn])
                                                          for i in range(self.cfg.group_size)])


@pytest.fixture
def setup(tmp_path, monkeypatch):
    import megatron_rl.rollout.agent
    import megatron_rl.rollout.local_engine
    import megatron_rl.tokenizer
    import verifier.farm
    import verifier.inputs

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(megatron_rl.rollout.agent, "AgentLoop", FakeAgent)
    monkeypatch.setattr(megatron_rl.rollout.local_engine, "serve_embedded", _fake_engine)
    monkeypatch.setattr(verifier.farm, "VerifierFarm", FakeFarm)
    monkeypatch.setattr(megatron_rl.tokenizer, "load_tokenizer", lambda path: ["tok"] * 10)
    monkeypatch.setattr(verifier.inputs, "host_available_bytes", lambda: 20 * GiB)   # any host this test runs on
    monkeypatch.setattr(FakeAgent, "ran", [])
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 512}))
    (model / "model.safetensors").write_bytes(b"")
    kb = _kernelbench(tmp_path / "KernelBench")
    return types.SimpleNamespace(tmp=tmp_path, model=model, kb=kb,
                                 argv=lambda out, *extra: ["--model", str(model), "--tasks", str(kb), "--out",
                                                           str(tmp_path / out), "--samples", "2", "--turns", "2",
                                                           "--no-progress", *extra])


def test_a_task_too_large_for_the_host_is_named_up_front_and_never_generated_for(setup, capsys):
    rc = main(setup.argv("out"))
    err = capsys.readouterr().err
    assert rc == 0, err
    assert FakeAgent.ran == [SMALL]                                   # nothing generated for the 6 GiB ReLU
    assert "1 of 2 tasks need more memory than this host has" in err and "--size-profile fit" in err
    summary = json.loads((setup.tmp / "out" / "summary.json").read_text())
    assert summary["scored_tasks"] == 1 and list(summary["unscored"]) == [RELU]
    reason = summary["unscored"][RELU]
    # the sizes and the remedy, whole (the old reason was cut at 300 characters, before them)
    assert reason.startswith("too_large: ") and "GiB of host memory" in reason and "inputs 6.0 GiB" in reason
    assert reason.endswith("--size-profile fit shrinks it to fit")
    assert "too_large" in (setup.tmp / "out" / "report.md").read_text()


def test_only_too_large_tasks_exit_3_with_the_reason(setup, capsys):
    (setup.kb / "level1" / "20_LeakyReLU.py").unlink()
    rc = main(setup.argv("out"))
    err = capsys.readouterr().err
    assert rc == 3 and FakeAgent.ran == []
    assert "error: no task could be scored (1 unscored; level1/19_ReLU: too_large: too large for this host" in err


def test_the_fit_profile_leaves_nothing_too_large(setup):
    cfg = EvalConfig(model=str(setup.model), tasks=str(setup.kb), out=str(setup.tmp / "o"), size_profile="fit",
                     progress=False)
    groups, _, _ = _preflight(cfg)
    assert cfg.too_large == {} and sum(map(len, groups.values())) == 2


def test_a_gpu_backend_is_not_checked_against_host_memory(setup):
    cfg = EvalConfig(model=str(setup.model), tasks=str(setup.kb), out=str(setup.tmp / "o"), progress=False)
    from megatron_rl.evaluate import _too_large_for_host

    cfg.backend = "cuda"
    assert _too_large_for_host(cfg, {"float32": []}, {}) == {}
