"""The training loop's own cost: each workload's step in a bare loop against the harness's --synthetic run of it.

    python bench/loop_overhead.py [--benchmarks resnet,bert,llama31_8b] [--steps 300] [--last 250]
                                  [--repeats 3] [--cpus 0,1] [--json results/bench/loop_overhead.json]

Both sides run the same workload class with the same options (tiny preset, synthetic input, the
preset's batch and optimizer), on 2 gloo ranks under torch.distributed.run, one thread per rank
(as the local launcher sets OMP_NUM_THREADS), pinned to the same CPUs:
  bare     the workload's own train_step in a plain `for` loop: model, batch, optimizer, LR schedule,
           and nothing else (no MLPerf log, run record, checkpoints, straggler hooks, metrics or progress);
  harness  `python -m workloads BENCH --synthetic --max-steps STEPS ...` with the worker arguments
           `harness run BENCH --synthetic --max-steps STEPS` gives its workers (harness.spec.JobSpec),
           the metrics feed on: the whole worker, its loop included.
Each side times the start of every step (on rank 0); the rate is over the last LAST of STEPS steps,
from the start of step STEPS-LAST to the start of step STEPS, so both sides count the same steps and
everything the harness does between them. Checkpoint saves (the tiny preset saves every 20 steps) and
evaluations inside that window are timed on their own and left out, as the harness's tracked_stats
leaves them out; their seconds are in the JSON. Sides alternate (bare first in odd repeats, harness
first in even ones) so that a change in the machine's load falls on both; each figure is the median of
REPEATS, and `ratio` is harness / bare of the medians, measured in the same run. Launches of one side differ
by several percent (`rate_range`), so a ratio near 1 needs enough repeats to mean anything. Beside the rate,
what other load moves less: rank 0's CPU time per step, the main thread's CPU time inside train_step (the
same ops on both sides: `train_step_cpu_ms`), and the first step after each save (`after_left_out`).
`--quick` (a test's mode) runs 12 steps, the last 8, once: it checks the shape, not the speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from summary import machine, publish  # noqa: E402  bench/summary.py, beside this script

BENCHMARKS = ("resnet", "bert", "llama31_8b")
UNITS = {"resnet": "img/s", "bert": "seq/s", "llama31_8b": "tokens/s"}
SIDES = ("bare", "harness")
# A harness feature's own cost: the harness side again with that one feature off (--features-off), as the
# JobSpec field (or environment) that turns it off.
FEATURES = {"stragglers": {"straggler_window": "0"},  # no forward hooks, calibration or window all-gathers
            "saves": {"checkpoint_every": "1000000"},  # the tiny preset saves every 20 steps
            "metrics": {}}  # no HARNESS_METRICS_DIR: the metrics feed writes nothing
RANKS = 2


# --- one side, on every rank (under torch.distributed.run) -----------------------------------------------------

def worker(side: str, benchmark: str, steps: int, out: Path, stamps_file: Path) -> None:
    """One side on this rank; `side` is bare, harness, or harness-no-FEATURE."""
    from harness.spec import JobSpec
    from workloads.common import resilience
    from workloads.common.campaign import RunOptions, freeze_init_objects, run_campaign, seed_everything
    from workloads.common.distributed import init_distributed, shutdown_distributed
    from workloads.common.page_cache import clear_page_caches
    from workloads.registry import BENCHMARKS as REGISTRY

    starts: list[float] = []
    cpu: list[float] = []  # this process's CPU seconds (all its threads) at each start: less moved by other load
    ends: list[float] = []  # when each train_step returned: the rest, until the next start, is the loop's
    # This thread's CPU seconds inside each train_step: the step's own work, the same ops on both sides, which
    # another process's load moves least (neither the gloo threads nor waiting for the other rank are in it).
    step_cpu: list[float] = []
    samples: list[int] = []
    # Saves and evals, (wall start, wall end, CPU start, CPU end): not training, as tracked_stats leaves them out.
    left_out: list[tuple[float, float, float, float]] = []

    def timed(method):
        def run(*args, **kwargs):
            began, began_cpu = time.perf_counter(), time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                left_out.append((began, time.perf_counter(), began_cpu, time.process_time()))
        return run

    base = REGISTRY[benchmark].workload_class()
    per_sample = []  # tokens per sequence for the language models' tokens/s, else 1

    class Timed(base):
        def train_step(self, batches):
            starts.append(time.perf_counter())
            cpu.append(time.process_time())
            began = time.thread_time()
            loss, trained = super().train_step(batches)
            step_cpu.append(time.thread_time() - began)
            ends.append(time.perf_counter())
            samples.append(trained)
            if not per_sample:
                per_sample.append(self.cfg.model.seq_len if UNITS[benchmark] == "tokens/s" else 1)
            return loss, trained

        evaluate = timed(base.evaluate)

    off = FEATURES.get(side.removeprefix("harness-no-"), {}) if side.startswith("harness-no-") else {}
    spec = JobSpec(benchmark=benchmark, synthetic=True, max_steps=steps, seed=1, out_dir=out, **off).resolved()
    opts = RunOptions.parse(spec.worker_args())
    if side.startswith("harness"):
        resilience.Resilience.save = timed(resilience.Resilience.save)
        run_campaign(Timed, opts)
    else:
        ctx = init_distributed()
        # As the harness does before every run (MLPerf's cache_clear): where it may, it drops the whole
        # machine's page cache, and on a shared machine the re-reading that follows slows every process for a
        # while, so the bare side does it too, and both sides start from the same state.
        clear_page_caches(ctx, opts.out)
        seed_everything(opts.seed + ctx.rank)
        workload = Timed(opts, ctx, opts.seed)
        # As the harness does after its init: else the first full collection of the init's objects (about 0.2 s)
        # falls inside one side's timed steps or the other's, wherever their allocations happen to make it due.
        freeze_init_objects()
        workload.open_data()
        gc.freeze()  # and what open_data built, as the harness does after run_start
        batches = workload.batches(0)
        for _ in range(steps):
            workload.train_step(batches)
        workload.close()
        shutdown_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        stamps_file.write_text(json.dumps({"starts": starts, "ends": ends, "cpu": cpu, "step_cpu": step_cpu,
                                           "samples": samples,
                                           "left_out": left_out, "per_sample": per_sample[0],
                                           "hooks_us_per_step": hooks_per_step(out)}))


def hooks_per_step(out: Path) -> float | None:
    """The straggler detector's forward hooks, in microseconds per step, as it timed itself in the run record
    (inside train_step, so not in the time between steps); None without a window (the bare side)."""
    from workloads.common.run_record import read_json_lines, run_record_path

    windows = [r for r in read_json_lines(run_record_path(out, 0)) if r.get("kind") == "stragglers"]
    return round(windows[-1]["overhead_s"]["hooks"] / windows[-1]["steps"][1] * 1e6, 2) if windows else None


# --- the driver -----------------------------------------------------------------------------------------------

def window(stamps: dict, last: int) -> dict:
    """Samples per second over the last `last` steps: from the start of step n-last to the start of step n,
    less the saves and evals inside (each lies between two steps, so wholly inside or outside); and rank 0's
    CPU seconds per step over the same steps, which other processes' load moves less than the wall clock.
    The first step after a save or eval is slower (the save's memory comes back as page faults, the caches
    are cold): its extra time over the median step, a cost of the saves that the rate keeps, is given apart."""
    starts, samples = stamps["starts"], stamps["samples"]
    begin, end = starts[-1 - last], starts[-1]
    inside = [(a, b, c, d) for a, b, c, d in stamps["left_out"] if begin <= a and b <= end]
    excluded, excluded_cpu = sum(b - a for a, b, _, _ in inside), sum(d - c for _, _, c, d in inside)
    trained = sum(samples[-1 - last:-1])
    seconds = end - begin - excluded
    steps = range(len(starts) - 1 - last, len(starts) - 1)
    step_ms = statistics.median(stamps["ends"][i] - starts[i] for i in steps) * 1000
    between = [starts[i + 1] - stamps["ends"][i] for i in steps]
    between_ms = statistics.median(between) * 1000
    cpu = stamps["cpu"][-1] - stamps["cpu"][-1 - last] - excluded_cpu
    step_cpu_ms = statistics.median(stamps["step_cpu"][i] for i in steps) * 1000
    after = [i for i in steps if any(stamps["ends"][i - 1] <= a and b <= starts[i] for a, b, _, _ in inside)]
    after_ms = statistics.median(stamps["ends"][i] - starts[i] for i in after) * 1000 - step_ms if after else None
    after_cpu_ms = statistics.median(stamps["step_cpu"][i] for i in after) * 1000 - step_cpu_ms if after else None
    return {"steps_run": len(starts), "samples": trained, "seconds": round(seconds, 3),
            "left_out_s": round(excluded, 3), "rate": trained * stamps["per_sample"] / seconds,
            "cpu_ms_per_step": round(cpu / last * 1000, 3),
            "hooks_us_per_step": stamps.get("hooks_us_per_step"), "train_step_ms_median": round(step_ms, 3),
            "train_step_cpu_ms_median": round(step_cpu_ms, 3),
            "after_left_out": {"steps": len(after), "extra_ms": after_ms and round(after_ms, 3),
                               "extra_cpu_ms": after_cpu_ms and round(after_cpu_ms, 3)},
            "between_steps_ms_median": round(between_ms, 3),
            # The loop's own time: outside train_step, saves and evals left out, as a share of the window.
            "between_steps_share": round((sum(between) - excluded) / seconds, 5)}


def launch(side: str, benchmark: str, steps: int, cpus: set[int], folder: Path) -> dict:
    """One side, as a fresh torch.distributed.run of RANKS processes on `cpus`; its rank 0's step stamps."""
    stamps_file, out = folder / f"{side}.json", folder / side
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.setdefault("HARNESS_DATA_DIR", str(folder / "data"))
    if side.startswith("harness") and side != "harness-no-metrics":
        env["HARNESS_METRICS_DIR"] = str(folder / "metrics")  # the node agent hands workers this folder
        (folder / "metrics").mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
               __file__, "--worker", side, "--benchmarks", benchmark, "--steps", str(steps),
               "--out", str(out), "--stamps", str(stamps_file)]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    if done.returncode != 0 or not stamps_file.is_file():
        raise SystemExit(f"loop_overhead: the {side} {benchmark} run failed ({done.returncode}):\n"
                         f"{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(stamps_file.read_text())


def measure(benchmark: str, steps: int, last: int, repeats: int, cpus: set[int],
            features_off: list[str]) -> dict:
    sides = (*SIDES, *(f"harness-no-{f}" for f in features_off))
    rates: dict[str, list[float]] = {side: [] for side in sides}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for repeat in range(repeats):
        for side in sides if repeat % 2 == 0 else sides[::-1]:
            with tempfile.TemporaryDirectory(prefix="loop-overhead-") as tmp:
                figures = window(launch(side, benchmark, steps, cpus, Path(tmp)), last)
            figures["rate"] = round(figures["rate"], 1)
            runs[side].append(figures)
            rates[side].append(figures["rate"])
            print(f"{benchmark} {side} #{repeat + 1}: {figures['rate']:,.1f} {UNITS[benchmark]}", file=sys.stderr)
    median = {side: statistics.median(rates[side]) for side in sides}
    pairs = [h / b for b, h in zip(rates["bare"], rates["harness"])]
    cpu = {side: statistics.median(r["cpu_ms_per_step"] for r in runs[side]) for side in sides}
    step_cpu = {side: statistics.median(r["train_step_cpu_ms_median"] for r in runs[side]) for side in sides}
    found = {"unit": UNITS[benchmark], "bare": round(median["bare"], 1), "harness": round(median["harness"], 1),
             "ratio": round(median["harness"] / median["bare"], 4), "pair_ratios": [round(r, 4) for r in pairs],
             # Launch to launch the same side moves by more than 2% (each process's memory layout, other load): a
             # ratio means something only beside these ranges, and a close call needs more --repeats.
             "rate_range": {side: [min(rates[side]), max(rates[side])] for side in sides},
             # The same comparison in rank 0's CPU time per step (bare / harness: 1.0 is no cost of its own).
             "cpu_ms_per_step": cpu, "cpu_ratio": round(cpu["bare"] / cpu["harness"], 4),
             # Inside train_step, the main thread's CPU time (median step, median launch): whether the same step
             # costs more in the harness's process (bare / harness: 1.0 is no cost of its own).
             "train_step_cpu_ms": step_cpu, "train_step_cpu_ratio": round(step_cpu["bare"] / step_cpu["harness"], 4),
             # The harness's time between steps (its loop, run record, metrics, straggler windows, loss checks), as
             # a share of its training time: measured directly, so other load moves it far less than the ratio.
             "between_steps_share": statistics.median(r["between_steps_share"] for r in runs["harness"])}
    # Each feature's own share: how much faster the harness runs without it, by wall clock and by CPU time.
    found["features_off"] = {f: {"rate": round(median[f"harness-no-{f}"], 1),
                                 "share": round(1 - median["harness"] / median[f"harness-no-{f}"], 4),
                                 "cpu_share": round(1 - cpu[f"harness-no-{f}"] / cpu["harness"], 4)}
                             for f in features_off}
    return {**found, "steps_run": {side: [r["steps_run"] for r in runs[side]] for side in sides}, "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmarks", default=",".join(BENCHMARKS),
                        help=f"comma-separated, from: {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--steps", type=int, default=300, help="steps each side runs")
    parser.add_argument("--last", type=int, default=250, help="the steps timed: the last this many")
    parser.add_argument("--repeats", type=int, default=3, help="launches per side (the median is reported)")
    parser.add_argument("--cpus", default=None,
                        help="CPUs both sides are pinned to, e.g. 0,1 (default: every CPU this process may use)")
    parser.add_argument("--features-off", default="", metavar="|".join(FEATURES),
                        help="also run the harness with each of these features off, for its own cost "
                             "(comma-separated; default: none)")
    parser.add_argument("--quick", action="store_true", help="12 steps, the last 8, once (a test's mode)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stamps", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.benchmarks, args.steps, args.out, args.stamps)
        return 0
    chosen = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in BENCHMARKS]
    if unknown or not chosen:
        parser.error(f"unknown benchmark(s) {', '.join(unknown) or '(none)'}; choose from: {', '.join(BENCHMARKS)}")
    features_off = [f.strip() for f in args.features_off.split(",") if f.strip()]
    if any(f not in FEATURES for f in features_off):
        parser.error(f"unknown --features-off {args.features_off!r}; choose from: {', '.join(FEATURES)}")
    if args.quick:
        args.steps, args.last, args.repeats = 12, 8, 1
    if not 0 < args.last < args.steps:
        parser.error(f"--last must be at least 1 and below --steps ({args.steps}), not {args.last}")
    try:
        cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else os.sched_getaffinity(0)
    except ValueError:
        parser.error(f"--cpus takes CPU numbers separated by commas, such as 0,1; not {args.cpus!r}")
    figures = {"machine": machine(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
               "ranks": RANKS, "backend": "gloo", "threads_per_rank": 1, "cpus": sorted(cpus),
               "steps": args.steps, "last": args.last, "repeats": args.repeats,
               "benchmarks": {b: measure(b, args.steps, args.last, args.repeats, cpus, features_off)
                              for b in chosen}}
    figures["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    publish(figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
