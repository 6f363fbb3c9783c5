#!/usr/bin/env bash
# README command one: build .venv if needed, then run the main job (RL training) on this machine.
# Extra arguments go to the trainer: config overrides (key=value), --model HF_DIR, --resume.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/_env.sh
ensure_venv
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m megatron_rl.train --config configs/quickstart.yaml "$@"
