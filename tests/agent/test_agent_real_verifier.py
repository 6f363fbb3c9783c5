"""The agent loop against the REAL verifier (CPU backend, a bundled task) with scripted responses
standing in for the model. One compiled candidate only, from the shared kernel library of
tests/verifier_core/candidates.py: it is built once per session and every later submission hits the build cache."""
import asyncio
import os

import pytest

from megatron_rl.rollout.agent import AgentConfig, AgentLoop, RolloutRequest
from megatron_rl.rollout.environment import KernelEnvironment, farm_verify_fn, threaded_verify_fn
from megatron_rl.rollout.prompts import defuse_control_tokens
from agent_fakes import ScriptedEngine
from verifier.types import Category, reward_eq2

from tests.verifier_core.candidates import RELU, compiled

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROSE_ONLY = "ReLU is memory bound, so a single pass is enough. I will write it next time."

FALLBACK_TO_TORCH = """Easy:

```python
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)
```
"""

IDENTITY_WRONG = """```python
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return x.clone()
```
"""

# the kernel library of tests/verifier_core/candidates.py: in the session's build cache, compiled once
CORRECT_CPP = compiled(RELU)


@pytest.fixture(scope="module")
def relu_task():
    from verifier.tasks import load_task

    return load_task(os.path.join(REPO, "verifier", "tasks", "level1", "7_ReLU.py"))


@pytest.fixture(scope="module")
def verifier_cfg(build_cache):
    from verifier.config import VerifierConfig

    return VerifierConfig(backend="cpu", build_cache_dir=build_cache,
                          num_correct_trials=2, num_timing_trials=5)


def test_agent_loop_with_the_real_verifier(qwen_tok, relu_task, verifier_cfg):
    from verifier.evaluate import verify as verify_one

    verify = threaded_verify_fn(lambda task, text: verify_one(task, text, verifier_cfg), max_workers=2)
    calls = []

    async def recording_verify(task, text):
        verdict = await verify(task, text)
        calls.append((text, verdict))
        return verdict

    cfg = AgentConfig(max_turns=3, group_size=1)
    env = KernelEnvironment([relu_task], "cpu", recording_verify, verifier_cfg.reward)
    engine_a = ScriptedEngine(qwen_tok, lambda turn, call: [PROSE_ONLY, FALLBACK_TO_TORCH, CORRECT_CPP][turn - 1])
    engine_b = ScriptedEngine(qwen_tok, lambda turn, call: CORRECT_CPP)
    engine_c = ScriptedEngine(qwen_tok, lambda turn, call: IDENTITY_WRONG)
    loop_a = AgentLoop(qwen_tok, engine_a, env, cfg)
    loop_b = AgentLoop(qwen_tok, engine_b, env, cfg)
    loop_c = AgentLoop(qwen_tok, engine_c, env, AgentConfig(max_turns=1, group_size=1))

    async def main():
        # one after the other: the verifier's timing audit compares wall clock with reported times, so
        # concurrent timed runs on a 2-core machine can be judged implausible. b's first turn submits
        # the kernel a's last turn compiled: a build-cache hit.
        return [await loop.run_group(RolloutRequest(relu_task, name))
                for loop, name in ((loop_c, "c"), (loop_a, "a"), (loop_b, "b"))]

    try:
        c, a, b = asyncio.run(main())
    finally:
        verify.executor.shutdown()
    assert a.ok and b.ok and c.ok, (a.error, b.error, c.error)
    (ta,), (tb,), (tc,) = a.trajectories, b.trajectories, c.trajectories

    # every response got exactly one recorded verdict, none of them infra
    assert len(calls) == 5 and all(v.category != Category.INFRA for _, v in calls)
    cats = [t.verdict.category for t in ta.turns]
    assert cats == [Category.FORMAT_ERROR, Category.CHEATING, Category.PASS], [t.verdict.feedback for t in ta.turns]
    assert ta.turns[2].verdict.q == 1.0 and ta.turns[2].verdict.speedup is not None

    # turn k's feedback is in turn k+1's prompt; the prompt names the backend's load_inline usage
    prompts = [qwen_tok.decode(inp) for inp, _, _ in engine_a.calls]
    assert "cpp_sources=" in prompts[0] and "7_ReLU" in prompts[0]
    for k in (0, 1):
        fb = defuse_control_tokens(ta.turns[k].verdict.feedback.strip())
        assert fb and fb in prompts[k + 1] and fb not in prompts[k]
        assert ta.turns[k].verdict.category.value in prompts[k + 1]

    # rewards: eq. 2 per turn, PrimeEcho over the trajectory
    s3 = reward_eq2(Category.PASS, 1.0, ta.turns[2].verdict.speedup)
    assert [t.score for t in ta.turns] == pytest.approx([-1.0, -1.0, s3])
    assert ta.reward == pytest.approx(0.75 * -1.0 + 0.25 * s3)          # no early bonus on turn 3
    assert tb.num_turns == 1 and tb.passed and len(engine_b.calls) == 1  # stopped at the first pass
    assert tb.reward == pytest.approx(tb.turns[0].score + 0.15)
    assert tc.turns[0].verdict.category == Category.CORRECTNESS_ERROR and tc.turns[0].verdict.q < 1.0
    assert tc.reward == pytest.approx(tc.turns[0].score) and tc.turns[0].score < 0

    # the loss mask covers exactly the engine's first response, in the context it answered
    (sample,) = ta.to_train_samples(advantage=1.0)
    sample.validate()
    first_in, _, first_out = engine_a.calls[0]
    assert sample.tokens == first_in + first_out
    assert sample.loss_mask == [0] * len(first_in) + [1] * len(first_out)
    assert [t.prompt_ids for t in ta.turns] == [c[0] for c in engine_a.calls]


def test_farm_adapter_with_the_real_farm(qwen_tok, relu_task, verifier_cfg):
    """The same loop through ``VerifierFarm.submit`` (cheap verdicts only: nothing is compiled)."""
    from verifier.farm import FarmConfig, VerifierFarm

    farm = VerifierFarm(verifier_cfg, FarmConfig(compile_workers=1, cpu_device_workers=1, compile_mode="thread",
                                                 device_mode="thread"))
    try:
        engine = ScriptedEngine(qwen_tok, lambda turn, call: [PROSE_ONLY, FALLBACK_TO_TORCH][turn - 1])
        loop = AgentLoop(qwen_tok, engine, KernelEnvironment([relu_task], "cpu", farm_verify_fn(farm)),
                         AgentConfig(max_turns=2, group_size=2))
        group = asyncio.run(loop.run_group(RolloutRequest(relu_task, "farm")))
    finally:
        farm.close()
    assert group.ok, group.error
    for traj in group.trajectories:
        assert [t.verdict.category for t in traj.turns] == [Category.FORMAT_ERROR, Category.CHEATING]
