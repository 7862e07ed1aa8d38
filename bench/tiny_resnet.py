"""Measure the tiny ResNet campaign on this machine: time-to-train, throughput, launcher overhead.

    python bench/tiny_resnet.py [--runs 3] [--json results/bench/tiny_resnet.json]

Launcher overhead is the wall time from starting `harness run` (a fresh
interpreter, as a user types it) to the first run's `run_start` in its MLPerf
log: interpreter and torch start-up, the elastic agent, rendezvous, process
group, dataset and model set-up. The dataset is generated beforehand, so the
figure is the steady state a user sees from the second run on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.results import load
from harness.results.parse import iter_events

from summary import machine, publish  # bench/summary.py, beside this script


def run_start_ms(path: Path) -> float:
    return next(float(e["time_ms"]) for e in iter_events(path.read_bytes()) if e["key"] == "run_start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="separate `harness run` launches to measure")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "HARNESS_DATA_DIR": str(Path(tmp) / "data")}
        from workloads.resnet.data import ensure_tiny_dataset, tiny_dataset_root

        os.environ["HARNESS_DATA_DIR"] = env["HARNESS_DATA_DIR"]
        started = time.perf_counter()
        ensure_tiny_dataset(tiny_dataset_root())
        generate_s = time.perf_counter() - started

        overheads, walls, outs = [], [], []
        for i in range(args.runs):
            out = Path(tmp) / f"run{i}"
            launched_ms = time.time() * 1000
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "harness", "run", "resnet", "--seed", str(100 + i),
                            "--out", str(out)], env=env, check=True, stdout=subprocess.DEVNULL)
            walls.append(time.perf_counter() - t0)
            overheads.append((run_start_ms(out / "result_0.txt") - launched_ms) / 1000)
            outs.append(out)
        runs = load(outs).records

    figures = {
        "machine": machine(),
        "runs": len(runs),
        "succeeded": sum(r.converged for r in runs),
        "dataset_generation_s": round(generate_s, 2),
        "launch_to_run_start_s": {"median": round(statistics.median(overheads), 2),
                                  "all": [round(x, 2) for x in overheads]},
        "time_to_train_min": {"median": round(statistics.median(r.time_to_train_min for r in runs), 3),
                              "all": [round(r.time_to_train_min, 3) for r in runs]},
        "throughput_img_per_s": {"median": round(statistics.median(r.samples_per_s for r in runs), 1)},
        "wall_per_launch_s": {"median": round(statistics.median(walls), 1)},
    }
    publish(figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
