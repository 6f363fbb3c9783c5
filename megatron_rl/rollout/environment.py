"""The task source of an RL run as one small interface: tasks, prompt, verify (+ score and feedback).

The agent loop and the rollout manager talk only to an `Environment`, so they hold no task-specific
branches. Two implementations: `KernelEnvironment` below (KernelBench-format tasks, the verifier farm,
MusaCoder eq. 2 scored with ``verifier.reward``) and `megatron_rl.toy.ToyEnvironment` (a character-level
task a tiny random model learns on a CPU). ``data.environment`` names one (``kernel``, ``toy``) or gives an
import path (``pkg.module:Class``) to a class with the same three class-level hooks:
``from_config(cfg, use_gpu)``, ``config_problems(cfg)`` (checked before anything starts) and
``own_tokenizer()`` (a tokenizer of its own, or None to use the model's).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Awaitable, Callable, Protocol

from verifier.types import Category, RewardParams, VerifyResult, reward_eq2

from ..algorithms.bdr import FailedPrompt
from ..algorithms.rewards import InfraVerdictError, TurnOutcome, load_callable
from .prompts import DEFAULT_SYSTEM_PROMPT, feedback_text, initial_messages, repair_messages

VerifyFn = Callable[[Any, str], Awaitable[VerifyResult]]
Messages = list[dict[str, str]]

BUILTIN = {"kernel": "megatron_rl.rollout.environment:KernelEnvironment", "toy": "megatron_rl.toy:ToyEnvironment"}


class Environment(Protocol):
    def tasks(self) -> list: ...

    def prompt(self, task) -> Messages:
        """The first turn's chat messages for ``task``."""

    async def verify(self, task, response: str) -> VerifyResult: ...

    def score(self, outcome: TurnOutcome) -> float:
        """s_k of one turn (raises `InfraVerdictError` on a verdict that must be retried, not scored)."""

    def feedback(self, verdict: VerifyResult) -> str:
        """The user message after a failed turn."""

    def repair_prompt(self, task, entry: FailedPrompt) -> Messages | None:
        """A BDR repair prompt (task + failed attempt + its error), or None when the task has none."""

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def environment_class(name: str) -> type:
    """``kernel`` | ``toy`` | ``pkg.module:Class`` -> the class (raises naming what is wrong)."""
    cls = load_callable(BUILTIN.get(name, name))
    missing = [h for h in ("from_config", "config_problems", "own_tokenizer") if not hasattr(cls, h)]
    if missing:
        raise TypeError(f"{name!r} is not an environment class: it lacks {missing}")
    return cls


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
# kernel tasks


class KernelEnvironment:
    """KernelBench-format tasks judged by the verifier; eq. 2 scores with the verifier's own reward
    parameters, so the logged verdict reward and the trained score cannot disagree."""

    def __init__(self, tasks: list, backend: str, verify: VerifyFn, reward: RewardParams = RewardParams(),
                 system_prompt: str | None = DEFAULT_SYSTEM_PROMPT, farm=None):
        self._tasks = list(tasks)
        self.backend = backend
        self.verify = verify
        self.reward = reward
        self.system_prompt = system_prompt
        self.farm = farm

    @classmethod
    def from_config(cls, cfg, *, use_gpu: bool = False) -> "KernelEnvironment":
        from verifier.farm import FarmConfig, VerifierFarm

        tasks = load_kernel_tasks(cfg.data)
        layout = FarmConfig(**cfg.farm.farm_config_kwargs())
        if cfg.farm.backend == "ray":  # compile and device workers as Ray actors (e.g. on dedicated verifier nodes)
            from verifier.ray_farm import RayVerifierFarm

            farm = RayVerifierFarm(cfg.verifier, layout)
        else:
            farm = VerifierFarm(cfg.verifier, layout)
        return cls(tasks, cfg.verifier.backend, farm_verify_fn(farm), cfg.verifier.reward, cfg.agent.system_prompt,
                   farm=farm)

    @staticmethod
    def config_problems(cfg) -> list[str]:
        """The task set loads (a tenth of a second) and holds tasks of the requested levels."""
        from megatron_rl.config import abs_path  # config imports this module (through the agent's config)

        tasks = abs_path(cfg.data.tasks)
        if not tasks.exists():
            return [f"data.tasks: {tasks} does not exist"]
        try:
            found = load_kernel_tasks(cfg.data, profile=False)
        except ValueError as e:
            return [str(e)]
        except Exception as e:  # noqa: BLE001 - TaskError, OSError, SyntaxError in a task file
            return [f"data.tasks: {tasks}: {e}"]
        return [] if found else [f"data.tasks: {tasks} holds no tasks"]

    @staticmethod
    def own_tokenizer() -> None:
        return None

    def tasks(self) -> list:
        return self._tasks

    def prompt(self, task) -> Messages:
        return initial_messages(task, self.backend, self.system_prompt)

    def score(self, outcome: TurnOutcome) -> float:
        v = outcome.verdict
        if v.category == Category.INFRA:
            raise InfraVerdictError(v.task_id, v.feedback[:200])
        return reward_eq2(v.category, v.q, v.speedup, self.reward)

    def feedback(self, verdict: VerifyResult) -> str:
        return feedback_text(verdict.category.value, verdict.q, verdict.feedback)

    def repair_prompt(self, task, entry: FailedPrompt) -> Messages:
        return repair_messages(task, self.backend, entry.failed_code, entry.category, entry.error,
                               self.system_prompt)

    def stats(self) -> dict[str, Any]:
        return self.farm.stats() if self.farm is not None else {}

    def close(self) -> None:
        if self.farm is not None:
            self.farm.close(drain=False)


def load_kernel_tasks(data, profile: bool = True) -> list:
    """The tasks of ``data.tasks`` at ``data.levels``, with ``data.size_profile`` applied (prompts and the
    verifier then see the same shapes). Raises ValueError naming the key when none is left."""
    from verifier.tasks import load_task_set

    from megatron_rl.config import abs_path  # config imports this module (through the agent's config)

    path = abs_path(data.tasks)
    tasks = load_task_set(str(path))
    if data.levels:
        have = sorted({t.level for t in tasks if t.level is not None})
        tasks = [t for t in tasks if t.level in set(data.levels)]
        if not tasks:
            raise ValueError(f"data.levels={list(data.levels)}: {path} has no task of those levels (it has levels "
                             f"{have})")
    if profile and data.size_profile:
        from verifier.size_profiles import apply_size_profile

        tasks = [apply_size_profile(t, data.size_profile) for t in tasks]
    return tasks
