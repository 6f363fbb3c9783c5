"""Slurm launch: the batch-side setup against fake slurm commands (fast, always), and the real-slurm selftest
plus the Dockerfile/shell lint (CI, or SLURM_SELFTEST=1 / LINT=1: they install packages and take minutes)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() == "true"


def _setup(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """`ray_cluster_setup` of launch/ray_cluster.sh inside a fake allocation; prints LOG_DIR."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu1\\ngpu2\\ngpu3\\n"\n')
    (bin_dir / "scontrol").chmod(0o755)
    script = f'set -euo pipefail; cd {ROOT}; source launch/ray_cluster.sh; ray_cluster_setup >/dev/null; echo "LOG_DIR=$LOG_DIR"'
    base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[1-3]",
            "SLURM_JOB_NUM_NODES": "3", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_ON_NODE": "16",
            "BASE_LOG_DIR": str(tmp_path / "logs"), "PY": str(bin_dir / "py"), "HOME": str(tmp_path)}
    # a python that has Ray's dashboard packages (the check before bring-up), unless a test says otherwise
    stub = tmp_path / "stub"
    stub.mkdir(exist_ok=True)
    for mod in ("aiohttp_cors", "opencensus", "prometheus_client"):
        (stub / f"{mod}.py").write_text("")
    (bin_dir / "py").write_text(f'#!/usr/bin/env bash\nPYTHONPATH={stub} exec python3 "$@"\n')
    (bin_dir / "py").chmod(0o755)
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={**base, **env}, timeout=60)


def test_setup_writes_a_restart_aware_log_dir_with_canary_env_and_token(tmp_path):
    p = _setup(tmp_path)
    assert p.returncode == 0, p.stderr
    first = Path(p.stdout.strip().split("=", 1)[1])
    assert first == tmp_path / "logs" / "77-logs"
    p = _setup(tmp_path, SLURM_RESTART_COUNT="2")
    second = Path(p.stdout.strip().split("=", 1)[1])
    assert second == tmp_path / "logs" / "77-logs-2" and first.is_dir()       # the first run's logs stay
    env = (second / "cluster.env").read_text()
    assert "CLUSTER_NODES=(gpu1 gpu2 gpu3)" in env and 'GPUS_PER_NODE="8"' in env and "RAY_AUTH_TOKEN_PATH" in env
    assert (second / ".shared_fs_canary").is_file()
    token = second / ".ray_auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text().strip()) == 64
    p = _setup(tmp_path, SLURM_RESTART_COUNT="2")
    assert p.returncode != 0 and "exists already" in p.stderr                  # never logs over a run


def test_setup_refuses_a_node_count_mismatch_and_ports_in_the_ephemeral_range(tmp_path):
    p = _setup(tmp_path, SLURM_JOB_NUM_NODES="4")
    assert p.returncode != 0 and "expands to 3 nodes, the job has 4" in p.stderr
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    p = _setup(tmp_path, SLURM_JOB_ID="78", PORT_WORKER_MIN=str(floor + 10))
    assert p.returncode != 0 and "inside the ephemeral range" in p.stderr


def test_setup_refuses_a_python_without_rays_dashboard(tmp_path):
    p = _setup(tmp_path, PY="python3")   # the system python: no aiohttp_cors / opencensus
    assert p.returncode != 0 and "lacks Ray's dashboard (ray[default])" in p.stderr


def test_scripts_parse():
    for f in ["launch/ray_cluster.sh", "launch/ray_node.sh", "launch/slurm_train.sbatch", "launch/slurm_selftest.sh",
              "docker/build.sh", "docker/entrypoint.sh", "docker/lint.sh"]:
        p = subprocess.run(["bash", "-n", str(ROOT / f)], capture_output=True, text=True)
        assert p.returncode == 0, f"{f}: {p.stderr}"


@pytest.mark.slow
@pytest.mark.skipif(not (IN_CI or os.environ.get("SLURM_SELFTEST") == "1"),
                    reason="real-slurm selftest: runs in CI, or set SLURM_SELFTEST=1 (root + apt, ~4 min)")
def test_real_slurm_selftest():
    p = subprocess.run(["bash", str(ROOT / "launch" / "slurm_selftest.sh")], capture_output=True, text=True,
                       timeout=840, cwd=ROOT)
    last = (p.stdout.strip().splitlines() or ["{}"])[-1]
    out = json.loads(last)
    if "skipped" in out:
        pytest.skip(f"slurm selftest skipped: {out['skipped']}")
    assert p.returncode == 0, p.stderr[-4000:]
    print(last)
    assert out["nodes"] == 2 and out["job_state"] == "COMPLETED"
    assert out["summary"]["steps"] == 2 and out["summary"]["reward_last"] is not None
    assert 0 < out["failfast_seconds"] < 60 and out["killed_node"].startswith("node")
    assert out["requeue_log_dirs"][1] == out["requeue_log_dirs"][0] + "-1" and out["attach_nodes"] == 2


@pytest.mark.skipif(not (IN_CI or os.environ.get("LINT") == "1"),
                    reason="hadolint + shellcheck from PyPI wheels: runs in CI, or set LINT=1")
def test_dockerfiles_and_scripts_lint_clean():
    p = subprocess.run(["bash", str(ROOT / "docker" / "lint.sh")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if "error" in out and "package registry" in out["error"]:
        pytest.skip(out["error"])
    assert p.returncode == 0 and out["clean"], p.stdout[-3000:]


@pytest.mark.parametrize("script", ["launch/slurm_train.sbatch", "launch/slurm_bench_actor.sbatch"])
def test_batch_scripts_find_the_repository_or_say_how_to_submit(tmp_path, script):
    """slurm runs a spool copy of the script, so the repository is the job's working directory (sbatch --chdir) or
    the folder sbatch was called from; submitted from elsewhere, the job says so instead of `source: not found`."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    p = subprocess.run(["bash", str(ROOT / script)], cwd=elsewhere, capture_output=True, text=True, timeout=60,
                       env={**env, "SLURM_SUBMIT_DIR": str(elsewhere)})
    assert p.returncode == 1 and f"{elsewhere} is not the repository" in p.stderr and "--chdir=REPO" in p.stderr
    # --chdir=REPO: the working directory is the repository while SLURM_SUBMIT_DIR is where sbatch was called;
    # the script gets past the check (to the next one, the missing allocation)
    p = subprocess.run(["bash", str(ROOT / script)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**env, "SLURM_SUBMIT_DIR": str(elsewhere), "PY": "true"})
    assert "is not the repository" not in p.stderr
