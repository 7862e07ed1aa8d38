#!/bin/sh
# Installs what the container tests need (Debian's podman, runc and debootstrap, with uidmap, fuse-overlayfs
# and slirp4netns), when it can: as root, with apt-get. Otherwise it says why and the tests marked `container`
# skip with that reason. It never fails the test command.
if command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_container: not root or no apt-get: container tests will be skipped (install podman, runc and debootstrap to run them)" >&2
    exit 0
fi
packages="podman runc debootstrap uidmap fuse-overlayfs slirp4netns"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q $packages >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $packages >/dev/null 2>&1; } \
    || echo "install_container: apt-get could not install $packages: container tests will be skipped" >&2
exit 0
