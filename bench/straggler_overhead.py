"""The straggler detector's cost as a share of training time, measured inside one run (goal: under 1%).

    python bench/straggler_overhead.py [--steps 200] [--window 10] [--json results/bench/straggler_overhead.json]

A real `harness run resnet` (2 ranks, gloo) with straggler windows every WINDOW seconds.
The detector times itself (its forward hooks, the calibration and every window's
all-gather) and writes the running total in each window of the run record; the share is
that total against the training time the same record holds, in the same run, so machine
load moves both alike. Rank 0's figure: every rank runs the same hooks and collectives.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from summary import machine, publish  # bench/summary.py, beside this script

GOAL = 0.01


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=float, default=10.0, help="seconds between straggler checks")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "HARNESS_DATA_DIR": os.environ.get("HARNESS_DATA_DIR") or str(Path(tmp) / "data")}
        out = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "harness", "run", "resnet", "--max-steps", str(args.steps),
                        "--straggler-window", f"{args.window:g}", "--metrics-port", "0", "--out", str(out)],
                       env=env, check=False, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (out / "run_0.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    windows = [r for r in records if r["kind"] == "stragglers"]
    if not windows:
        raise SystemExit("no straggler window closed: give more --steps or a shorter --window")
    train_s = sum(r["end"] - r["start"] for r in train)
    steps = sum(r["steps"][1] - r["steps"][0] + 1 for r in train)
    # The newest window's running total covers the run up to it; count training time up to the same step.
    last_step = windows[-1]["steps"][1]
    covered_s = sum((r["end"] - r["start"]) * min(1.0, max(0.0, (last_step - r["steps"][0] + 1)
                                                         / (r["steps"][1] - r["steps"][0] + 1))) for r in train)
    share = windows[-1]["overhead_s"] / covered_s
    summary = {"machine": machine(), "workload": f"resnet tiny, 2 CPU ranks, {args.steps} steps",
               "window_s": args.window, "windows": len(windows), "window_steps": windows[-1]["window_steps"],
               "mean_step_s": round(train_s / steps, 4), "detector_s": windows[-1]["overhead_s"],
               "training_s_covered": round(covered_s, 2), "overhead_share": round(share, 5),
               "goal_share": GOAL, "met": share < GOAL}
    publish(summary, args.json)
    return 0 if summary["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
