"""Narrow patches that let megatron-core 0.19 run on CPU with gloo.

megatron-core assumes CUDA in a handful of places (``torch.cuda.current_device()`` for buffer and
RoPE placement, ``torch.cuda.synchronize()`` in the checkpoint writer, the CUDA RNG tracker fork in
attention, ``device="cuda"`` literals in the pipeline schedules, CUDA streams in DDP). CI and the
CPU tests run the real megatron-core code through these patches, so TP/PP/DP logic, checkpoints
and losses are exercised without a GPU.

`apply()` is a no-op when CUDA is available: on GPU machines megatron-core runs unpatched.
Dropout RNG isolation across TP ranks is lost on CPU; every CPU config uses dropout 0.

Gated DeltaNet (the Qwen3.5 hybrid): megatron-core's ``GatedDeltaNet`` calls three kernels from
flash-linear-attention (``causal_conv1d``, ``l2norm``, ``chunk_gated_delta_rule``), which are Triton
and need a GPU. On CPU `apply()` puts torch references with the same signatures in their place
(`gdn_causal_conv1d`, `gdn_l2norm`, `gdn_chunk_gated_delta_rule`). They delegate the math to
transformers' own torch path for Qwen3.5 (one sequence at a time, so packed ``cu_seqlens`` batches
are exact), and a test pins them to it. The three ``torch.compile``-decorated GDN helpers and gated
attention's output gate run eagerly on CPU (Inductor would compile C++ for every new shape: the output gate's
first compile alone took 16 s of every CPU process that builds the hybrid).
"""
from __future__ import annotations

import contextlib
import inspect
import threading

import torch

_lock = threading.Lock()
_applied = False


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrites ``device="cuda..."`` keyword arguments of torch calls to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            # ``tensor.cuda()`` -> the tensor itself (M1, bridge/checkpoints): e.g. GPTModel with
            # tied embeddings and PP>1 moves the last stage's embedding copy with ``.data.cuda()``
            # before all-reducing it over the embedding group.
            return args[0]
        dev = kwargs.get("device")
        if dev is not None and _is_cuda(dev):
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class _NullStream:
    """Stands in for torch.cuda.Stream/Event on CPU (everything runs synchronously)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NullStream()

    def record(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *a, **k):
        pass


_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cuda_tensor_type_names():
    """Makes ``tensor.type()`` (no arguments) report CPU float tensors under their CUDA names.

    megatron-core's optimizers sort params by comparing ``param.type()`` with
    ``'torch.cuda.FloatTensor'`` etc. (DistributedOptimizer / Float16Optimizer param-group
    building, the fp32 check in ``clip_grad_by_total_norm_fp32``). Only active inside the wrapped
    megatron calls, so no other code ever sees the renamed types.
    """
    original = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_tensor_type_names(fn):
    def wrapper(*args, **kwargs):
        with _cuda_tensor_type_names():
            return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn
    return wrapper


def _patch_optimizer_type_checks() -> None:
    """DDP + distributed optimizer on CPU: see `_cuda_tensor_type_names` (M2, actor)."""
    from megatron.core.optimizer import distrib_optimizer, optimizer

    distrib_optimizer.DistributedOptimizer.__init__ = _with_cuda_tensor_type_names(
        distrib_optimizer.DistributedOptimizer.__init__)
    optimizer.Float16OptimizerWithFloat16Params.__init__ = _with_cuda_tensor_type_names(
        optimizer.Float16OptimizerWithFloat16Params.__init__)
    # optimizer.py calls the name it imported from clip_grads.
    optimizer.clip_grad_by_total_norm_fp32 = _with_cuda_tensor_type_names(
        optimizer.clip_grad_by_total_norm_fp32)



def _patch_recompute_rng() -> None:
    """Activation recomputation on CPU (M2, actor): megatron's checkpoint functions save and
    restore the CUDA RNG state around the recomputed forward; with no CUDA generator there is
    nothing to save (dropout is 0 in every CPU config), so the CUDA half becomes a no-op."""
    from megatron.core.tensor_parallel import random as mpu_random

    mpu_random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mpu_random._set_cuda_rng_state = lambda *a, **k: None


# --------------------------------------------------------------------------- Gated DeltaNet ops

def _segments(cu_seqlens, total: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, total)]
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(f"cu_seqlens {bounds} do not partition {total} packed tokens")
    return list(zip(bounds[:-1], bounds[1:]))


def gdn_causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                      activation=None, cu_seqlens=None, **_):
    """fla's ``causal_conv1d``: x ``[B, T, D]``, depthwise weight ``[D, W]``; returns (y, final state).

    With ``cu_seqlens`` (B == 1) every packed sequence starts from zero history, as it would alone."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    causal_conv1d_fn = inspect.unwrap(causal_conv1d_fn)  # the torch path, never an installed kernel
    if residual is not None or initial_state is not None or output_final_state:
        raise NotImplementedError("CPU causal_conv1d: residual / initial_state / output_final_state "
                                  "are not used by training and not implemented")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"packed causal_conv1d expects batch 1, got {x.shape[0]}")
    outs = [causal_conv1d_fn(x[:, a:b].transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
            for a, b in _segments(cu_seqlens, x.shape[1])]
    return torch.cat(outs, dim=1), None


def gdn_l2norm(x, eps: float = 1e-6, output_dtype=None):
    """fla's ``l2norm`` over the last dim: computed in fp32, returned in ``output_dtype`` or x's dtype."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm

    return l2norm(x.float(), dim=-1, eps=eps).to(output_dtype or x.dtype)


def gdn_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    """fla's ``chunk_gated_delta_rule`` (``[B, T, H, D]`` layout); returns (o, final state or None).

    Packed sequences (``cu_seqlens``, B == 1) each start from a zero (or their own initial) state. They run as one
    padded batch, not one call each: the torch path loops over 64-token chunks in Python, so a call per sequence
    multiplies the small ops by the number of sequences (most of a CPU SFT step). Padding is exact: a padded
    position has ``beta = 0`` (writes nothing) and ``g = 0`` (decays nothing), so outputs before it and the final
    state are those of the sequence alone."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    torch_chunk_gated_delta_rule = inspect.unwrap(torch_chunk_gated_delta_rule)  # never fla, even where installed
    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise NotImplementedError(f"CPU chunk_gated_delta_rule: only scale = head_dim**-0.5, got {scale}")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"packed chunk_gated_delta_rule expects batch 1, got {q.shape[0]}")
    segments = _segments(cu_seqlens, q.shape[1])
    if len(segments) == 1:
        return torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                            output_final_state=output_final_state,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    longest = max(b - a for a, b in segments)

    def batched(x):   # [1, T, ...] packed -> [N, longest, ...], zeros after each sequence
        return torch.stack([torch.nn.functional.pad(x[0, a:b], (0, 0) * (x.dim() - 2) + (0, longest - (b - a)))
                            for a, b in segments])

    o, final = torch_chunk_gated_delta_rule(
        batched(q), batched(k), batched(v), g=batched(g), beta=batched(beta), initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    o = torch.cat([o[i, :b - a] for i, (a, b) in enumerate(segments)]).unsqueeze(0)
    return o, final if output_final_state else None


def _patch_gated_delta_net() -> None:
    """Route megatron's GatedDeltaNet to the torch references above (CPU only)."""
    from megatron.core.ssm.gated_delta_net import common, gdn
    from megatron.core.transformer.attention import Attention

    for module in (common, gdn):
        module.causal_conv1d = gdn_causal_conv1d
        module.chunk_gated_delta_rule = gdn_chunk_gated_delta_rule
    common.l2norm = gdn_l2norm
    common.HAVE_FLA = True
    _run_eagerly(common._GDNBase, "_apply_gated_norm", "_prepare_input_for_gated_delta_rule", "_compute_g_and_beta")
    _run_eagerly(Attention, "_apply_output_gate")


def _run_eagerly(cls: type, *names: str) -> None:
    """Undo megatron's ``jit_fuser`` (``torch.compile``) on these methods of ``cls`` (CPU only)."""
    for name in names:
        fn = cls.__dict__[name]
        setattr(cls, name, getattr(fn, "_torchdynamo_orig_callable", fn))


def is_cpu_mode() -> bool:
    return _applied


def apply() -> bool:
    """Install the patches once per process when CUDA is unavailable. Returns True if active."""
    global _applied
    if torch.cuda.is_available():
        return False
    with _lock:
        if _applied:
            return True
        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.Stream = _NullStream
        torch.cuda.Event = _NullStream
        torch.cuda.current_stream = lambda *a, **k: _NullStream()
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

        from megatron.core.tensor_parallel import random as mpu_random

        mpu_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
        _patch_optimizer_type_checks()
        _patch_recompute_rng()
        _patch_gated_delta_net()

        mode = _CudaToCpuMode()
        mode.__enter__()  # stays on this thread's mode stack for the life of the process
        _applied = True
        return True
