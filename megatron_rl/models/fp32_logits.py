"""Logits in fp32 from bf16/fp16 hidden states and output weights, for the actor and the embedded engine alike.

Why: a bf16 GEMM hands back bf16 logits, and a trained model's logits reach 20-30, where one bf16 step is 0.125. The
trainer and the rollout engine compute the same logits with different kernels; when the fp32 accumulators differ
by a hair, their roundings can land a step apart, and a sampled token's logprob moves by up to that step. Keeping
the GEMM's fp32 output (same bf16 inputs, so no extra weight memory) removes the rounding from both sides
(MiniMax-M1 traced its train/rollout mismatch to the LM head; SGLang's ``--enable-fp32-lm-head`` does this for
the engine). ``bench/logprob_mismatch.py`` measures the effect.

On CUDA the forward is one ``torch.mm(..., out_dtype=torch.float32)`` (cuBLAS, bf16 in, fp32 out); elsewhere the
inputs are upcast first (the CPU's bf16 GEMM accumulates in fp32 but rounds its output). The backward rounds the
incoming gradient to the inputs' dtype, as the plain bf16 path (bf16 logits, then ``.float()``) does.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F


def _mm_fp32(x2d: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x2d.is_cuda and x2d.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x2d.dtype:
        return torch.mm(x2d, weight.t(), out_dtype=torch.float32)
    return F.linear(x2d.float(), weight.float())


class _Fp32OutputLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        out = _mm_fp32(x.reshape(-1, x.shape[-1]), weight)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(x.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.to(x.dtype)).view_as(x)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
        return grad_x, grad_w


def fp32_output_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` ([..., h] x [v, h] -> [..., v]) in fp32 without rounding the output to the inputs' dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(x, weight)
    return _Fp32OutputLinear.apply(x, weight)


def _fp32_head_forward(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    return fp32_output_linear(hidden, head.weight)


def _output_embedding(model: torch.nn.Module) -> torch.nn.Module | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def use_fp32_lm_head(model: torch.nn.Module) -> bool:
    """Make a transformers causal LM's output embedding return fp32 logits (the weight stays the same parameter, so
    weight updates and CUDA graphs that read it are unaffected). False when the model has no plain bias-free
    linear output embedding, or its forward is already replaced by someone else (an accelerate hook; nothing
    changed)."""
    head = _output_embedding(model)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return False
    if "forward" not in head.__dict__:   # bound to the module, so a copy of the model reads its own weight
        head.forward = types.MethodType(_fp32_head_forward, head)
        head._megatron_rl_fp32_logits = True
    return bool(head.__dict__.get("_megatron_rl_fp32_logits"))


def plain_lm_head(model: torch.nn.Module) -> None:
    """Undo `use_fp32_lm_head` (the output embedding returns its own dtype again)."""
    head = _output_embedding(model)
    if head is not None and head.__dict__.pop("_megatron_rl_fp32_logits", False):
        head.__dict__.pop("forward", None)
