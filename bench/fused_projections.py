"""Decode-step GEMMs of a whole model, each projection on its own against the projections that read the same input
grouped into one GEMM (q/k/v, gate/up, a Gated DeltaNet layer's in_proj_{qkv,z,b,a}), beside the copy bandwidth.

Why: at one request a decode step is bound by reading the weights, and a GEMM's share of the bandwidth falls with
its size (an 8B layer's k_proj and v_proj are 8 MB each, a GDN layer's in_proj_b and in_proj_a 256 KB). Grouping
them is what engines' fused QKV / gate-up weights do; this measures what it would buy before the engine changes.

Every layer has its own weights (so nothing stays in L2), each variant's GEMMs for all layers are captured in one
CUDA graph (no launch gaps) and replayed; the figure is ms per replay, the median of `--repeats`.

    python3 bench/fused_projections.py --shape 8b 9b_hybrid --rows 1 16 64 256 --out $OUT/fused_projections.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # megatron_rl, for emit_json

from common import QWEN3_5_SHAPES, QWEN3_SHAPES, copy_bandwidth, emit_json


def layer_groups(shape: str) -> list[list[list[tuple[int, int]]]]:
    """Per layer, its GEMMs as groups of (in, out) that read one input: grouping fuses each group into one GEMM."""
    if shape == "8b":
        s = QWEN3_SHAPES["8b"]
        h, f, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
        q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
        attention = [[(h, q), (h, kv), (h, kv)], [(q, h)], [(h, f), (h, f)], [(f, h)]]
        return [attention] * s["num_hidden_layers"]
    s = QWEN3_5_SHAPES["9b"]
    h, f, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    nk, nv, dk, dv = s["linear_num_key_heads"], s["linear_num_value_heads"], s["linear_key_head_dim"], \
        s["linear_value_head_dim"]
    mlp = [[(h, f), (h, f)], [(f, h)]]
    gated_attention = [[(h, 2 * q), (h, kv), (h, kv)], [(q, h)]] + mlp
    gdn = [[(h, 2 * nk * dk + nv * dv), (h, nv * dv), (h, nv), (h, nv)], [(nv * dv, h)]] + mlp
    return [gated_attention if (i + 1) % 4 == 0 else gdn for i in range(s["num_hidden_layers"])]


def graph_ms(fn, repeats: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(shape: str, rows: list[int], repeats: int, device) -> dict:
    layers = layer_groups(shape)
    dt = torch.bfloat16
    # separate weights per GEMM; the grouped variant owns the same bytes concatenated per group
    separate = [[[torch.randn(o, i, device=device, dtype=dt) * 0.02 for i, o in group] for group in layer]
                for layer in layers]
    grouped = [[torch.cat(ws) if len(ws) > 1 else ws[0] for ws in layer] for layer in separate]
    weight_bytes = sum(w.numel() * w.element_size() for layer in grouped for w in layer)
    out = {"weight_gb": round(weight_bytes / 1e9, 3), "gemms_per_step": {
        "separate": sum(len(g) for layer in layers for g in layer), "grouped": sum(len(layer) for layer in layers)},
        "rows": {}}
    for n in rows:
        width = max(i for layer in layers for g in layer for i, _ in g)
        x = torch.randn(n, width, device=device, dtype=dt)

        def run_separate():
            for layer in separate:
                for ws in layer:
                    for w in ws:
                        torch.nn.functional.linear(x[:, :w.shape[1]], w)

        def run_grouped():
            for layer in grouped:
                for w in layer:
                    torch.nn.functional.linear(x[:, :w.shape[1]], w)

        sep, grp = graph_ms(run_separate, repeats), graph_ms(run_grouped, repeats)
        out["rows"][str(n)] = {"separate_ms": round(sep, 4), "grouped_ms": round(grp, 4),
                               "saved_pct": round(100 * (sep - grp) / sep, 2),
                               "separate_gb_s": round(weight_bytes / sep / 1e6, 1),
                               "grouped_gb_s": round(weight_bytes / grp / 1e6, 1)}
        print(shape, n, out["rows"][str(n)], flush=True)
    del separate, grouped
    torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", nargs="+", default=["8b", "9b_hybrid"], choices=["8b", "9b_hybrid"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 256])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fused_projections.py measures CUDA GEMMs; no CUDA device here")
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_bandwidth_gb_s": round(copy_bandwidth(device) / 1e9, 1),
              "shapes": {s: measure(s, args.rows, args.repeats, device) for s in args.shape}}
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
