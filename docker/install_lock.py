"""Install a lock file on top of a base image that already ships torch (NGC PyTorch, Moore Threads' musa-pytorch).

    python docker/install_lock.py --lock requirements-cluster.lock [--extra 'fla-core==0.4.2' ...]
                                  [--constraint /etc/pip/constraint.txt] [--torch-minor 2.11 | --any-torch]
                                  [--plan-only]

Why: NGC PyTorch images pin every package they were built with in /etc/pip/constraint.txt (since 25.03),
and their torch, TransformerEngine, flash-attn and apex are compiled against each other. Installing the
project's lock there as-is either fails (ResolutionImpossible against the constraint file) or replaces the
base's torch with PyPI's and breaks the compiled extensions. So:

1. The torch stack stays the base's (`TORCH_STACK`: torch, triton, the CUDA/`nvidia-*` runtime wheels that
   PyPI's torch needs and the base replaces with its system CUDA). The lock's torch must have the base's
   major.minor (`--torch-minor`, default: the lock's), else the build stops naming both versions.
2. Every other lock pin wins over the base's constraint for the same package: that line is dropped from the
   constraint file (rewritten in place, atomically), so later `pip install`s in the image keep the
   project's versions; each override is printed.
3. pip installs the filtered lock under the adjusted constraints, then `pip check` must not name a locked
   package.

`--plan-only` prints the plan (JSON) and installs nothing: tests/launch exercises it with a fake base.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")
TORCH_STACK = re.compile(r"^(torch|triton|pytorch-triton|cuda-(bindings|pathfinder|toolkit)|nvidia-(?!ml-py$).+)$")


class InstallError(RuntimeError):
    pass


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    if not path.is_file():
        raise InstallError(f"lock file not found: {path}")
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r "):
            pins.update(read_lock(path.parent / line[3:].strip()))
            continue
        m = PIN.match(line)
        if not m:
            raise InstallError(f"{path}: not a pin: {raw!r}")
        pins[canon(m.group(1))] = m.group(2)
    return pins


def minor(version: str) -> str:
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise InstallError(f"cannot read a major.minor from version {version!r}")
    return f"{m.group(1)}.{m.group(2)}"


@dataclasses.dataclass
class Plan:
    install: dict[str, str]                  # name -> version, what pip installs
    kept_from_base: dict[str, str]           # torch stack: name -> base version (None if the base lacks it)
    constraint_overrides: dict[str, tuple[str, str]]  # name -> (base constraint, lock pin)
    constraint_lines: list[str]              # the adjusted constraint file
    base_torch: str | None


def make_plan(lock: dict[str, str], constraint_text: str, installed: dict[str, str], *,
              torch_minor: str | None, any_torch: bool) -> Plan:
    base_torch = installed.get("torch")
    if base_torch is None:
        raise InstallError("the base image has no torch installed: use an NGC PyTorch or musa-pytorch base")
    want = torch_minor or (minor(lock["torch"]) if "torch" in lock else None)
    if not any_torch and want and minor(base_torch) != want:
        raise InstallError(f"the base image's torch is {base_torch}, the lock pins torch {lock.get('torch')} "
                           f"(needs {want}.x): pick a base whose torch matches (BASE_IMAGE) or pass --any-torch")
    install: dict[str, str] = {}
    kept: dict[str, str] = {}
    for name, version in lock.items():
        if TORCH_STACK.match(name):
            kept[name] = installed.get(name, "")
        else:
            install[name] = version
    overrides: dict[str, tuple[str, str]] = {}
    lines: list[str] = []
    for raw in constraint_text.splitlines():
        m = PIN.match(raw.strip())
        if m and canon(m.group(1)) in install and m.group(2) != install[canon(m.group(1))]:
            overrides[canon(m.group(1))] = (m.group(2), install[canon(m.group(1))])
            continue
        lines.append(raw)
    return Plan(install, kept, overrides, lines, base_torch)


def installed_distributions() -> dict[str, str]:
    return {canon(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="docker/install_lock.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lock", required=True, type=Path)
    ap.add_argument("--extra", action="append", default=[], help="more requirement specs (e.g. the gpu extra)")
    ap.add_argument("--constraint", type=Path, default=Path("/etc/pip/constraint.txt"))
    ap.add_argument("--torch-minor", help="required major.minor of the base's torch (default: the lock's)")
    ap.add_argument("--any-torch", action="store_true", help="accept any base torch (the MUSA image)")
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--installed-json", type=Path, help=argparse.SUPPRESS)  # tests: a fake base's packages
    a = ap.parse_args(argv)
    try:
        lock = read_lock(a.lock)
        installed = (json.loads(a.installed_json.read_text()) if a.installed_json else installed_distributions())
        constraint_text = a.constraint.read_text() if a.constraint.is_file() else ""
        plan = make_plan(lock, constraint_text, installed, torch_minor=a.torch_minor, any_torch=a.any_torch)
    except InstallError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"base_torch": plan.base_torch, "install": len(plan.install),
                      "kept_from_base": plan.kept_from_base,
                      "constraint_overrides": {k: list(v) for k, v in plan.constraint_overrides.items()}},
                     indent=1, sort_keys=True), flush=True)
    if a.plan_only:
        return 0
    if a.constraint.is_file():
        write_atomic(a.constraint, "\n".join(plan.constraint_lines) + "\n")
    with tempfile.TemporaryDirectory() as d:
        req = Path(d) / "requirements.txt"
        req.write_text("".join(f"{n}=={v}\n" for n, v in sorted(plan.install.items())) + "".join(f"{s}\n" for s in a.extra))
        cmd = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "-r", str(req)]
        if a.constraint.is_file():
            cmd += ["-c", str(a.constraint)]
        if subprocess.run(cmd).returncode != 0:
            print(f"error: pip install of {a.lock} on this base failed (see above)", file=sys.stderr)
            return 1
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    ours = [ln for ln in check.stdout.splitlines() if any(canon(ln.split()[0]) == n for n in plan.install)]
    if ours:
        print("error: pip check names locked packages:\n  " + "\n  ".join(ours), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
