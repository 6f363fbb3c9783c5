#!/usr/bin/env bash
# README command two: build .venv if needed, then run the CPU test suite.
# Extra arguments go to pytest (e.g. `bash tests/run.sh -k bridge -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/_env.sh
ensure_venv
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest tests "$@"
