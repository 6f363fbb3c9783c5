"""The multi-turn agent loop: generate -> verify -> (feedback -> generate again), up to K turns.

One trajectory: the task prompt goes through the tokenizer's chat template; the engine generates a
response (token ids + rollout logprobs); the verifier judges the decoded text; on a failure the
verifier's feedback is appended as a new user turn and the model answers again on the full context.
It stops at the first passing turn or after ``max_turns`` (MusaCoder: 3). The trajectory reward is
PrimeEcho over the per-turn scores.

Token accounting is exact: the context is a list of token ids that only grows. Generated tokens are
appended as the engine returned them (never re-tokenized from text); each feedback turn is newly
tokenized text (the chat template's rendering of "end of assistant turn, user feedback, start of
assistant turn") appended between responses. The trained tokens are therefore exactly the tokens
the engine sampled, aligned with their rollout logprobs.

Generation and verification are injected async callables, so this module knows neither the engine
client nor the farm's internals:
    ``generate(input_ids, SamplingParams) -> GenerateResult``
    ``verify(task, response_text) -> VerifyResult``
:func:`farm_verify_fn` adapts a ``verifier.farm.VerifierFarm``; :func:`threaded_verify_fn` any
blocking ``verify(task, response)``. Many trajectories run concurrently (bounded by a semaphore),
so verifier calls overlap other trajectories' generation.

``infra`` verdicts are retried; if they persist the trajectory is re-run, and a group that still
cannot be verified is returned with ``status="infra"`` and no rewards: it is never scored.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import time
import zlib
from typing import Any, AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Sequence

from verifier.types import Category, RewardParams, VerifyResult

from ..algorithms.advantages import AdvantageConfig, DynamicSampler, RewardGroup, group_advantages
from ..algorithms.rewards import (InfraVerdictError, PrimeEchoConfig, TurnOutcome, checked_turn_score,
                                  primeecho_reward, resolve_turn_reward)
from .prompts import DEFAULT_SYSTEM_PROMPT, candidate_code, feedback_text, initial_messages, repair_messages
from .protocol import GenerateResult, SamplingParams

GenerateFn = Callable[[list[int], SamplingParams], Awaitable[GenerateResult]]
VerifyFn = Callable[[Any, str], Awaitable[VerifyResult]]


class GenerationAborted(RuntimeError):
    """The engine aborted the request (e.g. paused for a weight update): re-run the trajectory."""


class PromptTooLong(ValueError):
    """The first-turn prompt exceeds ``max_prompt_tokens``."""


# --------------------------------------------------------------------------------------------------
# verifier adapters


def farm_verify_fn(farm) -> VerifyFn:
    """Adapt ``VerifierFarm.submit(task, response) -> Future[VerifyResult]`` to an async verify fn.

    ``submit`` may block for backpressure, so it is called in a worker thread; the returned
    ``concurrent.futures.Future`` is awaited with ``asyncio.wrap_future``.
    """

    async def verify(task, response: str) -> VerifyResult:
        future = await asyncio.to_thread(farm.submit, task, response)
        return await asyncio.wrap_future(future)

    return verify


def threaded_verify_fn(fn: Callable[[Any, str], VerifyResult], max_workers: int = 4) -> VerifyFn:
    """Adapt a blocking ``fn(task, response) -> VerifyResult`` (e.g. ``verifier.evaluate.verify`` with a
    bound config) by running it on a private thread pool."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="verify")

    async def verify(task, response: str) -> VerifyResult:
        return await asyncio.wrap_future(pool.submit(fn, task, response))

    verify.executor = pool  # type: ignore[attr-defined]  # so callers can shut it down
    return verify


# --------------------------------------------------------------------------------------------------
# records


@dataclasses.dataclass
class TurnRecord:
    turn: int                        # 1-based
    prompt_ids: list[int]            # tokens appended before this response (turn 1: the whole prompt)
    response_ids: list[int]          # exactly what the engine generated
    rollout_logprobs: list[float]    # one per response token
    finish_reason: str
    weight_version: int | None
    response_text: str
    verdict: VerifyResult
    score: float                     # s_k
    trained: bool = False            # whether the policy-gradient loss covers this response
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

    @property
    def passed(self) -> bool:
        return any(t.verdict.passed for t in self.turns)

    @property
    def first_pass_turn(self) -> int | None:
        return next((t.turn for t in self.turns if t.verdict.passed), None)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def tokens(self) -> list[int]:
        out: list[int] = []
        for t in self.turns:
            out += t.prompt_ids
            out += t.response_ids
        return out

    def response_spans(self) -> list[tuple[int, int]]:
        """[start, end) token offsets of each turn's response in :meth:`tokens`."""
        spans, pos = [], 0
        for t in self.turns:
            pos += len(t.prompt_ids)
            spans.append((pos, pos + len(t.response_ids)))
            pos += len(t.response_ids)
        return spans

    def to_train_sample(self, advantage: float | None = None, train_on_all_turns: bool | None = None,
                        trim_untrained_tail: bool = False, weight: float = 1.0):
        """The whole conversation as a ``TrainSample``.

        ``loss_mask`` covers the responses marked ``trained`` by the loop: the first one by default
        (PrimeEcho: later turns only feed the reward), every one with ``train_on_all_turns``; the
        argument overrides the loop's choice. Fields: ``rollout_logprobs`` aligned to tokens
        (0 off the responses) and, when given, ``advantages`` (the sequence advantage on trained
        tokens, 0 elsewhere). ``trim_untrained_tail`` drops tokens after the last trained one: they
        cannot change a causal model's logprobs of earlier tokens, so this only saves compute.
        """
        from megatron_rl.types import TrainSample

        if not self.turns:
            raise ValueError(f"trajectory {self.group_id}/{self.sample_index} has no turns")
        if advantage is not None and not math.isfinite(advantage):
            raise ValueError(f"trajectory {self.group_id}/{self.sample_index}: advantage is {advantage}")
        tokens = self.tokens()
        n = len(tokens)
        loss_mask = [0] * n
        rollout_lp = [0.0] * n
        spans = self.response_spans()
        for (start, end), turn in zip(spans, self.turns):
            rollout_lp[start:end] = turn.rollout_logprobs
            trained = turn.trained if train_on_all_turns is None else (turn.turn == 1 or train_on_all_turns)
            if trained:
                loss_mask[start:end] = [1] * (end - start)
        if trim_untrained_tail:
            last = max((i for i, m in enumerate(loss_mask) if m), default=len(self.turns[0].prompt_ids))
            tokens, loss_mask, rollout_lp = tokens[: last + 1], loss_mask[: last + 1], rollout_lp[: last + 1]
        fields = {"rollout_logprobs": rollout_lp}
        if advantage is not None:
            fields["advantages"] = [float(advantage) if m else 0.0 for m in loss_mask]
        return TrainSample(tokens=tokens, loss_mask=loss_mask, fields=fields, weight=weight)


@dataclasses.dataclass
class RolloutRequest:
    """One prompt to sample a group for. ``messages=None`` builds the task prompt."""

    task: Any
    group_id: str
    messages: list[dict[str, str]] | None = None
    kind: str = "task"               # "task" | "repair"
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


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
        """GRPO advantages of this group (default config without a fixed group size)."""
        cfg = cfg if cfg is not None else AdvantageConfig(group_size=None)
        return group_advantages(self.rewards, cfg, self.request.group_id)


# --------------------------------------------------------------------------------------------------
# conversation tokens


class ConversationCodec:
    """Chat-template rendering and the exact token bookkeeping of a growing conversation."""

    _SENTINEL = "\ue000agent-loop-sentinel\ue000"

    def __init__(self, tokenizer, enable_thinking: bool | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        self.stop_token_ids = self._default_stop_ids()

    def _default_stop_ids(self) -> list[int]:
        ids = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        vocab = self.tokenizer.get_vocab()
        for tok in ("<|im_end|>", "<|endoftext|>"):
            if tok in vocab and vocab[tok] not in ids:
                ids.append(int(vocab[tok]))
        return ids

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

    def feedback_ids(self, user_text: str, previous_response_ids: Sequence[int]) -> list[int]:
        """Tokens that close the previous assistant turn, add ``user_text`` as a user turn and open
        the next assistant turn, as the chat template renders them.

        The template's own end-of-turn marker is dropped when the engine already generated it
        (the response ended on that stop token), so it is never duplicated; a truncated response
        gets the marker from the template.
        """
        msgs = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": self._SENTINEL},
                {"role": "user", "content": user_text}]
        text = self.render(msgs, add_generation_prompt=True)
        at = text.rfind(self._SENTINEL)
        if at < 0:
            raise ValueError("the chat template dropped the assistant message content; cannot derive the "
                             "feedback-turn tokens")
        delta = text[at + len(self._SENTINEL):]
        if previous_response_ids and int(previous_response_ids[-1]) in self.stop_token_ids:
            end_text = self.tokenizer.decode([int(previous_response_ids[-1])], skip_special_tokens=False)
            if end_text and delta.startswith(end_text):
                delta = delta[len(end_text):]
        return self.encode(delta)


# --------------------------------------------------------------------------------------------------
# the loop


@dataclasses.dataclass
class AgentConfig:
    backend: str = "cpu"                           # cuda | musa | cpu: what the prompt asks for
    max_turns: int = 3
    train_on_all_turns: bool = False               # default: the loss covers the first response only
    group_size: int = 8
    max_concurrency: int = 64                      # trajectories in flight
    sampling: SamplingParams = dataclasses.field(
        default_factory=lambda: SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=32768))
    max_prompt_tokens: int | None = 8192
    max_context_tokens: int | None = None          # bound on prompt + all turns
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    enable_thinking: bool | None = None            # forwarded to the chat template when set
    infra_retries: int = 3                         # re-verifications of one response on infra
    trajectory_retries: int = 2                    # re-runs of a trajectory (abort / persistent infra)
    seed: int | None = None                        # per-request sampling seeds derive from it
    reward_fn: str | None = None                   # None/"eq2" or "pkg.module:function"
    reward_params: RewardParams = dataclasses.field(default_factory=RewardParams)
    primeecho: PrimeEchoConfig = dataclasses.field(default_factory=PrimeEchoConfig)

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.group_size < 1 or self.max_concurrency < 1:
            raise ValueError("group_size and max_concurrency must be >= 1")
        if self.infra_retries < 0 or self.trajectory_retries < 0:
            raise ValueError("retry counts must be >= 0")


class AgentLoop:
    def __init__(self, tokenizer, generate: GenerateFn, verify: VerifyFn, cfg: AgentConfig = AgentConfig()):
        self.cfg = cfg
        self.codec = ConversationCodec(tokenizer, cfg.enable_thinking)
        self.generate = generate
        self.verify = verify
        self.reward_fn = resolve_turn_reward(cfg.reward_fn, cfg.reward_params)
        self._semaphores: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        self.stats = {"trajectories": 0, "trajectory_retries": 0, "infra_reverifications": 0, "groups_failed": 0}

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

    def task_request(self, task, group_id: str | None = None) -> RolloutRequest:
        return RolloutRequest(task=task, group_id=group_id or getattr(task, "task_id", str(task)))

    def repair_request(self, entry, task, group_id: str | None = None) -> RolloutRequest:
        """A BDR replay (``algorithms.bdr.FailedPrompt``) as a repair prompt for ``task``."""
        if getattr(task, "task_id", None) != entry.task_id:
            raise ValueError(f"BDR entry is for task {entry.task_id!r}, got task {getattr(task, 'task_id', task)!r}")
        msgs = repair_messages(task, self.cfg.backend, entry.failed_code, entry.category, entry.error,
                               self.cfg.system_prompt)
        return RolloutRequest(task=task, group_id=group_id or f"repair/{entry.task_id}/{entry.attempts}",
                              messages=msgs, kind="repair", meta={"bdr_attempts": entry.attempts})

    def record_failed_group(self, bdr, group: GroupResult, step: int | None = None) -> bool:
        """Push a group in which no trajectory passed to a ``BufferedDynamicRetry``.

        Each trajectory contributes its last (most refined) attempt; BDR keeps the best-scoring one.
        """
        if not group.ok:
            return False
        last = [t.turns[-1] for t in group.trajectories]
        task_id = getattr(group.request.task, "task_id", str(group.request.task))
        return bdr.add_group(task_id, [t.verdict for t in last], [t.score for t in last],
                             [candidate_code(t.response_text) for t in last],
                             attempts=int(group.request.meta.get("bdr_attempts", 0)), step=step)

    # ---- one trajectory

    def _sampling_for(self, group_id: str, sample_index: int, turn: int, context_len: int) -> SamplingParams | None:
        base = self.cfg.sampling
        max_new = base.max_new_tokens
        if self.cfg.max_context_tokens is not None:
            max_new = min(max_new, self.cfg.max_context_tokens - context_len)
        if max_new <= 0:
            return None
        seed = base.seed
        if self.cfg.seed is not None:
            seed = zlib.crc32(f"{self.cfg.seed}/{group_id}/{sample_index}/{turn}".encode()) & 0x7FFFFFFF
        return dataclasses.replace(base, max_new_tokens=max_new, seed=seed,
                                   stop_token_ids=list(base.stop_token_ids) or list(self.codec.stop_token_ids))

    def _check_generation(self, where: str, res: GenerateResult) -> None:
        if res.finish_reason == "abort":
            raise GenerationAborted(f"{where}: generation aborted by the engine")
        if len(res.token_ids) != len(res.logprobs):
            raise ValueError(f"{where}: engine returned {len(res.token_ids)} tokens but {len(res.logprobs)} logprobs")
        for i, lp in enumerate(res.logprobs):
            if lp is None or not math.isfinite(float(lp)):
                raise ValueError(f"{where}: rollout logprob of generated token {i} is {lp}")

    async def _verify_turn(self, where: str, task, text: str) -> tuple[VerifyResult, int]:
        for attempt in range(1, self.cfg.infra_retries + 2):
            verdict = await self.verify(task, text)
            if verdict is None or not isinstance(verdict, VerifyResult):
                raise TypeError(f"{where}: verify returned {type(verdict).__name__}, expected VerifyResult")
            if verdict.category != Category.INFRA:
                return verdict, attempt
            self.stats["infra_reverifications"] += 1
        raise InfraVerdictError(getattr(task, "task_id", str(task)),
                                f"{where}: still infra after {self.cfg.infra_retries + 1} attempts: "
                                f"{verdict.feedback[:200]}")

    def prompt_ids(self, request: RolloutRequest) -> list[int]:
        """First-turn prompt tokens of a request (task prompt or the request's own messages)."""
        task_id = getattr(request.task, "task_id", str(request.task))
        messages = request.messages or initial_messages(request.task, self.cfg.backend, self.cfg.system_prompt)
        prompt = self.codec.prompt_ids(messages)
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
        prompt = list(prompt) if prompt is not None else self.prompt_ids(request)
        async with self._semaphore():
            context: list[int] = list(prompt)
            new_ids = list(prompt)
            turns: list[TurnRecord] = []
            for turn in range(1, self.cfg.max_turns + 1):
                where = f"task {task_id!r} group {request.group_id!r} sample {sample_index} turn {turn}"
                params = self._sampling_for(request.group_id, sample_index, turn, len(context))
                if params is None:
                    break  # no room left in the context for another answer
                t0 = time.monotonic()
                gen = await self.generate(list(context), params)
                t1 = time.monotonic()
                self._check_generation(where, gen)
                text = self.codec.decode_response(gen.token_ids)
                verdict, attempts = await self._verify_turn(where, task, text)
                t2 = time.monotonic()
                score = checked_turn_score(self.reward_fn, TurnOutcome(task=task, turn=turn, response_text=text,
                                                                       verdict=verdict,
                                                                       response_ids=list(gen.token_ids)))
                turns.append(TurnRecord(
                    turn=turn, prompt_ids=new_ids, response_ids=list(gen.token_ids),
                    rollout_logprobs=[float(x) for x in gen.logprobs], finish_reason=gen.finish_reason,
                    weight_version=gen.weight_version, response_text=text, verdict=verdict, score=score,
                    trained=turn == 1 or self.cfg.train_on_all_turns, verify_attempts=attempts,
                    generate_seconds=t1 - t0, verify_seconds=t2 - t1))
                context += gen.token_ids
                if verdict.passed or turn == self.cfg.max_turns:
                    break
                new_ids = self.codec.feedback_ids(feedback_text(verdict.category.value, verdict.q, verdict.feedback),
                                                  gen.token_ids)
                context += new_ids
        if not turns:
            raise PromptTooLong(f"task {task_id!r}: no room for a response within max_context_tokens="
                                f"{self.cfg.max_context_tokens}")
        reward = primeecho_reward([t.score for t in turns], [t.verdict.passed for t in turns], self.cfg.primeecho)
        self.stats["trajectories"] += 1
        return Trajectory(task_id=task_id, group_id=request.group_id, sample_index=sample_index, turns=turns,
                          reward=reward, kind=request.kind)

    # ---- groups

    async def _trajectory_with_retries(self, request: RolloutRequest, sample_index: int,
                                       prompt: list[int]) -> Trajectory:
        for attempt in range(self.cfg.trajectory_retries + 1):
            try:
                return await self.run_trajectory(request, sample_index, prompt)
            except (InfraVerdictError, GenerationAborted):
                if attempt == self.cfg.trajectory_retries:
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
            for j in jobs:
                j.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            self.stats["groups_failed"] += 1
            status = {InfraVerdictError: "infra", GenerationAborted: "aborted", PromptTooLong: "prompt_too_long"}[type(e)]
            return GroupResult(request=request, trajectories=[], status=status, error=str(e))
        except BaseException:
            for j in jobs:
                j.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            raise
        return GroupResult(request=request, trajectories=list(trajectories))

    async def stream_groups(self, requests: Iterable[RolloutRequest] | AsyncIterable[RolloutRequest],
                            max_groups_in_flight: int | None = None) -> AsyncIterator[GroupResult]:
        """Run groups concurrently and yield each as it completes (any status).

        At most ``max_groups_in_flight`` groups are started ahead of consumption (default: enough to
        keep ``max_concurrency`` trajectories busy). Closing the iterator cancels unfinished groups.
        """
        limit = max_groups_in_flight or max(1, -(-self.cfg.max_concurrency // self.cfg.group_size) * 2)
        source = _aiter(requests)
        pending: set[asyncio.Future] = set()
        exhausted = False
        try:
            while True:
                while not exhausted and len(pending) < limit:
                    try:
                        req = await source.__anext__()
                    except StopAsyncIteration:
                        exhausted = True
                        break
                    pending.add(asyncio.ensure_future(self.run_group(req)))
                if not pending:
                    return
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    yield fut.result()
        finally:
            for fut in pending:
                fut.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def rollout_batch(self, requests: Iterable[RolloutRequest] | AsyncIterable[RolloutRequest],
                            num_groups: int, dynamic_sampling: bool = True,
                            on_group: Callable[[GroupResult], None] | None = None,
                            max_groups_in_flight: int | None = None
                            ) -> tuple[list[GroupResult], dict[str, Any]]:
        """Collect ``num_groups`` scored groups; with ``dynamic_sampling`` only groups whose rewards
        differ count (oversample by passing more requests than ``num_groups``).

        ``on_group`` sees every scored group, kept or not (e.g. to push all-failed groups to BDR).
        Unscored groups (infra/aborted/too long) are skipped and counted.
        """
        skipped: dict[str, int] = {}
        unscored_ids: list[str] = []
        issued: dict[int, int] = {}  # id(request) -> issue order, to return the batch in request order

        async def numbered():
            source = _aiter(requests)
            while True:
                try:
                    req = await source.__anext__()
                except StopAsyncIteration:
                    return
                issued[id(req)] = len(issued)
                yield req

        sampler = DynamicSampler(num_groups, require_variance=dynamic_sampling)
        stream = self.stream_groups(numbered(), max_groups_in_flight)
        try:
            async for group in stream:
                if not group.ok:
                    skipped[group.status] = skipped.get(group.status, 0) + 1
                    unscored_ids.append(getattr(group.request.task, "task_id", str(group.request.task)))
                    continue
                if on_group is not None:
                    on_group(group)
                if sampler.offer(group):
                    break
        finally:
            await stream.aclose()
        batch, ds = sampler.result()
        # Completion order depends on timing; the training batch must not (reproducible runs).
        batch = sorted(batch, key=lambda g: issued.get(id(g.request), len(issued)))
        stats = ds.to_dict()
        stats["groups_unscored"] = skipped
        stats["unscored_task_ids"] = unscored_ids  # the caller may re-queue these tasks
        return batch, stats


def _aiter(xs):
    if hasattr(xs, "__anext__"):
        return xs
    if hasattr(xs, "__aiter__"):
        return xs.__aiter__()

    async def gen():
        for x in xs:
            yield x

    return gen()
