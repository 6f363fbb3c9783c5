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
# Both tiers run in parallel (pytest-xdist, TEST_WORKERS workers: default the cores, at most 4). The unit tier sends
# a test file per worker at a time; the integration tier one test at a time, its longest first
# (tests/conftest.py::LONGEST_FIRST): its tests start processes of their own, but most of them use one core at a
# time (a compile, a verifier child, Ray actors waiting on each other), so two of them share two cores well. Each
# tier's workers share one verifier cache (tests/conftest.py::build_cache: kernel builds are content-addressed),
# removed when the run ends. A test that fails under a parallel tier's load is run again alone, once, and the tier
# passes only if it then passes; both outcomes are printed. (nproc without OMP_NUM_THREADS, which it would report
# instead of the cores.)
workers="${TEST_WORKERS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)}"
[ "$workers" -gt 4 ] && [ -z "${TEST_WORKERS:-}" ] && workers=4
caches="$(mktemp -d "${TMPDIR:-/tmp}/mrl-test-verifier-cache.XXXXXX")"
trap 'rm -rf "$caches"' EXIT
tiers=(unit integration)
case "${1:-}" in
  unit|integration) tiers=("$1"); shift ;;
esac
status=0
empty=0
for tier in "${tiers[@]}"; do
  select="$tier and not gpu"
  echo "=== $tier tier: -m '$select' ==="
  parallel=()
  if [ "$workers" -gt 1 ]; then
    if [ "$tier" = unit ]; then parallel=(-n "$workers" --dist loadfile)
    else parallel=(-n "$workers" --dist load --maxschedchunk 1); fi
  fi
  failed="$caches/$tier.failed"
  rc=0
  MRL_TEST_VERIFIER_CACHE="$caches/$tier" MRL_TEST_FAILED_FILE="$failed" .venv/bin/python -m pytest tests \
    -m "$select" --durations=25 ${parallel[@]+"${parallel[@]}"} "$@" || rc=$?
  if [ "$rc" -eq 1 ] && [ ${#parallel[@]} -gt 0 ] && [ -s "$failed" ]; then
    mapfile -t again < <(sort -u "$failed")
    if [ "${#again[@]}" -le 3 ]; then
      echo "=== $tier tier: ${#again[@]} test(s) failed with $workers running at once; running them again alone ==="
      rc=0
      MRL_TEST_VERIFIER_CACHE="$caches/$tier" .venv/bin/python -m pytest "${again[@]}" -m "$select" || rc=$?
      [ "$rc" -eq 0 ] && echo "=== $tier tier: passed alone (failed only under parallel load): ${again[*]} ==="
    fi
  fi
  if [ "$rc" -eq 5 ]; then empty=$((empty + 1)); elif [ "$rc" -ne 0 ]; then status=$rc; fi
done
# pytest's 5 means "no test selected": an error only when no tier selected any test
if [ "$status" -eq 0 ] && [ "$empty" -eq "${#tiers[@]}" ]; then status=5; fi
exit "$status"
