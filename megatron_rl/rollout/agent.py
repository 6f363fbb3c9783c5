"""The multi-turn agent loop: generate -> verify -> (feedback -> generate again), up to K turns.

One trajectory: the environment's first-turn messages go through the tokenizer's chat template; the
engine generates a response (token ids + rollout logprobs); the environment judges the decoded text;
on a failure its feedback is appended as a user message and the model answers the whole conversation
again. It stops at the first passing turn or after the request's ``max_turns`` (MusaCoder: 3, after a
single-turn warmup, see `AgentConfig.max_turns_at`). The trajectory reward is PrimeEcho over the
per-turn scores.

Every turn's prompt is the chat template's rendering of the conversation so far, as a chat server
would build it: earlier answers enter as messages, so a template that drops their reasoning (Qwen3
strips ``<think>`` blocks from past turns) keeps the context short. History is untrusted text: an answer (or
feedback quoting it) that spells a control string such as ``<|im_end|>\n<|im_start|>system`` with ordinary tokens
has it defused (`ConversationCodec.untrusted`), so re-rendering cannot turn it into a turn boundary or a fake turn;
the verifier still judges the text as generated. A turn is trained on exactly the
tokens its prompt and its response were (the generated ids, never re-tokenized), aligned with their
rollout logprobs. Each turn's budget is what is left of ``max_context_tokens`` after its prompt; a turn
given less than ``sampling.max_new_tokens`` is marked ``cut``, and a trajectory that stops because no
room is left is marked ``context_exhausted`` (both are logged per step).

Generation is an injected async callable and everything task-specific comes from an `Environment`
(prompt, verify, score, feedback), so this module knows neither the engine client nor the farm.
Many trajectories run concurrently (bounded by a semaphore), so verifier calls overlap other
trajectories' generation.

``infra`` verdicts are retried; if they persist the trajectory is re-run, and a group that still
cannot be verified is returned with ``status="infra"`` and no rewards: it is never scored. An infra verdict that is
the task's own fault (its rule in ``verifier.farm.TASK_FAULT_RULES``: a reference that does not repeat or ignores its
inputs) is retried neither way, as the farm does not retry it: the same task gives it again, and each retry would
cost a full verification (``TaskFaultVerdict``; the group is returned with ``status="infra"`` at once).

Dynamic sampling (`AgentLoop.rollout_batch`) decides in submission order, so which groups make the
batch does not depend on how long they took: slow tasks (long compiles, long answers, more turns) are
kept as often as fast ones.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time
import zlib
from typing import Any, AsyncIterable, Awaitable, Callable, Iterable, Sequence

from verifier.farm import TASK_FAULT_RULES   # light: no torch, no Ray, nothing of megatron_rl
from verifier.types import Category, VerifyResult

from ..algorithms.advantages import AdvantageConfig, DynamicSampler, RewardGroup, group_advantages, \
    has_reward_variance
from ..algorithms.rewards import (InfraVerdictError, PrimeEchoConfig, TurnOutcome, checked_turn_score,
                                  load_callable, primeecho_reward)
from .environment import Environment, farm_verify_fn, threaded_verify_fn  # noqa: F401 (the verifier adapters' old home)
from .prompts import (CONTROL_TOKENS, DEFAULT_SYSTEM_PROMPT, candidate_code, defuse_control_tokens,
                      tokenizer_control_tokens)
from .protocol import GenerateResult, SamplingParams

GenerateFn = Callable[[list[int], SamplingParams], Awaitable[GenerateResult]]


class GenerationAborted(RuntimeError):
    """The engine aborted the request (e.g. paused for a weight update): re-run the trajectory."""


class TaskFaultVerdict(InfraVerdictError):
    """An infra verdict that is the task's own fault (``TASK_FAULT_RULES``): never retried, neither the verification
    nor the trajectory; the group is unscored."""


class PromptTooLong(ValueError):
    """The first-turn prompt exceeds ``max_prompt_tokens``."""


# --------------------------------------------------------------------------------------------------
# records


@dataclasses.dataclass
class TurnRecord:
    turn: int                        # 1-based
    prompt_ids: list[int]            # the whole context the engine answered: the template's rendering so far
    response_ids: list[int]          # exactly what the engine generated
    rollout_logprobs: list[float]    # one per response token
    finish_reason: str
    weight_version: int | None
    response_text: str
    verdict: VerifyResult
    score: float                     # s_k
    trained: bool = False            # whether the policy-gradient loss covers this response
    max_new_tokens: int = 0          # this turn's budget
    cut: bool = False                # the context limit left it less than sampling.max_new_tokens
    verify_attempts: int = 1         # > 1 when infra verdicts were retried
    generate_seconds: float = 0.0
    verify_seconds: float = 0.0


@dataclasses.dataclass
class Trajectory:
    task_id: str
    group_id: str
    sample_index: int
    turns: list[TurnRecord]
    reward: float                    # PrimeEcho over the turn scores
    kind: str = "task"               # "task" | "repair" (a BDR replay)
    context_exhausted: bool = False  # a failed turn got no successor: no room left in max_context_tokens

    @property
    def passed(self) -> bool:
        return any(t.verdict.passed for t in self.turns)

    @property
    def first_pass_turn(self) -> int | None:
        return next((t.turn for t in self.turns if t.verdict.passed), None)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def to_train_samples(self, advantage: float | None = None, weight: float = 1.0) -> list:
        """One ``TrainSample`` per trained turn: that turn's prompt and response, the loss on the response.

        Turns are trained in the context they were generated in (each turn's prompt is its own rendering of
        the history). Fields: ``rollout_logprobs`` (0 on the prompt) and, when given, ``advantages`` (the
        trajectory's advantage on every trained token, 0 elsewhere).
        """
        from megatron_rl.types import TrainSample

        if not self.turns:
            raise ValueError(f"trajectory {self.group_id}/{self.sample_index} has no turns")
        if advantage is not None and not math.isfinite(advantage):
            raise ValueError(f"trajectory {self.group_id}/{self.sample_index}: advantage is {advantage}")
        samples = []
        for turn in self.turns:
            if not turn.trained:
                continue
            p, r = len(turn.prompt_ids), len(turn.response_ids)
            fields = {"rollout_logprobs": [0.0] * p + [float(x) for x in turn.rollout_logprobs]}
            if advantage is not None:
                fields["advantages"] = [0.0] * p + [float(advantage)] * r
            samples.append(TrainSample(tokens=list(turn.prompt_ids) + list(turn.response_ids),
                                       loss_mask=[0] * p + [1] * r, fields=fields, weight=weight))
        return samples


@dataclasses.dataclass
class RolloutRequest:
    """One prompt to sample a group for. ``messages=None`` uses the environment's prompt for the task."""

    task: Any
    group_id: str
    messages: list[dict[str, str]] | None = None
    kind: str = "task"               # "task" | "repair"
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_turns: int | None = None     # None: AgentConfig.max_turns
    generated_tokens: int = 0        # what the engines returned for this group so far (also if it is cancelled)


@dataclasses.dataclass
class GroupResult:
    request: RolloutRequest
    trajectories: list[Trajectory]
    status: str = "ok"               # "ok" | "infra" | "aborted" | "prompt_too_long"
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def group_id(self) -> str:
        return self.request.group_id

    @property
    def rewards(self) -> list[float]:
        if not self.ok:
            raise ValueError(f"group {self.request.group_id!r} has status {self.status!r}: it has no rewards")
        return [t.reward for t in self.trajectories]

    def to_reward_group(self) -> RewardGroup:
        return RewardGroup(group_id=self.request.group_id, rewards=list(self.rewards), items=list(self.trajectories))

    def advantages(self, cfg: AdvantageConfig | None = None) -> list[float]:
        """GRPO advantages of this group."""
        return group_advantages(self.rewards, cfg or AdvantageConfig(), self.request.group_id)


@dataclasses.dataclass
class BatchResult:
    """What `AgentLoop.rollout_batch` drew: the batch, and every other drawn request by fate."""

    groups: list[GroupResult]        # the training batch, in submission order
    unused: list[RolloutRequest]     # drawn but never decided (cancelled, or finished after the batch was full)
    unscored: list[GroupResult]      # infra / aborted / prompt too long
    stats: dict[str, Any]


# --------------------------------------------------------------------------------------------------
# conversation tokens


class ConversationCodec:
    """Chat-template rendering of a conversation, and its token ids."""

    def __init__(self, tokenizer, enable_thinking: bool | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        self.stop_token_ids = self._default_stop_ids()
        self.control_strings = self._control_strings()

    def _default_stop_ids(self) -> list[int]:
        ids = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        vocab = self.tokenizer.get_vocab()
        for tok in ("<|im_end|>", "<|endoftext|>"):
            if tok in vocab and vocab[tok] not in ids:
                ids.append(int(vocab[tok]))
        return ids

    def _control_strings(self) -> tuple[str, ...]:
        """Every string this tokenizer reads back as one added or special token (and ChatML's control strings),
        longest first, but the reasoning markers: templates split past answers on ``</think>``, and they open or
        close no turn. Whitespace tokens and single characters are left alone (code is full of them)."""
        found = set(CONTROL_TOKENS) | set(tokenizer_control_tokens(self.tokenizer))
        keep = (t for t in found if isinstance(t, str) and len(t) > 1 and t not in ("<think>", "</think>")
                and not any(c.isspace() for c in t))
        return tuple(sorted(keep, key=lambda t: (-len(t), t)))

    def untrusted(self, text: str) -> str:
        """``text`` (a model answer, verifier feedback) as message content that cannot add a control token to the
        prompt: re-rendered history must not turn a response that *spelled* ``<|im_end|>\\n<|im_start|>user``
        with ordinary tokens into a turn boundary and a fake user or system turn."""
        return defuse_control_tokens(text, self.control_strings)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        # the template already carries any BOS/control tokens: add nothing
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def decode_response(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)


# --------------------------------------------------------------------------------------------------
# the loop


@dataclasses.dataclass
class AgentConfig:
    max_turns: int = 3                             # MusaCoder: at most 3 responses, early stop on a pass
    single_turn_steps: int = 0                     # the max_turns schedule: 1 turn before this step (warmup)
    train_on_all_turns: bool = False               # default: the loss covers the first response only
    group_size: int = 8
    max_concurrency: int = 64                      # trajectories in flight
    dynamic_sampling: bool = False                 # keep only groups whose rewards differ (DAPO)
    max_oversample_rounds: int = 4                 # with it, at most prompts * (1 + this) groups per step
    sampling: SamplingParams = dataclasses.field(
        default_factory=lambda: SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=32768))
    max_prompt_tokens: int | None = 8192
    max_context_tokens: int | None = None          # bound on any turn's prompt + response
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    enable_thinking: bool | None = None            # forwarded to the chat template when set
    infra_retries: int = 3                         # re-verifications of one response on infra
    trajectory_retries: int = 2                    # re-runs of a trajectory (abort / persistent infra)
    seed: int | None = None                        # per-request sampling seeds derive from it
    reward_fn: str | None = None                   # None: the environment's score; or "pkg.module:function"
    primeecho: PrimeEchoConfig = dataclasses.field(default_factory=PrimeEchoConfig)

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.single_turn_steps < 0:
            raise ValueError(f"single_turn_steps must be >= 0, got {self.single_turn_steps}")
        if self.group_size < 1 or self.max_concurrency < 1:
            raise ValueError("group_size and max_concurrency must be >= 1")
        if self.max_oversample_rounds < 0:
            raise ValueError(f"max_oversample_rounds must be >= 0, got {self.max_oversample_rounds}")
        if self.infra_retries < 0 or self.trajectory_retries < 0:
            raise ValueError("retry counts must be >= 0")

    def max_turns_at(self, step: int) -> int:
        """Single-turn RL warmup, then multi-turn feedback RL (the paper's two stages)."""
        return 1 if step < self.single_turn_steps else self.max_turns

    def groups_to_draw(self, num_groups: int) -> int:
        """The most groups one step may draw to fill a batch of ``num_groups``."""
        return num_groups * (1 + self.max_oversample_rounds) if self.dynamic_sampling else num_groups


class AgentLoop:
    def __init__(self, tokenizer, generate: GenerateFn, env: Environment, cfg: AgentConfig = AgentConfig()):
        self.cfg = cfg
        self.codec = ConversationCodec(tokenizer, cfg.enable_thinking)
        self.generate = generate
        self.env = env
        self.score = load_callable(cfg.reward_fn) if cfg.reward_fn else env.score
        self._semaphores: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        self.stats = {"trajectories": 0, "trajectory_retries": 0, "infra_reverifications": 0, "task_fault_verdicts": 0,
                      "groups_failed": 0}

    def _semaphore(self) -> asyncio.Semaphore:
        """The concurrency bound of the running event loop (asyncio primitives bind to one loop, and a
        trainer may drive each step with its own ``asyncio.run``)."""
        loop = asyncio.get_running_loop()
        sem = self._semaphores.get(loop)
        if sem is None:
            self._semaphores = {l: s for l, s in self._semaphores.items() if not l.is_closed()}
            sem = self._semaphores[loop] = asyncio.Semaphore(self.cfg.max_concurrency)
        return sem

    # ---- requests

    def repair_request(self, entry, task, group_id: str | None = None) -> RolloutRequest | None:
        """A BDR replay (``algorithms.bdr.FailedPrompt``) as a repair prompt for ``task`` (None when the
        environment has no repair prompt for it)."""
        if getattr(task, "task_id", None) != entry.task_id:
            raise ValueError(f"BDR entry is for task {entry.task_id!r}, got task {getattr(task, 'task_id', task)!r}")
        msgs = self.env.repair_prompt(task, entry)
        if msgs is None:
            return None
        return RolloutRequest(task=task, group_id=group_id or f"repair/{entry.task_id}/{entry.attempts}",
                              messages=msgs, kind="repair", meta={"bdr_entry": entry})

    def record_failed_group(self, bdr, group: GroupResult, step: int | None = None) -> bool:
        """Push a group in which no trajectory passed to a ``BufferedDynamicRetry``.

        Each trajectory contributes its last (most refined) attempt; BDR keeps the best-scoring one.
        """
        if not group.ok:
            return False
        last = [t.turns[-1] for t in group.trajectories]
        task_id = getattr(group.request.task, "task_id", str(group.request.task))
        entry = group.request.meta.get("bdr_entry")
        return bdr.add_group(task_id, [t.verdict for t in last], [t.score for t in last],
                             [candidate_code(t.response_text) for t in last],
                             attempts=entry.attempts if entry is not None else 0, step=step)

    # ---- one trajectory

    def _sampling_for(self, group_id: str, sample_index: int, turn: int, prompt_len: int) -> SamplingParams | None:
        """This turn's sampling: the configured one, its budget bounded by what the context has left."""
        base = self.cfg.sampling
        max_new = base.max_new_tokens
        if self.cfg.max_context_tokens is not None:
            max_new = min(max_new, self.cfg.max_context_tokens - prompt_len)
        if max_new <= 0:
            return None
        seed = base.seed
        if self.cfg.seed is not None:
            seed = zlib.crc32(f"{self.cfg.seed}/{group_id}/{sample_index}/{turn}".encode()) & 0x7FFFFFFF
        return dataclasses.replace(base, max_new_tokens=max_new, seed=seed,
                                   stop_token_ids=list(base.stop_token_ids) or list(self.codec.stop_token_ids))

    def _check_generation(self, where: str, res: GenerateResult, max_new_tokens: int | None = None) -> None:
        if res.finish_reason == "abort":
            raise GenerationAborted(f"{where}: generation aborted by the engine")
        if max_new_tokens is not None and len(res.token_ids) > max_new_tokens:
            # trained as it is, prompt + response would pass max_context_tokens (and the trainer's sequence bound)
            raise ValueError(f"{where}: engine returned {len(res.token_ids)} tokens for a budget of "
                             f"max_new_tokens={max_new_tokens}")
        if len(res.token_ids) != len(res.logprobs):
            raise ValueError(f"{where}: engine returned {len(res.token_ids)} tokens but {len(res.logprobs)} logprobs")
        for i, lp in enumerate(res.logprobs):
            if lp is None or not math.isfinite(float(lp)):
                raise ValueError(f"{where}: rollout logprob of generated token {i} is {lp}")

    async def _verify_turn(self, where: str, task, text: str) -> tuple[VerifyResult, int]:
        for attempt in range(1, self.cfg.infra_retries + 2):
            verdict = await self.env.verify(task, text)
            if verdict is None or not isinstance(verdict, VerifyResult):
                raise TypeError(f"{where}: verify returned {type(verdict).__name__}, expected VerifyResult")
            if verdict.category != Category.INFRA:
                return verdict, attempt
            if verdict.rule in TASK_FAULT_RULES:   # the task's fault: every retry would give it again
                self.stats["task_fault_verdicts"] += 1
                raise TaskFaultVerdict(getattr(task, "task_id", str(task)),
                                       f"{where}: the task's fault ({verdict.rule}), not retried: "
                                       f"{verdict.feedback[:200]}")
            self.stats["infra_reverifications"] += 1
        raise InfraVerdictError(getattr(task, "task_id", str(task)),
                                f"{where}: still infra after {self.cfg.infra_retries + 1} attempts: "
                                f"{verdict.feedback[:200]}")

    def first_messages(self, request: RolloutRequest) -> list[dict[str, str]]:
        return list(request.messages) if request.messages is not None else self.env.prompt(request.task)

    def prompt_ids(self, request: RolloutRequest) -> list[int]:
        """First-turn prompt tokens of a request (the environment's prompt or the request's own messages)."""
        task_id = getattr(request.task, "task_id", str(request.task))
        prompt = self.codec.prompt_ids(self.first_messages(request))
        if not prompt:
            raise ValueError(f"task {task_id!r}: the chat template produced an empty prompt")
        if self.cfg.max_prompt_tokens is not None and len(prompt) > self.cfg.max_prompt_tokens:
            raise PromptTooLong(f"task {task_id!r}: prompt is {len(prompt)} tokens > max_prompt_tokens="
                                f"{self.cfg.max_prompt_tokens}")
        return prompt

    async def run_trajectory(self, request: RolloutRequest, sample_index: int,
                             prompt: list[int] | None = None) -> Trajectory:
        task = request.task
        task_id = getattr(task, "task_id", str(task))
        max_turns = request.max_turns or self.cfg.max_turns
        messages = self.first_messages(request)
        prompt = list(prompt) if prompt is not None else self.prompt_ids(request)
        turns: list[TurnRecord] = []
        exhausted = False
        async with self._semaphore():
            for turn in range(1, max_turns + 1):
                where = f"task {task_id!r} group {request.group_id!r} sample {sample_index} turn {turn}"
                if turn > 1:
                    prompt = self.codec.prompt_ids(messages)  # the history as the chat template renders it
                params = self._sampling_for(request.group_id, sample_index, turn, len(prompt))
                if params is None:
                    exhausted = True
                    break
                t0 = time.monotonic()
                gen = await self.generate(list(prompt), params)
                t1 = time.monotonic()
                request.generated_tokens += len(gen.token_ids)
                self._check_generation(where, gen, params.max_new_tokens)
                text = self.codec.decode_response(gen.token_ids)
                verdict, attempts = await self._verify_turn(where, task, text)
                t2 = time.monotonic()
                score = checked_turn_score(self.score, TurnOutcome(task=task, turn=turn, response_text=text,
                                                                   verdict=verdict, response_ids=list(gen.token_ids)))
                turns.append(TurnRecord(
                    turn=turn, prompt_ids=prompt, response_ids=list(gen.token_ids),
                    rollout_logprobs=[float(x) for x in gen.logprobs], finish_reason=gen.finish_reason,
                    weight_version=gen.weight_version, response_text=text, verdict=verdict, score=score,
                    trained=turn == 1 or self.cfg.train_on_all_turns, max_new_tokens=params.max_new_tokens,
                    cut=params.max_new_tokens < self.cfg.sampling.max_new_tokens, verify_attempts=attempts,
                    generate_seconds=t1 - t0, verify_seconds=t2 - t1))
                if verdict.passed or turn == max_turns:
                    break
                # the answer and the feedback (which may quote it) are untrusted: defused as the task text is
                messages += [{"role": "assistant", "content": self.codec.untrusted(text)},
                             {"role": "user", "content": self.codec.untrusted(self.env.feedback(verdict))}]
        if not turns:
            raise PromptTooLong(f"task {task_id!r}: no room for a response within max_context_tokens="
                                f"{self.cfg.max_context_tokens}")
        reward = primeecho_reward([t.score for t in turns], [t.verdict.passed for t in turns], self.cfg.primeecho)
        self.stats["trajectories"] += 1
        return Trajectory(task_id=task_id, group_id=request.group_id, sample_index=sample_index, turns=turns,
                          reward=reward, kind=request.kind, context_exhausted=exhausted)

    # ---- groups

    async def _trajectory_with_retries(self, request: RolloutRequest, sample_index: int,
                                       prompt: list[int]) -> Trajectory:
        for attempt in range(self.cfg.trajectory_retries + 1):
            try:
                return await self.run_trajectory(request, sample_index, prompt)
            except (InfraVerdictError, GenerationAborted) as e:
                if attempt == self.cfg.trajectory_retries or isinstance(e, TaskFaultVerdict):
                    raise
                self.stats["trajectory_retries"] += 1
        raise AssertionError("unreachable")

    async def run_group(self, request: RolloutRequest, group_size: int | None = None) -> GroupResult:
        """G trajectories of one prompt. A group that cannot be fully verified is returned unscored."""
        g = group_size or self.cfg.group_size
        try:
            prompt = self.prompt_ids(request)
        except PromptTooLong as e:
            self.stats["groups_failed"] += 1
            return GroupResult(request=request, trajectories=[], status="prompt_too_long", error=str(e))
        jobs = [asyncio.ensure_future(self._trajectory_with_retries(request, i, prompt)) for i in range(g)]
        try:
            trajectories = await asyncio.gather(*jobs)
        except (InfraVerdictError, GenerationAborted, PromptTooLong) as e:
            await _cancel(jobs)
            self.stats["groups_failed"] += 1
            status = ("infra" if isinstance(e, InfraVerdictError) else   # TaskFaultVerdict too
                      {GenerationAborted: "aborted", PromptTooLong: "prompt_too_long"}[type(e)])
            return GroupResult(request=request, trajectories=[], status=status, error=str(e))
        except BaseException:
            await _cancel(jobs)
            raise
        return GroupResult(request=request, trajectories=list(trajectories))

    async def rollout_batch(self, requests: Iterable[RolloutRequest] | AsyncIterable[RolloutRequest],
                            num_groups: int, on_group: Callable[[GroupResult], None] | None = None,
                            max_groups_in_flight: int | None = None) -> BatchResult:
        """Collect ``num_groups`` scored groups, drawing at most ``cfg.groups_to_draw(num_groups)`` requests.

        Groups run concurrently but are *decided* in submission order: group i joins the batch (with
        ``cfg.dynamic_sampling``, only if its rewards differ) once every group drawn before it is decided,
        so the batch does not depend on which groups finish first. Requests are drawn just ahead of need:
        enough running groups to fill the rest of the batch at the keep rate seen so far, at most
        ``max_groups_in_flight`` running. When the batch is full the groups behind it are cancelled and
        returned as ``unused`` (their tasks and BDR entries belong back where they came from). ``on_group``
        sees every decided scored group in order, kept or not (e.g. to push all-failed groups to BDR).

        Stats: the sampler's (``groups_drawn``: scored groups decided, ``groups_kept``,
        ``groups_dropped_zero_std``, ``stop_reason``, ``keep_rate``), ``groups_started``, ``groups_unused``,
        ``groups_cancelled`` (unused and still running), ``groups_unscored`` (by status), ``tokens_generated``
        (every finished generate call of every started group), ``tokens_in_batch`` and
        ``discarded_token_frac`` (the share of generated tokens that will not be trained on).
        """
        cap = self.cfg.groups_to_draw(num_groups)
        running_cap = max_groups_in_flight or max(1, -(-self.cfg.max_concurrency // self.cfg.group_size) * 2)
        variance = self.cfg.dynamic_sampling
        sampler = DynamicSampler(num_groups, require_variance=variance)
        source = _aiter(requests)
        drawn: list[tuple[RolloutRequest, asyncio.Future]] = []
        unscored: list[GroupResult] = []
        decided = 0
        exhausted = False

        def keeps(group: GroupResult) -> bool:
            return group.ok and (not variance or has_reward_variance(group.rewards))

        def expected_batch() -> float:
            """The batch size once every drawn group is decided: finished groups as they are, running ones at
            the keep rate seen so far (a prior of 1 before anything has finished)."""
            finished = [f.result() for _, f in drawn if _finished(f)]
            rate = (sum(map(keeps, finished)) + 1) / (len(finished) + 1)
            ahead = [f for _, f in drawn[decided:]]
            return (len(sampler.batch) + sum(keeps(f.result()) for f in ahead if _finished(f))
                    + rate * sum(not f.done() for f in ahead))

        try:
            while True:
                while not exhausted and len(drawn) < cap and expected_batch() < num_groups and \
                        sum(1 for _, f in drawn[decided:] if not f.done()) < running_cap:
                    try:
                        req = await source.__anext__()
                    except StopAsyncIteration:
                        exhausted = True
                        break
                    drawn.append((req, asyncio.ensure_future(self.run_group(req))))
                if decided == len(drawn):
                    break
                head = drawn[decided][1]
                if not head.done():
                    await asyncio.wait([f for _, f in drawn[decided:] if not f.done()],
                                       return_when=asyncio.FIRST_COMPLETED)
                    continue
                group = head.result()
                decided += 1
                if not group.ok:
                    unscored.append(group)
                    continue
                if on_group is not None:
                    on_group(group)
                if sampler.offer(group):
                    break
        finally:
            await _cancel([f for _, f in drawn[decided:]])
        batch, ds = sampler.result()
        unused = [r for r, _ in drawn[decided:]]
        generated = sum(r.generated_tokens for r, _ in drawn)
        trained = sum(g.request.generated_tokens for g in batch)
        stats = ds.to_dict()
        stats.update(
            groups_started=len(drawn), groups_unused=len(unused),
            groups_cancelled=sum(1 for _, f in drawn[decided:] if f.cancelled()),
            groups_unscored=_count(g.status for g in unscored),
            tokens_generated=generated, tokens_in_batch=trained,
            discarded_token_frac=(generated - trained) / generated if generated else 0.0)
        return BatchResult(groups=batch, unused=unused, unscored=unscored, stats=stats)


def _finished(f: asyncio.Future) -> bool:
    return f.done() and not f.cancelled() and f.exception() is None


async def _cancel(futures: Sequence[asyncio.Future]) -> None:
    for f in futures:
        f.cancel()
    if futures:
        await asyncio.gather(*futures, return_exceptions=True)


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _aiter(xs):
    if hasattr(xs, "__anext__"):
        return xs
    if hasattr(xs, "__aiter__"):
        return xs.__aiter__()

    async def gen():
        for x in xs:
            yield x

    return gen()
