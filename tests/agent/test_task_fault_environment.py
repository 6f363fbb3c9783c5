"""Task-fault infra verdicts in RL: the loop verifies them once (``TASK_FAULT_RULES``), and the kernel environment
leaves tasks too large for this machine's memory out of sampling when it loads its task set (a warning line naming
them and the remedy; an error when none is left), sizing each once per process."""
import asyncio
import logging
import os

import pytest

from megatron_rl.rollout.agent import AgentConfig, AgentLoop, RolloutRequest
from megatron_rl.rollout.environment import KernelEnvironment, tasks_that_fit
from verifier import inputs
from verifier.config import VerifierConfig
from verifier.tasks import load_task
from verifier.types import Category, VerifyResult
from agent_fakes import IM_END, Task

from test_agent_hostile36 import IdsEngine, spelled

GiB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMALL_RELU = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


batch_size = 16
dim = 512


def get_inputs():
    return [torch.rand(batch_size, dim)]


def get_init_inputs():
    return []
'''
FULL_RELU = SMALL_RELU.replace("batch_size = 16", "batch_size = 4096").replace("dim = 512", "dim = 393216")


@pytest.fixture(autouse=True)
def _small_host(monkeypatch):
    """A 24 GiB host with plenty free now: KernelBench's full-size ReLU (54 GiB a trial) cannot fit it in all."""
    inputs.clear_footprint_cache()
    monkeypatch.setattr(inputs, "host_total_bytes", lambda: 24 * GiB)
    monkeypatch.setattr(inputs, "host_available_bytes", lambda: 1 * GiB)   # busy now: must not count
    yield
    inputs.clear_footprint_cache()


def _tree(tmp_path, n_full=3, n_small=1):
    level = tmp_path / "tasks" / "level1"
    level.mkdir(parents=True, exist_ok=True)
    for i in range(n_full):
        (level / f"{19 + i}_ReLU.py").write_text(FULL_RELU.replace("dim = 393216", f"dim = {393216 + i}"))
    for i in range(n_small):
        (level / f"{90 + i}_small.py").write_text(SMALL_RELU)
    return str(tmp_path / "tasks")


def test_tasks_too_large_for_the_host_are_left_out_with_one_warning(tmp_path, caplog):
    from verifier.tasks import load_task_set
    tasks = load_task_set(_tree(tmp_path, n_full=7, n_small=2))
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.environment"):
        kept = tasks_that_fit(tasks, VerifierConfig(), None)
    assert [t.task_id for t in kept] == ["level1/90_small", "level1/91_small"]
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_rl.rollout.environment"]
    assert len(lines) == 1, lines
    assert "7 of 9 tasks" in lines[0] and "level1/19_ReLU" in lines[0] and "..." in lines[0]
    assert "level1/25_ReLU" not in lines[0]   # the first few only
    assert "data.size_profile=fit" in lines[0]


def test_a_task_set_of_which_nothing_fits_is_an_error(tmp_path):
    from verifier.tasks import load_task_set
    tasks = load_task_set(_tree(tmp_path, n_full=2, n_small=0))
    with pytest.raises(ValueError, match=r"none of the 2 tasks fits.*data.size_profile=fit"):
        tasks_that_fit(tasks, VerifierConfig(), None)


def test_the_environment_samples_only_tasks_that_fit_and_sizes_each_once(tmp_path, monkeypatch):
    import verifier.farm
    from megatron_rl.config import load_config

    calls = []
    real = inputs.estimate_footprint
    monkeypatch.setattr(inputs, "estimate_footprint", lambda m, p: calls.append(p) or real(m, p))
    monkeypatch.setattr(verifier.farm, "VerifierFarm", lambda cfg, layout: None)
    tree = _tree(tmp_path, n_full=2, n_small=1)
    cfg = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"),
                      [f"data.tasks={tree}", "kernel_backend=cpu", "data.levels=[]"])
    assert KernelEnvironment.config_problems(cfg) == [] and calls == []   # validation stays fast: nothing sized
    env = KernelEnvironment.from_config(cfg)
    assert [t.task_id for t in env.tasks()] == ["level1/90_small"] and len(calls) == 3
    # the verifier's own memory gate, in this process, reuses the footprints
    for t in env.tasks():
        inputs.task_footprint(t, cfg.verifier.precision)
    assert len(calls) == 3
    # the remedy works: at size profile `fit` every task is sampled
    fit = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"),
                      [f"data.tasks={tree}", "kernel_backend=cpu", "data.levels=[]", "data.size_profile=fit"])
    assert len(KernelEnvironment.from_config(fit).tasks()) == 3
    nothing = load_config(os.path.join(ROOT, "configs", "quickstart.yaml"),
                          [f"data.tasks={_tree(tmp_path / 'all', n_full=1, n_small=0)}", "kernel_backend=cpu",
                           "data.levels=[]"])
    with pytest.raises(ValueError, match="none of the 1 tasks"):
        KernelEnvironment.from_config(nothing)


@pytest.mark.parametrize("rule", ["task_too_large", "task_load_failed", "reference_failed", None])
def test_the_loop_verifies_a_task_fault_once_and_retries_memory_that_is_only_busy(qwen_tok, rule):
    calls = []

    async def verify(task, text):
        calls.append(text)
        return VerifyResult(task_id=task.task_id, category=Category.INFRA, rule=rule, feedback="memory")

    engine = IdsEngine(lambda turn: (spelled(qwen_tok, "PASS") + [IM_END], "stop"))
    cfg = AgentConfig(max_turns=2, infra_retries=3, trajectory_retries=2)
    loop = AgentLoop(qwen_tok, engine, KernelEnvironment([], "cpu", verify), cfg)
    group = asyncio.run(loop.run_group(RolloutRequest(Task("t"), "g"), group_size=1))
    assert group.status == "infra" and not group.trajectories
    if rule is None:
        assert len(calls) == (cfg.infra_retries + 1) * (cfg.trajectory_retries + 1)
    else:
        assert len(calls) == 1 and len(engine.calls) == 1 and rule in group.error
