# Shared by launch/quickstart.sh and tests/run.sh: find Python >= 3.12 and make sure .venv
# matches the lock files. Sourced, not executed.
#
# .venv is built from requirements-dev.lock: the runtime closure (requirements.lock, generated from
# pyproject.toml by `python launch/lock.py`) plus the test extra (pytest, pytest-timeout) and the musa extra
# (mthreads-ml-py). It is (re)built when it is missing or when either lock changed since it was built
# (tracked by a hash stamp written last, so an interrupted install is redone, never half-used).

find_python312() {
  local c
  for c in "${PYTHON:-}" python3.12 python3 $(ls -d "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 2>/dev/null) \
           /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
    if "$c" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done
  return 1
}

ensure_venv() {
  local root stamp want py
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  stamp="$root/.venv/.requirements.sha256"
  want="$(cat "$root/requirements.lock" "$root/requirements-dev.lock" | sha256sum | cut -d' ' -f1)"
  if [ -x "$root/.venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  py="$(find_python312)" || { echo "error: Python >= 3.12 not found (tried python3.12, python3, ~/.pyenv/versions/3.12*); set PYTHON=/path/to/python3.12" >&2; return 1; }
  echo "[env] building .venv with $py from requirements-dev.lock (first run downloads torch, a few minutes)" >&2
  rm -rf "$root/.venv"
  "$py" -m venv "$root/.venv" || return 1
  # --no-cache-dir: pip's wheel cache would hold a second copy of torch and its CUDA libraries
  # (several GB) next to the venv; a CI disk once ran out of space on exactly that.
  "$root/.venv/bin/python" -m pip install -q --no-cache-dir --upgrade pip || return 1
  # (byte-compiled at install, as pip does by default: the verifier's sandboxed children cannot write .pyc files
  # into the venv, so without them every child start would compile torch's modules again)
  "$root/.venv/bin/python" -m pip install -q --no-cache-dir -r "$root/requirements-dev.lock" || {
    echo "error: pip install -r requirements-dev.lock failed (free disk where the venv lives: $(df -h "$root" | awk 'NR==2{print $4}'))" >&2
    return 1; }
  echo "$want" > "$stamp.tmp" && mv "$stamp.tmp" "$stamp"
}
