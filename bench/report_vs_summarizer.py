"""Time `harness report` against MLCommons' result_summarizer on the same submission, in one run,
and check that both give the same scores and RCP verdicts.

    python bench/report_vs_summarizer.py [SUBMISSION] [--ruleset 3.0.0] [--repeat 3]
                                         [--json results/bench/report_vs_summarizer.json]

The summarizer rewrites files in its input (scaling.json, by its RCP check) and writes
summary.json into its working folder, so each of its tries runs on a fresh throw-away copy
from a throw-away folder (the copying is not timed); ours reads the original. Both are timed
as fresh processes, the way a user runs them, and the best of `--repeat` tries is kept for each,
in wall time and in CPU time (user + system; steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from summary import machine, publish  # bench/summary.py, beside this script

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "mlperf-results" / "training_v3.0" / "NVIDIA_CoreWeave"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], cwd: Path) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stdout) of one fresh process."""
    started, cpu = time.perf_counter(), _children_cpu()
    done = subprocess.run(cmd, check=True, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - started, _children_cpu() - cpu, done.stdout


def summarizer_scores(summary_json: Path) -> dict[tuple[str, str], tuple[float, str]]:
    """(system, benchmark) -> (score, RCP verdict), from the summarizer's detailed summary.json."""
    scores = {}
    for row in json.loads(summary_json.read_text()):
        for column, value in row.items():
            if column.endswith(":time_to_train") and value is not None:
                benchmark = column.removesuffix(":time_to_train")
                scores[(row["system"], benchmark)] = (value, row.get(f"{benchmark}:RCP") or None)
    return scores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submission", type=Path, nargs="?", default=DEFAULT)
    parser.add_argument("--ruleset", default="3.0.0")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if not args.submission.is_dir():
        print(f"no submission folder at {args.submission}", file=sys.stderr)
        return 2
    size_mb = sum(p.stat().st_size for p in args.submission.rglob("*") if p.is_file()) / 1e6
    ours, theirs = [float("inf")] * 2, [float("inf")] * 2  # best (wall, cpu) seconds
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for _ in range(args.repeat):
            *seconds, report = timed([sys.executable, "-m", "harness", "report", str(args.submission.absolute()),
                                      "--ruleset", args.ruleset, "--format", "json"], cwd=work)
            ours = [min(a, b) for a, b in zip(ours, seconds)]
            copy = work / "copy" / args.submission.name
            shutil.rmtree(copy.parent, ignore_errors=True)
            shutil.copytree(args.submission, copy)
            *seconds, _ = timed([sys.executable, "-m", "mlperf_logging.result_summarizer", str(copy), "training",
                                 args.ruleset], cwd=work)
            theirs = [min(a, b) for a, b in zip(theirs, seconds)]
        official = summarizer_scores(work / "summary.json")
    mine = {(g["system"], g["benchmark"]): (g["score_min"], g["rcp"]) for g in json.loads(report)
            if g["score_min"] is not None}
    same = mine.keys() == official.keys() and all(
        abs(mine[k][0] / official[k][0] - 1) < 1e-9 and mine[k][1] == official[k][1] for k in official)
    publish({"machine": machine(), "submission": str(args.submission), "ruleset": args.ruleset,
             "log_mb": round(size_mb, 1), "harness_report_s": round(ours[0], 3),
             "result_summarizer_s": round(theirs[0], 2), "speedup": round(theirs[0] / ours[0], 1),
             "harness_report_cpu_s": round(ours[1], 3), "result_summarizer_cpu_s": round(theirs[1], 2),
             "cpu_speedup": round(theirs[1] / ours[1], 1), "scores": len(official), "same_scores_and_rcp": same},
            args.json)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
