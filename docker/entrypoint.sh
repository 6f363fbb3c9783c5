#!/usr/bin/env bash
# Image entrypoint: print the versions this container runs with, then run the trainer.
#
#   docker run IMAGE --config configs/qwen3_8b.yaml --model /ckpt/Qwen3-8B train.steps=10   # the trainer
#   docker run IMAGE bash | ray ... | python ...                                             # any command
#
# Arguments that start with `-` or look like `key=value` go to `python -m megatron_rl.train`; a first
# argument that is a command on PATH runs that command instead (slurm's pyxis steps use this for `ray`).
set -euo pipefail
PY="${PYTHON:-python}"
cd "${MUSACODER_HOME:-/opt/musacoder-rl}"

if [ "${MUSACODER_QUIET:-0}" != 1 ]; then
  "$PY" - <<'PYEOF' >&2 || true
from importlib import metadata
names = ["torch", "torch_musa", "megatron-core", "transformers", "ray", "transformer-engine", "flash-attn",
         "fla-core", "sglang", "omegaconf"]
found = []
for n in names:
    try:
        found.append(f"{n}={metadata.version(n)}")
    except metadata.PackageNotFoundError:
        pass
print("[image] " + " ".join(found))
PYEOF
fi

if [ $# -gt 0 ] && [[ "$1" != -* ]] && [[ "$1" != *=* ]] && command -v "$1" >/dev/null 2>&1; then
  exec "$@"
fi
exec "$PY" -m megatron_rl.train "$@"
