"""Time `harness run gpt3 --dry-run` for 448 nodes x 8 GPUs on every cluster backend, and check that
each rerun prints the same bytes.

    python bench/render_requests.py [--repeat 5] [--out results/bench/render.json]

Each render is a fresh process, as a user runs it, so interpreter start-up and imports count;
`python -c pass` in the same run is the reference floor. Goal: under 2 s each.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GOAL_S = 2.0
FORMS = {
    "slurm": ["--backend", "slurm"],
    "k8s-pytorchjob": ["--backend", "k8s"],
    "k8s-trainjob": ["--backend", "k8s", "--api", "trainjob"],
}


def timed(cmd: list[str]) -> tuple[float, bytes]:
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, check=True)
    return time.perf_counter() - started, done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "bench" / "render.json")
    args = parser.parse_args()
    floor = statistics.median(timed([sys.executable, "-c", "pass"])[0] for _ in range(args.repeat))
    record = {"machine": f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} cores",
              "python_start_s": round(floor, 3), "goal_s": GOAL_S, "forms": {}}
    ok = True
    for name, extra in FORMS.items():
        cmd = [sys.executable, "-m", "harness", "run", "gpt3", *extra, "--profile", "coreweave-h100", "--nodes", "448",
               "--gpus-per-node", "8", "--dry-run", "--out", "/results/gpt3-448"]
        runs = [timed(cmd) for _ in range(args.repeat)]
        times = [t for t, _ in runs]
        identical = len({out for _, out in runs}) == 1
        record["forms"][name] = {"median_s": round(statistics.median(times), 3), "max_s": round(max(times), 3),
                                 "bytes": len(runs[0][1]), "identical": identical}
        ok &= identical and max(times) < GOAL_S
        print(f"{name:15s} median {statistics.median(times):.2f} s, max {max(times):.2f} s, "
              f"{len(runs[0][1])} bytes, identical on rerun: {identical}")
    print(f"python -c pass: {floor:.3f} s; goal: each under {GOAL_S} s -> {'met' if ok else 'MISSED'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
