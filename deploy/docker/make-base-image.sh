#!/usr/bin/env bash
# Builds the base image tandem-base:bookworm (Debian bookworm: python3, venv, pip, build-essential) without a
# registry: debootstrap from the Debian mirror apt already uses, then `docker import`. Skips if the image exists.
#   deploy/docker/make-base-image.sh [IMAGE]      (DEBIAN_MIRROR=URL to choose the mirror)
set -euo pipefail
image=${1:-tandem-base:bookworm}
if docker image inspect "$image" >/dev/null 2>&1; then
    echo "$image exists"; exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install -y debootstrap" >&2; exit 1; }
if [ -z "${DEBIAN_MIRROR:-}" ]; then  # the first Debian mirror in apt's sources (deb822 or one-line format)
    DEBIAN_MIRROR=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list 2>/dev/null \
        | grep -oE 'https?://[^ ]+/debian/?( |$)' | grep -v security | head -1 | tr -d ' ' || true)
    DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
fi
root=$(mktemp -d /tmp/tandem-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm from $DEBIAN_MIRROR into $root (a few minutes)"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python3-dev,build-essential,ca-certificates \
    bookworm "$root" "$DEBIAN_MIRROR" >"$root.log" 2>&1 || { tail -30 "$root.log" >&2; exit 1; }
rm -f "$root.log"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
tar -C "$root" -c . | docker import -c 'CMD ["/bin/bash"]' -c 'ENV LANG=C.UTF-8' - "$image"
echo "imported $image"
