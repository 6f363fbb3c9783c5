"""``python -m ckpt_tools {hf-to-mcore, mcore-to-hf, verify}`` (contract in ARCHITECTURE.md).

Exit codes: 0 success; 1 `verify` ran but the logits differ beyond tolerance; 2 bad input or a
failed conversion (the message on stderr names the file or field). No command leaves a partial
output directory behind.
"""
from __future__ import annotations

import argparse
import json
import sys

from .ranks import ToolError

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2


def _size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1048576' -> bytes."""
    t = text.strip().upper()
    units = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "B": 1}
    for suffix, mult in units.items():
        if t.endswith(suffix):
            try:
                return int(float(t[: -len(suffix)]) * mult)
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB)") from None


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ckpt_tools",
                                description="HF <-> Megatron distributed-checkpoint conversion and parity checks")
    sub = p.add_subparsers(dest="cmd", required=True)

    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron distributed checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="new checkpoint root (must not exist or be empty)")
    a.add_argument("--tp", type=_positive, default=1)
    a.add_argument("--pp", type=_positive, default=1)
    a.add_argument("--vpp", type=_positive, default=None, help="virtual pipeline chunks per stage")
    a.add_argument("--dtype", default=None, help="Megatron params dtype (default: the HF config's)")
    a.add_argument("--no-progress", action="store_true")

    b = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint -> HF release directory")
    b.add_argument("--ckpt", required=True, help="checkpoint root (with latest_checkpointed_iteration.txt)")
    b.add_argument("--out", required=True, help="new HF directory (must not exist or be empty)")
    b.add_argument("--iteration", type=int, default=None, help="default: the latest")
    b.add_argument("--tp", type=_positive, default=1, help="ranks used to load (any value the model allows)")
    b.add_argument("--pp", type=_positive, default=1)
    b.add_argument("--dtype", default=None, help="output dtype (default: the checkpoint's params dtype)")
    b.add_argument("--max-shard-size", type=_size, default=None,
                   help="per safetensors file (default: the source release's shard files when the checkpoint "
                        "recorded them, else 5GB)")
    b.add_argument("--no-progress", action="store_true")

    c = sub.add_parser("verify", help="compare HF and Megatron logits on the same tokens")
    c.add_argument("--hf", required=True)
    c.add_argument("--ckpt", required=True)
    c.add_argument("--iteration", type=int, default=None)
    c.add_argument("--tp", type=_positive, default=1)
    c.add_argument("--pp", type=_positive, default=1)
    c.add_argument("--tol", type=float, default=None,
                   help="max abs logit difference (default 1e-4 in fp32; bf16: 5%% of max |logit|, >= 0.05)")
    c.add_argument("--compute-dtype", choices=("auto", "checkpoint", "float32"), default="auto",
                   help="dtype both models run in: auto (default) = float32 on a CPU host when two float32 copies "
                        "fit in its memory, else the checkpoint's (in float32, bf16 rounding cannot mask or mimic "
                        "a layout error)")
    c.add_argument("--batch", type=_positive, default=2)
    c.add_argument("--seq-len", type=_positive, default=32)
    c.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "hf-to-mcore":
            from .convert import HFToMcore, hf_to_mcore

            out = hf_to_mcore(HFToMcore(args.hf, args.out, args.tp, args.pp, args.vpp, args.dtype,
                                        progress=not args.no_progress))
            print(json.dumps({"ok": True, "out": str(out), "tp": args.tp, "pp": args.pp}))
            return EXIT_OK
        if args.cmd == "mcore-to-hf":
            from .convert import McoreToHF, mcore_to_hf

            out = mcore_to_hf(McoreToHF(args.ckpt, args.out, args.tp, args.pp, args.dtype, args.max_shard_size,
                                        args.iteration, progress=not args.no_progress))
            print(json.dumps({"ok": True, "out": str(out)}))
            return EXIT_OK
        from .verify import VerifyJob, verify

        report = verify(VerifyJob(args.hf, args.ckpt, args.tp, args.pp, args.tol, args.batch, args.seq_len,
                                  args.seed, args.iteration, args.compute_dtype))
        print(json.dumps(report.to_json()))
        return EXIT_OK if report.ok else EXIT_MISMATCH
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:   # a write of the parent's share (config, assets) on a full or read-only disk
        from megatron_rl.fsutil import describe_os_error

        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
