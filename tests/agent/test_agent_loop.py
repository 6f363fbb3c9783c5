"""The agent loop's mechanics with a scripted engine and a marker verifier (the real-verifier run
is in test_agent_real_verifier.py; dynamic sampling in test_dynamic_sampling.py)."""
import asyncio
import dataclasses
import math

import pytest

from megatron_rl.algorithms.bdr import BDRConfig, BufferedDynamicRetry
from megatron_rl.rollout.agent import AgentConfig, AgentLoop, RolloutRequest
from megatron_rl.rollout.environment import KernelEnvironment
from megatron_rl.rollout.prompts import feedback_text, initial_messages
from megatron_rl.types import TrainSample
from agent_fakes import IM_END, MarkerVerifier, ScriptedEngine, Task, token_logprobs


def env(verify=None, **kw):
    """The kernel environment around a scripted verifier (prompts for the cpu backend)."""
    return KernelEnvironment([], "cpu", verify or MarkerVerifier(), **kw)


def by_turn(*texts):
    return lambda turn, call: texts[turn - 1]


def run(coro):
    return asyncio.run(coro)


def rendered(tok, msgs):
    return tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def test_feedback_turn_and_exact_tokens(qwen_tok):
    engine = ScriptedEngine(qwen_tok, by_turn("first try WRONG", "second try PASS", "never used"))
    loop = AgentLoop(qwen_tok, engine, env(), AgentConfig(max_turns=3, group_size=1))
    traj = run(loop.run_trajectory(RolloutRequest(Task("t1"), "g"), 0))

    assert traj.num_turns == 2 and len(engine.calls) == 2 and traj.first_pass_turn == 2   # stopped early
    assert [t.verdict.category.value for t in traj.turns] == ["correctness_error", "pass"]
    (in1, _, out1), (in2, _, out2) = engine.calls
    # each prompt is the chat template's rendering of the conversation so far
    msgs = initial_messages(Task("t1"), "cpu")
    assert in1 == rendered(qwen_tok, msgs) and traj.turns[0].prompt_ids == in1
    msgs += [{"role": "assistant", "content": "first try WRONG"},
             {"role": "user", "content": feedback_text("correctness_error", 0.4, "FEEDBACK-t1: mismatch at index 3")}]
    assert in2 == rendered(qwen_tok, msgs) and traj.turns[1].prompt_ids == in2
    assert "FEEDBACK-t1: mismatch at index 3" in qwen_tok.decode(in2[len(in1):])
    assert in2.count(IM_END) == in1.count(IM_END) + 2   # the answer is closed once, then the feedback turn

    # PrimeEcho: 0.75·s1 + 0.25·max(s1, s2) + b(2);  s1 = -0.5 + 0.5·0.4 = -0.3, s2 = 1 + 0.5·1 = 1.5
    assert traj.reward == pytest.approx(0.75 * -0.3 + 0.25 * 1.5 + 0.08)

    # the first turn is trained, in the context it was generated in, on exactly the engine's tokens
    (sample,) = traj.to_train_samples(advantage=0.7)
    assert isinstance(sample, TrainSample)
    sample.validate()
    assert sample.tokens == in1 + out1
    assert sample.loss_mask == [0] * len(in1) + [1] * len(out1)
    assert sample.fields["rollout_logprobs"][len(in1):] == token_logprobs(len(out1), 100)
    assert sample.fields["advantages"] == [0.0] * len(in1) + [0.7] * len(out1)
    assert [t.trained for t in traj.turns] == [True, False]

    loop_all = AgentLoop(qwen_tok, ScriptedEngine(qwen_tok, by_turn("first try WRONG", "second try PASS")), env(),
                         AgentConfig(max_turns=3, train_on_all_turns=True))
    traj_all = run(loop_all.run_trajectory(RolloutRequest(Task("t1"), "g"), 0))
    first, second = traj_all.to_train_samples(advantage=1.0)
    assert first.tokens == in1 + out1 and second.tokens == in2 + out2
    assert second.fields["rollout_logprobs"][len(in2):] == token_logprobs(len(out2), 200)


def test_history_is_rendered_as_the_template_does(qwen_tok):
    """Qwen3's template keeps only the answer of a past turn: its reasoning leaves the context, while the
    trained first turn keeps every token the engine generated."""
    engine = ScriptedEngine(qwen_tok, by_turn("<think>\nlong private reasoning\n</think>\n\nanswer WRONG",
                                              "PASS"))
    loop = AgentLoop(qwen_tok, engine, env(), AgentConfig(max_turns=2))
    traj = run(loop.run_trajectory(RolloutRequest(Task("t2"), "g"), 0))
    second_prompt = qwen_tok.decode(traj.turns[1].prompt_ids)
    assert "answer WRONG<|im_end|>" in second_prompt and "long private reasoning" not in second_prompt
    (sample,) = traj.to_train_samples(advantage=1.0)
    assert "long private reasoning" in qwen_tok.decode(sample.tokens)


def test_every_turn_recorded_when_all_fail(qwen_tok):
    engine = ScriptedEngine(qwen_tok, by_turn("no code", "still WRONG", "no code again"))
    loop = AgentLoop(qwen_tok, engine, env(), AgentConfig(max_turns=3))
    traj = run(loop.run_trajectory(RolloutRequest(Task("t2"), "g"), 0))
    assert [t.verdict.category.value for t in traj.turns] == ["format_error", "correctness_error", "format_error"]
    assert [t.score for t in traj.turns] == pytest.approx([-1.0, -0.3, -1.0])
    assert traj.reward == pytest.approx(0.75 * -1.0 + 0.25 * -0.3)
    assert not traj.passed and traj.first_pass_turn is None and not traj.context_exhausted
    # later prompts carry the verdict of the turn before
    assert "format_error" in qwen_tok.decode(engine.calls[1][0]) and "FEEDBACK-t2" in qwen_tok.decode(engine.calls[2][0])


def test_truncated_response_gets_the_end_marker(qwen_tok):
    engine = ScriptedEngine(qwen_tok, by_turn("cut off mid sen", "PASS"),
                            finish_reason=lambda turn: "length" if turn == 1 else "stop")
    loop = AgentLoop(qwen_tok, engine, env(), AgentConfig(max_turns=2))
    traj = run(loop.run_trajectory(RolloutRequest(Task("t3"), "g"), 0))
    assert traj.turns[0].finish_reason == "length" and traj.turns[0].response_ids[-1] != IM_END
    assert "cut off mid sen<|im_end|>" in qwen_tok.decode(traj.turns[1].prompt_ids)  # the template closes it


def test_infra_is_retried_and_never_scored(qwen_tok):
    engine = ScriptedEngine(qwen_tok, by_turn("PASS"))
    loop = AgentLoop(qwen_tok, engine, env(MarkerVerifier(infra_budget=2)), AgentConfig(max_turns=1, infra_retries=3))
    traj = run(loop.run_trajectory(RolloutRequest(Task("t4"), "g"), 0))
    assert traj.turns[0].verify_attempts == 3 and traj.turns[0].verdict.passed

    loop = AgentLoop(qwen_tok, ScriptedEngine(qwen_tok, by_turn("INFRA forever")), env(),
                     AgentConfig(max_turns=2, group_size=2, infra_retries=1, trajectory_retries=1))
    group = run(loop.run_group(RolloutRequest(Task("t5"), "g5")))
    assert group.status == "infra" and group.trajectories == [] and "t5" in group.error
    with pytest.raises(ValueError, match="no rewards"):
        group.rewards


def test_aborted_generation_reruns_the_trajectory(qwen_tok):
    aborts = {"left": 1}

    def finish(turn):
        if aborts["left"]:
            aborts["left"] -= 1
            return "abort"
        return "stop"

    engine = ScriptedEngine(qwen_tok, by_turn("PASS"), finish_reason=finish)
    loop = AgentLoop(qwen_tok, engine, env(), AgentConfig(max_turns=1, group_size=2))
    group = run(loop.run_group(RolloutRequest(Task("t6"), "g6")))
    assert group.ok and len(group.trajectories) == 2 and loop.stats["trajectory_retries"] == 1


def test_bad_engine_output_is_named(qwen_tok):
    class Broken(ScriptedEngine):
        async def __call__(self, input_ids, params):
            res = await super().__call__(input_ids, params)
            res.logprobs = res.logprobs[:-1] if self.mode == "short" else [math.nan] + res.logprobs[1:]
            return res

    for mode, match in (("short", "engine returned 2 tokens but 1 logprobs"), ("nan", "rollout logprob of generated token 0 is nan")):
        engine = Broken(qwen_tok, by_turn("PASS"))
        engine.mode = mode
        loop = AgentLoop(qwen_tok, engine, env(), AgentConfig(max_turns=1))
        with pytest.raises(ValueError, match=f"task 't7' group 'g7' sample 0 turn 1: {match}"):
            run(loop.run_trajectory(RolloutRequest(Task("t7"), "g7"), 0))


def test_each_turn_is_budgeted_from_the_remaining_context(qwen_tok):
    engine = ScriptedEngine(qwen_tok, by_turn("WRONG", "WRONG", "WRONG"))
    loop = AgentLoop(qwen_tok, engine, env(), AgentConfig(max_turns=1, max_prompt_tokens=10))
    group = run(loop.run_group(RolloutRequest(Task("t8"), "g8")))
    assert group.status == "prompt_too_long" and engine.calls == []

    free = run(AgentLoop(qwen_tok, engine, env(), AgentConfig(max_turns=3)).run_trajectory(
        RolloutRequest(Task("t9"), "g9"), 0))
    p1, p2 = (len(t.prompt_ids) for t in free.turns[:2])
    assert free.num_turns == 3 and not any(t.cut for t in free.turns) and not free.context_exhausted

    # room for the second turn's prompt and 10 tokens: turn 1 is cut to what is left, turn 2 to 10,
    # turn 3 is skipped for lack of context, and both are recorded
    limit = p2 + 10
    engine.calls.clear()
    loop = AgentLoop(qwen_tok, engine, env(), AgentConfig(max_turns=3, max_context_tokens=limit))
    traj = run(loop.run_trajectory(RolloutRequest(Task("t9"), "g9"), 0))
    assert [p.max_new_tokens for _, p, _ in engine.calls] == [limit - p1, 10]
    assert all(len(inp) + p.max_new_tokens <= limit for inp, p, _ in engine.calls)
    assert [(t.max_new_tokens, t.cut) for t in traj.turns] == [(limit - p1, True), (10, True)]
    assert traj.num_turns == 2 and traj.context_exhausted


def test_max_turns_of_the_request(qwen_tok):
    """The step's max_turns (single-turn warmup) caps the trajectory below the config's max_turns."""
    cfg = AgentConfig(max_turns=3, single_turn_steps=2)
    assert [cfg.max_turns_at(s) for s in range(4)] == [1, 1, 3, 3]
    engine = ScriptedEngine(qwen_tok, by_turn("WRONG", "WRONG", "PASS"))
    loop = AgentLoop(qwen_tok, engine, env(), cfg)
    assert run(loop.run_trajectory(RolloutRequest(Task("w"), "w", max_turns=1), 0)).num_turns == 1
    assert run(loop.run_trajectory(RolloutRequest(Task("w"), "w", max_turns=3), 0)).num_turns == 3


def test_concurrency_is_bounded_and_verification_overlaps_generation(qwen_tok):
    engine = ScriptedEngine(qwen_tok, lambda turn, call: "WRONG" if turn == 1 else "PASS", delay=0.002)
    verifier = MarkerVerifier(delay=0.002)
    overlap = {"seen": False}
    original = verifier.__call__

    async def watched(task, text):
        if engine.in_flight > 0:
            overlap["seen"] = True
        return await original(task, text)

    loop = AgentLoop(qwen_tok, engine, env(watched), AgentConfig(max_turns=2, group_size=4, max_concurrency=3, seed=5))
    out = run(loop.rollout_batch([RolloutRequest(Task(f"c{i}"), f"c{i}") for i in range(3)], 3))
    assert [g.group_id for g in out.groups] == ["c0", "c1", "c2"] and all(g.ok for g in out.groups)
    assert engine.max_in_flight == 3          # bounded by the semaphore, and actually concurrent
    assert overlap["seen"]                    # a verification ran while another trajectory generated
    seeds = {p.seed for _, p, _ in engine.calls}
    assert len(seeds) == len(engine.calls)    # distinct per (group, sample, turn)
    again = run(loop.rollout_batch([RolloutRequest(Task("d"), "d")], 1))   # a new event loop (one asyncio.run per step)
    assert again.groups[0].ok and engine.max_in_flight == 3


def test_rollout_batch_dynamic_sampling_and_bdr(qwen_tok):
    # task "easy" always passes, "hard" always fails, "mixed" passes for even calls only
    def script(turn, call):
        return "PASS" if call % 2 == 0 else "WRONG"

    class PerTask(MarkerVerifier):
        async def __call__(self, task, text):
            if task.task_id == "easy":
                text = "PASS"
            elif task.task_id == "hard":
                text = "WRONG"
            return await super().__call__(task, text)

    engine = ScriptedEngine(qwen_tok, script)
    loop = AgentLoop(qwen_tok, engine, env(PerTask()),
                     AgentConfig(max_turns=1, group_size=4, max_concurrency=1, dynamic_sampling=True))
    bdr = BufferedDynamicRetry(BDRConfig(capacity=8, replay_prob=1.0), seed=0)
    seen, groups = [], {}

    def on_group(group):
        seen.append(group.group_id)
        groups[group.group_id] = group
        loop.record_failed_group(bdr, group, step=3)

    requests = [RolloutRequest(Task(n), f"{n}-{i}") for i, n in enumerate(["easy", "hard", "mixed", "hard", "mixed"])]
    out = run(loop.rollout_batch(requests, num_groups=2, on_group=on_group, max_groups_in_flight=1))
    assert [g.group_id for g in out.groups] == ["mixed-2", "mixed-4"] and out.unused == []
    st = out.stats
    assert st["groups_drawn"] == 5 and st["groups_dropped_zero_std"] == 3 and st["stop_reason"] == "full"
    total = sum(r.generated_tokens for r in requests)
    assert st["tokens_generated"] == total and st["discarded_token_frac"] == pytest.approx(
        1 - sum(g.request.generated_tokens for g in out.groups) / total)   # the three dropped groups
    assert seen == ["easy-0", "hard-1", "mixed-2", "hard-3", "mixed-4"]
    assert [e.task_id for e in bdr.entries()] == ["hard"] and "FEEDBACK-hard" in bdr.entries()[0].error
    (entry,) = bdr.draw(1)
    assert (entry.step, entry.attempts) == (3, 1)
    # "hard" failed twice: the later group refreshed the entry; equal scores -> its earliest sample
    assert entry.failed_code == groups["hard-3"].trajectories[0].turns[-1].response_text
    engine.calls.clear()
    repair = run(loop.run_group(loop.repair_request(entry, Task("hard"))))
    prompt = qwen_tok.decode(engine.calls[0][0])
    assert "A previous attempt at this task failed" in prompt and "FEEDBACK-hard: mismatch" in prompt
    assert repair.ok and repair.trajectories[0].kind == "repair"
    assert loop.record_failed_group(bdr, repair) and bdr.entries()[0].attempts == 1   # re-buffered, counted
    with pytest.raises(ValueError, match="for task 'hard'"):
        loop.repair_request(entry, Task("easy"))
    for g in out.groups:
        adv = g.advantages()
        assert len(adv) == 4 and max(adv) > 0 > min(adv)
    loop.cfg = dataclasses.replace(loop.cfg, dynamic_sampling=False)
    plain = run(loop.rollout_batch(requests[:2], num_groups=2))
    assert [g.group_id for g in plain.groups] == ["easy-0", "hard-1"] and plain.stats["groups_dropped_zero_std"] == 0
