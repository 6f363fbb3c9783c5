"""What several benchmarks share: the Qwen3 dense and Qwen3.5 hybrid shapes, the model-FLOPs count and the
peak MFU is measured against, and printing + writing the one JSON result of a run."""
from __future__ import annotations

import json
import os

PEAK_TFLOPS = 790.0  # bf16 dense matmul rate measured on the H200 (../shared/GPU_MACHINE.md)

QWEN3_SHAPES = {  # dense Qwen3 dimensions; each script adds layers, embeddings tying, RoPE, context
    "32b": dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                num_attention_heads=64, num_key_value_heads=8, head_dim=128),
    "8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "1b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=8, head_dim=128),
}


QWEN3_5_SHAPES = {  # Qwen3.5 hybrid text dimensions (every 4th layer gated attention, the rest Gated DeltaNet)
    "9b": dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
               num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
               linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4),
    "27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4),
}
GDN_CHUNK = 64  # fla's chunk size for the chunked gated delta rule


def _text(cfg):
    return cfg.text_config if getattr(cfg, "model_type", None) == "qwen3_5" else cfg


def _layer_types(cfg) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    return list(types) if types else ["full_attention"] * cfg.num_hidden_layers


def matmul_params(cfg) -> int:
    """Parameters that take part in matmuls: decoder layers plus the output projection (the embedding
    lookup does no matmul). ``cfg`` is an HF config (attributes), dense Qwen3 or the Qwen3.5 hybrid (gated
    attention's q_proj is twice as wide; a GDN layer has in_proj_{qkv,z,b,a} and out_proj instead)."""
    cfg = _text(cfg)
    h, nh, ng, hd, f = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, \
        cfg.intermediate_size
    gated = 2 if getattr(cfg, "model_type", "") in ("qwen3_5_text",) else 1
    attention = h * (gated * nh + 2 * ng) * hd + nh * hd * h + 3 * h * f
    total = 0
    for kind in _layer_types(cfg):
        if kind == "linear_attention":
            nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
            dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
            total += h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * h + 3 * h * f
        else:
            total += attention
    return total + cfg.vocab_size * h


def model_flops(cfg, seq_lens, passes: float = 3.0) -> float:
    """Model FLOPs over sequences of ``seq_lens`` tokens: 2*N per token per pass, plus for each full-attention
    layer causal attention (QK^T and PV), plus for each Gated DeltaNet layer its chunked delta rule (per token
    and value head: the intra-chunk QK^T and attention-times-values, 2*C*(dk+dv), and three state products,
    3*dk*dv, with C = 64). ``passes`` is 3 for forward+backward, 1 for forward only. Recompute is not counted."""
    cfg = _text(cfg)
    types = _layer_types(cfg)
    n_attn = sum(1 for t in types if t != "linear_attention")
    dense = 2.0 * passes * matmul_params(cfg) * sum(seq_lens)
    attn = sum(2.0 * passes * n_attn * s * s * cfg.num_attention_heads * cfg.head_dim for s in seq_lens)
    gdn = 0.0
    if n_attn < len(types):
        dk, dv, nv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
        per_token = 2.0 * nv * (2 * GDN_CHUNK * (dk + dv) / 2 + 3 * dk * dv)
        gdn = passes * (len(types) - n_attn) * per_token * sum(seq_lens)
    return dense + attn + gdn


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of a 2 GiB buffer, 10 copies after one warm-up):
    the attainable memory bandwidth that decode-step limits are computed against."""
    import time

    import torch

    x = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)


def emit_json(result, out: str | None, **dumps_kwargs) -> str:
    """Print the run's JSON and, with ``out``, write it there atomically (parent dirs created)."""
    from megatron_rl.fsutil import write_text_atomic

    text = json.dumps(result, **dumps_kwargs)
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        write_text_atomic(out, text + "\n")
    return text


# Kernel-name fragments -> category, first match wins (cuBLAS/cuBLASLt, flash/cuDNN attention, Adam, ...).
KERNEL_CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "cudnn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("norm", ("norm",)),
    ("softmax/cross-entropy", ("softmax", "log_softmax", "nll", "cross_entropy", "logsumexp")),
    ("copy/cast/cat", ("copy", "memcpy", "memset", "cat", "fill", "transpose")),
    ("reduction", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise", "triton")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(f in low for f in fragments):
            return category
    return "other"


def gpu_kernel_breakdown(prof, wall_s: float, top: int = 15) -> dict:
    """Where the device time of a profiled region went: per-category and top kernels (ms), and the share
    of the wall time during which no kernel ran (launch/CPU-bound gaps). ``prof`` is a finished
    ``torch.profiler.profile`` with CUDA activity."""
    from torch.autograd import DeviceType

    per_kernel: dict[str, float] = {}
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != DeviceType.CUDA:
            continue
        us = float(getattr(evt, "self_device_time_total", 0.0) or 0.0)
        per_kernel[evt.key] = per_kernel.get(evt.key, 0.0) + us
    total_ms = sum(per_kernel.values()) / 1e3
    by_cat: dict[str, float] = {}
    for name, us in per_kernel.items():
        by_cat[kernel_category(name)] = by_cat.get(kernel_category(name), 0.0) + us / 1e3
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {
        "wall_ms": round(wall_s * 1e3, 1),
        "kernel_ms": round(total_ms, 1),
        "idle_fraction": round(max(0.0, 1.0 - total_ms / (wall_s * 1e3)), 4) if wall_s > 0 else None,
        "by_category_ms": {k: round(v, 1) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels_ms": [[name[:120], round(us / 1e3, 2), kernel_category(name)] for name, us in ranked],
    }
