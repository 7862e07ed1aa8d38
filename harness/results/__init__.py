"""Results as data: `load(paths)` parses MLPerf logs into runs grouped and scored per (system, benchmark).

    from harness.results import load
    rs = load(["results/runs"])
    for group in rs.groups: print(group.system, group.benchmark, group.score_min)
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from harness.results.parse import ErrorSink, LogError, Run, load_runs, parse_file
from harness.results.score import benchmark_score, required_runs


@dataclass
class Group:
    """The runs of one benchmark on one system, and their MLPerf score."""

    submitter: str | None
    system: str | None
    benchmark: str | None
    runs: list[Run]
    scaling_factor: float = 1.0

    @property
    def score_min(self) -> float | None:
        return benchmark_score([r.time_to_train_min for r in self.runs], [r.succeeded for r in self.runs],
                               self.benchmark or "", self.scaling_factor)

    @property
    def required_runs(self) -> int | None:
        return required_runs(self.benchmark or "")


@dataclass
class ResultSet:
    runs: list[Run]
    groups: list[Group] = field(default_factory=list)


def _scaling_factor(folder: Path) -> float:
    """The factor in <benchmark folder>/scaling.json, as the summarizer applies it (read, never written)."""
    try:
        return float(json.loads((folder / "scaling.json").read_text())["scaling_factor"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1.0


def _report_to_stderr(path: Path, reason: str) -> None:
    print(f"harness: skipping {path}: {reason}", file=sys.stderr)


def load(paths: Iterable[str | Path], on_error: ErrorSink = _report_to_stderr) -> ResultSet:
    """Parse every result_*.txt under `paths`; unusable files go to `on_error` and are left out."""
    runs = load_runs([Path(p) for p in paths], on_error)
    grouped: dict[tuple, Group] = {}
    for run in runs:
        key = (run.submitter, run.system, run.benchmark)
        if key not in grouped:
            grouped[key] = Group(*key, runs=[], scaling_factor=_scaling_factor(Path(run.file).parent))
        grouped[key].runs.append(run)
    return ResultSet(runs=runs, groups=list(grouped.values()))


__all__ = ["Group", "LogError", "ResultSet", "Run", "load", "parse_file"]
