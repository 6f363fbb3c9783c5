"""Megatron DDP, the (distributed) Adam optimizer and the LR schedule for the actor.

Everything here is megatron-core's own machinery: ``DistributedDataParallel`` owns contiguous
grad (and, with the distributed optimizer, param) buffers, ``get_megatron_optimizer`` builds the
ZeRO-1 style ``DistributedOptimizer`` holding fp32 main params and Adam moments for this rank's
shard, and ``OptimizerParamScheduler`` sets LR / weight decay per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class OptimSettings:
    """Optimizer and LR schedule. `ActorConfig` extends it, so these are ``actor.lr`` etc. in configs."""

    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_init: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_steps: int | None = None      # None: a long horizon (effectively constant after warmup)
    lr_decay_style: str = "constant"       # constant | linear | cosine | inverse-square-root
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False
    grad_reduce_in_fp32: bool = True
    bucket_size: int | None = None
    # Without apex/TE, megatron falls back to torch's Adam in its multi-tensor (foreach) form; torch's
    # single fused kernel does the same update with far fewer passes over the fp32 state.
    fused_adam: bool = True

    def validate(self) -> None:
        problems = []
        if not self.lr > 0:
            problems.append(f"lr={self.lr} must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            problems.append(f"min_lr={self.min_lr} must be in [0, lr]")
        if not 0 <= self.lr_warmup_init <= self.lr:
            problems.append(f"lr_warmup_init={self.lr_warmup_init} must be in [0, lr]")
        if self.lr_warmup_steps < 0:
            problems.append(f"lr_warmup_steps={self.lr_warmup_steps} must be >= 0")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            problems.append(f"lr_decay_steps={self.lr_decay_steps} must exceed lr_warmup_steps={self.lr_warmup_steps}")
        if self.lr_decay_style not in ("constant", "linear", "cosine", "inverse-square-root"):
            problems.append(f"lr_decay_style={self.lr_decay_style!r} is not one of constant/linear/cosine/inverse-square-root")
        if self.weight_decay < 0:
            problems.append(f"weight_decay={self.weight_decay} must be >= 0")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            problems.append(f"adam betas ({self.adam_beta1}, {self.adam_beta2}) must be in [0, 1)")
        if not self.adam_eps > 0:
            problems.append(f"adam_eps={self.adam_eps} must be > 0")
        if self.clip_grad < 0:
            problems.append(f"clip_grad={self.clip_grad} must be >= 0 (0 disables clipping)")
        if problems:
            raise ValueError("invalid optimizer settings: " + "; ".join(problems))


def wrap_ddp(chunks: list, settings: OptimSettings) -> list:
    """Wrap each GPTModel chunk in megatron DDP (the first chunk owns bucketing under VPP)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=settings.grad_reduce_in_fp32,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # the actor detects non-finite steps itself and skips them
        bucket_size=settings.bucket_size,
    )
    return [
        DistributedDataParallel(chunk.config, ddp_config, chunk,
                                disable_bucketing=(k > 0))  # megatron-LM convention for VPP
        for k, chunk in enumerate(chunks)
    ]


def build_optimizer(model: list, settings: OptimSettings, params_dtype: torch.dtype):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        fp16=False,
        params_dtype=params_dtype,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        # An overflowing (inf) grad norm skips the update inside megatron's step; NaNs are caught
        # by the actor before the step is attempted.
        grad_norm_skip_threshold=float(torch.finfo(torch.float32).max),
    )
    optimizer = get_megatron_optimizer(cfg, model)
    align_mixed_dtype_group_order(optimizer)
    if settings.fused_adam:
        use_fused_torch_adam(optimizer)
    return optimizer


def align_mixed_dtype_group_order(optimizer) -> int:
    """Make the distributed optimizer's record of where each param sits in its group match the order it installed.

    Why: megatron-core 0.19.2 records ``(group, position)`` per param in grad-buffer order, then installs each
    group's params fp32 params first. A group that mixes dtypes (Qwen3.5's fp32 ``A_log`` / ``dt_bias`` among bf16
    norms and biases) is reordered, so every optimizer-state save and load fetches another param's shard: saving
    fails on a shape mismatch, or, where shapes agree, writes one param's state under another's name. Training is
    unaffected. (Megatron-LM issue 2777; fixed upstream after 0.19.) Returns how many entries moved; 0 for groups
    of one dtype and on a megatron that installs the recorded order."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    moved = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        for group, (fp32_params, half_params) in enumerate(zip(opt.model_fp32_groups, opt.model_float16_groups)):
            for position, param in enumerate((*fp32_params, *half_params)):
                if opt.model_param_group_index_map.get(param) != (group, position):
                    opt.model_param_group_index_map[param] = (group, position)
                    moved += 1
    return moved


def use_fused_torch_adam(optimizer) -> int:
    """Switch megatron's torch-Adam fallback to torch's fused implementation; returns the groups switched.

    Only torch's own Adam/AdamW are touched (apex's and TE's FusedAdam are fused already), and only when
    every parameter sits on a device torch's fused Adam supports. Checkpoints are unaffected: the flag
    lives in the param groups, and a checkpoint saved with either form loads into the other.
    """
    switched = 0
    for megatron_opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(megatron_opt, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            params = group["params"]
            if group.get("capturable") or group.get("differentiable") or not params or not all(
                    p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in params):
                continue
            group["fused"], group["foreach"] = True, False
            switched += 1
    return switched


def build_scheduler(optimizer, settings: OptimSettings):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = settings.lr_decay_steps or max(settings.lr_warmup_steps + 1, 10**9)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=settings.lr_warmup_init,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=settings.lr_decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        # on resume the schedule is this config's, at the checkpoint's step: megatron's default keeps the
        # checkpoint's horizon, so a run resumed with more steps (SFT's decay follows train.steps) sat at min_lr
        # past the old end without a word (`checkpoint.load_checkpoint` logs what changed)
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
    )


def current_lr(optimizer) -> float:
    for group in optimizer.param_groups:
        lr = group.get("lr")
        if lr is not None:
            return float(lr)
    return 0.0


def grads_are_finite(model: list) -> bool:
    """Local check of every DDP grad buffer (reduce the flag across ranks before trusting it)."""
    for buf in _buffers(model):
        if buf.grad_data is not None and buf.grad_data.numel() and not torch.isfinite(buf.grad_data).all():
            return False
    return True


class HostStash:
    """Pinned host copies of device tensors, kept between offloads and refilled in place.

    Why: a colocated actor moves its optimizer state (12 bytes a parameter) to the host before every
    rollout and back after it. ``tensor.to("cpu")`` allocates pageable memory each time and copies at a
    few GB/s; copies into pinned buffers that persist run at the link's speed and allocate nothing after
    the first offload. A buffer that cannot be pinned (host limits) falls back to pageable memory.

    Cost: the stash holds a host copy of all offloaded state for the whole run (the pageable copies were freed
    at onload), and torch's pinned allocator rounds each buffer up to a power of two, so host use is between
    1x and 2x that state (``pinned_bytes`` counts the requested sizes).
    """

    def __init__(self):
        self._host: dict[tuple, torch.Tensor] = {}
        self.pinned_bytes = 0

    def put(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        """The host copy of device tensor `t` under `key` (copied asynchronously: synchronize before use)."""
        host = self._host.get(key)
        if host is None or host.shape != t.shape or host.dtype != t.dtype:
            try:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self.pinned_bytes += host.numel() * host.element_size()
            except RuntimeError:
                host = torch.empty(t.shape, dtype=t.dtype)
            self._host[key] = host
        host.copy_(t, non_blocking=True)
        return host

    @staticmethod
    def take(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A device copy of a stashed tensor (asynchronous; the host buffer stays for the next offload)."""
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        out.copy_(host, non_blocking=True)
        return out


def offload_to_cpu(model: list, optimizer, stash: HostStash) -> None:
    """Free accelerator memory between training phases (colocated rollouts).

    Moves DDP param/grad buffers (megatron's ``offload_to_cpu`` on each buffer; params live in
    the buffers under the distributed optimizer, otherwise they move one by one) and the
    optimizer's fp32 main params and Adam moments, into `stash`'s pinned buffers. A no-op without CUDA.

    Why not ``MegatronOptimizer.offload_to_cpu``: for a parameter the model itself holds in fp32 (GDN's
    ``A_log``), the distributed optimizer's main param is a view into the DDP param buffer; megatron's own
    offload would copy that view out (after the buffer has given up its storage, or leaving the view
    detached from the model on restore). Those views travel with their buffer here instead.
    """
    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()
    in_buffers = _buffer_storages(model)
    _move_optimizer_state(optimizer, stash, None, skip=in_buffers)
    for buf in _buffers(model):
        buf.offload_to_cpu(move_params=buf.param_data is not None, move_grads=True)
        if buf.param_data is None:
            for p in buf.params:
                p.data = stash.put((id(p), "data"), p.data)
    torch.cuda.synchronize()   # the copies read device memory that empty_cache hands back
    torch.cuda.empty_cache()


def restore_from_cpu(model: list, optimizer, stash: HostStash) -> None:
    if not torch.cuda.is_available():
        return
    device = torch.device("cuda", torch.cuda.current_device())
    for buf in _buffers(model):
        buf.reload_from_cpu(move_params=buf.param_data is not None, move_grads=True)
        if buf.param_data is None:
            for p in buf.params:
                p.data = stash.take(p.data, device)
    _move_optimizer_state(optimizer, stash, device, skip=_buffer_storages(model))
    torch.cuda.synchronize()


def _buffer_storages(model: list) -> set[int]:
    return {buf.param_data.untyped_storage().data_ptr() for buf in _buffers(model) if buf.param_data is not None}


def _move_optimizer_state(optimizer, stash: HostStash, device: torch.device | None, skip: set[int]) -> None:
    """Main params (except views into the storages in `skip`) and optimizer state tensors: into `stash`
    (``device=None``) or back onto `device`."""
    def move(key: tuple, t: torch.Tensor) -> torch.Tensor:
        if device is None:
            return stash.put(key, t) if t.device.type != "cpu" else t
        return stash.take(t, device) if t.device != device else t

    for megatron_opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(megatron_opt, "optimizer", None)
        if inner is None or getattr(megatron_opt, "is_stub_optimizer", False):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in skip:
                    p.data = move((id(p), "data"), p.data)
        for owner, state in inner.state.items():
            for k, v in state.items():
                if torch.is_tensor(v):
                    state[k] = move((id(owner), k), v)


def _buffers(model: list):
    for chunk in model:
        yield from list(chunk.buffers) + list(chunk.expert_parallel_buffers)
