#!/usr/bin/env bash
# The whole recipe on one CPU machine (ARCHITECTURE.md): generate tasks -> teacher data -> SFT a tiny model ->
# RFT -> RL a few steps -> evaluate every stage on held-out tasks with the CPU verifier. Builds .venv if needed.
# Extra arguments are recipe overrides (key=value, see configs/recipe_cpu.yaml), e.g. workdir=runs/r2.
# The last stdout line is JSON: stages' pass_at_8, heldout_tasks, wall_seconds, model (the final HF export).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/_env.sh
ensure_venv
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m megatron_rl.recipe --config configs/recipe_cpu.yaml "$@"
