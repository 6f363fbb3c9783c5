"""The Dockerfiles, checked offline (no Docker daemon here): build context, no venv, entrypoint, the NGC
constraint-file handling, and the base-tag check of docker/build.sh."""
from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "docker" / "Dockerfile.rollout", ROOT / "docker" / "Dockerfile.musa"]
sys.path.insert(0, str(ROOT / "docker"))
import install_lock  # noqa: E402


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _ignored(rel: str, patterns: list[str]) -> bool:
    hit = False
    for p in patterns:
        neg = p.startswith("!")
        p = p.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel, p + "/*") or any(
                fnmatch.fnmatch(part, p.replace("**/", "")) for part in rel.split("/")):
            hit = not neg
    return hit


def _dockerignore() -> list[str]:
    return [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def test_dockerignore_keeps_the_venv_git_and_runs_out():
    pats = _dockerignore()
    for rel in (".venv/bin/python", ".git/HEAD", "runs/quickstart/metrics.jsonl", "logs/12-logs/batch.log",
                "megatron_rl/__pycache__/x.pyc"):
        assert _ignored(rel, pats), rel
    for rel in ("megatron_rl/train.py", "requirements.lock", "docker/entrypoint.sh", "configs/quickstart.yaml",
                "bench/results/actor_h200.json"):
        assert not _ignored(rel, pats), rel


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(dockerfile):
    ins = _instructions(dockerfile)
    ops = [op for op, _ in ins]
    assert ins[0][0] == "ARG" and ins[0][1].startswith("BASE_IMAGE=") and ("FROM", "${BASE_IMAGE}") in ins
    text = dockerfile.read_text()
    assert not re.search(r"-m venv|virtualenv |uv venv|conda create", text), "no venv in the image"
    pats = _dockerignore()
    for op, rest in ins:
        if op == "COPY" and not rest.startswith("--from"):
            *srcs, _dst = rest.split()
            for s in srcs:
                if s == ".":
                    continue
                assert (ROOT / s).exists(), f"{dockerfile.name}: COPY source {s} does not exist"
                assert not _ignored(s, pats), f"{dockerfile.name}: COPY source {s} is excluded by .dockerignore"
    assert ("ENTRYPOINT", '["/opt/musacoder-rl/docker/entrypoint.sh"]') in ins
    assert ops.index("COPY") < [i for i, (o, r) in enumerate(ins) if o == "COPY" and r.startswith(". ")][0], \
        "dependencies are copied (and installed) before the code"
    if dockerfile.name != "Dockerfile.rollout":
        assert "docker/install_lock.py --lock requirements-cluster.lock" in text
    else:
        assert "-r docker/rollout.lock" in text


def _entrypoint(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    fake = tmp_path / "fakepython"
    fake.write_text("#!/usr/bin/env bash\necho \"python-called $*\"\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "MUSACODER_HOME": str(ROOT), "MUSACODER_QUIET": "1"}
    return subprocess.run(["bash", str(ROOT / "docker" / "entrypoint.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=30)


def test_entrypoint_runs_the_trainer_or_a_command(tmp_path):
    p = _entrypoint("--config", "configs/qwen3_8b.yaml", "train.steps=3", tmp_path=tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "python-called -m megatron_rl.train --config configs/qwen3_8b.yaml train.steps=3"
    p = _entrypoint("train.steps=3", tmp_path=tmp_path)
    assert p.stdout.strip() == "python-called -m megatron_rl.train train.steps=3"
    p = _entrypoint("echo", "hello", tmp_path=tmp_path)
    assert p.stdout.strip() == "hello"


LOCK = {"torch": "2.11.0", "triton": "3.6.0", "nvidia-cublas": "13.1.0.3", "cuda-toolkit": "13.0.2",
        "nvidia-ml-py": "13.615.71", "transformers": "5.17.0", "megatron-core": "0.19.2", "numpy": "2.5.5"}


def test_ngc_base_keeps_its_torch_stack_and_the_lock_wins_elsewhere():
    constraint = "torch==2.11.0a0+abc.nv26.3\ntransformers==4.57.0\nnumpy==2.5.5\nflash-attn==2.8.3\n"
    installed = {"torch": "2.11.0a0+abc.nv26.3", "transformer-engine": "2.9.0", "flash-attn": "2.8.3"}
    plan = install_lock.make_plan(LOCK, constraint, installed, torch_minor=None, any_torch=False)
    assert set(plan.kept_from_base) == {"torch", "triton", "nvidia-cublas", "cuda-toolkit"}
    assert set(plan.install) == {"nvidia-ml-py", "transformers", "megatron-core", "numpy"}
    assert plan.constraint_overrides == {"transformers": ("4.57.0", "5.17.0")}
    assert "transformers==4.57.0" not in plan.constraint_lines and "flash-attn==2.8.3" in plan.constraint_lines


def test_a_base_with_another_torch_is_refused_naming_both():
    with pytest.raises(install_lock.InstallError, match=r"base image's torch is 2\.10\.0a0.*pins torch 2\.11\.0"):
        install_lock.make_plan(LOCK, "", {"torch": "2.10.0a0+nv25.12"}, torch_minor=None, any_torch=False)
    plan = install_lock.make_plan(LOCK, "", {"torch": "2.7.1"}, torch_minor=None, any_torch=True)   # MUSA
    assert plan.base_torch == "2.7.1" and "torch" not in plan.install
    with pytest.raises(install_lock.InstallError, match="no torch installed"):
        install_lock.make_plan(LOCK, "", {}, torch_minor=None, any_torch=True)


def test_install_lock_plan_only_cli(tmp_path):
    (tmp_path / "x.lock").write_text("".join(f"{k}=={v}\n" for k, v in LOCK.items()))
    (tmp_path / "constraint.txt").write_text("transformers==4.57.0\n")
    (tmp_path / "installed.json").write_text(json.dumps({"torch": "2.11.0a0+nv"}))
    p = subprocess.run([sys.executable, str(ROOT / "docker" / "install_lock.py"), "--lock", str(tmp_path / "x.lock"),
                        "--constraint", str(tmp_path / "constraint.txt"), "--installed-json", str(tmp_path / "installed.json"),
                        "--plan-only"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["constraint_overrides"] == {"transformers": ["4.57.0", "5.17.0"]}
    assert (tmp_path / "constraint.txt").read_text() == "transformers==4.57.0\n"   # plan-only changes nothing


def _build(*args: str, tmp_path: Path, manifest_ok: bool) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "docker.log"
    (bin_dir / "docker").write_text(
        "#!/usr/bin/env bash\necho \"$*\" >> " + str(log) + "\n"
        'if [ "$1" = manifest ]; then ' + ("exit 0" if manifest_ok else 'echo "no such manifest: $3" >&2; exit 1') + "; fi\n"
        "exit 0\n")
    (bin_dir / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(ROOT / "docker" / "build.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=30)


def test_build_refuses_a_missing_base_tag_naming_it(tmp_path):
    p = _build("train", "--build-arg", "BASE_IMAGE=nvcr.io/nvidia/pytorch:99.99-py3", tmp_path=tmp_path, manifest_ok=False)
    assert p.returncode == 3 and "base image 'nvcr.io/nvidia/pytorch:99.99-py3'" in p.stderr
    assert "build" not in (tmp_path / "docker.log").read_text().split("\n")[-2]   # docker build never ran
    p = _build("rollout", tmp_path=tmp_path, manifest_ok=True)
    assert p.returncode == 0
    last = (tmp_path / "docker.log").read_text().strip().splitlines()[-1]
    assert last.startswith("build -f docker/Dockerfile.rollout -t musacoder-rl:rollout")
    p = _build("tpu", tmp_path=tmp_path, manifest_ok=True)
    assert p.returncode == 2 and "unknown image kind 'tpu'" in p.stderr
