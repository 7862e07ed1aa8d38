"""Time `harness report` against MLCommons' result_summarizer on the same submission, in one run.

    python bench/report_vs_summarizer.py [SUBMISSION] [--ruleset 3.0.0] [--repeat 3]

The summarizer rewrites files in its input (scaling.json) and writes
summary.json into its working folder, so it runs on a throw-away copy from a
throw-away folder; ours reads the original. Both are timed as fresh processes, the
way a user runs them, and the best of `--repeat` tries is kept for each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "mlperf-results" / "training_v3.0" / "NVIDIA_CoreWeave"


def best_time(cmd: list[str], repeat: int, cwd: Path) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submission", type=Path, nargs="?", default=DEFAULT)
    parser.add_argument("--ruleset", default="3.0.0")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if not args.submission.is_dir():
        print(f"no submission folder at {args.submission}", file=sys.stderr)
        return 2
    size_mb = sum(p.stat().st_size for p in args.submission.rglob("*") if p.is_file()) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        ours = best_time([sys.executable, "-m", "harness", "report", str(args.submission.absolute()), "--ruleset",
                          args.ruleset, "--format", "json"], args.repeat, cwd=Path(tmp))
        copy = Path(tmp) / args.submission.name
        shutil.copytree(args.submission, copy)
        # The summarizer also writes summary.json (and more) into its working folder: the throw-away one.
        theirs = best_time([sys.executable, "-m", "mlperf_logging.result_summarizer", str(copy), "training",
                            args.ruleset], args.repeat, cwd=Path(tmp))
    print(json.dumps({"submission": str(args.submission), "log_mb": round(size_mb, 1),
                      "harness_report_s": round(ours, 2), "result_summarizer_s": round(theirs, 2),
                      "speedup": round(theirs / ours, 1)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
