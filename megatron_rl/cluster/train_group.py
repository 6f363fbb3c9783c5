"""The training side as a group of ranks: one `TrainWorker` per GPU (or per CPU process on gloo).

`TrainWorker` is a plain class holding one rank's `MegatronActor`; `TrainGroup` runs it as Ray actors
in the placement group's bundles (rank 0 picks the rendezvous address), or in-process when the world
size is 1 and Ray is unavailable (the GPU benchmark machine has no Ray). Every collective call goes
to all ranks at once and returns rank 0's answer.

A step's samples reach every rank as one object reference (Ray resolves it on each rank); the ranks
compute the old and reference logprobs their loss declares, train, and return metrics. Nothing
per-token comes back.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Sequence

from .handles import call_all, local_handle, resolve

log = logging.getLogger(__name__)


class TrainWorker:
    """One training rank: parallel init, the actor, checkpoints, weight sync."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, cfg, model_dir: str,
                 local_rank: int = 0):
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr,
                          MASTER_PORT=str(master_port), LOCAL_RANK=str(local_rank))
        from transformers import AutoConfig

        from megatron_rl.actor.actor import MegatronActor
        from megatron_rl.parallel import init_parallel

        self.rank = rank
        a = cfg.actor
        init_parallel(a.tp, a.pp, vpp=a.vpp, seed=cfg.seed)
        self.actor = MegatronActor(a, AutoConfig.from_pretrained(model_dir))
        self.model_dir = model_dir
        self._sync = None
        self._train_extra = 0   # device memory the last train step allocated above what it started with

    # ---- weights and checkpoints
    def init_weights(self, ckpt_root: str | None, with_reference: bool) -> dict:
        """The run's weights: the initial model, a copy of it as π_ref when the loss has a KL term, then (to
        resume) the checkpoint. π_ref stays the initial policy after a resume. Returns the checkpoint's extra."""
        if ckpt_root is None or with_reference:
            self.actor.load_hf(self.model_dir)
        if with_reference:
            self.actor.snapshot_reference()
        return self.actor.load(ckpt_root) if ckpt_root is not None else {}

    def save(self, ckpt_root: str, iteration: int, extra: dict) -> str:
        """With the model dir's config, tokenizer and chat template as the checkpoint's HF assets, so an export
        of it (ckpt_tools mcore-to-hf) is a complete HF model."""
        return self.actor.save(ckpt_root, iteration, extra, hf_assets_dir=self.model_dir)

    # ---- compute
    def train(self, samples, loss_cfg) -> dict[str, float] | None:
        """One rollout batch (samples arrive resolved from their object reference): π_old / π_ref on these
        ranks, then the PPO mini-batches. Rank 0 answers."""
        import torch

        from megatron_rl.algorithms import PolicyLoss

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        metrics = self.actor.train_rl_batch(samples, PolicyLoss(loss_cfg))
        if cuda:
            self._train_extra = int(torch.cuda.max_memory_allocated() - start)
        return metrics if self.rank == 0 else None

    def train_extra_bytes(self) -> int:
        """Device memory the last train step needed above what it started with (activations, logits; at the
        first step also the optimizer state it created); 0 before the first step and without CUDA."""
        return self._train_extra

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

    def free_device_bytes(self) -> int:
        """Free memory of this rank's GPU (all processes on it counted) after returning our cached blocks;
        0 without CUDA."""
        import torch

        if not torch.cuda.is_available():
            return 0
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info()[0])

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
        # off this event loop: it carries the weight sync's own requests
        return await asyncio.to_thread(lambda: resolve(self.relauncher.relaunch_engine.remote(self.name)))


class TrainGroup:
    """All training ranks; each method runs on every rank and returns rank 0's result."""

    def __init__(self, cfg, model_dir: str, *, placement=None, use_gpu: bool, ray_mode: bool,
                 worker_cls: type = TrainWorker):
        """`worker_cls`: `TrainWorker` or a subclass with more rank methods (SFT's), reached through `call`."""
        world = cfg.cluster.actor_world_size
        self.ray_mode = ray_mode
        if not ray_mode:
            if world != 1:
                raise RuntimeError("without Ray the trainer runs one rank in-process: set cluster.actor_world_size=1")
            from megatron_rl.parallel import free_port

            self.workers = [local_handle(worker_cls(0, 1, "127.0.0.1", free_port(), cfg, model_dir))]
            return
        import ray

        from .placement import bundle_options

        cls = ray.remote(worker_cls)
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
        call_all([w.ping.remote() for w in self.workers])

    def call(self, method: str, *args):
        """`method` of the worker class on every rank at once; rank 0's answer."""
        return call_all([getattr(w, method).remote(*args) for w in self.workers])

    def init_weights(self, ckpt_root: str | None, with_reference: bool) -> dict:
        return call_all([w.init_weights.remote(ckpt_root, with_reference) for w in self.workers])

    def save(self, root: str, iteration: int, extra: dict) -> str:
        return call_all([w.save.remote(root, iteration, extra) for w in self.workers])

    def train(self, samples, loss_cfg) -> dict[str, float]:
        """``samples``: the rollout's object reference (a list without Ray)."""
        return call_all([w.train.remote(samples, loss_cfg) for w in self.workers])

    def offload(self) -> None:
        call_all([w.offload.remote() for w in self.workers])

    def min_free_device_bytes(self) -> int:
        """The least free GPU memory over the ranks (each rank's GPU hosts a colocated engine)."""
        return min(resolve([w.free_device_bytes.remote() for w in self.workers]))

    def max_train_extra_bytes(self) -> int:
        """The most device memory any rank's last train step needed beyond its resident state."""
        return max(resolve([w.train_extra_bytes.remote() for w in self.workers]))

    def onload(self) -> None:
        call_all([w.onload.remote() for w in self.workers])

    def sync_weights(self, engines, version: int, sync_cfg, relauncher=None) -> dict:
        return call_all([w.sync_weights.remote(engines, version, sync_cfg, relauncher) for w in self.workers])

    def shutdown(self) -> None:
        try:
            call_all([w.shutdown.remote() for w in self.workers])
        except Exception as e:  # noqa: BLE001 - a rank that already died
            log.warning("train group shutdown: %s", e)


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


__all__ = ["TrainGroup", "TrainWorker"]
