"""The CI regression verdict: is a candidate campaign slower than its baseline, beyond its runs' spread?

Two kinds of campaign are compared, each with its own kind. A time-to-train campaign (real input) shows the
MLPerf score where both sides have the runs the rules require, else the median time-to-train of the converged
runs, and counts each converged run's minutes. A throughput campaign (`harness run X --synthetic --max-steps N`:
no quality target, so no time-to-train) shows the median tokens/s of its finished runs (samples/s where a run
logs no tokens/s) and counts each finished run's mean rate. A slowdown is measured as time either way: a longer
time-to-train, or a longer time per token (baseline rate / candidate rate - 1), so `max_slowdown` means one thing
(10% lets a rate fall to 1 / 1.1 = 90.9% of the baseline's).

The decision is a one-sided Welch t-test on the logs of the counted values: the candidate regresses when, with
95% confidence, its geometric mean is slower than the baseline's times (1 + max_slowdown), i.e. when the lower
confidence bound of the slowdown lies above the limit. Why this test:
- Logs, because run times and rates spread in proportion to their size and a slowdown is a ratio; the log
  turns it into a difference of means, and run times are commonly modelled as log-normal.
- Welch's, because each side keeps its own variance: a candidate on a noisy machine is judged by its own noise,
  not the baseline's. The rule this replaced widened the limit by the baseline's (slowest - fastest) / median
  alone, so a baseline spread 48% turned a 10% limit into 58% however many runs confirmed a slowdown, a noisy
  candidate whose figure crossed the limit failed on noise, and a one-run baseline got 0% noise silently.
- Not a rank, permutation or bootstrap test: with CI's 3 to 5 runs a side their p-values come in coarse steps
  (3 runs against 3 have 20 orderings: the smallest p is 1/20) and a bootstrap of 3 values has 10 distinct
  resamples; the t-test works from 2 runs on one side, and for log-normal runs its error rate holds at any count.
- Student's t quantile is computed here (the regularized incomplete beta, then bisection; tests hold it to
  the table and to scipy where installed) rather than adding scipy, 40 MB, to the dependencies for one function.

Too few runs: a side with one counted run shows no spread. Where the other side has two or more, that side's
spread stands for both (one value against a sample: the standard error of s * sqrt(1/n + 1), with n - 1
degrees of freedom), and the verdict says so; where both have one, there is no spread to tell a slowdown from
noise, and the verdict is "no verdict" (exit 2), saying so.

Failed runs: a candidate run that did not converge (time-to-train) or finish (throughput) while every baseline
run did is a regression whatever the figures, and so is a candidate with no run to count.

Runs of two groups are never pooled; groups are report's (one per system folder in a submission
tree, one per campaign folder outside one). Where the baseline holds one group of a benchmark,
every candidate group of it is compared with that one (so differently named systems still meet,
and a parent folder of candidate campaigns gets one verdict per campaign); where it holds
several, each candidate group is compared with the baseline's group of the same system.
Exit codes: 0 pass, 1 regression, 2 unusable input or no verdict.

From Python, with the same one-line errors (HarnessError) as the command:

    from harness.compare import compare_paths, exit_code
    verdicts = compare_paths("results/baselines/resnet-tiny", "candidate", max_slowdown=0.10)
    for v in verdicts:
        print(v.decision, v.slowdown_bound, v.line())
    raise SystemExit(exit_code(verdicts))
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from harness.errors import HarnessError
from harness.results import Group, ResultSet, labels, load_found

CONFIDENCE = 0.95
# Exit codes, and a verdict's decision; unusable input raises HarnessError (exit 2).
PASS, REGRESSION, NO_VERDICT = 0, 1, 2
DECISIONS = {PASS: "pass", REGRESSION: "REGRESSION", NO_VERDICT: "no verdict"}
RATES = ("tokens/s", "samples/s")  # the throughput metrics, the first every run logs wins: higher is better


@dataclass(frozen=True)
class Verdict:
    """One comparison as data: the figures, the test and the decision (line() says it in one line)."""

    benchmark: str  # the benchmark, with the system where a side holds several
    metric: str  # "score" or "median" (minutes, lower is better), or one of RATES (the median, higher is better)
    baseline: float  # the figure shown: the score, the median minutes, or the median rate
    candidate: float | None  # None: no candidate run to count
    baseline_runs: int  # the runs the test counts: converged (time-to-train) or finished (throughput)
    candidate_runs: int
    max_slowdown: float  # the limit, a fraction (0.1 = 10%)
    confidence: float
    slowdown: float | None  # the candidate's geometric-mean slowdown, a fraction (of a rate: base / cand - 1)
    slowdown_bound: float | None  # its lower confidence bound: a regression where it exceeds max_slowdown
    t: float | None  # Welch's t of the log slowdown against log(1 + max_slowdown)
    df: float | None  # its degrees of freedom
    p_value: float | None  # the chance of a t this large were the candidate just max_slowdown slower
    failed: int  # candidate runs that did not converge (time-to-train) or finish (throughput)
    left_out: int  # of those, runs whose files failed the compliance checker
    decision: int  # PASS, REGRESSION or NO_VERDICT
    spread_note: str | None = None  # where a side had too few runs to judge its spread, what was done

    @property
    def regressed(self) -> bool:
        return self.decision == REGRESSION

    def line(self) -> str:
        rate = self.metric in RATES
        label = f"median {self.metric}" if rate else self.metric

        def figure(value: float) -> str:
            return f"{value:.1f}" if rate else f"{value:.4f} min"

        text = f"{self.benchmark}: {DECISIONS[self.decision]}: "
        if self.candidate is None:
            text += f"no candidate run to count, baseline {label} {figure(self.baseline)}"
        else:
            text += (f"{label} {figure(self.candidate)} vs baseline {figure(self.baseline)} "
                     f"({self.candidate / self.baseline - 1:+.1%})")
        if self.slowdown_bound is not None:
            text += (f"; slowdown {self.slowdown:+.1%}, at {self.confidence:.0%} confidence at least "
                     f"{self.slowdown_bound:+.1%}, limit {self.max_slowdown:+.1%} (one-sided Welch t-test on log "
                     f"{'rate' if rate else 'time-to-train'} of {self.baseline_runs} baseline and "
                     f"{self.candidate_runs} candidate runs)")
        if self.spread_note:
            text += f"; {self.spread_note}"
        if self.failed:
            text += f"; {self.failed} candidate run(s) did not {'finish' if rate else 'converge'}"
        if self.left_out:
            text += f" ({self.left_out} left out by the compliance checker)"
        return text


def exit_code(verdicts: list[Verdict]) -> int:
    """The command's exit code: REGRESSION where any verdict is one, else NO_VERDICT where any is, else PASS."""
    decisions = {v.decision for v in verdicts}
    return REGRESSION if REGRESSION in decisions else NO_VERDICT if NO_VERDICT in decisions else PASS


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes' betacf)."""
    tiny = 1e-300

    def nonzero(v: float) -> float:
        return v if abs(v) > tiny else tiny

    c, d = 1.0, 1 / nonzero(1 - (a + b) * x / (a + 1))
    h = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 / nonzero(1 + numerator * d)
            c = nonzero(1 + numerator / c)
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` (> 0, not only whole) degrees of freedom."""
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with t_cdf(t, df) = p, for 0 < p < 1 (by bisection: the CDF rises, and 60 halvings of the bracket
    leave less than 1e-12 of it)."""
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, 2 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2


def _spread(base: list[float], cand: list[float]) -> tuple[float, float, str | None] | None:
    """(standard error of the difference of means, degrees of freedom, a note on what stood in) for the log costs
    of both sides; None where neither side has two values to show a spread."""
    nb, nc = len(base), len(cand)
    if nb >= 2 and nc >= 2:
        vb, vc = statistics.variance(base) / nb, statistics.variance(cand) / nc
        se2 = vb + vc
        # Welch-Satterthwaite; with no spread on either side the difference is exact and df does not matter.
        df = se2 * se2 / (vb * vb / (nb - 1) + vc * vc / (nc - 1)) if se2 > 0 else nb + nc - 2
        return math.sqrt(se2), df, None
    if nb < 2 and nc < 2:
        return None
    one, other, many = ("baseline", "candidate", cand) if nb < 2 else ("candidate", "baseline", base)
    note = (f"the {one} has 1 run: too few to judge its run-to-run spread, so the {other}'s "
            f"({len(many)} runs) stands for both")
    return statistics.stdev(many) * math.sqrt(1 / nb + 1 / nc), len(many) - 1, note


def _by_benchmark(results: ResultSet) -> dict[str, list[Group]]:
    found: dict[str, list[Group]] = defaultdict(list)
    for group in results.groups:
        found[group.benchmark or "?"].append(group)
    return found


def _pairs(baseline: ResultSet, candidate: ResultSet) -> list[tuple[str, Group, Group]]:
    """(label, baseline group, candidate group) for each comparison, on the groups `load` makes (harness.results.
    group_key: a system folder in a submission tree, a campaign folder outside one), so two groups' runs are
    never pooled. Where the baseline holds one group of a benchmark, every candidate group of it is compared
    with that one (differently named systems still meet); where it holds several, each candidate group with
    the baseline's group of the same system, which must be only one."""
    base, cand = _by_benchmark(baseline), _by_benchmark(candidate)
    common = sorted(base.keys() & cand.keys())
    if not common:
        raise HarnessError(f"no benchmark in common: baseline has {', '.join(sorted(base)) or 'none'}, "
                           f"candidate has {', '.join(sorted(cand)) or 'none'}")
    pairs = []
    for name in common:
        named = list(zip(cand[name], labels(cand[name])))
        if len(base[name]) == 1:
            several = len(named) > 1
            pairs.extend((f"{name} on {label}" if several else name, base[name][0], c) for c, label in named)
            continue
        by_system: dict[str | None, list[Group]] = defaultdict(list)
        for group in base[name]:
            by_system[group.system_id].append(group)
        matched = []
        for c, label in named:
            same = by_system.get(c.system_id, [])
            if len(same) > 1:
                raise HarnessError(f"{name}: the baseline holds {len(same)} campaigns on {c.system_id} "
                                   f"({', '.join(str(g.folder) for g in same)}); give the one to compare with")
            if same:
                matched.append((f"{name} on {label}", same[0], c))
        if not matched:
            raise HarnessError(f"{name}: several systems ran it and none is on both sides (baseline: "
                               f"{', '.join(sorted(str(g.system_id) for g in base[name]))}; candidate: "
                               f"{', '.join(sorted(str(g.system_id) for g in cand[name]))}); compare one system "
                               f"per side, or the same systems")
        pairs.extend(matched)
    return pairs


@dataclass(frozen=True)
class _Side:
    """What one side gives the test: the figure shown, the log cost of each counted run, whether every run counted."""

    figure: float | None
    costs: list[float]
    all_counted: bool


def _time_to_train(b: Group, c: Group, name: str) -> tuple[str, _Side, _Side]:
    """Converged runs' minutes; the score where both sides have one, else the median."""
    b_times, c_times = ([r.time_to_train_min for r in g.runs if r.converged] for g in (b, c))
    if not b_times:
        raise HarnessError(f"{name}: no baseline run converged, so there is nothing to compare against")
    instant = [r.file for g in (b, c) for r in g.runs if r.converged and not r.time_to_train_min > 0]
    if instant:  # run_stop at run_start: a log cut or edited by hand, whose time no ratio can compare
        raise HarnessError(f"{name}: {instant[0]} converged in no time (run_stop at run_start): not a time to compare")
    scored = b.score_min is not None and c.score_min is not None
    sides = [_Side((g.score_min if scored else statistics.median(times)) if times else None,
                   [math.log(m) for m in times], len(times) == len(g.runs))
             for g, times in ((b, b_times), (c, c_times))]
    return "score" if scored else "median", *sides


def _throughput(b: Group, c: Group, name: str) -> tuple[str, _Side, _Side]:
    """Finished runs' mean rates, tokens/s where every one logs it, else samples/s; the cost of a rate is the time
    per token or sample, so a log cost is -log(rate)."""
    b_runs, c_runs = ([r for r in g.runs if not r.unfinished] for g in (b, c))
    if not b_runs:
        raise HarnessError(f"{name}: no baseline run finished, so there is nothing to compare against")
    attribute = {"tokens/s": "tokens_per_s", "samples/s": "samples_per_s"}
    metric = next((m for m in RATES if all((getattr(r, attribute[m]) or 0) > 0 for r in b_runs + c_runs)), None)
    if metric is None:
        raise HarnessError(f"{name}: not every finished run logs a throughput (tracked_stats tokens_per_second or "
                           f"throughput), so there is nothing to compare")
    sides = []
    for group, runs in ((b, b_runs), (c, c_runs)):
        rates = [getattr(r, attribute[metric]) for r in runs]
        sides.append(_Side(statistics.median(rates) if rates else None, [-math.log(x) for x in rates],
                           len(runs) == len(group.runs)))
    return metric, *sides


def _synthetic(group: Group, name: str, side: str) -> bool:
    """Whether a group is a throughput campaign; one that mixes both kinds of run is unusable."""
    synthetic = sum(r.synthetic for r in group.runs)
    if 0 < synthetic < len(group.runs):
        raise HarnessError(f"{name}: the {side} mixes {synthetic} runs on synthetic input with "
                           f"{len(group.runs) - synthetic} on real input ({group.folder}); give one kind")
    return synthetic > 0


def _checked(max_slowdown: float, confidence: float) -> None:
    if not max_slowdown >= 0:
        raise HarnessError(f"the max slowdown must be 0 or more, got {max_slowdown:.0%}")
    if not 0.5 <= confidence < 1:
        raise HarnessError(f"the confidence must lie from 50% up to (not including) 100%, got {confidence:.0%}")


def _verdict(name: str, metric: str, b: _Side, c: _Side, failed: int, left_out: int, max_slowdown: float,
             confidence: float) -> Verdict:
    """The test and the decision for one pair of sides."""
    failure = c.figure is None or (failed > 0 and b.all_counted)  # a regression whatever the figures
    spread = _spread(b.costs, c.costs) if c.costs else None
    figures = dict(benchmark=name, metric=metric, baseline=b.figure, candidate=c.figure,
                   baseline_runs=len(b.costs), candidate_runs=len(c.costs), max_slowdown=max_slowdown,
                   confidence=confidence, failed=failed, left_out=left_out)
    if spread is None:
        note = None if not c.costs else ("the baseline and the candidate have 1 run each: too few to judge "
                                         "run-to-run spread, so no verdict on speed (give a side 2 runs or more)")
        return Verdict(**figures, slowdown=None, slowdown_bound=None, t=None, df=None, p_value=None,
                       decision=REGRESSION if failure else NO_VERDICT, spread_note=note)
    se, df, note = spread
    difference, limit = statistics.fmean(c.costs) - statistics.fmean(b.costs), math.log1p(max_slowdown)
    if se > 0:
        t, bound = (difference - limit) / se, difference - t_quantile(confidence, df) * se
    else:  # no spread on either side: the difference is exact
        t, bound = (math.copysign(math.inf, difference - limit) if difference != limit else 0.0), difference
    return Verdict(**figures, slowdown=math.expm1(difference), slowdown_bound=math.expm1(bound), t=t, df=df,
                   p_value=t_cdf(-t, df), decision=REGRESSION if failure or bound > limit else PASS,
                   spread_note=note)


def compare(baseline: ResultSet, candidate: ResultSet, max_slowdown: float = 0.10,
            confidence: float = CONFIDENCE) -> list[Verdict]:
    """Verdicts for every benchmark in both sets; `max_slowdown` is a fraction (0.1 = 10%)."""
    _checked(max_slowdown, confidence)
    verdicts = []
    for name, b, c in _pairs(baseline, candidate):
        synthetic = _synthetic(b, name, "baseline")
        if synthetic != _synthetic(c, name, "candidate"):
            kinds = ("throughput runs (synthetic input)", "time-to-train runs (real input)")
            raise HarnessError(f"{name}: the baseline holds {kinds[not synthetic]} and the candidate "
                               f"{kinds[synthetic]}; compare a campaign with one of its own kind")
        metric, b_side, c_side = (_throughput if synthetic else _time_to_train)(b, c, name)
        failed = sum(r.unfinished if synthetic else not r.converged for r in c.runs)
        verdicts.append(_verdict(name, metric, b_side, c_side, failed, 0 if synthetic else len(c.left_out),
                                 max_slowdown, confidence))
    return verdicts


def compare_paths(baseline: str | Path, candidate: str | Path, max_slowdown: float = 0.10,
                  ruleset: str | None = None, confidence: float = CONFIDENCE) -> list[Verdict]:
    """`harness compare` from Python: load a baseline's and a candidate's result files or folders (by `ruleset`,
    else load's default) and compare them. Unusable input raises HarnessError with the command's one-line error."""
    _checked(max_slowdown, confidence)
    sides = [load_found([path], ruleset=ruleset, empty_exit=2) for path in (baseline, candidate)]
    return compare(*sides, max_slowdown=max_slowdown, confidence=confidence)
