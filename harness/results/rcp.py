"""The RCP verdict of a closed (system, benchmark) group, as MLCommons' result summarizer reports it.

This mirrors `mlperf_logging.rcp_checker.rcp_checker.check_directory(dir, 'training', ruleset, False,
False, rcp_pass='pruned_rcps', set_scaling=False)` and the verdict names the summarizer's
`_compute_strong_scaling_scores` gives its result (Pass, Fail, Interp. Fail, Missing, No RCP,
Unknown state). Calling the checker whole would import scipy (about 1 s, more than the whole report)
and read every log again, so its steps are repeated here on the already parsed runs, each function
naming the one it mirrors; the reference convergence points are read from mlperf-logging's own
`rcp_checker/training_<ruleset>/rcps_<benchmark>.json`, so a new round's RCPs come with a newer
mlperf-logging. tests/test_results.py compares these steps and the verdicts with the checker's own.
Nothing is written: the checker's set_scaling would rewrite scaling.json.
"""

from __future__ import annotations

import ast
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import mlperf_logging

from harness.results.parse import Run
from harness.results.rules import eval_step_key

RCP_ROOT = Path(mlperf_logging.__file__).parent / "rcp_checker"

ALPHA, TOLERANCE = 0.05, 0.0001  # RCP_Checker.__init__
NOT_CONVERGED_EPOCHS = 1e9  # read_submission_file's value for a run that did not converge
# read_submission_file: benchmarks whose convergence point is the samples_count of the last eval.
SAMPLES_BENCHMARKS = {"llama2_70b_lora", "flux1", "llama31_405b", "llama31_8b", "gpt_oss_20b", "deepseekv3_671b",
                      "qwen35_397b_grpo", "dlrmv4"}
SAMPLES_RCPS = {"llama2_70b_lora", "flux1"}  # RCP_Checker._process_raw_rcp_data: RCPs in "samples to converge"
# RCP_Checker.__init__: the rulesets the checker supports (those it ships RCPs for).
SUPPORTED = {p.name.removeprefix("training_") for p in RCP_ROOT.glob("training_*.*.*")}


class RcpUnavailable(ValueError):
    """The RCP check could not run (the summarizer prints a warning and leaves the RCP column empty)."""


@dataclass
class RcpResult:
    verdict: str  # the summarizer's RCP column: Pass, Fail, Interp. Fail, Missing, No RCP, Unknown state
    message: str  # check_directory's message, e.g. "RCP found" or "RCP Interpolation"
    scaling: float  # check_directory's score normalization (what set_scaling would write to scaling.json)


@functools.cache
def submission_runs() -> dict[str, int]:
    """rcp_checker.submission_runs['training'], read from the checker's source without importing it (and scipy)."""
    tree = ast.parse((RCP_ROOT / "rcp_checker.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "submission_runs" for t in node.targets):
            return ast.literal_eval(node.value)["training"]
    raise RcpUnavailable("mlperf-logging's RCP checker has no submission_runs table")


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan  # np.mean


def _std(values: list[float]) -> float:  # np.std (population)
    mean = _mean(values)
    return math.sqrt(_mean([(v - mean) ** 2 for v in values]))


def _interp(x: float, x0: float, x1: float, y0: float, y1: float) -> float:  # np.interp on two points
    return (y1 - y0) / (x1 - x0) * (x - x0) + y0


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (Lentz's method)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return h


def _betai(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with df degrees of freedom (scipy.stats.t.sf)."""
    tail = 0.5 * _betai(df / 2.0, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def p_value(subm_mean: float, subm_stdev: float, subm_n: int, ref_mean: float, ref_stdev: float,
            ref_n: int) -> float:
    """RCP_Checker._find_p_value: scipy's ttest_ind_from_stats (equal variances) made one-sided."""
    df = subm_n + ref_n - 2
    pooled = ((subm_n - 1) * subm_stdev ** 2 + (ref_n - 1) * ref_stdev ** 2) / df
    t = (subm_mean - ref_mean) / math.sqrt(pooled * (1.0 / subm_n + 1.0 / ref_n))
    two_sided = 2 * t_sf(abs(t), df)
    return two_sided / 2 if t < 0 else 1 - two_sided / 2


def _min_acceptable_mean(mean: float, stdev: float, ref_n: int, submission_runs: int) -> float:
    """RCP_Checker._find_min_acceptable_mean: binary search for the fastest mean a t-test still accepts."""
    if stdev == 0:
        return mean
    subm_n = submission_runs - 2
    low, high = 0.0, mean
    mid = (low + high) / 2
    while high - low > TOLERANCE:
        if p_value(mid, stdev, ref_n, mean, stdev, subm_n) > ALPHA:
            high = mid
        else:
            low = mid
        mid = (low + high) / 2
    return mid


def _rejected(benchmark: str) -> int:
    return 4 if benchmark == "unet3d" else 1  # RCP_Checker.compute_rcp_stats and _eval_submission_record


def with_limits(record: dict, ref_n: int, submission_runs: int) -> dict:
    """The record with its fastest acceptable mean ("Min Epochs") and "Max Speedup", as compute_rcp_stats and
    _create_interp_rcp add them. Computed only for the record a verdict uses: pruning needs only the means."""
    min_epochs = _min_acceptable_mean(record["RCP Mean"], record["RCP Stdev"], ref_n, submission_runs)
    return {**record, "Max Speedup": record["RCP Mean"] / min_epochs, "Min Epochs": min_epochs}


def _interp_record(benchmark: str, bs: float, low: dict, high: dict) -> dict:
    """RCP_Checker._create_interp_rcp, without the limits (with_limits(record, 2 x runs, runs) adds them)."""
    return {"Benchmark": benchmark, "BS": bs, "ref_n": None,
            "RCP Mean": _interp(bs, low["BS"], high["BS"], low["RCP Mean"], high["RCP Mean"]),
            "RCP Stdev": _interp(bs, low["BS"], high["BS"], low["RCP Stdev"], high["RCP Stdev"])}


@functools.cache
def pruned_rcps(ruleset: str, benchmark: str) -> tuple[dict, ...]:
    """RCP_Checker.__init__ (with _process_raw_rcp_data, compute_rcp_stats, _prune_rcps): the pruned RCPs,
    by batch size, each with its mean, stdev and `ref_n` (the runs its mean counts). Raises RcpUnavailable
    where the checker's constructor would raise."""
    if ruleset not in SUPPORTED:
        raise RcpUnavailable(f"the RCP checker does not support ruleset {ruleset}")
    runs = submission_runs().get(benchmark)
    path = RCP_ROOT / f"training_{ruleset}" / f"rcps_{benchmark}.json"
    if runs is None or not path.is_file():
        raise RcpUnavailable(f"mlperf-logging's RCP checker has no RCPs for {benchmark!r} in ruleset {ruleset}")
    records = []
    for record in json.loads(path.read_text()).values():
        unit = "samples to converge" if record["Benchmark"] in SAMPLES_RCPS else "Epochs to converge"
        epochs = sorted(record[unit])
        rejected = _rejected(record["Benchmark"])
        records.append({"Benchmark": record["Benchmark"], "BS": record["BS"], "ref_n": len(epochs) - rejected * 2,
                        "RCP Mean": _mean(epochs[rejected:len(epochs) - rejected]), "RCP Stdev": _std(epochs)})
    records.sort(key=lambda r: r["BS"])
    fastest = min(records, key=lambda r: r["RCP Mean"])
    kept = [r for r in records if r["BS"] >= fastest["BS"]]
    i = 1
    while i < len(kept) - 1:
        if kept[i]["RCP Mean"] > _interp_record(benchmark, kept[i]["BS"], kept[i - 1], kept[i + 1])["RCP Mean"]:
            del kept[i]
            i -= 1
        i += 1
    return tuple(r for r in records if any(r["Benchmark"] == k["Benchmark"] and r["BS"] == k["BS"] for k in kept))


def submission_epochs(run: Run, ruleset: str) -> float:
    """rcp_checker.read_submission_file: the run's convergence point (epochs, or samples), 1e9 if it failed."""
    if run.last_stop is None:
        return NOT_CONVERGED_EPOCHS
    evals_before, status = run.last_stop
    if status != "success":
        return NOT_CONVERGED_EPOCHS
    records = run.eval_records[:evals_before]
    if run.benchmark == "stable_diffusion":
        step = eval_step_key(ruleset)
        steps = {}
        for value, metadata in records:  # the per-step FID and CLIP, keyed as the checker keys them
            steps.setdefault(metadata[step], {})[metadata["metric"]] = value
        passing = [s for s, r in steps.items() if r["FID"] <= 90.0 and r["CLIP"] >= 0.15]  # the checker's criteria
        return min(passing)
    if not records:
        raise RcpUnavailable(f"{run.file}: no eval_accuracy before run_stop")
    metadata = records[-1][1]
    if run.benchmark in SAMPLES_BENCHMARKS:
        return metadata["samples_count"]
    return round(metadata["epoch_num"], 3)


def _evaluate(record: dict, epochs: list[float], ruleset: str, benchmark: str) -> tuple[bool, float]:
    """RCP_Checker._eval_submission_record (without writing scaling.json)."""
    runs = submission_runs()[benchmark]
    record = with_limits(record, runs * 2 if record["ref_n"] is None else record["ref_n"], runs)
    max_speedup = record["Max Speedup"]
    if tuple(map(int, ruleset.split("."))) >= (5, 0, 0) and benchmark == "llama31_405b":
        max_speedup = record["RCP Mean"] / (record["Min Epochs"] - 46080)
    epochs = sorted(epochs)
    rejected = _rejected(record["Benchmark"])
    mean = _mean(epochs[rejected:len(epochs) - rejected])
    norm = record["RCP Mean"] / mean if mean else math.inf  # numpy's division gives inf
    return mean >= record["RCP Mean"] / max_speedup, (1.0 if norm < 1 else norm)


def check(runs: list[Run], ruleset: str) -> RcpResult:
    """check_directory(..., rcp_pass='pruned_rcps') on a group's runs, with the summarizer's verdict name.
    Raises RcpUnavailable where the checker raises (the summarizer then shows no verdict)."""
    try:
        epochs = [submission_epochs(run, ruleset) for run in runs]
    except (KeyError, TypeError, ValueError) as exc:
        raise RcpUnavailable(f"the RCP checker cannot read these logs: {type(exc).__name__}: {exc}") from None
    sizes = {repr(run.last_batch_size) for run in runs}
    benchmarks = {run.benchmark for run in runs}
    if len(sizes) > 1 or len(benchmarks) > 1:  # get_submission_epochs: files that do not match
        raise RcpUnavailable("the runs' batch sizes or benchmarks differ")
    benchmark, bs = benchmarks.pop(), runs[0].last_batch_size
    rcps = pruned_rcps(ruleset, benchmark or "")
    if bs is None or bs == -1:
        return _result(False, "Could not detect global_batch_size", 1.0)
    failed = sum(e == NOT_CONVERGED_EPOCHS for e in epochs)
    if failed > _rejected(benchmark):
        return _result(False, "Insufficient convergence", 1.0)
    try:
        exact = [r for r in rcps if r["BS"] == bs]
        below = max((r for r in rcps if 0 < r["BS"] < bs), key=lambda r: r["BS"], default=None)
        above = min((r for r in rcps if bs < r["BS"] < 1e9), key=lambda r: r["BS"], default=None)
        if exact:
            passed, norm = _evaluate(exact[0], epochs, ruleset, benchmark)
            return _result(passed, "RCP found", norm)
        if below is not None and above is not None:
            record = _interp_record(benchmark, bs, below, above)
            passed, norm = _evaluate(record, epochs, ruleset, benchmark)
            return _result(passed, "RCP Interpolation", norm)
        if below is not None:
            return _result(False, f"Missing RCP, please submit RCP with BS = {bs}", 1.0)
        if above is not None:
            smallest = min(rcps, key=lambda r: r["BS"])
            passed, norm = _evaluate(smallest, epochs, ruleset, benchmark)
            return _result(passed, "RCP not found but slower convergence on smaller batch size" if passed else
                           f"Missing RCP, please submit RCP with BS = {bs}", norm)
        return _result(False, "Cannot find any RCPs", 1.0)
    except TypeError as exc:  # a batch size that is not a number
        raise RcpUnavailable(f"the RCP checker cannot compare batch size {bs!r}: {exc}") from None


def _result(passed: bool, message: str, scaling: float) -> RcpResult:
    """The verdict name the summarizer's _compute_strong_scaling_scores gives check_directory's result."""
    if passed:
        verdict = "Pass"
    elif message == "RCP found":
        verdict = "Fail"
    elif message == "RCP Interpolation":
        verdict = "Interp. Fail"
    elif "Missing" in message:
        verdict = "Missing"
    elif message == "Cannot find any RCPs":
        verdict = "No RCP"
    else:
        verdict = "Unknown state"
    return RcpResult(verdict, message, scaling)
