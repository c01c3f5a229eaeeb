#!/usr/bin/env bash
# Builds the router image with no Docker daemon and no base image to pull: buildah (daemonless)
# on a Debian bookworm base that debootstrap makes here (python3, pip), passed to
# docker/router.Dockerfile as PYTHON_IMAGE. For machines that reach package registries only;
# elsewhere `make images` builds on python:3.12-slim. Needs root, buildah and debootstrap
# (Debian: apt-get install buildah debootstrap).
#
#   bash docker/buildah-router.sh [TAG]     # default localhost/pagedserve-router:dev
#
# The base is made once and kept as localhost/pagedserve-base:bookworm. It trusts the host's
# CA bundle, so pip inside the build works where a proxy re-signs TLS as the host's does.
set -euo pipefail
tag=${1:-localhost/pagedserve-router:dev}
base=localhost/pagedserve-base:bookworm
cd "$(dirname "$0")/.."
if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates \
        bookworm "$work/rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
    # pip installs into this image's own Python (PEP 668 would refuse it), as on python:*-slim.
    rm -f "$work"/rootfs/usr/lib/python3*/EXTERNALLY-MANAGED
    cp /etc/ssl/certs/ca-certificates.crt "$work/rootfs/etc/ssl/certs/ca-certificates.crt"
    container=$(buildah from scratch)
    cp -a "$work/rootfs/." "$(buildah mount "$container")/"
    buildah umount "$container"
    buildah config --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt "$container"
    buildah commit -q "$container" "$base"
    buildah rm "$container"
fi
buildah bud --isolation chroot --build-arg PYTHON_IMAGE="$base" -f docker/router.Dockerfile -t "$tag" .
