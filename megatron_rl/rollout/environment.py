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
import logging
from typing import Any, Awaitable, Callable, Protocol

from verifier.types import Category, RewardParams, VerifyResult, reward_eq2

from ..algorithms.bdr import FailedPrompt
from ..algorithms.rewards import InfraVerdictError, TurnOutcome, load_callable
from .prompts import DEFAULT_SYSTEM_PROMPT, feedback_text, initial_messages, repair_messages

VerifyFn = Callable[[Any, str], Awaitable[VerifyResult]]
Messages = list[dict[str, str]]

log = logging.getLogger(__name__)

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
        # host memory only: a Ray farm verifies on other nodes, and a GPU's size would be read by initialising CUDA in
        # this process (a context on the trainer's GPU 0); the farm's own gate still gives those task_too_large
        if cfg.farm.backend != "ray" and cfg.verifier.backend == "cpu":
            tasks = tasks_that_fit(tasks, cfg.verifier, cfg.data.size_profile)
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


def tasks_that_fit(tasks: list, vcfg, size_profile: str | None = None, *, shown: int = 5) -> list:
    """The tasks one verification of which fits this machine's whole memory for the verifier's backend
    (``verifier.evaluate.memory_problem`` with ``task_only``: the device's and host's whole memory and the child's
    ``memory_limit_bytes``; what is free right now does not count; `from_config` asks for the cpu backend only).
    Every draw of a task that does not fit gives an unscored group (its verdicts are ``infra``/``task_too_large``), so
    those are left out here, with one warning line naming how many, the first few and the remedy; a ValueError when none
    is left. Each task is sized on meta tensors once per process (``verifier.inputs.task_footprint``'s cache, which the
    verifier's own gate then reuses): seconds for KernelBench's long RNNs, so this runs where tasks are loaded for
    sampling, never in ``config_problems``. A task that does not load here is kept: the verifier names it
    (``task_load_failed``)."""
    from verifier.devices import get_backend
    from verifier.evaluate import memory_problem
    from verifier.inputs import task_footprint

    backend = get_backend(vcfg.backend)
    kept, too_large = [], {}
    for t in tasks:
        try:
            problem = memory_problem(task_footprint(t, vcfg.precision), vcfg, backend, 0, {}, task_only=True)
        except Exception:  # noqa: BLE001 - the task's own import or code: left to the verifier's verdict
            problem = None
        if problem:
            too_large[getattr(t, "task_id", str(t))] = problem
        else:
            kept.append(t)
    if not too_large:
        return kept
    remedy = ("data.size_profile=fit shrinks KernelBench's GPU sizes to fit (fit:<MiB> for a budget)"
              if not size_profile else f"a smaller data.size_profile than {size_profile!r} (e.g. fit:<MiB>)")
    first = next(iter(too_large.values()))
    names = ", ".join(list(too_large)[:shown]) + (", ..." if len(too_large) > shown else "")
    if not kept:
        raise ValueError(f"data.tasks: none of the {len(tasks)} tasks fits this machine's memory on the "
                         f"{vcfg.backend} backend at its sizes ({names}; first: {first}); {remedy}")
    log.warning("data.tasks: %d of %d tasks need more memory than this machine has on the %s backend at their sizes "
                "and are left out of sampling (%s); %s", len(too_large), len(tasks), vcfg.backend, names, remedy)
    return kept
