#!/usr/bin/env bash
# A Debian bookworm base image made from Debian's own packages, for a machine that cannot reach
# Docker Hub (compose.offline.yaml builds every image of the stack on it):
#
#   sudo bash deploy/offline/debian-base.sh [TAG]        # default tag: apiary/debian:bookworm
#
# debootstrap (minbase, with python3 and its venv module, which the queen's image needs) into a
# temporary folder, then `docker import`. Needs root, debootstrap and a Debian mirror
# (DEBIAN_MIRROR, default http://deb.debian.org/debian). About a minute.
set -euo pipefail
TAG=${1:-apiary/debian:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
command -v debootstrap > /dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }
ROOTFS=$(mktemp -d /tmp/apiary-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=ca-certificates,python3,python3-venv \
    bookworm "$ROOTFS" "$MIRROR"
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin
tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$TAG"
echo "built $TAG"
