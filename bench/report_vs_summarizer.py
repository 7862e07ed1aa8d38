"""Time `harness report` (which runs mlperf-logging's compliance checker on every file, as the summarizer
does) against MLCommons' result_summarizer on the same submissions, in one run, and check that both give
the same scores and RCP verdicts. Goal: warm 30x or more faster than the summarizer, cold 3x or more.

    python bench/report_vs_summarizer.py [--repeat 3] [--json results/bench/report_vs_summarizer.json]

The submissions are the NVIDIA+CoreWeave v3.0 tree and the shared tree with the most result files
(../shared/mlperf-results/, each with the ruleset official-scores.json gives it). For each, three
timings, interleaved so that a busy machine slows them alike:
- cold: `harness report` with an empty verdict cache (HARNESS_DATA_DIR in a fresh folder): every file
  goes through the checker, in worker processes;
- warm: `harness report` again on a cache that holds every verdict, as when a notebook or CI re-reads a
  tree;
- the summarizer: `python -m mlperf_logging.result_summarizer TREE training RULESET`, which checks each
  file with the same checker, parses it again, and runs the RCP checker (which parses it once more). It
  rewrites files in its input (scaling.json) and writes summary.json into its working folder, so each try
  runs on a fresh throw-away copy from a throw-away folder (the copying is not timed).
All are fresh processes, the way a user runs them; the best of `--repeat` tries is kept, in wall time and
in CPU time (user + system of the process and its workers; steadier on a shared machine). The ratios are
the summarizer's time over the report's. `checker_cpu_s` is the checker alone on every file, one after
another in this process: the least CPU time a cold report can take, and so the most its CPU-time ratio
can reach while the checker runs in full.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from summary import machine, publish  # bench/summary.py, beside this script

SHARED = Path(__file__).resolve().parents[2] / "shared" / "mlperf-results"
COREWEAVE = "training_v3.0/NVIDIA_CoreWeave"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], cwd: Path, env: dict | None = None) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stdout) of one fresh process, its workers' CPU included."""
    started, cpu = time.perf_counter(), _children_cpu()
    done = subprocess.run(cmd, check=True, cwd=cwd, capture_output=True, text=True, env=env)
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


def trees() -> list[tuple[str, str]]:
    """(folder, ruleset): the CoreWeave tree and the shared tree with the most result files."""
    rows = json.loads((SHARED / "official-scores.json").read_text())["scores"]
    rulesets = {row["folder"]: row["ruleset"] for row in rows}
    largest = max(rulesets, key=lambda folder: len(list((SHARED / folder).rglob("result_*.txt"))))
    return [(folder, rulesets[folder]) for folder in dict.fromkeys([COREWEAVE, largest])]


def checker_cpu(tree: Path, ruleset: str) -> float:
    """CPU seconds of mlperf-logging's checker alone on every file of the tree, in this process."""
    from mlperf_logging.compliance_checker import mlp_compliance  # noqa: F401 - imported before the clock starts

    from harness.results.compliance import check_file

    started = time.process_time()
    for path in sorted(tree.rglob("result_*.txt")):
        check_file(str(path), ruleset)
    return time.process_time() - started


def measure(tree: Path, ruleset: str, repeat: int, work: Path) -> dict:
    best = {name: [float("inf")] * 2 for name in ("cold", "warm", "summarizer")}  # (wall, cpu) seconds

    def keep(name: str, seconds: list[float]) -> None:
        best[name] = [min(a, b) for a, b in zip(best[name], seconds)]

    report = [sys.executable, "-m", "harness", "report", str(tree.absolute()), "--ruleset", ruleset, "--format",
              "json"]
    warm_cache = work / "warm-cache"
    for i in range(repeat):
        cold_cache = work / f"cold-cache-{i}"
        *seconds, output = timed(report, cwd=work, env={**os.environ, "HARNESS_DATA_DIR": str(cold_cache)})
        keep("cold", seconds)
        if i == 0:
            shutil.copytree(cold_cache, warm_cache)  # every verdict, for the warm runs
        *seconds, output = timed(report, cwd=work, env={**os.environ, "HARNESS_DATA_DIR": str(warm_cache)})
        keep("warm", seconds)
        copy = work / "copy" / tree.name
        shutil.rmtree(copy.parent, ignore_errors=True)
        shutil.copytree(tree, copy)
        *seconds, _ = timed([sys.executable, "-m", "mlperf_logging.result_summarizer", str(copy), "training", ruleset],
                            cwd=work)
        keep("summarizer", seconds)
    official = summarizer_scores(work / "summary.json")
    mine = {(g["system"], g["benchmark"]): (g["score_min"], g["rcp"]) for g in json.loads(output)
            if g["score_min"] is not None}
    same = mine.keys() == official.keys() and all(
        abs(mine[k][0] / official[k][0] - 1) < 1e-9 and mine[k][1] == official[k][1] for k in official)
    summarizer_wall, summarizer_cpu = best["summarizer"]
    checker = checker_cpu(tree, ruleset)
    return {"submission": str(tree), "ruleset": ruleset, "result_files": len(list(tree.rglob("result_*.txt"))),
            "log_mb": round(sum(p.stat().st_size for p in tree.rglob("*") if p.is_file()) / 1e6, 1),
            "cold_report_s": round(best["cold"][0], 3), "warm_report_s": round(best["warm"][0], 3),
            "result_summarizer_s": round(summarizer_wall, 2),
            "cold_speedup": round(summarizer_wall / best["cold"][0], 1),
            "warm_speedup": round(summarizer_wall / best["warm"][0], 1),
            "cold_report_cpu_s": round(best["cold"][1], 3), "warm_report_cpu_s": round(best["warm"][1], 3),
            "result_summarizer_cpu_s": round(summarizer_cpu, 2),
            "cold_cpu_speedup": round(summarizer_cpu / best["cold"][1], 1),
            "warm_cpu_speedup": round(summarizer_cpu / best["warm"][1], 1),
            "checker_cpu_s": round(checker, 2), "cold_cpu_speedup_bound": round(summarizer_cpu / checker, 1),
            "scores": len(official), "same_scores_and_rcp": same}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if not (SHARED / "official-scores.json").is_file():
        print(f"no shared MLPerf results at {SHARED}", file=sys.stderr)
        return 2
    figures = []
    load_before = os.getloadavg()
    for folder, ruleset in trees():
        with tempfile.TemporaryDirectory() as tmp:
            figures.append(measure(SHARED / folder, ruleset, args.repeat, Path(tmp)))
    # The machine's load average (1, 5, 15 min) before and after: other work slows the report's parallel
    # checking more than the one-process summarizer.
    publish({"machine": machine(), "load_average": [[round(x, 1) for x in load_before],
                                                    [round(x, 1) for x in os.getloadavg()]], "trees": figures},
            args.json)
    return 0 if all(f["same_scores_and_rcp"] for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
