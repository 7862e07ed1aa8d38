"""Read MLPerf result logs (ours and anyone's) into Run records.

The lines are read by workloads.common.mllog_reader, which the workloads share. A file that cannot
be used is reported through `on_error(path, reason)` and left out; it never
stops the others. This module must not import torch: reports run anywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from mlperf_logging.mllog import constants as C

from harness.results.goodput import account
from workloads.common.mllog_reader import LogError, iter_events  # the one MLLOG reader (light, torch-free)
from workloads.common.mllog_reader import is_number as _is_number
from workloads.common.mlperf import TRACKED_STATS  # the writer's key names (torch-free module)

TRACKED = ("throughput", "tokens_per_second", "mfu")  # tracked_stats fields: samples/s (NVIDIA's name), tokens/s, MFU

ErrorSink = Callable[[Path, str], None]


@dataclass
class Run:
    """One timed run: the facts a report needs, taken from one result file."""

    file: str
    benchmark: str | None
    system: str | None
    submitter: str | None
    division: str | None
    status: str | None
    seed: int | None
    run_start_ms: float
    run_stop_ms: float
    quality: float | None  # the last eval_accuracy
    samples_per_s: float | None  # mean logged throughput (tracked_stats)
    global_batch_size: int | None
    evals: list[tuple[float, float]] = field(default_factory=list)  # (ms since run_start, accuracy)
    accelerators: int | None = None  # from the submission's system description, where there is one
    converged: bool = False  # set by harness.results.load under a ruleset's target check
    # From the harness's run record beside the log (None for logs without one): see goodput.py.
    restarts: int | None = None
    goodput: float | None = None
    badput: dict[str, float] | None = None
    # Language models' tracked_stats also carry tokens/s and, on GPUs with a known peak, MFU (None where not logged).
    tokens_per_s: float | None = None
    mfu: float | None = None

    @property
    def time_to_train_min(self) -> float:
        return (self.run_stop_ms - self.run_start_ms) / 60000


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def parse_file(path: Path, system: str | None = None, submitter: str | None = None) -> Run:
    """One result file -> Run. `system` and `submitter` override the logged values (submission trees)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise LogError(f"cannot read: {exc.strerror or exc}") from None
    if not data.strip():
        raise LogError("empty file")
    first: dict[str, dict] = {}
    run_start = run_stop = None
    evals: list[tuple[float, float]] = []
    stats: dict[str, list[float]] = {name: [] for name in TRACKED}
    for event in iter_events(data):
        key = event["key"]
        first.setdefault(key, event)
        # The official summarizer's rule: the last run_start seen before the first run_stop.
        if run_stop is None:
            if key == C.RUN_START:
                run_start = event
            elif key == C.RUN_STOP and run_start is not None:
                run_stop = event
        if key == C.EVAL_ACCURACY and _is_number(event.get("value")):
            evals.append((float(event["time_ms"]), float(event["value"])))
        elif key == TRACKED_STATS and isinstance(event.get("value"), dict):
            for name, values in stats.items():
                value = event["value"].get(name)
                if _is_number(value):
                    values.append(float(value))
    if not first:
        raise LogError("no MLLOG records")
    if run_start is None:
        raise LogError("run_start not recorded")
    if run_stop is None:
        raise LogError("run_stop not recorded")
    start_ms, stop_ms = float(run_start["time_ms"]), float(run_stop["time_ms"])

    def value(key: str, kind: type):
        """The first logged value of `key`, or None where it is missing or of the wrong type."""
        found = first[key].get("value") if key in first else None
        return found if isinstance(found, kind) and not isinstance(found, bool) else None

    metadata = run_stop.get("metadata") if isinstance(run_stop.get("metadata"), dict) else {}
    status = metadata.get(C.STATUS)
    evals.sort()
    return Run(
        file=str(path), benchmark=value(C.SUBMISSION_BENCHMARK, str),
        system=system or value(C.SUBMISSION_PLATFORM, str), submitter=submitter or value(C.SUBMISSION_ORG, str),
        division=value(C.SUBMISSION_DIVISION, str), status=status if isinstance(status, str) else None,
        seed=value(C.SEED, int), run_start_ms=start_ms, run_stop_ms=stop_ms, quality=evals[-1][1] if evals else None,
        samples_per_s=_mean(stats["throughput"]), tokens_per_s=_mean(stats["tokens_per_second"]),
        mfu=_mean(stats["mfu"]),
        global_batch_size=value(C.GLOBAL_BATCH_SIZE, int),
        evals=[(t - start_ms, acc) for t, acc in evals],
    )


def result_files(paths: Iterable[Path]) -> list[Path]:
    """result_*.txt files under the given files and folders, sorted, each once."""
    found: set[Path] = set()
    for path in map(Path, paths):
        if path.is_dir():
            found.update(p for p in path.rglob("result_*.txt") if p.is_file())
        else:
            found.add(path)
    return sorted(found)


def system_description(path: Path) -> tuple[str, dict] | None:
    """(system, description) for a file at <org>/results/<system>/<benchmark>/result_*.txt beside
    <org>/systems/<system>.json; None elsewhere, so the log's own keys count."""
    parts = path.absolute().parts
    if len(parts) < 5 or parts[-4] != "results":
        return None
    system = parts[-3]
    try:
        description = json.loads((Path(*parts[:-4]) / "systems" / f"{system}.json").read_text())
    except (OSError, ValueError):
        return None
    return (system, description) if isinstance(description, dict) else None


def _accelerators(description: dict) -> int | None:
    try:
        return int(description["number_of_nodes"]) * max(1, int(description["accelerators_per_node"]))
    except (KeyError, TypeError, ValueError):
        return None


def load_runs(paths: Iterable[Path], on_error: ErrorSink) -> list[Run]:
    runs = []
    for path in result_files(paths):
        found = system_description(path)
        system, description = found if found else (None, {})
        try:
            run = parse_file(path, system, description.get("submitter"))
        except LogError as exc:
            on_error(path, str(exc))
            continue
        run.accelerators = _accelerators(description)
        accounting = account(path, run.run_start_ms, run.run_stop_ms)
        if accounting is not None:
            run.restarts, run.goodput, run.badput = accounting.restarts, accounting.goodput, accounting.badput
        runs.append(run)
    return runs
