"""Ray orchestration: the placement group, the train group and the rollout manager, as one handle.

`Cluster` starts the roles of a run and speaks for them to the driver loop:
* `rollout(step)`: generate and verify one step of groups (around it, the colocated placement
  resumes/releases the engines' KV cache and offloads the actor);
* `train`: the `TrainGroup` (logprobs, train step, checkpoints, reference snapshot);
* `sync_weights(version)`: actor -> engines (the colocated transport when they share GPUs, the
  distributed one, gloo or NCCL, for the disaggregated placement);
* `rollout_async(step)`: the one-step-off-policy overlap (disaggregated placement only).

With ``cluster.backend=local`` (or when Ray cannot be imported) the same roles run in-process with
one train rank; that is how the GPU benchmark machine, which has no Ray, runs a full RL step.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


def _ray_available() -> bool:
    try:
        import ray  # noqa: F401  (only whether it imports)
    except Exception:
        return False
    return True


class Cluster:
    def __init__(self, cfg, model_dir: str, tokenizer_path: str):
        import torch

        from megatron_rl.sync.weight_sync import WeightSyncConfig

        from .rollout_manager import RolloutManager
        from .train_group import TrainGroup

        self.cfg = cfg
        c = cfg.cluster
        self.use_gpu = torch.cuda.is_available() if c.use_gpu is None else bool(c.use_gpu)
        if self.use_gpu and not torch.cuda.is_available():
            raise RuntimeError("cluster.use_gpu=true but CUDA is not available on the driver")
        self.colocated = c.placement == "colocated"
        self.ray_mode = c.backend == "ray" or (c.backend == "auto" and _ray_available())
        self.sync_cfg = WeightSyncConfig(
            transport="colocated" if self.colocated else "distributed",  # gloo on CPU, NCCL on GPU
            bucket_bytes=cfg.rollout.sync_bucket_mb << 20, sglang_native=cfg.rollout.engine == "sglang")
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-async")
        self.placement = None
        world = c.actor_world_size
        if self.ray_mode:
            import ray

            from .placement import create_placement

            if not ray.is_initialized():
                env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(_repo_root()), os.environ.get("PYTHONPATH")])),
                       "TOKENIZERS_PARALLELISM": "false", "NCCL_NVLS_ENABLE": "0",
                       "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
                ray.init(address=c.ray_address, num_cpus=c.num_cpus, include_dashboard=False,
                         runtime_env={"env_vars": env}, logging_level=logging.WARNING, log_to_driver=True)
            slots = world if self.colocated else world + max(c.rollout_gpus, 0 if not self.use_gpu else 1)
            self.placement = create_placement(slots, self.use_gpu)
            engine_gpus = (self.placement.gpu_ids[:world] if self.colocated else self.placement.gpu_ids[world:]) \
                if self.use_gpu else []
            # The manager holds no GPU itself, but its engine processes and verifier device workers use
            # the node's GPUs: keep Ray from hiding them (it blanks CUDA_VISIBLE_DEVICES otherwise).
            mgr_env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if self.use_gpu else {}
            self.rollout_mgr = ray.remote(RolloutManager).options(
                num_cpus=0, max_concurrency=2, runtime_env={"env_vars": mgr_env}).remote(
                cfg, model_dir, tokenizer_path, str(cfg.run_dir), use_gpu=self.use_gpu, engine_gpus=engine_gpus,
                ray_mode=True)
        else:
            self.rollout_mgr = RolloutManager(cfg, model_dir, tokenizer_path, str(cfg.run_dir),
                                              use_gpu=self.use_gpu, engine_gpus=[0] if self.use_gpu else [],
                                              ray_mode=False)
        self.train = TrainGroup(cfg, model_dir, placement=self.placement, use_gpu=self.use_gpu,
                                ray_mode=self.ray_mode)

    # ---- calls into the rollout manager (Ray actor or local object)
    def _mgr(self, method: str, *args):
        fn = getattr(self.rollout_mgr, method)
        if self.ray_mode:
            import ray

            return ray.get(fn.remote(*args))
        return fn(*args)

    def rollout(self, step: int):
        if self.colocated:
            self.train.offload()
            self._mgr("resume_memory", ["kv_cache"])
        out = self._mgr("generate", step)
        if self.colocated:
            self._mgr("release_memory", ["kv_cache", "weights"])
            self.train.onload()
        return out

    def rollout_async(self, step: int) -> concurrent.futures.Future:
        """Start generating `step` while the caller trains (disaggregated placement only)."""
        if self.colocated:
            raise RuntimeError("async rollout needs the disaggregated placement")
        if self.ray_mode:
            ref = self.rollout_mgr.generate.remote(step)
            return self._pool.submit(_ray_get, ref)
        return self._pool.submit(self.rollout_mgr.generate, step)

    def rollout_state(self) -> dict:
        return self._mgr("state_dict")

    def load_rollout_state(self, st: dict) -> None:
        self._mgr("load_state_dict", st)

    def sync_weights(self, version: int) -> dict:
        if self.colocated:
            self._mgr("resume_memory", ["weights"])
        endpoints = self._mgr("engine_endpoints")
        report = self.train.sync_weights(endpoints, version, self.sync_cfg, self.rollout_mgr)
        return report

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.train.shutdown()
        except Exception as e:  # noqa: BLE001
            log.warning("train group shutdown: %s", e)
        try:
            self._mgr("shutdown")
        except Exception as e:  # noqa: BLE001
            log.warning("rollout manager shutdown: %s", e)
        if self.ray_mode:
            import ray

            if ray.is_initialized() and self.cfg.cluster.ray_address is None:
                ray.shutdown()


def _ray_get(ref) -> Any:
    import ray

    return ray.get(ref)


def _repo_root():
    from megatron_rl.config import REPO_ROOT

    return REPO_ROOT


__all__ = ["Cluster"]
