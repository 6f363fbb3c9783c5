#!/usr/bin/env bash
# README command one: build .venv if needed, then run the main job on this machine.
# Extra arguments are passed through as config overrides (key=value) to the trainer.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/_env.sh
ensure_venv
export PYTHONUNBUFFERED=1
if [ -f megatron_rl/train.py ]; then
  exec .venv/bin/python -m megatron_rl.train --config configs/quickstart.yaml "$@"
fi
# Until the RL trainer lands: verify the bundled tasks' reference-as-candidate on this machine.
exec .venv/bin/python -m verifier eval --tasks verifier/tasks --self-check --out runs/quickstart/verify.jsonl "$@"
