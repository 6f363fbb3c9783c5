"""The agent loop's mechanics with a scripted engine and a marker verifier (the real-verifier run
is in test_agent_real_verifier.py)."""
import asyncio
import dataclasses
import math

import pytest

from megatron_rl.algorithms.bdr import BDRConfig, BufferedDynamicRetry
from megatron_rl.rollout.agent import AgentConfig, AgentLoop, ConversationCodec, RolloutRequest
from megatron_rl.rollout.prompts import feedback_text, initial_messages
from megatron_rl.types import TrainSample
from agent_fakes import IM_END, MarkerVerifier, ScriptedEngine, token_logprobs


@dataclasses.dataclass
class Task:
    task_id: str
    source: str = "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x\n" \
                  "def get_inputs():\n    return [torch.randn(4, 8)]\ndef get_init_inputs():\n    return []\n"
    path: str = "<t>"


def by_turn(*texts):
    return lambda turn, call: texts[turn - 1]


def run(coro):
    return asyncio.run(coro)


def test_feedback_turn_and_exact_tokens(qwen_tok):
    engine = ScriptedEngine(qwen_tok, by_turn("first try WRONG", "second try PASS", "never used"))
    verifier = MarkerVerifier()
    loop = AgentLoop(qwen_tok, engine, verifier, AgentConfig(max_turns=3, group_size=1))
    traj = run(loop.run_trajectory(RolloutRequest(Task("t1"), "g"), 0))

    assert traj.num_turns == 2 and len(engine.calls) == 2 and traj.first_pass_turn == 2   # stopped early
    assert [t.verdict.category.value for t in traj.turns] == ["correctness_error", "pass"]
    (in1, _, out1), (in2, _, out2) = engine.calls
    # the second prompt is the first context + the engine's own tokens + newly tokenized feedback
    assert in2[: len(in1) + len(out1)] == in1 + out1
    delta = in2[len(in1) + len(out1):]
    assert "FEEDBACK-t1: mismatch at index 3" in qwen_tok.decode(delta)
    assert delta[0] != IM_END                     # the engine's <|im_end|> is not duplicated
    # ... and equals the chat template's rendering of the whole conversation
    msgs = initial_messages(Task("t1"), "cpu") + [
        {"role": "assistant", "content": "first try WRONG"},
        {"role": "user", "content": feedback_text("correctness_error", 0.4, "FEEDBACK-t1: mismatch at index 3")}]
    rendered = qwen_tok.encode(qwen_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                               add_special_tokens=False)
    assert in2 == rendered

    # PrimeEcho: 0.75·s1 + 0.25·max(s1, s2) + b(2);  s1 = -0.5 + 0.5·0.4 = -0.3, s2 = 1 + 0.5·1 = 1.5
    assert traj.reward == pytest.approx(0.75 * -0.3 + 0.25 * 1.5 + 0.08)

    sample = traj.to_train_sample(advantage=0.7)
    assert isinstance(sample, TrainSample)
    sample.validate()
    assert sample.tokens == in2 + out2
    first = range(len(in1), len(in1) + len(out1))
    assert [i for i, m in enumerate(sample.loss_mask) if m] == list(first)
    assert [sample.tokens[i] for i in first] == out1
    assert [sample.fields["rollout_logprobs"][i] for i in first] == token_logprobs(len(out1), 100)
    second = range(len(in2), len(in2) + len(out2))
    assert [sample.fields["rollout_logprobs"][i] for i in second] == token_logprobs(len(out2), 200)
    assert {sample.fields["advantages"][i] for i in first} == {0.7}
    assert sum(sample.fields["advantages"]) == pytest.approx(0.7 * len(out1))

    assert [t.trained for t in traj.turns] == [True, False]
    both = traj.to_train_sample(train_on_all_turns=True)
    assert [i for i, m in enumerate(both.loss_mask) if m] == list(first) + list(second)
    loop_all = AgentLoop(qwen_tok, ScriptedEngine(qwen_tok, by_turn("first try WRONG", "second try PASS")), MarkerVerifier(),
                         AgentConfig(max_turns=3, train_on_all_turns=True))
    traj_all = run(loop_all.run_trajectory(RolloutRequest(Task("t1"), "g"), 0))
    assert [t.trained for t in traj_all.turns] == [True, True]
    assert traj_all.to_train_sample().loss_mask == both.loss_mask
    trimmed = traj.to_train_sample(trim_untrained_tail=True)
    assert trimmed.tokens == in1 + out1 and sum(trimmed.loss_mask) == len(out1)


def test_every_turn_recorded_when_all_fail(qwen_tok):
    engine = ScriptedEngine(qwen_tok, by_turn("no code", "still WRONG", "no code again"))
    loop = AgentLoop(qwen_tok, engine, MarkerVerifier(), AgentConfig(max_turns=3))
    traj = run(loop.run_trajectory(RolloutRequest(Task("t2"), "g"), 0))
    assert [t.verdict.category.value for t in traj.turns] == ["format_error", "correctness_error", "format_error"]
    assert [t.score for t in traj.turns] == pytest.approx([-1.0, -0.3, -1.0])
    assert traj.reward == pytest.approx(0.75 * -1.0 + 0.25 * -0.3)
    assert not traj.passed and traj.first_pass_turn is None
    # later prompts carry the verdict of the turn before
    assert "format_error" in qwen_tok.decode(engine.calls[1][0]) and "FEEDBACK-t2" in qwen_tok.decode(engine.calls[2][0])


def test_truncated_response_gets_the_end_marker(qwen_tok):
    engine = ScriptedEngine(qwen_tok, by_turn("cut off mid sen", "PASS"),
                            finish_reason=lambda turn: "length" if turn == 1 else "stop")
    loop = AgentLoop(qwen_tok, engine, MarkerVerifier(), AgentConfig(max_turns=2))
    traj = run(loop.run_trajectory(RolloutRequest(Task("t3"), "g"), 0))
    assert traj.turns[0].finish_reason == "length" and traj.turns[0].response_ids[-1] != IM_END
    assert traj.turns[1].prompt_ids[0] == IM_END      # the template closes the truncated turn


def test_infra_is_retried_and_never_scored(qwen_tok):
    verifier = MarkerVerifier(infra_budget=2)
    engine = ScriptedEngine(qwen_tok, by_turn("PASS"))
    loop = AgentLoop(qwen_tok, engine, verifier, AgentConfig(max_turns=1, infra_retries=3))
    traj = run(loop.run_trajectory(RolloutRequest(Task("t4"), "g"), 0))
    assert traj.turns[0].verify_attempts == 3 and traj.turns[0].verdict.passed

    loop = AgentLoop(qwen_tok, ScriptedEngine(qwen_tok, by_turn("INFRA forever")), MarkerVerifier(),
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
    loop = AgentLoop(qwen_tok, engine, MarkerVerifier(), AgentConfig(max_turns=1, group_size=2))
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
        loop = AgentLoop(qwen_tok, engine, MarkerVerifier(), AgentConfig(max_turns=1))
        with pytest.raises(ValueError, match=f"task 't7' group 'g7' sample 0 turn 1: {match}"):
            run(loop.run_trajectory(RolloutRequest(Task("t7"), "g7"), 0))


def test_prompt_and_context_limits(qwen_tok):
    engine = ScriptedEngine(qwen_tok, by_turn("WRONG", "WRONG", "WRONG"))
    loop = AgentLoop(qwen_tok, engine, MarkerVerifier(), AgentConfig(max_turns=1, max_prompt_tokens=10))
    group = run(loop.run_group(RolloutRequest(Task("t8"), "g8")))
    assert group.status == "prompt_too_long" and engine.calls == []

    loop = AgentLoop(qwen_tok, engine, MarkerVerifier(), AgentConfig(max_turns=3))
    prompt_len = len(loop.codec.prompt_ids(initial_messages(Task("t9"), "cpu")))
    limit = prompt_len + 40
    loop = AgentLoop(qwen_tok, engine, MarkerVerifier(), AgentConfig(max_turns=3, max_context_tokens=limit))
    engine.calls.clear()
    traj = run(loop.run_trajectory(RolloutRequest(Task("t9"), "g9"), 0))
    assert engine.calls[0][1].max_new_tokens == 40
    assert all(len(inp) + p.max_new_tokens <= limit for inp, p, _ in engine.calls)
    assert traj.num_turns == len(engine.calls) < 3   # the feedback turn ate the rest of the budget


def test_concurrency_is_bounded_and_verification_overlaps_generation(qwen_tok):
    engine = ScriptedEngine(qwen_tok, lambda turn, call: "WRONG" if turn == 1 else "PASS", delay=0.002)
    verifier = MarkerVerifier(delay=0.002)
    overlap = {"seen": False}
    original = verifier.__call__

    async def watched(task, text):
        if engine.in_flight > 0:
            overlap["seen"] = True
        return await original(task, text)

    loop = AgentLoop(qwen_tok, engine, watched, AgentConfig(max_turns=2, group_size=4, max_concurrency=3, seed=5))
    groups = run(_collect(loop, [RolloutRequest(Task(f"c{i}"), f"c{i}") for i in range(3)]))
    assert sorted(g.group_id for g in groups) == ["c0", "c1", "c2"] and all(g.ok for g in groups)
    assert engine.max_in_flight == 3          # bounded by the semaphore, and actually concurrent
    assert overlap["seen"]                    # a verification ran while another trajectory generated
    seeds = {p.seed for _, p, _ in engine.calls}
    assert len(seeds) == len(engine.calls)    # distinct per (group, sample, turn)
    again = run(_collect(loop, [RolloutRequest(Task("d"), "d")]))   # a new event loop (e.g. one asyncio.run per step)
    assert again[0].ok and engine.max_in_flight == 3


async def _collect(loop, requests):
    return [g async for g in loop.stream_groups(requests)]


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
    loop = AgentLoop(qwen_tok, engine, PerTask(), AgentConfig(max_turns=1, group_size=4, max_concurrency=1))
    bdr = BufferedDynamicRetry(BDRConfig(capacity=8, replay_prob=1.0), seed=0)
    seen, groups = [], {}

    def on_group(group):
        seen.append(group.group_id)
        groups[group.group_id] = group
        loop.record_failed_group(bdr, group, step=3)

    requests = [RolloutRequest(Task(n), f"{n}-{i}") for i, n in enumerate(["easy", "hard", "mixed", "hard", "mixed"])]
    batch, stats = run(loop.rollout_batch(requests, num_groups=2, on_group=on_group, max_groups_in_flight=1))
    assert [g.group_id for g in batch] == ["mixed-2", "mixed-4"]
    assert stats["groups_drawn"] == 5 and stats["groups_dropped_zero_std"] == 3 and stats["stop_reason"] == "full"
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
    for g in batch:
        adv = g.advantages()
        assert len(adv) == 4 and max(adv) > 0 > min(adv)
    plain, stats = run(loop.rollout_batch(requests[:2], num_groups=2, dynamic_sampling=False))
    assert [g.group_id for g in plain] == ["easy-0", "hard-1"] and stats["groups_dropped_zero_std"] == 0


def test_feedback_ids_for_other_templates():
    """A template that is not ChatML: the delta is whatever the template renders after the answer."""

    class TinyTok:
        eos_token_id = 2

        def get_vocab(self):
            return {"</s>": 2}

        def apply_chat_template(self, msgs, tokenize, add_generation_prompt, **kw):
            out = "".join(f"[{m['role']}]{m['content']}</s>" for m in msgs)
            return out + ("[assistant]" if add_generation_prompt else "")

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text.replace("</s>", "\x02")]

        def decode(self, ids, skip_special_tokens=False):
            return "".join("</s>" if i == 2 else chr(i) for i in ids)

    codec = ConversationCodec(TinyTok())
    assert codec.stop_token_ids == [2]
    ids = codec.feedback_ids("fix it", [ord("a"), 2])
    assert TinyTok().decode(ids) == "[user]fix it</s>[assistant]"
    ids = codec.feedback_ids("fix it", [ord("a")])
    assert TinyTok().decode(ids) == "</s>[user]fix it</s>[assistant]"
