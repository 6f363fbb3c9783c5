"""What the verifier child's watch of the timed reference (`verifier._child.ReferenceWatch.check`, run before the warm-up and
before every timed batch of both runners, ~240 per check) costs per check, against the per-tensor form it replaced
(each storage sampled, masked and compared on its own: one synchronisation per tensor), and against one timed call of
the model itself. Models: a level-1-like Linear (2 tensors) and a level-3-like stack of 100 Conv2d + BatchNorm2d (700
tensors).

    python bench/reference_check_cost.py [--device cuda] [--out FILE]
"""
from __future__ import annotations

import argparse
import secrets
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import emit_json  # noqa: E402
from verifier._child import REFERENCE_SAMPLE_BYTES, ReferenceWatch, TensorOps  # noqa: E402


def _per_tensor_check(tensors, device):
    """The replaced form: per storage, a generator seeded from its key, a fresh sample and mask, one comparison."""
    def veiled(t, key):
        raw = torch.empty(0, dtype=torch.uint8, device=device).set_(t.untyped_storage())
        gen = torch.Generator(device=device)
        gen.manual_seed(key)
        if raw.numel() > REFERENCE_SAMPLE_BYTES:
            raw = raw[torch.randint(0, raw.numel(), (REFERENCE_SAMPLE_BYTES,), generator=gen, device=device)]
        mask = torch.empty((raw.numel() + 7) // 8, dtype=torch.int64, device=device).random_(generator=gen)
        return torch.bitwise_xor(raw, mask.view(torch.uint8)[:raw.numel()])

    key = secrets.randbits(60)
    kept = [veiled(t, key + i) for i, t in enumerate(tensors)]
    return lambda: all([torch.equal(veiled(t, key + i), k) for i, (t, k) in enumerate(zip(tensors, kept))])


def _ms(fn, device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    torch.manual_seed(0)
    models = {"linear_4096": (torch.nn.Linear(4096, 4096), torch.randn(64, 4096)),
              "conv_bn_x100": (torch.nn.Sequential(*[m for _ in range(100) for m in (torch.nn.Conv2d(64, 64, 3,
                                                                                                     padding=1),
                                                                                     torch.nn.BatchNorm2d(64))]),
                               torch.randn(8, 64, 32, 32))}
    rows = {}
    for name, (model, x) in models.items():
        model = model.to(device).eval()
        watch = ReferenceWatch(model, types.SimpleNamespace(), TensorOps.capture(torch))
        (record,) = watch.records
        tensors = [t for t, *_ in record["entries"]]
        x = x.to(device)
        with torch.no_grad():
            rows[name] = {"tensors": len(tensors), "bytes_compared": record["kept"].numel(),
                          "check_ms": round(_ms(watch.check, device, a.reps), 3),
                          "per_tensor_check_ms": round(_ms(_per_tensor_check(tensors, device), device, a.reps), 3),
                          "model_call_ms": round(_ms(lambda: model(x), device, a.reps), 3)}
        assert watch.check() is None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    emit_json({"device": str(device), "gpu": gpu, "torch": torch.__version__, "reps": a.reps, "models": rows}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
