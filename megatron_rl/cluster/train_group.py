"""The training side as a group of ranks: one `TrainWorker` per GPU (or per CPU process on gloo).

`TrainWorker` is a plain class holding one rank's `MegatronActor`; `TrainGroup` runs it as Ray actors
in the placement group's bundles (rank 0 picks the rendezvous address), or in-process when the world
size is 1 and Ray is unavailable (the GPU benchmark machine has no Ray). Every collective call goes
to all ranks at once and returns rank 0's answer.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch


class TrainWorker:
    """One training rank: parallel init, the actor, reference snapshot, checkpoints, weight sync."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, cfg, model_dir: str,
                 local_rank: int = 0):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr,
                          MASTER_PORT=str(master_port), LOCAL_RANK=str(local_rank))
        from transformers import AutoConfig

        from megatron_rl.actor.actor import MegatronActor
        from megatron_rl.parallel import init_parallel

        self.rank = rank
        self.cfg = cfg
        a = cfg.actor
        init_parallel(a.tp, a.pp, vpp=a.vpp, seed=cfg.seed)
        self.hf_config = AutoConfig.from_pretrained(model_dir)
        self.actor = MegatronActor(a, self.hf_config)
        self.model_dir = model_dir
        self._ref: list[torch.Tensor] | None = None
        self._sync = None

    # ---- weights and checkpoints
    def load_hf(self) -> None:
        self.actor.load_hf(self.model_dir)

    def save(self, ckpt_root: str, iteration: int, extra: dict) -> str:
        return self.actor.save(ckpt_root, iteration, extra)

    def load(self, ckpt_root: str, iteration: int | None = None) -> dict:
        return self.actor.load(ckpt_root, iteration)

    def snapshot_ref(self) -> None:
        """Keep this rank's shards of the current weights on the CPU as the KL reference policy."""
        self._ref = [p.detach().to("cpu", copy=True) for p in self._params()]

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for chunk in self.actor.model for p in chunk.parameters()]

    # ---- compute
    def compute_logprobs(self, samples, with_entropy: bool = False, trained_only: bool = False
                         ) -> list[list[float]] | None:
        out = self.actor.compute_logprobs(samples, with_entropy=with_entropy, trained_only=trained_only)
        if self.rank != 0:
            return None
        lps = out[0] if isinstance(out, tuple) else out
        return [t.tolist() for t in lps]

    def compute_ref_logprobs(self, samples, trained_only: bool = False) -> list[list[float]] | None:
        """Logprobs under the reference snapshot: swap it in, compute, swap the policy back."""
        if self._ref is None:
            raise RuntimeError("no reference snapshot: call snapshot_ref() first")
        params = self._params()
        current = [p.detach().to("cpu", copy=True) for p in params]
        with torch.no_grad():
            for p, r in zip(params, self._ref):
                p.copy_(r.to(p.device))
        try:
            return self.compute_logprobs(samples, trained_only=trained_only)
        finally:
            with torch.no_grad():
                for p, c in zip(params, current):
                    p.copy_(c.to(p.device))

    def train_step(self, samples, loss_cfg) -> dict[str, float]:
        from megatron_rl.algorithms import PolicyLoss

        return self.actor.train_step(samples, PolicyLoss(loss_cfg))

    def offload(self) -> None:
        self.actor.state_offload()

    def onload(self) -> None:
        self.actor.state_onload()

    # ---- weight sync (rank 0 talks to the engines)
    def sync_weights(self, engines: Sequence[tuple[str, str]] | None, version: int, sync_cfg,
                     relauncher=None) -> dict:
        from megatron_rl.rollout.engine import EngineManager, HttpEngine
        from megatron_rl.sync.weight_sync import WeightSync

        if self._sync is None:
            manager = None
            if self.rank == 0:
                manager = EngineManager([HttpEngine(url, name=name, launcher=_Relauncher(relauncher, name))
                                         for name, url in engines])
            self._sync = WeightSync.for_actor(self.actor, manager, sync_cfg)
        return self._sync.sync(str(version)).to_json()

    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        from megatron_rl.parallel import destroy_parallel

        if self._sync is not None:
            self._sync.close()
        destroy_parallel()


class _Relauncher:
    """An `EngineLauncher` that asks the rollout manager (which owns the server processes)."""

    def __init__(self, relauncher, name: str):
        self.relauncher, self.name = relauncher, name

    async def relaunch(self) -> str:
        if self.relauncher is None:
            raise RuntimeError(f"engine {self.name} died and no relauncher was given")
        method = self.relauncher.relaunch_engine
        if hasattr(method, "remote"):  # a Ray actor handle: ObjectRefs are awaitable
            return await method.remote(self.name)
        import asyncio

        return await asyncio.to_thread(method, self.name)


class TrainGroup:
    """All training ranks; each method runs on every rank and returns rank 0's result."""

    def __init__(self, cfg, model_dir: str, *, placement=None, use_gpu: bool, ray_mode: bool):
        self.cfg = cfg
        world = cfg.cluster.actor_world_size
        self.ray_mode = ray_mode
        if not ray_mode:
            if world != 1:
                raise RuntimeError("without Ray the trainer runs one rank in-process: set cluster.actor_world_size=1")
            from megatron_rl.parallel import free_port

            self.workers = [TrainWorker(0, 1, "127.0.0.1", free_port(), cfg, model_dir)]
            return
        import ray

        from .placement import bundle_options

        cls = ray.remote(TrainWorker)
        # rank 0 picks a port on its own node; the other ranks rendezvous there
        addr, port = ray.get(_rendezvous_fn().options(**bundle_options(placement, 0, use_gpu, num_gpus=0)).remote())
        self.workers = []
        for rank in range(world):
            opts = bundle_options(placement, rank, use_gpu, num_gpus=0.4 if use_gpu else 0)
            env = {"OMP_NUM_THREADS": "1"}
            if use_gpu:
                env.update(RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES="1")
            opts["runtime_env"] = {"env_vars": env}
            local_rank = placement.gpu_ids[rank] if use_gpu else 0
            self.workers.append(cls.options(**opts).remote(rank, world, addr, port, cfg, model_dir, local_rank))
        ray.get([w.ping.remote() for w in self.workers])

    def _all(self, method: str, *args, **kwargs) -> Any:
        if not self.ray_mode:
            return getattr(self.workers[0], method)(*args, **kwargs)
        import ray

        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return ray.get(refs)[0]

    def load_hf(self):
        return self._all("load_hf")

    def save(self, root: str, iteration: int, extra: dict) -> str:
        return self._all("save", root, iteration, extra)

    def load(self, root: str, iteration: int | None = None) -> dict:
        return self._all("load", root, iteration)

    def snapshot_ref(self):
        return self._all("snapshot_ref")

    def compute_logprobs(self, samples, trained_only: bool = False) -> list[list[float]]:
        return self._all("compute_logprobs", self._share(samples), trained_only=trained_only)

    def compute_ref_logprobs(self, samples, trained_only: bool = False) -> list[list[float]]:
        return self._all("compute_ref_logprobs", self._share(samples), trained_only=trained_only)

    def train_step(self, samples, loss_cfg) -> dict[str, float]:
        return self._all("train_step", self._share(samples), loss_cfg)

    def offload(self):
        return self._all("offload")

    def onload(self):
        return self._all("onload")

    def sync_weights(self, engines, version: int, sync_cfg, relauncher=None) -> dict:
        return self._all("sync_weights", engines, version, sync_cfg, relauncher)

    def _share(self, samples):
        if not self.ray_mode:
            return samples
        import ray

        return ray.put(list(samples))

    def shutdown(self) -> None:
        try:
            self._all("shutdown")
        except Exception:
            pass


def _rendezvous_impl() -> tuple[str, int]:
    import ray

    from megatron_rl.parallel import free_port

    return ray.util.get_node_ip_address(), free_port()


_RENDEZVOUS = None


def _rendezvous_fn():
    """A Ray task that runs in rank 0's bundle and returns (node ip, free port) for torch.distributed."""
    global _RENDEZVOUS
    if _RENDEZVOUS is None:
        import ray

        _RENDEZVOUS = ray.remote(num_cpus=0)(_rendezvous_impl)
    return _RENDEZVOUS
