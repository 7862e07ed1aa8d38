"""The straggler detector's cost as a share of training time, measured inside one run (goal: under 1%).

    python bench/straggler_overhead.py [--steps 200] [--window 10] [--json results/bench/straggler_overhead.json]

A real `harness run resnet` (2 ranks, gloo) with straggler windows every WINDOW seconds
(short, so that a short run closes many). The detector times itself (its forward hooks;
the calibration and every window's all-gather) and writes both running totals in each
window of the run record; the measured share is that time against the training time the
same record holds, in the same run, so machine load moves both alike. The share at the
default 60 s window follows from the same two measured costs: the hooks' per step, the
collectives' per window. Rank 0's figures: every rank runs the same hooks and collectives.
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
DEFAULT_WINDOW_S = 60.0  # harness run's --straggler-window default


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
    spent = windows[-1]["overhead_s"]
    share = (spent["hooks"] + spent["windows"]) / covered_s
    # At the default window the same measured costs spread over more steps: the hooks' cost per step and the
    # collectives' cost per window, from this run, over a window of DEFAULT_WINDOW_S of this run's steps.
    steps_covered = sum(min(r["steps"][1], last_step) - r["steps"][0] + 1 for r in train if r["steps"][0] <= last_step)
    per_step, per_window = spent["hooks"] / steps_covered, spent["windows"] / (len(windows) + 1)  # + calibration
    mean_step = train_s / steps
    default_share = (per_step * DEFAULT_WINDOW_S / mean_step + per_window) / DEFAULT_WINDOW_S
    summary = {"machine": machine(), "workload": f"resnet tiny, 2 CPU ranks, {args.steps} steps",
               "window_s": args.window, "windows": len(windows), "window_steps": windows[-1]["window_steps"],
               "mean_step_s": round(mean_step, 4), "detector_hooks_s": spent["hooks"],
               "detector_windows_s": spent["windows"], "training_s_covered": round(covered_s, 2),
               "overhead_share_measured": round(share, 5),
               "hooks_per_step_s": round(per_step, 7), "collectives_per_window_s": round(per_window, 5),
               "overhead_share_at_default_window": round(default_share, 6), "default_window_s": DEFAULT_WINDOW_S,
               "goal_share": GOAL, "met": default_share < GOAL and share < 2 * GOAL}
    publish(summary, args.json)
    return 0 if summary["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
