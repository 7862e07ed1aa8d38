"""Where compiling lands, on and off the clock, on CPU with `--compile on` (the tiny ResNet, 2 ranks, gloo).

    python bench/clock_start.py [--json results/bench/clock_start.json]

Four real `harness run resnet --compile on` campaigns, figures read from their run records (run_<i>.jsonl):
  cold          --warm-up off: the first timed step compiles (as every run did before the warm-up);
  warm          a campaign of 2 runs with the warm-up: run 1 compiles in its init, run 2 reads the compiled code
                (the process's caches and the campaign's folder, compile_cache/);
  restart       a rank killed at step 6: the restarted attempt (new processes, no warm-up: its clock runs)
                compiles its first step from the campaign's folder;
  restart-cold  the same with torch's caches off (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1): what the folder saves.
The first-step multiple is the first timed step's seconds over the median steady step's (the records give each
attempt's first step alone). Rank 0's figures; every figure is a measurement of this machine at that moment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from summary import machine, publish  # bench/summary.py, beside this script

STEPS = 30


def campaign(out: Path, env: dict, *args: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "harness", "run", "resnet", "--compile", "on", "--max-steps",
                           str(STEPS), "--checkpoint-every", "5", "--straggler-window", "0", "--out", str(out), *args],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1):  # 1: the short run stops before the target, which is expected
        raise SystemExit(f"harness run {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "run_0.jsonl").read_text().splitlines()]


def first_step(records: list[dict], attempt: int) -> dict:
    """The attempt's first timed step: its seconds, what compiling took of them, and its multiple of a steady step."""
    train = [r for r in records if r["kind"] == "train" and r["attempt"] == attempt]
    steady = [(r["end"] - r["start"]) / (r["steps"][1] - r["steps"][0] + 1) for r in train[1:]]
    seconds = train[0]["end"] - train[0]["start"]
    return {"first_step_s": round(seconds, 3), "first_step_compile_s": train[0].get("compile_s", 0.0),
            "steady_step_s": round(statistics.median(steady), 4),
            "first_step_multiple": round(seconds / statistics.median(steady), 1)}


def warm_up(records: list[dict]) -> dict:
    done = next(r for r in records if r["kind"] == "warm_up")
    return {"warm_up_s": round(done["end"] - done["start"], 2), "warm_up_compile_s": done.get("compile_s")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "HARNESS_DATA_DIR": os.environ.get("HARNESS_DATA_DIR") or str(Path(tmp) / "data")}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # each campaign's own folder
        campaign(Path(tmp) / "dataset", {**env}, "--compile", "off", "--max-steps", "1")  # the tiny dataset, once
        cold = campaign(Path(tmp) / "cold", env, "--warm-up", "off")
        warm = campaign(Path(tmp) / "warm", env, "--warm-up", "on", "--runs", "2")
        warm_second = [json.loads(line) for line in (Path(tmp) / "warm" / "run_1.jsonl").read_text().splitlines()]
        restart = campaign(Path(tmp) / "restart", env, "--inject-failure", "1:6")
        restart_cold = campaign(Path(tmp) / "restart-cold", {**env, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"},
                                "--inject-failure", "1:6")
    summary = {
        "machine": machine(),
        "workload": f"resnet tiny, 2 CPU ranks (gloo), --compile on, {STEPS} steps",
        "cold (no warm-up)": first_step(cold, 0),
        "run 1 (warm-up)": {**warm_up(warm), **first_step(warm, 0)},
        "run 2 (warm-up, compiled code reused)": {**warm_up(warm_second), **first_step(warm_second, 0)},
        "restarted attempt (campaign cache)": first_step(restart, 1),
        "restarted attempt (caches off)": first_step(restart_cold, 1),
    }
    publish(summary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
