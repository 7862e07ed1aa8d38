#!/usr/bin/env bash
# bench/gpu_throughput.py on a GPU machine that has only torch, pandas, matplotlib and pytest and no
# network: installs what else it needs from .wheelhouse/ (filled beforehand with
# `python bench/wheelhouse.py fill` where PyPI is reachable) into a scratch folder, then runs the bench
# with that folder and this checkout on PYTHONPATH. Arguments go to gpu_throughput.py.
#   bench/gpu_throughput.sh [--workloads resnet,bert,gpt3,llama31_8b,gpt_oss_20b,flux1] [--out-dir results/bench]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
site=${GPU_BENCH_SITE:-${TMPDIR:-/tmp}/gpu-bench-site}
"$python" bench/wheelhouse.py install --target "$site"
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" bench/gpu_throughput.py "$@"
