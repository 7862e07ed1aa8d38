#!/bin/sh
# The whole suite on a slow, busy machine: pytest pinned to fewer cores, beside a CPU hog on every core.
# It proves that no test depends on how fast the machine is (a test that counts what fits in N seconds
# fails here). Run it from the repository root after the README's test command has installed everything:
#
#   sh tests/under_load.sh                  # the whole suite: 1 core for the tests, a hog on every core
#   sh tests/under_load.sh -m "not slow"    # any pytest arguments pass through
#
# UNDER_LOAD_CORES   cores the tests may use, counted from core 0 (default 1)
# UNDER_LOAD_NICE    the hogs' niceness: 0 takes an equal share of each core, 19 almost none (default 10)
set -eu
cd "$(dirname "$0")/.."
cores="${UNDER_LOAD_CORES:-1}"
nice="${UNDER_LOAD_NICE:-10}"
all="$(nproc --all)"
case "$cores" in ''|*[!0-9]*) echo "under_load: UNDER_LOAD_CORES must be a whole number, got '$cores'" >&2; exit 2;; esac
case "$nice" in ''|*[!0-9]*) echo "under_load: UNDER_LOAD_NICE must be 0 to 19, got '$nice'" >&2; exit 2;; esac
if [ "$cores" -lt 1 ] || [ "$cores" -gt "$all" ]; then
    echo "under_load: UNDER_LOAD_CORES must be 1 to $all (this machine's cores), got $cores" >&2
    exit 2
fi
if [ "$nice" -gt 19 ]; then
    echo "under_load: UNDER_LOAD_NICE must be 0 to 19, got $nice" >&2
    exit 2
fi
command -v taskset >/dev/null || { echo "under_load: taskset (util-linux) is needed to pin the tests" >&2; exit 2; }

hogs=""
stop_hogs() { [ -z "$hogs" ] || kill $hogs 2>/dev/null || true; }
trap stop_hogs EXIT INT TERM
core=0
while [ "$core" -lt "$all" ]; do
    taskset -c "$core" nice -n "$nice" python3 -c "while True: pass" &
    hogs="$hogs $!"
    core=$((core + 1))
done
echo "under_load: tests on core(s) 0-$((cores - 1)) of $all, a busy loop at nice $nice on each core" >&2
started="$(date +%s)"
status=0
taskset -c "0-$((cores - 1))" python -m pytest "$@" || status=$?
echo "under_load: pytest exited $status after $(( $(date +%s) - started )) s" >&2
exit "$status"
