#!/usr/bin/env bash
# Build one of the project's images, after checking that its base image tag exists.
#
#   bash docker/build.sh train|rollout|musa [--tag NAME:TAG] [docker build args, e.g. --build-arg BASE_IMAGE=...]
#
# A base image tag that the registry does not know stops the build before anything runs, naming the tag
# (`docker manifest inspect`; set SKIP_BASE_CHECK=1 for a base that exists only locally).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: bash docker/build.sh train|rollout|musa [--tag NAME:TAG] [docker build args]" >&2; exit 2; }
[ $# -ge 1 ] || usage
kind="$1"; shift
case "$kind" in
  train)   file=Dockerfile ;;
  rollout) file=docker/Dockerfile.rollout ;;
  musa)    file=docker/Dockerfile.musa ;;
  *) echo "error: unknown image kind '$kind' (train, rollout or musa)" >&2; exit 2 ;;
esac
tag="musacoder-rl:$kind"
args=()
base=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag="$2"; shift 2 ;;
    --build-arg) args+=("$1" "$2"); [[ "$2" == BASE_IMAGE=* ]] && base="${2#BASE_IMAGE=}"; shift 2 ;;
    --build-arg=*) args+=("$1"); [[ "${1#--build-arg=}" == BASE_IMAGE=* ]] && base="${1#--build-arg=BASE_IMAGE=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ -z "$base" ]; then  # the Dockerfile's default
  base="$(sed -n 's/^ARG BASE_IMAGE=//p' "$file" | head -1)"
fi
[ -n "$base" ] || { echo "error: $file declares no default BASE_IMAGE; pass --build-arg BASE_IMAGE=..." >&2; exit 2; }
command -v docker >/dev/null 2>&1 || { echo "error: docker is not installed" >&2; exit 2; }

if [ "${SKIP_BASE_CHECK:-0}" != 1 ]; then
  if ! out="$(docker manifest inspect "$base" 2>&1)"; then
    echo "error: base image '$base' for $file was not found or is not readable: ${out##*$'\n'}" >&2
    echo "       (pick an existing tag with --build-arg BASE_IMAGE=..., log in to its registry, or SKIP_BASE_CHECK=1)" >&2
    exit 3
  fi
fi
echo "[build] $tag from $file on $base"
exec docker build -f "$file" -t "$tag" "${args[@]}" .
