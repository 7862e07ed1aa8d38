"""Time from a fault to the first productive step after restore, on CPU (goal: p50 <= 10 s).

    python bench/fault_recovery.py [--faults 5] [--json results/bench/fault_recovery.json]

Each trial is a real `harness run resnet` (2 ranks, gloo) whose rank 1 is SIGKILLed at a
seeded random step (--inject-failure). From the run record: the fault's moment, the
restarted attempt's process start, its restore, and the end of its first training step
(the first train record's start plus one step's share of it). Splits: detection and
restart (fault -> new process), start-up (-> restore), restore, first step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from summary import machine, publish  # bench/summary.py, beside this script


def trial(step: int, out: Path, env: dict) -> dict:
    subprocess.run([sys.executable, "-m", "harness", "run", "resnet", "--inject-failure", f"1:{step}",
                    "--checkpoint-every", "5", "--max-steps", str(step + 10), "--out", str(out)],
                   env=env, capture_output=True, check=False)
    lines = [json.loads(line) for line in (out / "run_0.jsonl").read_text().splitlines()]
    fault = next(r["start"] for r in lines if r["kind"] == "fault")
    again = [r for r in lines if r["attempt"] == 1]
    started = next(r["start"] for r in again if r["kind"] == "startup")
    restore = next((r for r in again if r["kind"] == "restore"), None)
    train = next(r for r in again if r["kind"] == "train")
    first_step_end = train["start"] + (train["end"] - train["start"]) / (train["steps"][1] - train["steps"][0] + 1)
    return {"fault_step": step, "fault_to_first_step_s": round(first_step_end - fault, 2),
            "detect_and_restart_s": round(started - fault, 2),
            "startup_s": round((restore or train)["start"] - started, 2),
            "restore_s": round(restore["end"] - restore["start"], 3) if restore else 0.0,
            "first_step_s": round(first_step_end - train["start"], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "HARNESS_DATA_DIR": os.environ.get("HARNESS_DATA_DIR") or str(Path(tmp) / "data")}
        trial(6, Path(tmp) / "warm-up", env)  # generates the tiny dataset once, outside the figures
        trials = [trial(rng.randint(6, 40), Path(tmp) / f"trial-{i}", env) for i in range(args.faults)]
    seconds = [t["fault_to_first_step_s"] for t in trials]
    summary = {"machine": machine(),
               "workload": "resnet tiny, 2 CPU ranks, checkpoint every 5 steps",
               "fault_to_first_step_s": {"p50": statistics.median(seconds), "max": max(seconds)},
               "goal_p50_s": 10.0, "met": statistics.median(seconds) <= 10.0, "trials": trials}
    publish(summary, args.json)
    return 0 if summary["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
