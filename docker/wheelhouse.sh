#!/usr/bin/env bash
# Fill docker/wheelhouse/ with every wheel the image needs, downloaded ON THE HOST, so that
# `docker build` installs with `pip install --no-index --find-links` and needs no network.
#
#   docker/wheelhouse.sh            (run from anywhere; uses the repo this script lives in)
#
# Wheels are for the image's platform (CPython 3.11, glibc manylinux x86_64), not the host's.
# torch is the CPU build (torch==2.13.0+cpu, override with PDSERVE_TORCH_SPEC); if the configured
# package indexes do not have it, the PyTorch CPU index (PDSERVE_TORCH_INDEX_URL) is added.
# The download is cached under $PDSERVE_DOCKER_CACHE (default /var/cache/pdserve-docker), keyed
# by a hash of the requirements and the target platform; docker/wheelhouse/ receives hard links
# (or copies across file systems). ~1 GB: the ucxx-cu12 stack alone is ~350 MB.
# PDSERVE_EXTRAS (comma-separated, e.g. structured) adds optional-dependency groups, for an image
# built with the matching --build-arg (WITH_STRUCTURED=1).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${PDSERVE_DOCKER_CACHE:-/var/cache/pdserve-docker}"
DEST="$ROOT/docker/wheelhouse"
PY="${PYTHON:-python3}"
TORCH_SPEC="${PDSERVE_TORCH_SPEC:-torch==2.13.0+cpu}"
TORCH_INDEX_URL="${PDSERVE_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
# glibc 2.36 (bookworm) and every older manylinux tag (pip does not expand them itself).
PLATFORM=(--python-version 3.11 --implementation cp --abi cp311 --only-binary=:all:)
for minor in $(seq 36 -1 5); do PLATFORM+=(--platform "manylinux_2_${minor}_x86_64"); done
for legacy in manylinux2014 manylinux2010 manylinux1; do
  PLATFORM+=(--platform "${legacy}_x86_64")
done
RECIPE=1

log() { echo "wheelhouse: $*" >&2; }

EXTRAS=()
IFS=',' read -ra _groups <<<"${PDSERVE_EXTRAS:-}"
for group in "${_groups[@]}"; do [[ -n "$group" ]] && EXTRAS+=(--extra "$group"); done
REQS="$("$PY" "$ROOT/docker/requirements.py" "$ROOT/pyproject.toml" --torch "$TORCH_SPEC" \
  "${EXTRAS[@]}")"
# The build tools go in too: the image upgrades pip and builds pdserve itself offline.
REQS="$REQS"$'\n'"pip"$'\n'"setuptools>=68"$'\n'"wheel"
KEY="$(printf '%s|%s|%s' "$REQS" "${PLATFORM[*]}" "$RECIPE" | sha256sum | cut -c1-12)"
WHEELS="$CACHE/wheels-$KEY"

if [[ ! -f "$WHEELS/.complete" ]]; then
  mkdir -p "$CACHE"
  TMP="$(mktemp -d "$CACHE/wheels.XXXXXX")"
  trap 'rm -rf "$TMP"' EXIT
  printf '%s\n' "$REQS" >"$TMP/requirements.txt"
  EXTRA=()
  if ! "$PY" -m pip download -q --no-deps -d "$TMP" "${PLATFORM[@]}" "$TORCH_SPEC" \
    >/dev/null 2>&1; then
    log "$TORCH_SPEC is not on the configured indexes; adding $TORCH_INDEX_URL"
    EXTRA=(--extra-index-url "$TORCH_INDEX_URL")
  fi
  log "pip download into $TMP (cold: ~1 GB)"
  "$PY" -m pip download --progress-bar off -d "$TMP" "${PLATFORM[@]}" "${EXTRA[@]}" \
    -r "$TMP/requirements.txt" >&2
  rm -f "$TMP/requirements.txt"
  touch "$TMP/.complete"
  rm -rf "$WHEELS"
  mv "$TMP" "$WHEELS"
  trap - EXIT
else
  log "cached $WHEELS"
fi

mkdir -p "$DEST"
find "$DEST" -maxdepth 1 -name '*.whl' -delete
cp -al "$WHEELS"/*.whl "$DEST"/ 2>/dev/null || cp "$WHEELS"/*.whl "$DEST"/
log "$(find "$DEST" -maxdepth 1 -name '*.whl' | wc -l) wheels in $DEST ($(du -sh "$WHEELS" | cut -f1))"
