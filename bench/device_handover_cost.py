"""Where a device handover's time goes (verifier.device_handover), on one GPU.

A check hands a candidate's outputs from its sandboxed child to the parent through a buffer the parent exported;
on the farm benchmark's L1 tasks (256 MB outputs) each handover cost the child ~0.23 s (``trial_save`` /
``audit_save`` in ``bench/results/verifier_farm_h200.md``), about 12 of them per check while the device is held
alone. This splits one handover into its driver calls and its copy, beside the copy bandwidth of the same tensor:

    python3 bench/device_handover_cost.py --mib 256 --repeats 10 --out bench/results/device_handover_cost_h200.json

Prints one JSON object: per step (``open``: cuIpcOpenMemHandle, ``copy``: the layout copy, ``close``:
cuIpcCloseMemHandle, ``write_outputs``: all of it as the child runs it), the median milliseconds over the repeats,
and the parent's ``snapshot`` of the buffer.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl.fsutil import write_text_atomic  # noqa: E402
from verifier import device_handover  # noqa: E402


def _ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _child(message: dict, nbytes: int, repeats: int, results) -> None:
    device = torch.device("cuda", 0)
    out = torch.randn(nbytes // 4, device=device)
    torch.cuda.synchronize(device)
    driver = device_handover._driver()
    handle = bytes.fromhex(message["handle"])
    steps: dict[str, list[float]] = {"open": [], "copy": [], "close": [], "write_outputs": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        ptr, _size = driver.open(handle)
        steps["open"].append((time.perf_counter() - t0) * 1e3)
        dest = device_handover._bytes_at(ptr, nbytes, device)

        def copy() -> None:
            device_handover.pack({"out0": out}, dest)
            torch.cuda.synchronize(device)
        steps["copy"].append(_ms(copy))
        steps["close"].append(_ms(lambda: driver.close(ptr)))
        steps["write_outputs"].append(_ms(lambda: device_handover.write_outputs(message, {"out0": out}, device)))
    results.put({k: v for k, v in steps.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "needs a CUDA device"}))
        return 2
    device = torch.device("cuda", 0)
    nbytes = args.mib << 20
    buf = device_handover.ExportedBuffer(device_handover.aligned(nbytes), device)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(buf.message(), nbytes, args.repeats, results))
    proc.start()
    steps = results.get(timeout=600)
    proc.join()
    snaps = [_ms(buf.snapshot) for _ in range(args.repeats)]
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def d2d() -> None:
        dst.copy_(src)
        torch.cuda.synchronize(device)
    d2d()
    copies = [_ms(d2d) for _ in range(args.repeats)]
    buf.close()
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "bytes": nbytes,
              "repeats": args.repeats,
              "child_ms_median": {k: round(statistics.median(v), 3) for k, v in steps.items()},
              "child_ms_first": {k: round(v[0], 3) for k, v in steps.items()},
              "parent_snapshot_ms_median": round(statistics.median(snaps), 3),
              "device_copy_ms_median": round(statistics.median(copies), 3),
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    print(json.dumps(report, indent=1))
    if args.out:
        write_text_atomic(args.out, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
