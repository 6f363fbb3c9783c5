"""megatron's gradient-accumulation fusion without apex: the wgrad GEMM accumulates into ``main_grad``.

With ``gradient_accumulation_fusion`` off, every linear layer's weight gradient is a bf16 GEMM result
that DDP then adds into the fp32 ``main_grad`` buffer: one extra read-modify-write of the whole fp32
gradient per micro-batch (on one H200, 111 ms of a 1.65 s step of 12 Qwen3-8B layers; see
``bench/results/actor_h200.md``). megatron fuses that add into the GEMM through apex's
``fused_weight_gradient_mlp_cuda`` extension, which is often not installed. PyTorch's CUDA build exposes the
same cuBLAS operation itself: ``aten::addmm.dtype_out`` multiplies bf16/fp16 matrices into an fp32
output with ``beta=1``, i.e. ``main_grad += grad_output^T @ input`` in one GEMM.

`install` provides that extension's two functions under its module name, only when apex's module does not
import and CUDA is present; megatron then uses them as it would apex's. Nothing changes unless the config
asks for ``gradient_accumulation_fusion``.
"""
from __future__ import annotations

import sys
import types

import torch

MODULE_NAME = "fused_weight_gradient_mlp_cuda"


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad (fp32) += grad_output^T @ total_input`` with bf16/fp16 operands, fp32 accumulation."""
    torch.ops.aten.addmm.dtype_out(main_grad, _as_2d(grad_output).t(), _as_2d(total_input), torch.float32,
                                   out=main_grad)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad (bf16/fp16) += grad_output^T @ total_input``."""
    torch.addmm(main_grad, _as_2d(grad_output).t(), _as_2d(total_input), out=main_grad)


def install() -> str:
    """Make megatron's gradient-accumulation fusion available; returns which implementation it uses."""
    try:
        __import__(MODULE_NAME)
        return "apex"
    except ImportError:
        pass
    if not torch.cuda.is_available():
        raise RuntimeError("gradient_accumulation_fusion needs CUDA (apex's fused_weight_gradient_mlp_cuda "
                           "or torch's aten::addmm.dtype_out); turn it off on CPU")
    if "dtype_out" not in torch.ops.aten.addmm.overloads():
        raise RuntimeError(f"gradient_accumulation_fusion: neither apex's {MODULE_NAME} nor torch's "
                           f"aten::addmm.dtype_out (torch {torch.__version__}) is available; turn it off")
    module = types.ModuleType(MODULE_NAME, __doc__)
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16
    sys.modules[MODULE_NAME] = module
    from megatron.core.tensor_parallel import layers   # decided at its import whether apex was there

    layers.fused_weight_gradient_mlp_cuda = module
    layers._grad_accum_fusion_available = True
    return "torch"
