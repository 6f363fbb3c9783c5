"""Dynamic sampling under concurrency: which groups make the batch must not depend on how long they took,
and whatever a step drew but did not use goes back (tasks to the stream, BDR entries to the buffer)."""
import asyncio
import itertools

from megatron_rl.algorithms.bdr import BDRConfig, BufferedDynamicRetry, FailedPrompt
from megatron_rl.cluster.rollout_manager import PromptSource, TaskStream
from megatron_rl.rollout.agent import AgentConfig, AgentLoop, RolloutRequest
from megatron_rl.rollout.environment import KernelEnvironment
from verifier.types import Category, VerifyResult
from agent_fakes import ScriptedEngine, Task

class TimedVerifier:
    """`slow-*` tasks take 100x longer to verify (long compiles); in a `*-var-*` task's group the first
    sample passes and the others fail (rewards differ), a `*-flat-*` task's group all fail."""

    def __init__(self, slow_s=0.3, fast_s=0.003):
        self.slow_s, self.fast_s = slow_s, fast_s
        self.calls: dict[str, int] = {}

    async def __call__(self, task, text):
        tid = task.task_id
        await asyncio.sleep(self.slow_s if tid.startswith("slow") else self.fast_s)
        k = self.calls[tid] = self.calls.get(tid, 0) + 1
        if "-var-" in tid and k == 1:
            return VerifyResult(task_id=tid, category=Category.PASS, q=1.0, speedup=1.0, feedback="ok")
        return VerifyResult(task_id=tid, category=Category.COMPILE_ERROR, feedback="error: nope")


def loop_for(tok, verifier, **cfg):
    cfg = dict(dict(max_turns=1, group_size=2, max_concurrency=64, dynamic_sampling=True), **cfg)
    return AgentLoop(tok, ScriptedEngine(tok, lambda turn, call: "answer"),
                     KernelEnvironment([], "cpu", verifier), AgentConfig(**cfg))


def test_slow_and_fast_tasks_are_kept_in_proportion(qwen_tok):
    names = [f"{kind}-{i}" for i in range(6) for kind in ("slow-var", "fast-var", "fast-flat")]
    requests = [RolloutRequest(Task(n), n) for n in names]
    loop = loop_for(qwen_tok, TimedVerifier())
    out = asyncio.run(loop.rollout_batch(iter(requests), num_groups=4))

    # decided in submission order: the first four groups with differing rewards, slow or fast
    assert [g.group_id for g in out.groups] == ["slow-var-0", "fast-var-0", "slow-var-1", "fast-var-1"]
    drawn = out.stats["groups_started"]
    assert 5 <= drawn < len(requests)                        # drawn ahead only as far as needed
    assert out.unused == requests[5:drawn]                   # behind the batch: returned, in order
    assert out.stats["groups_unused"] == len(out.unused) and out.stats["groups_dropped_zero_std"] == 1
    frac = out.stats["discarded_token_frac"]
    assert 0 < frac < 1 and out.stats["tokens_generated"] == sum(r.generated_tokens for r in requests)


def test_unused_requests_go_back_where_they_came_from(qwen_tok):
    tasks = [Task(f"t{i}") for i in range(4)]
    env = KernelEnvironment(tasks, "cpu", TimedVerifier())
    loop = AgentLoop(qwen_tok, ScriptedEngine(qwen_tok, lambda turn, call: "answer"), env, AgentConfig())
    stream = TaskStream(tasks, seed=0)
    bdr = BufferedDynamicRetry(BDRConfig(replay_prob=1.0), seed=0)
    bdr.push(FailedPrompt("t2", "bad code", "compile_error", "error: x", -1.0))
    source = PromptSource(loop, stream, bdr)

    first = list(itertools.islice(source.requests(step=4, max_turns=2), 3))
    assert [(r.kind, r.task.task_id, r.max_turns) for r in first][0] == ("repair", "t2", 2)
    assert len(bdr) == 0 and all(r.kind == "task" for r in first[1:])
    source.give_back(first)
    assert [(e.task_id, e.attempts) for e in bdr.entries()] == [("t2", 0)]     # the replay is not counted
    again = list(itertools.islice(source.requests(step=5, max_turns=2), 3))
    assert [(r.kind, r.task.task_id) for r in again] == [(r.kind, r.task.task_id) for r in first]
