#!/usr/bin/env bash
# README command two: build .venv if needed, then run the CPU test suite in two tiers, unit first
# (in-process, seconds each) then integration (tests marked `slow`: spawned ranks, Ray, compiles,
# end-to-end training runs). `bash tests/run.sh unit` or `bash tests/run.sh integration` runs one tier;
# other arguments go to pytest (e.g. `bash tests/run.sh unit -k bridge -x`). Each tier prints its 25
# slowest tests, so the suite's time stays visible.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/_env.sh
ensure_venv
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# one verifier build cache for both tiers (tests/conftest.py::verifier_cache_root): content-addressed, so a
# kernel compiled by a unit test is not compiled again by an integration test; removed when the run ends
if [ -z "${MRL_TEST_VERIFIER_CACHE:-}" ]; then
  MRL_TEST_VERIFIER_CACHE="$(mktemp -d "${TMPDIR:-/tmp}/mrl-test-verifier-cache.XXXXXX")"
  trap 'rm -rf "$MRL_TEST_VERIFIER_CACHE"' EXIT
fi
export MRL_TEST_VERIFIER_CACHE
tiers=(unit integration)
case "${1:-}" in
  unit|integration) tiers=("$1"); shift ;;
esac
status=0
empty=0
for tier in "${tiers[@]}"; do
  select="$tier and not gpu"
  echo "=== $tier tier: -m '$select' ==="
  rc=0
  .venv/bin/python -m pytest tests -m "$select" --durations=25 "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then empty=$((empty + 1)); elif [ "$rc" -ne 0 ]; then status=$rc; fi
done
# pytest's 5 means "no test selected": an error only when no tier selected any test
if [ "$status" -eq 0 ] && [ "$empty" -eq "${#tiers[@]}" ]; then status=5; fi
exit "$status"
