"""Bytes and CPU seconds the RL driver process spends moving data, per step (Ray mode).

Runs the real driver (`megatron_rl.train.main`) in this process on a preset (default: the toy run,
Ray, TP=2) and counts, in the driver only:
* bytes in: the pickled size of every object `ray.get` hands back;
* bytes out: the pickled size of every `ray.put` object and of every actor-method call's arguments
  (an object reference or actor handle counts as a few bytes: only the reference crosses);
* CPU seconds of the driver process per step (`time.process_time`: its own Python work plus Ray's
  threads in it that receive and deserialize results), and the step's wall seconds.
Counters are read at each `RunLogger.log_step`; the first step (warm-up) is left out of the medians.

    python bench/driver_io.py --steps 8 --out bench/results/driver_io_after.json [key=value ...]
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit_json  # noqa: E402

def pickled_size(obj) -> int:
    """Bytes of ``obj`` pickled as Ray does (cloudpickle), a reference or actor handle as its few-byte id."""
    import ray
    from ray import cloudpickle

    class Sizing(cloudpickle.CloudPickler):
        def persistent_id(self, o):
            return "ref" if isinstance(o, (ray.ObjectRef, ray.actor.ActorHandle)) else None

    buf = io.BytesIO()
    Sizing(buf, protocol=5).dump(obj)
    return buf.tell()


class Counters:
    def __init__(self):
        self.bytes_in = 0
        self.bytes_out = 0
        self.calls = 0

    def snapshot(self) -> tuple[int, int, int, float, float]:
        return self.bytes_in, self.bytes_out, self.calls, time.process_time(), time.perf_counter()


def install(counters: Counters) -> None:
    import ray
    import ray.actor

    real_get, real_put = ray.get, ray.put
    real_remote = ray.actor.ActorMethod._remote

    def get(refs, *a, **kw):
        out = real_get(refs, *a, **kw)
        counters.bytes_in += pickled_size(out)
        return out

    def put(obj, *a, **kw):
        counters.bytes_out += pickled_size(obj)
        return real_put(obj, *a, **kw)

    def remote(self, args=None, kwargs=None, **kw):
        counters.bytes_out += pickled_size((args or (), kwargs or {}))
        counters.calls += 1
        return real_remote(self, args=args, kwargs=kwargs, **kw)

    ray.get, ray.put = get, put
    ray.actor.ActorMethod._remote = remote


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/toy_learn.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import tempfile

    from megatron_rl import observability, train

    counters = Counters()
    install(counters)
    marks = []
    real_log_step = observability.RunLogger.log_step

    def log_step(self, step, *a, **kw):
        marks.append(counters.snapshot())
        return real_log_step(self, step, *a, **kw)

    observability.RunLogger.log_step = log_step
    log_dir = tempfile.mkdtemp(prefix="driver-io-")
    os.chdir(ROOT)
    argv = ["--config", args.config, f"train.steps={args.steps}", f"train.log_dir={log_dir}",
            "train.dump_samples=false", *args.overrides]
    t0 = time.perf_counter()
    rc = train.main(argv)
    wall = time.perf_counter() - t0
    if rc != 0 or len(marks) < 3:
        print(f"driver run failed (rc={rc}, {len(marks)} steps logged)", file=sys.stderr)
        return 1
    steps = [tuple(b[i] - a[i] for i in range(5)) for a, b in zip(marks, marks[1:])]
    med = lambda k: statistics.median(s[k] for s in steps)  # noqa: E731
    result = {
        "bench": "driver_io", "label": args.label, "config": args.config, "overrides": args.overrides,
        "steps": args.steps, "steps_measured": len(steps),
        "driver_bytes_in_per_step": med(0), "driver_bytes_out_per_step": med(1),
        "driver_bytes_per_step": med(0) + med(1), "actor_calls_per_step": med(2),
        "driver_cpu_seconds_per_step": round(med(3), 4), "step_wall_seconds": round(med(4), 3),
        "per_step": [{"bytes_in": s[0], "bytes_out": s[1], "calls": s[2], "cpu_s": round(s[3], 4),
                      "wall_s": round(s[4], 3)} for s in steps],
        "run_wall_seconds": round(wall, 1), "command": " ".join(["python", "bench/driver_io.py", *sys.argv[1:]]),
    }
    emit_json(result, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
