"""The rollout side: engines, the verifier farm, the agent loop, the data stream and BDR.

`RolloutManager` owns every long-lived rollout resource. It launches the engines (the embedded HF
engine as server processes, or real SGLang servers as Ray actors), runs the multi-turn agent loop
against them with rewards from the verifier farm, replays all-failed prompts through Buffered Dynamic
Retry, and hands back scored groups. It runs as a Ray actor in the job, or in-process without Ray.
Its data position and BDR buffer are part of every checkpoint.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import time
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RolloutOutput:
    groups: list            # scored GroupResults (status ok), the training batch
    stats: dict[str, Any]   # dynamic sampling, unscored groups, BDR, farm


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
        if task_id in self._by_id and task_id not in self.requeued:
            self.requeued.append(task_id)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "requeued": list(self.requeued), "seed": self.seed}

    def load_state_dict(self, st: dict) -> None:
        self.seed, self.epoch, self.pos = st["seed"], st["epoch"], st["pos"]
        self.requeued = [t for t in st.get("requeued", []) if t in self._by_id]
        self._order = self._shuffle(self.epoch)


class RolloutManager:
    def __init__(self, cfg, model_dir: str, tokenizer_path: str, run_dir: str, *, use_gpu: bool,
                 engine_gpus: list[int] | None = None, ray_mode: bool = False):
        from megatron_rl.algorithms import BufferedDynamicRetry
        from megatron_rl.rollout.agent import AgentLoop
        from megatron_rl.rollout.engine import BackgroundLoop
        from megatron_rl.tokenizer import load_tokenizer

        self.cfg = cfg
        self.model_dir = model_dir
        self.run_dir = Path(run_dir)
        self.use_gpu = use_gpu
        self.ray_mode = ray_mode
        self.toy = cfg.data.tasks == "toy"
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.tasks = self._load_tasks()
        self.stream = TaskStream(self.tasks, cfg.data.shuffle_seed)
        self.bdr = BufferedDynamicRetry(cfg.bdr, seed=cfg.seed)
        self.loop = BackgroundLoop("rollout")
        self._servers: dict[str, Any] = {}
        self.engines = self._launch_engines(engine_gpus or [])
        self.router = None
        generate = self.engines.generate
        if cfg.rollout.use_router and cfg.rollout.engine == "sglang":
            generate = self._start_router()
        self.farm = None
        verify = self._make_verify()
        self.agent = AgentLoop(self.tokenizer, generate, verify, cfg.agent)

    # ---- setup
    def _load_tasks(self) -> list:
        if self.toy:
            from megatron_rl.toy import toy_tasks

            return toy_tasks()
        from verifier.tasks import load_task_set

        from megatron_rl.config import REPO_ROOT

        path = Path(self.cfg.data.tasks)
        tasks = load_task_set(str(path if path.is_absolute() else REPO_ROOT / path))
        if self.cfg.data.levels:
            tasks = [t for t in tasks if t.level in set(self.cfg.data.levels)]
        if not tasks:
            raise ValueError(f"no tasks in {self.cfg.data.tasks} (levels={self.cfg.data.levels})")
        if self.cfg.farm.size_profile:
            from verifier.size_profiles import apply_size_profile

            tasks = [apply_size_profile(t, self.cfg.farm.size_profile) for t in tasks]
        return tasks

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

    def _make_verify(self):
        if self.toy:
            from megatron_rl.toy import toy_verdict

            async def verify(task, text):
                return toy_verdict(task, text)

            return verify
        from verifier.farm import FarmConfig, VerifierFarm

        from megatron_rl.rollout.agent import farm_verify_fn

        f = self.cfg.farm
        layout = FarmConfig(
            compile_workers=f.compile_workers, device_workers=f.device_workers,
            workers_per_device=f.workers_per_device, cpu_device_workers=f.cpu_device_workers,
            max_in_flight=f.max_in_flight, max_retries=f.max_retries, result_cache_path=f.result_cache_path)
        if f.backend == "ray":  # compile and device workers as Ray actors (e.g. on dedicated verifier nodes)
            from verifier.ray_farm import RayVerifierFarm

            self.farm = RayVerifierFarm(self.cfg.verifier, layout)
        else:
            self.farm = VerifierFarm(self.cfg.verifier, layout)
        return farm_verify_fn(self.farm)

    def _launch_engines(self, gpus: list[int]):
        from megatron_rl.rollout.engine import EngineManager, HttpEngine
        from megatron_rl.rollout.sglang_engine import (ProcessLauncher, SGLangServerConfig, ServerProcess,
                                                       launch_sglang_engines)

        r = self.cfg.rollout
        log_dir = str(self.run_dir / "engine_logs")
        if r.engine == "sglang":
            cfgs = [SGLangServerConfig(model_path=self.model_dir, tp_size=r.gpus_per_engine, log_dir=log_dir,
                                       enable_memory_saver=self.cfg.cluster.placement == "colocated",
                                       startup_timeout_s=r.startup_timeout_s, server_args=dict(r.sglang))
                    for _ in range(r.num_engines)]
            engines = launch_sglang_engines(cfgs)
            return EngineManager(engines)
        engines = []
        for i in range(r.num_engines):
            gpu = gpus[i] if self.use_gpu and i < len(gpus) else None
            scfg = SGLangServerConfig(
                model_path=self.model_dir, launch_module="megatron_rl.rollout.embedded_server",
                log_dir=log_dir, startup_timeout_s=r.startup_timeout_s,
                cuda_visible_devices=str(gpu) if gpu is not None else ("" if not self.use_gpu else None),
                server_args={"dtype": r.engine_dtype, "device": "cuda" if self.use_gpu else "cpu",
                             "random_seed": self.cfg.seed, **dict(r.sglang)},
                env={"OMP_NUM_THREADS": "1"} if not self.use_gpu else {})
            server = ServerProcess(scfg)
            url = server.start()
            name = f"engine-{i}"
            self._servers[name] = server
            engines.append(HttpEngine(url, name=name, launcher=ProcessLauncher(server)))
        return EngineManager(engines)

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
    def _requests(self, step: int) -> Iterator:
        """Task prompts, with BDR repair prompts mixed in at the replay probability."""
        k = 0
        while True:
            entry = self.bdr.maybe_replay()
            if entry is not None and not self.toy:
                task = next((t for t in self.tasks if t.task_id == entry.task_id), None)
                if task is not None:
                    yield self.agent.repair_request(entry, task, group_id=f"s{step}/repair{k}/{entry.task_id}")
                    k += 1
                    continue
            task = self.stream.next()
            gid = f"s{step}/g{k}/{task.task_id}"
            k += 1
            if self.toy:
                from megatron_rl.rollout.agent import RolloutRequest

                yield RolloutRequest(task=task, group_id=gid, messages=task.messages())
            else:
                yield self.agent.task_request(task, group_id=gid)

    def generate(self, step: int) -> RolloutOutput:
        t0 = time.perf_counter()
        cfg = self.cfg
        want = cfg.data.prompts_per_step
        cap = want * (1 + cfg.train.max_oversample_rounds) if cfg.train.dynamic_sampling else want
        requests = itertools.islice(self._requests(step), cap)

        def on_group(group):
            if not any(t.passed for t in group.trajectories) and not self.toy:
                self.agent.record_failed_group(self.bdr, group, step=step)

        async def run():
            return await self.agent.rollout_batch(requests, want, dynamic_sampling=cfg.train.dynamic_sampling,
                                                  on_group=on_group)

        self.ensure_engines()
        groups, stats = self.loop.run(run())
        # Tasks whose group could not be scored (infra, aborted) go back to the front of the queue.
        for gid in stats.get("unscored_task_ids", []):
            self.stream.requeue(gid)
        stats = dict(stats, seconds=time.perf_counter() - t0, bdr_size=len(self.bdr),
                     agent=dict(self.agent.stats))
        if self.farm is not None:
            stats["farm"] = self.farm.stats()
        return RolloutOutput(groups=groups, stats=stats)

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
        if self.farm is not None:
            self.farm.close(drain=False)
        self.loop.close()

