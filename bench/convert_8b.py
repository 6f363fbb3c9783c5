"""Time `hf-to-mcore` on a Qwen3-8B-shaped checkpoint built from random weights (GPU machine).

    python bench/convert_8b.py [--layers 36] [--workdir DIR] [--export] [--keep]

Writes a bf16 HF checkpoint (hidden 4096, 32/8 heads, head_dim 128, ffn 12288, vocab 151936,
untied; `--layers` shrinks it) as 5 GB safetensors shards, then runs the converter at TP=1 and
prints one JSON object: bytes, seconds and GB/s for writing the input, for `hf-to-mcore`, and
(with `--export`) for `mcore-to-hf`. Needs no Ray.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import QWEN3_SHAPES  # noqa: E402

import torch  # noqa: E402


def qwen3_8b_config(layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(**{**QWEN3_SHAPES["8b"], "num_hidden_layers": layers}, tie_word_embeddings=False,
                       max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       rms_norm_eps=1e-6, dtype="bfloat16")


def write_random_hf(cfg, out_dir: str, seed: int = 0) -> int:
    """Random bf16 weights with the exact HF names/shapes (taken from a meta-device model)."""
    from transformers import Qwen3ForCausalLM

    from ckpt_tools.hf_io import ShardedSafetensorsWriter

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3ForCausalLM(cfg).state_dict().items()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    writer = ShardedSafetensorsWriter(out_dir)
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        writer.add(name, t)
    writer.close()
    cfg.save_pretrained(out_dir)
    return writer.total_bytes


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--workdir", default=None, help="default: a temp dir (deleted unless --keep)")
    ap.add_argument("--export", action="store_true", help="also time mcore-to-hf and check it is bitwise")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    from ckpt_tools import HFToMcore, McoreToHF, hf_to_mcore, mcore_to_hf

    work = args.workdir or tempfile.mkdtemp(prefix="convert_8b_")
    hf_dir, mc_dir, out_dir = (os.path.join(work, n) for n in ("hf", "mcore", "hf_export"))
    result: dict = {"layers": args.layers, "tp": 1, "pp": 1, "cuda": torch.cuda.is_available(),
                    "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    try:
        cfg = qwen3_8b_config(args.layers)
        t0 = time.perf_counter()
        nbytes = write_random_hf(cfg, hf_dir)
        result["write_input_s"] = round(time.perf_counter() - t0, 2)
        result["hf_bytes"] = nbytes
        result["params_billion"] = round(nbytes / 2 / 1e9, 3)
        print("progress:", json.dumps(result), file=sys.stderr, flush=True)

        t0 = time.perf_counter()
        hf_to_mcore(HFToMcore(hf_dir, mc_dir, tp=1, pp=1, progress=False))
        secs = time.perf_counter() - t0
        result["hf_to_mcore_s"] = round(secs, 2)
        result["hf_to_mcore_GBps"] = round(nbytes / secs / 1e9, 3)
        result["mcore_bytes"] = dir_bytes(mc_dir)
        print("progress:", json.dumps(result), file=sys.stderr, flush=True)

        if args.export:
            t0 = time.perf_counter()
            mcore_to_hf(McoreToHF(mc_dir, out_dir, progress=False))
            secs = time.perf_counter() - t0
            result["mcore_to_hf_s"] = round(secs, 2)
            result["mcore_to_hf_GBps"] = round(nbytes / secs / 1e9, 3)
            from megatron_rl.bridge import LazyHFState

            a, b = LazyHFState(hf_dir), LazyHFState(out_dir)
            result["export_bitwise_equal"] = sorted(a.keys()) == sorted(b.keys()) and all(
                torch.equal(a.read(k), b.read(k)) for k in a.keys())
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
