#!/bin/sh
# Installs what the Slurm tests need (Debian's slurm-wlm and munge), when it can: as root, with apt-get.
# Otherwise it says why and the tests marked `slurm` skip with that reason. It never fails the test command.
if command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm: not root or no apt-get: Slurm tests will be skipped (install slurm-wlm and munge to run them)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q slurm-wlm munge >/dev/null 2>&1; } \
    || echo "install_slurm: apt-get could not install slurm-wlm and munge: Slurm tests will be skipped" >&2
exit 0
