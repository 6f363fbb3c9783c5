"""The rollout side: engines, the environment (tasks, verifier), the agent loop, the data stream and BDR.

`RolloutManager` owns every long-lived rollout resource. It launches the engines (the embedded HF
engine as server processes, or real SGLang servers as Ray actors), runs the multi-turn agent loop
against them with the environment's prompts and verdicts, replays all-failed prompts through
Buffered Dynamic Retry, and turns each step's batch into training samples (GRPO advantages on the
rollout side). It hands back a `RolloutResult`: a reference to those samples plus small metrics, so
per-token data goes from here straight to the train ranks, never through the driver. It writes the
step's trajectories to ``samples/`` itself for the same reason. It runs as a Ray actor in the job,
or in-process without Ray. Its data position and BDR buffer are part of every checkpoint.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import random
import time
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RolloutResult:
    """One step's rollout as the driver sees it: the samples stay by reference."""

    samples: Any                 # ObjectRef of list[TrainSample] with Ray, the list itself without; None: none
    metrics: dict[str, float]    # reward, pass rate, dynamic sampling, tokens, BDR, ... (scalars only)

    @property
    def empty(self) -> bool:
        return self.samples is None


class TaskStream:
    """Epoch-shuffled, resumable order over the task set; failed (unscored) tasks are re-queued first."""

    def __init__(self, tasks: list, seed: int):
        if not tasks:
            raise ValueError("the task set is empty")
        self.tasks = tasks
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        self.requeued: list[str] = []
        self._by_id = {t.task_id: t for t in tasks}
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self):
        if self.requeued:
            return self._by_id[self.requeued.pop(0)]
        if self.pos >= len(self._order):
            self.epoch += 1
            self.pos = 0
            self._order = self._shuffle(self.epoch)
        task = self.tasks[self._order[self.pos]]
        self.pos += 1
        return task

    def requeue(self, task_id: str) -> None:
        """Put a drawn task back (in front of the epoch order): every draw that was not used comes back."""
        if task_id in self._by_id:
            self.requeued.append(task_id)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "requeued": list(self.requeued), "seed": self.seed}

    def load_state_dict(self, st: dict) -> None:
        self.seed, self.epoch, self.pos = st["seed"], st["epoch"], st["pos"]
        self.requeued = [t for t in st.get("requeued", []) if t in self._by_id]
        self._order = self._shuffle(self.epoch)


class PromptSource:
    """Where a step's requests come from: BDR repair prompts at the replay probability, else the task
    stream. Whatever a step drew and did not use goes back: tasks to the front of the stream, BDR
    entries to the front of the buffer (nothing is lost to a cancelled group)."""

    def __init__(self, agent, stream: TaskStream, bdr):
        self.agent, self.stream, self.bdr = agent, stream, bdr
        self._by_id = {t.task_id: t for t in stream.tasks}

    def requests(self, step: int, max_turns: int) -> Iterator:
        from megatron_rl.rollout.agent import RolloutRequest

        for k in itertools.count():
            entry = self.bdr.maybe_replay()
            if entry is not None:
                task = self._by_id.get(entry.task_id)
                req = self.agent.repair_request(entry, task, group_id=f"s{step}/repair{k}/{entry.task_id}") \
                    if task is not None else None
                if req is not None:
                    req.max_turns = max_turns
                    yield req
                    continue
            task = self.stream.next()
            yield RolloutRequest(task=task, group_id=f"s{step}/g{k}/{task.task_id}", max_turns=max_turns)

    def give_back(self, requests) -> None:
        for req in requests:
            entry = req.meta.get("bdr_entry")
            if entry is not None:
                self.bdr.restore(entry)
            else:
                self.stream.requeue(req.task.task_id)


class RolloutManager:
    def __init__(self, cfg, model_dir: str, tokenizer_path: str, run_dir: str, *, use_gpu: bool,
                 engine_gpus: list[int] | None = None, ray_mode: bool = False):
        from megatron_rl.algorithms import BufferedDynamicRetry
        from megatron_rl.observability import RunLogger
        from megatron_rl.rollout.agent import AgentLoop
        from megatron_rl.rollout.engine import BackgroundLoop
        from megatron_rl.rollout.environment import environment_class
        from megatron_rl.tokenizer import load_tokenizer

        self.cfg = cfg
        self.model_dir = model_dir
        self.run_dir = Path(run_dir)
        self.use_gpu = use_gpu
        self.ray_mode = ray_mode
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.env = environment_class(cfg.data.environment).from_config(cfg, use_gpu=use_gpu)
        self.stream = TaskStream(self.env.tasks(), cfg.data.shuffle_seed)
        self.bdr = BufferedDynamicRetry(cfg.bdr, seed=cfg.seed)
        self.loop = BackgroundLoop("rollout")
        self._servers: dict[str, Any] = {}
        self.engines = self._launch_engines(engine_gpus or [])
        self.router = None
        generate = self.engines.generate
        if cfg.rollout.use_router and cfg.rollout.engine == "sglang":
            generate = self._start_router()
        self.agent = AgentLoop(self.tokenizer, generate, self.env, cfg.agent)
        self.source = PromptSource(self.agent, self.stream, self.bdr)
        # only its per-step trajectory dump is used here: the driver logs the metrics
        self.samples_log = RunLogger(self.run_dir, tensorboard=False, dump_samples=cfg.train.dump_samples)

    # ---- setup
    def _start_router(self):
        """SGLang router in front of the engines: generation goes through it (cache-aware routing);
        control calls (pause, flush, weight updates) still go to every engine directly."""
        from megatron_rl.rollout.client import EngineClient
        from megatron_rl.rollout.engine import EngineManager, HttpEngine
        from megatron_rl.rollout.router import RouterConfig, RouterProcess, register_worker

        self.router = RouterProcess(RouterConfig(log_dir=str(self.run_dir / "engine_logs"),
                                                 router_args=dict(self.cfg.rollout.router_args)))
        url = self.router.start()

        async def register():
            async with EngineClient(url) as client:
                for _, worker in self.engine_endpoints():
                    await register_worker(client, worker)

        self.loop.run(register())
        return EngineManager([HttpEngine(url, name="router")]).generate

    def _launch_engines(self, gpus: list[int]):
        from megatron_rl.rollout.engine import EngineManager, HttpEngine
        from megatron_rl.rollout.sglang_engine import (ProcessLauncher, SGLangServerConfig, ServerProcess,
                                                       launch_sglang_engines)

        r = self.cfg.rollout
        log_dir = str(self.run_dir / "engine_logs")
        if r.engine == "sglang":
            cfgs = [SGLangServerConfig(model_path=self.model_dir, tp_size=r.gpus_per_engine, log_dir=log_dir,
                                       enable_memory_saver=self.cfg.cluster.placement == "colocated",
                                       startup_timeout_s=r.startup_timeout_s,
                                       server_args={**self._numerics_args(), **dict(r.sglang)})
                    for _ in range(r.num_engines)]
            engines = launch_sglang_engines(cfgs)
            return EngineManager(engines)
        engines = []
        for i in range(r.num_engines):
            gpu = gpus[i] if self.use_gpu and i < len(gpus) else None
            scfg = SGLangServerConfig(
                model_path=self.model_dir, launch_module="megatron_rl.rollout.embedded_server",
                log_dir=log_dir, startup_timeout_s=r.startup_timeout_s,
                # the start-up request builds kernels and the first decode graph before the first rollout
                skip_server_warmup=False,
                cuda_visible_devices=str(gpu) if gpu is not None else ("" if not self.use_gpu else None),
                server_args={"dtype": r.engine_dtype, "device": "cuda" if self.use_gpu else "cpu",
                             "random_seed": self.cfg.seed, **self._numerics_args(), **dict(r.sglang)},
                env={"OMP_NUM_THREADS": "1"} if not self.use_gpu else {})
            server = ServerProcess(scfg)
            url = server.start()
            name = f"engine-{i}"
            self._servers[name] = server
            engines.append(HttpEngine(url, name=name, launcher=ProcessLauncher(server)))
        return EngineManager(engines)

    def _numerics_args(self) -> dict[str, Any]:
        """Server args that make the engines compute logits as the actor does (its config owns the choice)."""
        return {"enable_fp32_lm_head": True} if self.cfg.actor.fp32_lm_head else {}

    # ---- queries used by the trainer
    def engine_endpoints(self) -> list[tuple[str, str]]:
        return [(e.name, e.client.url) for e in self.engines.engines]

    def relaunch_engine(self, name: str) -> str:
        self.loop.run(self.engines.relaunch(name))
        return dict(self.engine_endpoints())[name]

    def ensure_engines(self) -> list[str]:
        return self.loop.run(self.engines.ensure_healthy())

    def release_memory(self, tags: list[str] | None = None, wait_s: float = 60.0) -> None:
        """Release engine memory; requests still draining (cancelled extras) are aborted first,
        since engines refuse to release while busy (as SGLang does)."""
        from megatron_rl.rollout.engine import EngineGroupError

        async def release():
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    return await self.engines.release_memory(tags)
                except EngineGroupError:
                    if time.monotonic() > deadline:
                        raise
                    await self.engines.fan_out("abort_request", lambda e: e.client.abort_request(abort_all=True))
                    await asyncio.sleep(0.2)

        self.loop.run(release())

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.loop.run(self.engines.resume_memory(tags))

    # ---- one step of rollouts
    def generate(self, step: int) -> RolloutResult:
        """Draw, generate and verify one step's groups, then return its training samples by reference."""
        from megatron_rl.rl_batch import build_train_batch, rollout_metrics

        t0 = time.perf_counter()
        cfg = self.cfg
        max_turns = cfg.agent.max_turns_at(step)

        def on_group(group):
            if not any(t.passed for t in group.trajectories):
                self.agent.record_failed_group(self.bdr, group, step=step)

        self.ensure_engines()
        engine_before = self._engine_stats()
        out = self.loop.run(self.agent.rollout_batch(self.source.requests(step, max_turns), cfg.data.prompts_per_step,
                                                     on_group=on_group))
        # requests the batch did not use, and groups that could not be scored, go back where they came from
        self.source.give_back(out.unused + [g.request for g in out.unscored])
        metrics = {f"rollout/{k}": float(v) for k, v in out.stats.items() if _scalar(v)}
        metrics.update({"rollout/groups_unscored": float(sum(out.stats["groups_unscored"].values())),
                        "turns/max": float(max_turns), "bdr/size": float(len(self.bdr)),
                        "bdr/returned": float(self.bdr.counters["returned"])})
        metrics.update({f"env/{k}": float(v) for k, v in self.env.stats().items() if _scalar(v)})
        metrics.update(_engine_metrics(engine_before, self._engine_stats()))
        if not out.groups:
            log.warning("step %d: no scored groups (%s)", step, out.stats["groups_unscored"])
            return RolloutResult(samples=None, metrics=metrics)
        samples, trajectories = build_train_batch(out.groups, cfg.advantage, cfg.agent.group_size)
        self.samples_log.dump_samples(step, trajectories)
        metrics.update(rollout_metrics(trajectories))
        metrics.update({"rollout/samples": float(len(samples)), "rollout/tokens": float(sum(map(len, samples))),
                        "rollout/seconds": time.perf_counter() - t0})
        return RolloutResult(samples=self._share(samples), metrics=metrics)

    def _engine_stats(self) -> list[dict]:
        """Each embedded engine's cumulative `EngineStats` (SGLang reports none: an empty list)."""
        if self.cfg.rollout.engine != "embedded":
            return []

        async def query():
            infos = await asyncio.gather(*(e.client.get_server_info() for e in self.engines.engines),
                                         return_exceptions=True)
            return [i.get("engine_stats", {}) if isinstance(i, dict) else {} for i in infos]

        return self.loop.run(query())

    def _share(self, samples: list):
        """With Ray, the samples go into the object store owned by this actor; the train ranks fetch them."""
        if not self.ray_mode:
            return samples
        import ray

        return ray.put(samples)

    # ---- checkpointed state
    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict(), "bdr": self.bdr.state_dict()}

    def load_state_dict(self, st: dict) -> None:
        self.stream.load_state_dict(st["stream"])
        self.bdr.load_state_dict(st["bdr"])

    def shutdown(self) -> None:
        try:
            self.loop.run(self.engines.close(), timeout=30)
        except Exception:
            pass
        if self.router is not None:
            self.router.stop()
        for server in self._servers.values():
            server.stop()
        self.env.close()
        self.samples_log.close()
        self.loop.close()


def _engine_metrics(before: list[dict], after: list[dict]) -> dict[str, float]:
    """``engine/*`` metrics of one rollout from the engines' cumulative stats: seconds in prefill, in decode
    steps and in CUDA graph captures (summed over engines), decode steps, the mean running batch of a step, and the
    rows the overlapped schedule computed for requests that had already stopped (`decode_rows_discarded`)."""
    if len(before) != len(after):
        return {}
    # an engine that did not answer either time (or was relaunched: its counters restarted) is left out
    pairs = [(b, a) for b, a in zip(before, after) if b and a and all(a.get(k, 0) >= v for k, v in b.items())]
    if not pairs:
        return {}
    diff = {k: sum(a.get(k, 0) - b.get(k, 0) for b, a in pairs) for k in pairs[0][1]}
    out = {f"engine/{k}": float(diff[k])
           for k in ("prefill_s", "prefill_tokens", "decode_s", "decode_steps", "decode_rows_discarded",
                     "graph_capture_s") if k in diff}
    if diff.get("decode_steps"):
        out["engine/mean_batch"] = diff["decode_rows"] / diff["decode_steps"]
        out["engine/decode_ms_per_step"] = 1e3 * diff["decode_s"] / diff["decode_steps"]
    return out


def _scalar(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
