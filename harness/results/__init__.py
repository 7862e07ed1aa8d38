"""Results as data: `load(paths)` parses MLPerf logs into runs, grouped and scored per (system, benchmark).

    from harness.results import load
    rs = load(["results/runs"])  # each log by its own ruleset; load(paths, ruleset="5.1.0") forces one
    rs.runs     # pandas: one row per run
    rs.events   # pandas: every MLLOG event of every run
    rs.scores   # pandas: one row per group (submitter, system, benchmark, campaign), with the ruleset that judged it

Systems go by the official `system_name` of a submission's systems/<folder>.json
(`system`), with the folder as `system_id`. Which runs form a group is decided in one
place, `group_key`, which report, compare, the frames and the plots all read through
`ResultSet.groups`: in a submission tree, by system folder, as the official summarizer
keeps them apart (several folders can share one name); outside a tree, by the campaign
folder that holds the logs, so that two campaigns on one platform are two groups, each
scored on its own, never one average of both.

Each log is judged by a ruleset: the one the caller forces, else its own (`rules.ruleset_for`: the round its
submission tree's path names, else the newest ruleset that holds its benchmark), so one set can hold 6.1 runs
beside 5.1 references. A group's runs share it (it is part of `group_key`); a log that no ruleset holds is
said so, its group unscorable, its file unchecked, never counted as failed.

Every file is checked by mlperf-logging's compliance checker (harness.results.compliance),
as the summarizer checks it: a file that fails counts as a failed run, named with the
checker's first error.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterable

from harness.results import compliance, rcp
from harness.results.parse import ErrorSink, LogError, Run, iter_events, load_runs, parse_file
from harness.results.power import energy, has_power
from harness.results.rules import NoRuleset, RuleError, check_ruleset, converged, ruleset_for, target_check
from harness.results.score import benchmark_score, required_runs

# Columns of ResultSet.runs, each an attribute of Run.
RUN_COLUMNS = ["submitter", "system", "system_id", "benchmark", "division", "status", "converged", "synthetic",
               "compliant", "campaign", "seed", "accelerators", "time_to_train_min", "quality", "samples_per_s",
               "tokens_per_s", "mfu", "global_batch_size", "restarts", "goodput", "compliance_error", "ruleset",
               "file"]
SCORE_COLUMNS = ["submitter", "system", "system_id", "campaign", "benchmark", "division", "ruleset", "accelerators",
                 "runs", "required_runs", "converged", "left_out", "score_min", "scaling_factor", "rcp", "rcp_scaling",
                 "energy", "min_min", "max_min", "unscorable"]


@dataclass
class Group:
    """The runs of one benchmark on one system, and their MLPerf score."""

    submitter: str | None
    system: str | None
    benchmark: str | None
    runs: list[Run]
    scaling_factor: float = 1.0  # from scaling.json, as the summarizer applies it
    system_id: str | None = None
    unscorable: str | None = None  # why the ruleset's rules cannot score this group, if they cannot
    rcp: str | None = None  # the summarizer's RCP verdict (closed division): Pass, Fail, Missing, ...
    rcp_message: str | None = None  # the RCP checker's message, or why it could not run
    # The factor the RCP check computes, which the summarizer writes to scaling.json for its next run.
    rcp_scaling: float | None = None
    energy: float | None = None  # the summarizer's power score, where the group has power results
    campaign: str | None = None  # outside a submission tree, the folder of the group's logs
    ruleset: str | None = None  # the ruleset that judged the group; None where none holds it (see `unscorable`)

    @property
    def folder(self) -> str | None:
        """Where the group's runs live: the system folder in a submission tree, else the campaign folder."""
        return self.system_id if self.campaign is None else self.campaign

    @property
    def left_out(self) -> list[Run]:
        """The runs whose files failed the compliance checker (Run.left_out: aborted ones had failed already):
        counted as failed runs, their times unscored."""
        return [r for r in self.runs if r.left_out]

    @property
    def division(self) -> str | None:
        divisions = {r.division for r in self.runs}
        return divisions.pop() if len(divisions) == 1 else None

    @property
    def score_min(self) -> float | None:
        if self.unscorable:
            return None
        return benchmark_score([r.time_to_train_min for r in self.runs], [r.converged for r in self.runs],
                               self.benchmark or "", self.scaling_factor)

    @property
    def required_runs(self) -> int | None:
        return required_runs(self.benchmark or "")


def labels(groups: list[Group]) -> list[str]:
    """A label per group for tables and pictures: the system's name, and where another of `groups` has the
    same name but another folder, the folder too (a submission's system folders often share one official
    name; campaigns on one platform always do). A campaign goes by its folder's name, or by its whole path
    where two campaign folders share a name."""
    def folder(group: Group) -> str:
        if group.campaign is None:
            return str(group.system_id)
        short = Path(group.campaign).name or group.campaign
        clash = any(g.campaign not in (None, group.campaign) and Path(g.campaign).name == short for g in groups)
        return group.campaign if clash else short

    folders: dict[str, set] = {}
    for g in groups:
        folders.setdefault(g.system or "?", set()).add(g.folder)
    return [f"{g.system or '?'} ({folder(g)})" if len(folders[g.system or "?"]) > 1 else g.system or "?"
            for g in groups]


@dataclass
class ResultSet:
    records: list[Run]
    groups: list[Group] = field(default_factory=list)
    ruleset: str | None = None  # the ruleset forced on every group, else None: each group's own (Group.ruleset)

    @cached_property
    def runs(self):
        """One row per run."""
        import pandas as pd

        return pd.DataFrame([[getattr(r, c) for c in RUN_COLUMNS] for r in self.records], columns=RUN_COLUMNS)

    @cached_property
    def events(self):
        """Every MLLOG event: file, key, value, time (ms since run_start), epoch, samples."""
        import pandas as pd

        rows = []
        for run in self.records:
            for e in iter_events(Path(run.file).read_bytes()):
                metadata = e.get("metadata") if isinstance(e.get("metadata"), dict) else {}
                rows.append({"file": run.file, "system": run.system, "benchmark": run.benchmark, "key": e["key"],
                             "value": e.get("value"), "time_ms": e["time_ms"] - run.run_start_ms,
                             "epoch": metadata.get("epoch_num"), "samples": metadata.get("samples_count")})
        return pd.DataFrame(rows, columns=["file", "system", "benchmark", "key", "value", "time_ms", "epoch",
                                           "samples"])

    @cached_property
    def scores(self):
        """One row per group (submitter, system, benchmark, campaign): the score and the spread of its runs."""
        import pandas as pd

        rows = []
        for g in self.groups:
            minutes = [r.time_to_train_min for r in g.runs if r.time_to_train_min is not None]
            accelerators = {r.accelerators for r in g.runs} - {None}
            rows.append({"submitter": g.submitter, "system": g.system, "system_id": g.system_id,
                         "campaign": g.campaign, "benchmark": g.benchmark, "division": g.division,
                         "ruleset": g.ruleset,
                         "accelerators": accelerators.pop() if len(accelerators) == 1 else None,
                         "runs": len(g.runs), "required_runs": g.required_runs,
                         "converged": sum(r.converged for r in g.runs), "left_out": len(g.left_out),
                         "score_min": g.score_min,
                         "scaling_factor": g.scaling_factor, "rcp": g.rcp, "rcp_scaling": g.rcp_scaling,
                         "energy": g.energy,
                         "min_min": min(minutes, default=None), "max_min": max(minutes, default=None),
                         "unscorable": g.unscorable})
        return pd.DataFrame(rows, columns=SCORE_COLUMNS)


    def compare_systems(self, a: str, b: str):
        """Two systems (by official name or folder) side by side, one row per benchmark both ran.

        `speedup` is how many times faster b trains than a (score a / score b), and
        `scaling_efficiency` is that speedup over the ratio of their accelerators:
        1.0 means b's extra GPUs pay off in full.
        """
        scores = self.scores
        known = sorted(set(scores.system.dropna()) | set(scores.system_id.dropna()))
        for name in (a, b):
            if name not in known:
                raise ValueError(f"no system {name!r} in these results; they have: {', '.join(known)}")
        columns = ["benchmark", "accelerators", "score_min"]

        def of(name: str):  # a system by its official name or its folder
            return scores[(scores.system == name) | (scores.system_id == name)][columns]

        side = of(a).merge(of(b), on="benchmark", suffixes=("_a", "_b"))
        side["speedup"] = side.score_min_a / side.score_min_b
        side["accelerator_ratio"] = side.accelerators_b / side.accelerators_a
        side["scaling_efficiency"] = side.speedup / side.accelerator_ratio
        return side.set_index("benchmark")


def _scaling_factor(folder: Path) -> float:
    """The factor in <benchmark folder>/scaling.json, as the summarizer applies it (read, never written)."""
    try:
        return float(json.loads((folder / "scaling.json").read_text())["scaling_factor"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1.0


def _report_to_stderr(path: Path, reason: str) -> None:
    print(f"harness: skipping {path}: {reason}", file=sys.stderr)


SYNTHETIC = "synthetic input: throughput runs have no quality target, so no score"


def _judge(group: Group) -> None:
    """Convergence of each run by the ruleset's target, of compliant runs only (the summarizer counts a file
    that fails the checker as a failed run); a rule that cannot be applied makes the group unscorable, and so
    does synthetic input (whatever its meaningless evals logged)."""
    synthetic = sum(r.synthetic for r in group.runs)
    if synthetic:
        group.unscorable = SYNTHETIC if synthetic == len(group.runs) else \
            f"{synthetic} of {len(group.runs)} runs on synthetic input, which has no quality target"
        for run in group.runs:
            run.converged = False
        return
    try:
        for run in group.runs:
            run.reached_target = converged(run.status, run.eval_records,
                                           target_check(group.ruleset, run.division, run.benchmark))
            run.converged = run.compliant and run.reached_target
    except RuleError as exc:
        group.unscorable = str(exc)
        for run in group.runs:
            run.converged = False


def _check_rcp(group: Group) -> None:
    """The summarizer runs the RCP checker on closed results only (and synthetic input has no convergence)."""
    if group.division != "closed" or any(r.synthetic for r in group.runs):
        return
    try:
        result = rcp.check(group.runs, group.ruleset)
    except rcp.RcpUnavailable as exc:
        group.rcp_message = str(exc)
        return
    group.rcp, group.rcp_message, group.rcp_scaling = result.verdict, result.message, result.scaling


def group_key(run: Run) -> tuple:
    """Which group a run belongs to. In a submission tree: its system folder (system_id), not its name, as the
    official summarizer keeps them apart. Outside a tree: also its campaign folder, since a platform name
    (submission_platform) says nothing of which campaign a log came from. And its ruleset: a group is judged by
    one (a folder of one system in two rounds' trees is two submissions)."""
    return run.submitter, run.system_id, run.benchmark, run.campaign, run.ruleset


def _check_compliance(runs: list[Run]) -> None:
    """Each judged file's compliance verdict, by the ruleset that judges it."""
    for ruleset in sorted({r.ruleset for r in runs if r.ruleset}):
        judged = [r for r in runs if r.ruleset == ruleset]
        checked = compliance.verdicts([Path(r.file) for r in judged], ruleset)
        for run in judged:
            run.compliance_error = checked[Path(run.file)].error
            run.compliance_failed_keys = checked[Path(run.file)].failed_keys


def load(paths: Iterable[str | Path], ruleset: str | None = None,
         on_error: ErrorSink = _report_to_stderr) -> ResultSet:
    """Parse every result_*.txt under `paths`, check each with mlperf-logging's compliance checker, judge
    convergence by its ruleset's targets, check RCPs. The ruleset is `ruleset` for every log where one is given,
    else each log's own (rules.ruleset_for).

    Files that are no MLPerf log go to `on_error` and are left out; a run that never finished is
    kept as a failed run, and so is a file that fails the compliance checker. Nothing under `paths`
    is written (verdicts are cached under the harness's cache folder).
    """
    if ruleset is not None:
        check_ruleset(ruleset)
    runs = load_runs([Path(p) for p in paths], on_error)
    unjudged: dict[str, str] = {}  # file -> why no ruleset judges it
    for run in runs:
        try:
            run.ruleset = ruleset or ruleset_for(run.file, run.benchmark)
        except NoRuleset as exc:
            unjudged[run.file] = str(exc)
    _check_compliance(runs)
    grouped: dict[tuple, Group] = {}
    for run in runs:
        key = group_key(run)
        if key not in grouped:
            grouped[key] = Group(run.submitter, run.system, run.benchmark, runs=[], system_id=run.system_id,
                                 campaign=run.campaign, scaling_factor=_scaling_factor(Path(run.file).parent),
                                 ruleset=run.ruleset)
        grouped[key].runs.append(run)
    for group in grouped.values():
        if group.ruleset is None:
            group.unscorable = unjudged[group.runs[0].file]
            continue
        _judge(group)
        _check_rcp(group)
        folder = Path(group.runs[0].file).parent
        if has_power(folder) and group.score_min is not None:
            group.energy = energy(folder, group.runs, group.ruleset, group.benchmark or "", group.scaling_factor,
                                  on_error)
    return ResultSet(records=runs, groups=list(grouped.values()), ruleset=ruleset)


def load_found(paths: Iterable[str | Path], ruleset: str | None = None, empty_exit: int = 1) -> ResultSet:
    """`load` for a command or a CI job: a path that does not exist (exit 2), or paths that hold no readable log
    (`empty_exit`), is one line, raised as HarnessError."""
    from harness.errors import HarnessError

    paths = [Path(p) for p in paths]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise HarnessError(f"no such file or folder: {', '.join(missing)}")
    results = load(paths, ruleset=ruleset)
    if not results.records:
        raise HarnessError(f"no readable result_*.txt files under {', '.join(map(str, paths))}", empty_exit)
    return results


__all__ = ["Group", "LogError", "ResultSet", "Run", "group_key", "labels", "load", "load_found", "parse_file"]
