#!/usr/bin/env bash
# The base image the Dockerfile builds on (its PYTHON_IMAGE), for hosts that cannot pull one:
#
#   docker/base-image.sh [IMAGE]   prints the image to build on: IMAGE (python:3.11-slim-bookworm by default)
#                                  when the engine has or can pull it, else an equivalent it builds once from
#                                  Debian's packages with debootstrap (Debian bookworm: Python 3.11, pip, CA
#                                  certificates), tagged specsplit-python:3.11-bookworm
set -euo pipefail

WANT=${1:-python:3.11-slim-bookworm}
LOCAL=specsplit-python:3.11-bookworm

if docker image inspect "$WANT" >/dev/null 2>&1 || docker pull -q "$WANT" >/dev/null 2>&1; then
  echo "$WANT"
  exit 0
fi
if ! docker image inspect "$LOCAL" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || { echo "cannot pull $WANT and debootstrap is not installed" >&2; exit 3; }
  root=$(mktemp -d /var/tmp/specsplit-rootfs.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" http://deb.debian.org/debian >"$root.log" 2>&1 \
    || { echo "debootstrap failed (see $root.log)" >&2; exit 3; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' - "$LOCAL" >/dev/null
  rm -f "$root.log"
fi
echo "$LOCAL"
