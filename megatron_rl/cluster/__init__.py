"""Ray orchestration: the placement group, the train group and the rollout manager, as one handle.

`Cluster` starts the roles of a run and speaks for them to the driver loop:
* `start(resume)`: initial weights (and π_ref), or the checkpoint plus the rollout state, then the first
  weight sync;
* `rollout(step)`: one step's `RolloutResult` (its samples by reference, small metrics). Around it the
  colocated placement resumes/releases the engines' memory and offloads the actor; with
  ``cluster.async_rollout`` the next step's rollout is already running while this step trains (colocated, after a
  first synchronous step the engines' cache stays resumed and the actor resident: both fit together or the run
  stops);
* `train`: the `TrainGroup` (logprobs its loss needs, PPO mini-batches, checkpoints);
* `save(iteration, history)` and `sync_weights(version)` (actor -> engines: the colocated transport when
  they share GPUs, the distributed one, gloo or NCCL, for the disaggregated placement).

Only object references and small dicts pass through here. With ``cluster.backend=local`` (or when Ray
cannot be imported) the same roles run in-process with one train rank; that is how the GPU benchmark
machine, which has no Ray, runs a full RL step.
"""
from __future__ import annotations

import concurrent.futures
import copy
import logging
import os

from megatron_rl.observability import PhaseTimer

from .handles import local_handle, resolve

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
        self.model_dir = model_dir
        c = cfg.cluster
        self.use_gpu = torch.cuda.is_available() if c.use_gpu is None else bool(c.use_gpu)
        if self.use_gpu and not torch.cuda.is_available():
            raise RuntimeError("cluster.use_gpu=true but CUDA is not available on the driver")
        self.colocated = c.placement == "colocated"
        self.ray_mode = ray_mode(c)
        self.sync_cfg = WeightSyncConfig(
            transport="colocated" if self.colocated else "distributed",  # gloo on CPU, NCCL on GPU
            bucket_bytes=cfg.rollout.sync_bucket_mb << 20, sglang_native=cfg.rollout.engine == "sglang")
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-async")
        self._pending: tuple[int, concurrent.futures.Future] | None = None
        self._offload: bool | None = None     # the last rollout's choice (see offload_actor)
        self._offload_need: int | None = None  # bytes the rollout needs beside the actor (-1: unknown)
        self._engines_resident = False         # colocated async: the engines' cache resumed for the whole run
        self._first_step_done = False          # colocated async: the first step of a process runs synchronously
        self._state_before_pending: dict | None = None   # async: the rollout state a checkpoint of this step saves
        self.placement = None
        world = c.actor_world_size
        if self.ray_mode:
            import ray

            from .placement import create_placement

            start_ray(c)
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
            self.rollout_mgr = local_handle(RolloutManager(
                cfg, model_dir, tokenizer_path, str(cfg.run_dir), use_gpu=self.use_gpu,
                engine_gpus=[0] if self.use_gpu else [], ray_mode=False))
        self.train = TrainGroup(cfg, model_dir, placement=self.placement, use_gpu=self.use_gpu,
                                ray_mode=self.ray_mode)

    def start(self, resume: bool) -> tuple[int, dict]:
        """(first step, run history): the weights (see `TrainWorker.init_weights`), on resume the rollout
        state too, then the first weight sync."""
        extra = self.train.init_weights(str(self.cfg.ckpt_root) if resume else None,
                                        with_reference=self.cfg.loss.kl_loss_coef > 0)
        start, history = 0, {"reward": []}
        if resume:
            if "rollout" not in extra:   # e.g. an SFT run's checkpoint: RL starts from its HF export instead
                raise SystemExit(f"--resume: the checkpoint in {self.cfg.ckpt_root} holds no RL run state (no rollout "
                                 f"state: an SFT checkpoint?); to start RL from an SFT run, pass its HF export "
                                 f"(--model SFT_RUN_DIR/hf) without --resume")
            start, history = int(extra["step"]), extra.get("history", history)
            resolve(self.rollout_mgr.load_state_dict.remote(extra["rollout"]))
            if extra.get("initial_model") not in (None, self.model_dir):
                log.warning("resuming with model %s, the run started from %s: the KL reference is the former",
                            self.model_dir, extra["initial_model"])
        self.sync_weights(start)
        return start, history

    # ---- one step
    def rollout(self, step: int, timer=None):
        """This step's `RolloutResult`. With async rollouts it was started during the previous step's training
        (one step off-policy), and the next one starts now. `timer` (a `PhaseTimer`) gets the phases:
        ``rollout``, and for a colocated actor that leaves the GPU to the engines ``offload`` / ``onload``."""
        timer = timer or PhaseTimer()
        if not self.cfg.cluster.async_rollout or (self.colocated and not self._first_step_done):
            # colocated async: this process's first step runs synchronously, so that the room the engines need
            # is measured beside an actor that has trained once (its optimizer state exists)
            self._first_step_done = True
            return self._rollout_synchronously(step, timer)
        if self.colocated and not self._engines_resident:
            self._keep_engines_resident()
        with timer("rollout"):
            out = (self._pending[1] if self._pending and self._pending[0] == step else self._submit(step)).result()
        if step + 1 < self.cfg.train.steps:
            # what a checkpoint of this step saves: the draws up to this step, before the next one starts drawing
            self._state_before_pending = copy.deepcopy(resolve(self.rollout_mgr.state_dict.remote()))
            self._pending = (step + 1, self._submit(step + 1))
        else:
            self._pending = None
        return out

    def _rollout_synchronously(self, step: int, timer):
        """One rollout with nothing beside it; colocated, the engines' cache is resumed and released around it.
        When the room is too small the actor offloads and the engines' weights leave the GPU during training
        too; when it is not, they stay (moving them to the host and back cost ~5 s per step for an 8-layer 8B
        slice on the H200, `bench/results/rl_step_h200.md`, against 0.1 s for a sync into resident weights)."""
        offload = self.colocated and self.offload_actor()
        if offload:
            with timer("offload"):
                self.train.offload()
        with timer("rollout"):
            if self.colocated:
                resolve(self.rollout_mgr.resume_memory.remote(["kv_cache"]))
            out = resolve(self.rollout_mgr.generate.remote(step))
            if self.colocated:
                resolve(self.rollout_mgr.release_memory.remote(["kv_cache", "weights"] if offload else ["kv_cache"]))
        if offload:
            with timer("onload"):
                self.train.onload()
        return out

    def _keep_engines_resident(self) -> None:
        """Colocated async: the next rollout runs while the actor trains, so the actor cannot leave the GPUs and
        the engines' cache is resumed once for the run. Stops with the figures when the two do not fit. Measured
        after the first (synchronous) step, so the optimizer state is counted; training's activations are not (they
        are freed by then), and a run where they do not fit stops with an out-of-memory error in training."""
        # cluster.offload_actor=false is the user's word that both fit (config validation refuses true here)
        if self.cfg.cluster.offload_actor is None and self.offload_actor():
            what = "cluster.async_rollout with cluster.placement=colocated keeps the actor on its GPUs"
            measured = self.cfg.rollout.engine == "embedded" and bool(self._offload_need and self._offload_need > 0)
            if measured:
                raise RuntimeError(
                    f"{what}, but the engines' cache and the farm need {self._offload_need / 2**30:.1f} GiB beside "
                    f"it and {self.train.min_free_device_bytes() / 2**30:.1f} GiB are free: use the synchronous "
                    f"colocated mode (it offloads the actor during rollouts), fewer concurrent requests, or the "
                    f"disaggregated placement")
            raise RuntimeError(
                f"{what}, and whether the engines fit beside it cannot be measured (SGLang takes a static share; an "
                f"embedded engine's estimate failed, see the warning above): size rollout.sglang.mem_fraction_static "
                f"(SGLang) to leave room for the actor and set cluster.offload_actor=false")
        resolve(self.rollout_mgr.resume_memory.remote(["kv_cache"]))
        self._engines_resident = True

    def offload_actor(self) -> bool:
        """Whether the colocated actor leaves the GPU for this rollout: ``cluster.offload_actor``, or when that is
        unset, whether the memory the resident actor and engines leave is less than either what the rollout
        needs beside them (the engines' cache for a step's requests plus the verifier farm's share of the GPU) or
        what the last train step needed above the actor's resident state (its activations and logits; the engines'
        weights stay on the GPU through a step that does not offload). Measured before every rollout (the actor's
        optimizer state appears at its first step; the measurement also returns the actor's cached blocks to the
        device), so a run that outgrows the room switches to offloading: an 8B-shaped 20-layer slice ran out of
        memory in its second train step when only the rollout's need was counted (bench/results/rl_step_h200.md).
        SGLang engines take a static share: always."""
        choice = self.cfg.cluster.offload_actor
        if choice is not None or not self.use_gpu or self.cfg.rollout.engine != "embedded":
            return bool(choice) if choice is not None else self.use_gpu
        if self._offload_need is None:
            try:
                self._offload_need = rollout_cache_need(self.cfg, self.model_dir) + farm_device_reserve(self.cfg)
            except Exception as e:   # noqa: BLE001 - an estimate that cannot be made must not stop the run
                log.warning("cannot estimate the engines' memory (%s); the actor offloads during rollouts", e)
                self._offload_need = -1
        if self._offload_need < 0:
            return True
        free = self.train.min_free_device_bytes()
        train_extra = self.train.max_train_extra_bytes()
        offload = free < max(self._offload_need, train_extra)
        if offload != self._offload:
            print(f"[run] actor offload during rollouts: {'on' if offload else 'off'} (the engines' cache and the "
                  f"farm need {self._offload_need / 2**30:.1f} GiB, the last train step "
                  f"{train_extra / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free beside the actor; "
                  f"cluster.offload_actor sets it)", flush=True)
        self._offload = offload
        return offload

    def _submit(self, step: int) -> concurrent.futures.Future:
        return self._pool.submit(lambda: resolve(self.rollout_mgr.generate.remote(step)))

    def save(self, iteration: int, history: dict) -> str:
        # with a rollout in flight the manager's live state already holds the next step's draws
        rollout_state = self._state_before_pending if self._pending is not None \
            else resolve(self.rollout_mgr.state_dict.remote())
        extra = {"step": iteration, "rollout": rollout_state, "history": history, "initial_model": self.model_dir}
        return self.train.save(str(self.cfg.ckpt_root), iteration, extra)

    def finish_pending_rollout(self) -> None:
        """Async: wait for the rollout in flight (the part of it that training did not hide)."""
        if self._pending is not None:
            self._pending[1].result()

    def sync_weights(self, version: int) -> dict:
        """Actor -> engines; async, after the rollout in flight has finished on the old weights. Colocated with
        resident engines, their cache is released around the sync (they are idle), which leaves the room for the
        transport's staged copy of the weights."""
        self.finish_pending_rollout()
        if self.colocated:
            if self._engines_resident:
                resolve(self.rollout_mgr.release_memory.remote(["kv_cache"]))
            resolve(self.rollout_mgr.resume_memory.remote(["weights"]))
        endpoints = resolve(self.rollout_mgr.engine_endpoints.remote())
        try:
            return self.train.sync_weights(endpoints, version, self.sync_cfg, self.rollout_mgr)
        finally:
            if self.colocated and self._engines_resident:
                resolve(self.rollout_mgr.resume_memory.remote(["kv_cache"]))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.train.shutdown()
        try:
            resolve(self.rollout_mgr.shutdown.remote())
        except Exception as e:  # noqa: BLE001
            log.warning("rollout manager shutdown: %s", e)
        if self.ray_mode:
            import ray

            if ray.is_initialized() and self.cfg.cluster.ray_address is None:
                ray.shutdown()


def ray_mode(c) -> bool:
    """Whether ``cluster.backend`` (auto: when Ray imports) runs the roles as Ray actors."""
    return c.backend == "ray" or (c.backend == "auto" and _ray_available())


def start_ray(c) -> None:
    """Join ``cluster.ray_address`` or start a local Ray cluster (once per process) with the environment every
    role needs (the repo on PYTHONPATH, NVLink multicast off)."""
    import ray

    if ray.is_initialized():
        return
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(_repo_root()), os.environ.get("PYTHONPATH")])),
           "TOKENIZERS_PARALLELISM": "false", "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    ray.init(address=c.ray_address, num_cpus=c.num_cpus, include_dashboard=False,
             runtime_env={"env_vars": env}, logging_level=logging.WARNING, log_to_driver=True)


def _repo_root():
    from megatron_rl.config import REPO_ROOT

    return REPO_ROOT


__all__ = ["Cluster", "ray_mode", "start_ray"]


def rollout_cache_need(cfg, model_dir: str) -> int:
    """Device bytes one colocated embedded engine wants for a step's requests: their cache (`plan.rollout_
    cache_bytes` at the longest context a turn may reach) over the share of free memory the engine's cache may
    take (``kv_cache_fraction``)."""
    import json

    from megatron_rl.plan import rollout_cache_bytes, shape_from_hf
    from megatron_rl.rollout.embedded_engine import EmbeddedEngineConfig

    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    shape = shape_from_hf(hf, model_dir)
    a, r = cfg.agent, cfg.rollout
    server = {k.replace("-", "_"): v for k, v in dict(r.sglang).items()}
    in_flight = min(a.max_concurrency, cfg.data.prompts_per_step * a.group_size)
    if a.dynamic_sampling:   # over-drawn groups are in flight too
        in_flight = min(a.max_concurrency, in_flight * (1 + a.max_oversample_rounds))
    running = server.get("max_running_requests") or server.get("max_batch_size") or EmbeddedEngineConfig.max_batch_size
    per_engine = min(-(-in_flight // max(1, r.num_engines)), int(running))
    # a turn's prompt holds the earlier turns: the prompt bound plus every turn's response, within the context
    bounds = [a.max_context_tokens, (hf.get("text_config") or hf).get("max_position_embeddings")]
    if a.max_prompt_tokens is not None:
        bounds.append(a.max_prompt_tokens + a.max_turns * a.sampling.max_new_tokens)
    tokens = min(int(b) for b in bounds if b)
    dtype_bytes = 4 if r.engine_dtype in ("float32", "fp32") else 2
    fraction = float(server.get("kv_cache_fraction") or EmbeddedEngineConfig.kv_cache_fraction)
    return int(rollout_cache_bytes(shape, per_engine, tokens, dtype_bytes) / fraction)


def farm_device_reserve(cfg) -> int:
    """Device bytes the verifier farm's workers on one GPU may hold during a rollout (their candidates run on the
    engines' GPUs): ``workers_per_device`` shares of ``shared_device_max_bytes``; none for the CPU verifier."""
    if cfg.verifier.backend == "cpu":
        return 0
    return max(1, cfg.farm.workers_per_device) * int(cfg.verifier.shared_device_max_bytes)
