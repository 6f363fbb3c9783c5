"""pyproject.toml, the lock files and the committed pip resolution agree with each other and with .venv."""
from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))
import lock  # noqa: E402  (launch/ is scripts, not a package)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _satisfied(specs: list[str], pins: dict[str, str]) -> list[str]:
    bad = []
    for s in specs:
        r = Requirement(s)
        v = pins.get(lock.canon(r.name))
        if v is None or (r.specifier and not r.specifier.contains(v, prereleases=True)):
            bad.append(f"{s} (lock: {v})")
    return bad


@pytest.mark.parametrize("spec", lock.LOCKS, ids=lambda s: s.path)
def test_every_lock_pins_what_pyproject_asks_for(spec):
    pins = lock.read_pins(ROOT / spec.path)
    wanted = lock.project_specs(spec.extras)
    assert not _satisfied(wanted, pins)
    if spec.base:  # an extra's lock only adds pins on top of its base
        base = lock.read_pins(ROOT / spec.base)
        assert all(pins[n] == v for n, v in base.items())


def test_test_packages_are_not_runtime_dependencies():
    runtime = lock.read_pins(ROOT / "requirements.lock")
    assert "pytest" not in runtime and "pytest-timeout" not in runtime
    assert not any(Requirement(s).name.startswith("pytest") for s in PYPROJECT["dependencies"])
    assert {"pytest", "pytest-timeout"} <= set(lock.read_pins(ROOT / "requirements-dev.lock"))


def test_the_shared_pins_are_the_ones_the_h200_results_ran_with():
    pins = lock.read_pins(ROOT / "requirements.lock")
    assert (pins["torch"], pins["megatron-core"], pins["transformers"], pins["ray"]) == ("2.11.0", "0.19.2", "5.17.0", "2.60.0")


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(), reason="not running in the project's .venv")
def test_the_venv_is_exactly_the_dev_lock():
    pins = lock.read_pins(ROOT / "requirements-dev.lock")
    # Only the venv's own site-packages: setuptools puts its _vendor folder (a second, older `packaging`)
    # on sys.path once something imports it, and which copy wins would then depend on test order.
    site_dirs = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {lock.canon(d.metadata["Name"]): d.version for d in metadata.distributions(path=site_dirs)}
    wrong = {n: (v, installed.get(n)) for n, v in pins.items() if installed.get(n) != v}
    assert not wrong, f"the venv differs from requirements-dev.lock (pinned, installed): {wrong}"


def test_the_committed_pip_resolution_is_of_these_locks():
    result = json.loads((ROOT / "docker" / "pip_resolution.json").read_text())
    sets = result["sets"]
    for spec in lock.LOCKS:
        entry = sets[spec.path]
        assert entry["sha256"] == lock.sha256(ROOT / spec.path), f"{spec.path} changed: run `python launch/lock.py --check`"
        assert entry["ok"] and not entry["added_by_pip"] and not entry["moved_by_pip"]
    assert sets["docker/rollout.lock"]["sha256"] == lock.sha256(ROOT / "docker" / "rollout.lock")
    assert sets["docker/rollout.lock"]["ok"]
    assert sets["gpu extra on requirements.lock"]["ok"]
    refused = sets["sglang extra on requirements.lock"]
    assert not refused["ok"] and "transformers" in refused["error"]   # why the rollout image exists
    assert "://" not in json.dumps(result).replace("<url>", "")        # no registry hosts in committed results


def test_rollout_lock_shares_the_cluster_wide_pins():
    roll, runtime = lock.read_pins(ROOT / "docker" / "rollout.lock"), lock.read_pins(ROOT / "requirements.lock")
    for n in lock.ROLLOUT_HELD:
        assert roll[n] == runtime[n], n
    assert roll["transformers"] != runtime["transformers"] and "sglang" in roll and "aiohttp-cors" in roll


def test_read_pins_rejects_what_is_not_a_pin(tmp_path):
    (tmp_path / "a.lock").write_text("torch>=2\n")
    with pytest.raises(lock.LockError, match="not a `name==version` pin"):
        lock.read_pins(tmp_path / "a.lock")
    (tmp_path / "b.lock").write_text("torch==2.1\nTorch==2.2\n")
    with pytest.raises(lock.LockError, match="pinned twice"):
        lock.read_pins(tmp_path / "b.lock")


def test_the_project_builds_as_a_wheel(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                        "-q", "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    wheel = next(tmp_path.glob("musacoder_rl-*.whl"))
    import zipfile
    names = zipfile.ZipFile(wheel).namelist()
    assert "megatron_rl/plan.py" in names and "verifier/cli.py" in names and "ckpt_tools/__main__.py" in names
    meta = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "Requires-Dist: torch==2.11.0" in text and 'extra == "sglang"' in text
