#!/usr/bin/env bash
# Build a Debian bookworm base image with python3 + venv WITHOUT pulling from any registry:
# debootstrap a minimal root filesystem from a Debian mirror, then `docker import` it.
#
#   docker/build-base-image.sh [IMAGE_REPO [EXTRA_PACKAGES]]   (default IMAGE_REPO: pdserve-base)
#
# Prints the image reference (IMAGE_REPO:bookworm-<key>) as the last line of stdout. Use it as
# the Dockerfile's base:  docker build --build-arg BASE_IMAGE=<that> ...
# EXTRA_PACKAGES (comma-separated) go into that image too. The image that compiles the C kernels
# needs a compiler the runtime image must not carry, so it is a second base:
#   docker/build-base-image.sh pdserve-build-base gcc,libc6-dev
#   docker build --build-arg BASE_IMAGE=<first> --build-arg BUILD_BASE_IMAGE=<second> ...
#
# Cached twice, keyed by a hash of everything that goes into the root filesystem:
#   - the image itself (if `docker image inspect` finds it, nothing else runs);
#   - the root filesystem tarball under $PDSERVE_DOCKER_CACHE (default /var/cache/pdserve-docker),
#     so a wiped Docker state costs a `docker import` (seconds) rather than a debootstrap (~1 min).
# Needs root (debootstrap), `debootstrap` and `docker` (apt-get install debootstrap docker.io).
set -euo pipefail

REPO="${1:-pdserve-base}"
CACHE="${PDSERVE_DOCKER_CACHE:-/var/cache/pdserve-docker}"
SUITE="${PDSERVE_BASE_SUITE:-bookworm}"
MIRROR="${PDSERVE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
INCLUDE="python3,python3-venv,ca-certificates${2:+,$2}"
DOCKER="${DOCKER:-docker}"
# Bump when the recipe below changes, so stale caches are not reused.
RECIPE=2

KEY="$(printf '%s|%s|%s|%s|%s' "$SUITE" "$MIRROR" "$INCLUDE" minbase "$RECIPE" \
  | sha256sum | cut -c1-12)"
IMAGE="$REPO:$SUITE-$KEY"
TARBALL="$CACHE/base-$SUITE-$KEY.tar"

log() { echo "build-base-image: $*" >&2; }

if "$DOCKER" image inspect "$IMAGE" >/dev/null 2>&1; then
  log "cached image $IMAGE"
  echo "$IMAGE"
  exit 0
fi

mkdir -p "$CACHE"
if [[ ! -s "$TARBALL" ]]; then
  command -v debootstrap >/dev/null || { log "debootstrap not installed"; exit 2; }
  ROOTFS="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
  trap 'rm -rf "$ROOTFS" "$TARBALL.part"' EXIT
  log "debootstrap $SUITE into $ROOTFS (about a minute)"
  debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$ROOTFS" "$MIRROR" >&2
  # Trim what an image does not need: apt lists and caches, docs, man pages.
  chroot "$ROOTFS" apt-get clean
  rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin \
    "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
    "$ROOTFS"/var/log/*.log "$ROOTFS"/var/log/apt/*
  # The image's resolver and hostname come from the container runtime.
  : >"$ROOTFS/etc/resolv.conf"
  : >"$ROOTFS/etc/hostname"
  tar --numeric-owner -C "$ROOTFS" -cf "$TARBALL.part" .
  mv "$TARBALL.part" "$TARBALL"
  rm -rf "$ROOTFS"
  trap - EXIT
fi

log "docker import $TARBALL as $IMAGE"
"$DOCKER" import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' \
  "$TARBALL" "$IMAGE" >&2
echo "$IMAGE"
