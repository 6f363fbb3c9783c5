"""Which sandbox layers a GPU child tolerates on this machine (run where the verifier farm runs).

    python bench/verifier_sandbox_probe.py [--backend cuda]

Starts one sandboxed probe child per configuration (all layers, then each layer switched off alone) and
reports the isolation each applied and whether the device initialised inside it, as JSON.
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

PROBE = '''
import traceback
try:
    import torch
    dev = getattr(torch, {backend!r})
    ok = bool(dev.is_available())
    err = None
    if ok:
        x = torch.ones(1024, device={backend!r})
        ok = float((x * 2).sum()) == 2048.0
    else:
        try:
            dev.init()
        except Exception as e:
            err = f"{{type(e).__name__}}: {{e}}"
except Exception:
    ok, err = False, traceback.format_exc()[-1500:]
chan.send({{"op": "device", "ok": ok, "error": err}})
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda", choices=["cuda", "musa"])
    args = parser.parse_args()

    from verifier.config import VerifierConfig
    from verifier.devices import get_backend
    from verifier.sandbox import ChildFailed, SandboxedChild

    variants = {
        "all_layers": {},
        "no_landlock": {"landlock": False},
        "landlock_proc_self": {"extra_writable": ("/dev/shm", "/proc/self")},
        "landlock_proc_driver": {"extra_writable": ("/dev/shm", "/proc/driver")},
        "landlock_proc": {"extra_writable": ("/dev/shm", "/proc")},
    }
    out = {"env": {k: v for k, v in os.environ.items() if "CUDA" in k or "NVIDIA" in k or "MUSA" in k}}
    for name, overrides in variants.items():
        cfg = VerifierConfig(backend=args.backend, **overrides)
        workdir = tempfile.mkdtemp(prefix="verifier-probe-")
        child = SandboxedChild("probe", {"code": PROBE.format(backend=args.backend)}, cfg, get_backend(args.backend),
                               workdir, [])
        t0 = time.monotonic()
        child.start()
        msgs = []
        try:
            while True:
                msgs.append(child.recv(time.monotonic() + 120))
        except ChildFailed:
            pass
        except Exception as e:
            msgs.append({"op": "parent_error", "error": repr(e)})
        exit_info = child.close()
        shutil.rmtree(workdir, ignore_errors=True)
        out[name] = {"messages": msgs, "exit": exit_info.describe(), "stderr": exit_info.stderr_tail[-800:],
                     "seconds": round(time.monotonic() - t0, 2)}
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
