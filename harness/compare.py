"""The CI regression verdict: is a candidate campaign slower than its baseline beyond noise?

For each benchmark present in both, the compared figure is the MLPerf score
when both sides have the runs the rules require, else the median time-to-train
of the converged runs. Run-to-run noise is the baseline's own relative spread,
(slowest - fastest) / median over its converged runs. The candidate regresses when

    candidate > baseline * (1 + max_slowdown + noise)

or when any candidate run failed to converge while every baseline run did.
Runs of two groups are never pooled; groups are report's (one per system folder in a submission
tree, one per campaign folder outside one). Where the baseline holds one group of a benchmark,
every candidate group of it is compared with that one (so differently named systems still meet,
and a parent folder of candidate campaigns gets one verdict per campaign); where it holds
several, each candidate group is compared with the baseline's group of the same system.
Exit codes: 0 pass, 1 regression, 2 unusable input.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from harness.errors import HarnessError
from harness.results import Group, ResultSet, labels

PASS, REGRESSION = 0, 1  # unusable input raises HarnessError (exit 2)


@dataclass
class Verdict:
    benchmark: str  # the benchmark, with the system where a side holds several
    metric: str  # "score" or "median"
    baseline_min: float
    candidate_min: float
    noise: float
    limit_min: float
    unconverged: int  # candidate runs that did not converge
    regressed: bool
    left_out: int = 0  # of those, runs whose files failed the compliance checker

    def line(self) -> str:
        change = self.candidate_min / self.baseline_min - 1
        verdict = "REGRESSION" if self.regressed else "pass"
        text = (f"{self.benchmark}: {verdict}: {self.metric} {self.candidate_min:.4f} min vs baseline "
                f"{self.baseline_min:.4f} min ({change:+.1%}); limit {self.limit_min:.4f} min "
                f"(max slowdown + baseline noise {self.noise:.1%})")
        if self.unconverged:
            text += f"; {self.unconverged} candidate run(s) did not converge"
        if self.left_out:
            text += f" ({self.left_out} left out by the compliance checker)"
        return text


def _minutes(group: Group) -> list[float]:
    return [r.time_to_train_min for r in group.runs if r.converged]


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


def compare(baseline: ResultSet, candidate: ResultSet, max_slowdown: float) -> list[Verdict]:
    """Verdicts for every benchmark in both sets; `max_slowdown` is a fraction (0.1 = 10%)."""
    verdicts = []
    for name, b, c in _pairs(baseline, candidate):
        for side, group in (("baseline", b), ("candidate", c)):
            if any(r.synthetic for r in group.runs):
                raise HarnessError(f"{name}: the {side} holds runs on synthetic input ({group.folder}): a "
                                   "throughput run has no time-to-train to compare")
        b_times = _minutes(b)
        if not b_times:
            raise HarnessError(f"{name}: no baseline run converged, so there is nothing to compare against")
        noise = (max(b_times) - min(b_times)) / statistics.median(b_times)
        if b.score_min is not None and c.score_min is not None:
            metric, b_value, c_value = "score", b.score_min, c.score_min
        else:
            c_times = _minutes(c) or [float("inf")]
            metric, b_value, c_value = "median", statistics.median(b_times), statistics.median(c_times)
        limit = b_value * (1 + max_slowdown + noise)
        unconverged = sum(not r.converged for r in c.runs)
        regressed = c_value > limit or (unconverged > 0 and len(b_times) == len(b.runs))
        verdicts.append(Verdict(name, metric, b_value, c_value, noise, limit, unconverged, regressed,
                                len(c.left_out)))
    return verdicts
