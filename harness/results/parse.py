"""Read MLPerf result logs (ours and anyone's) into Run records.

The lines are read by workloads.common.mllog_reader, which the workloads share.
A line counts when it holds `:::MLLOG {json}` anywhere, so prefixes such as
srun's `-l` rank labels are ignored, as are all other lines. A file that is no
MLPerf log (empty, no MLLOG record, a damaged record, no run_start) is reported
through `on_error(path, reason)` and left out; it never stops the others. A log
that started but never logged run_stop is a run that did not finish: it is kept,
as a failed run (`Run.unfinished`), since the official summarizer counts it so.
In a submission tree, a system folder without a readable systems/<folder>.json is left out
(each of its files reported), as the summarizer leaves it out.
This module must not import torch: reports run anywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from harness.results.goodput import account
from harness.results.keys import C, TRACKED_STATS
from workloads.common.mllog_reader import LogError, iter_events  # the one MLLOG reader (light, torch-free)
from workloads.common.mllog_reader import is_number as _is_number
from workloads.common.run_record import ran_synthetic

# NeMo's tracked_stats field for seconds per training step of global_batch_size samples (train_step_timing before
# 2024): the one throughput NVIDIA's v5.1 and v6.0 logs carry.
STEP_TIMES = ("train_step_time", "train_step_timing")

ErrorSink = Callable[[Path, str], None]


@dataclass(frozen=True)
class Rates:
    """How one log's tracked_stats records give samples/s and tokens/s: the Run's means and the pictures' lines
    both read them through here.

    A log that states step times gets its samples/s from them (global_batch_size / step time, a figure whose
    meaning is fixed), and its `throughput` field is not read: NeMo's gpt3 logs of v3.0 put tokens/s there. Other
    logs' samples/s are their `throughput` field (what NVIDIA's other logs and this harness's workloads write).
    tokens/s is the logged `tokens_per_second`, else samples/s times the logged max_sequence_length, which only the
    language models log (their samples are sequences of that many tokens)."""

    batch_size: int | None = None
    sequence_length: int | None = None
    step_timed: bool = False

    def samples_per_s(self, stats: dict) -> float | None:
        if not self.step_timed:
            rate = stats.get("throughput")
            return float(rate) if _is_number(rate) else None
        seconds = next((stats[name] for name in STEP_TIMES if _is_number(stats.get(name))), None)
        return self.batch_size / seconds if seconds and self.batch_size else None

    def tokens_per_s(self, stats: dict) -> float | None:
        if _is_number(stats.get("tokens_per_second")):
            return float(stats["tokens_per_second"])
        samples = self.samples_per_s(stats)
        return samples * self.sequence_length if samples is not None and self.sequence_length else None


@dataclass
class Run:
    """One timed run: the facts a report needs, taken from one result file."""

    file: str
    benchmark: str | None
    system: str | None  # the official system_name of systems/<folder>.json, else the logged submission_platform
    submitter: str | None
    division: str | None
    status: str | None
    seed: int | None
    run_start_ms: float
    run_stop_ms: float | None  # None: the run never logged run_stop (it did not finish)
    quality: float | None  # the last eval_accuracy that is a plain number
    samples_per_s: float | None  # the mean over the log's tracked_stats records of their samples/s (Rates)
    global_batch_size: int | None
    evals: list[tuple[float, float]] = field(default_factory=list)  # (ms since run_start, accuracy), numbers only
    # Every eval_accuracy as logged, for the ruleset's target: (value of any JSON type, metadata), in file order.
    eval_records: list[tuple[object, dict]] = field(default_factory=list)
    system_id: str | None = None  # the results/<folder> name in a submission tree, else the logged platform
    # What mlperf-logging's RCP checker reads, which differs from the above on per-rank duplicates:
    # the last global_batch_size, and at the last run_stop the evals logged before it and its status.
    last_batch_size: object = None
    last_stop: tuple[int, object] | None = None  # (len(eval_records) before the last run_stop, its status)
    accelerators: int | None = None  # from the submission's system description, where there is one
    converged: bool = False  # set by harness.results.load under a ruleset's target check, for a compliant log
    reached_target: bool = False  # the same check, whatever the compliance checker says of the log
    # From the harness's run record beside the log (None for logs without one): see goodput.py.
    restarts: int | None = None
    goodput: float | None = None
    badput: dict[str, float] | None = None
    stragglers: list[dict] | None = None  # ranks the straggler checks named: {"rank", "node", "score", "windows"}
    # Language models' tokens/s (Rates) and, on GPUs with a known peak, the logged MFU (None where not logged).
    tokens_per_s: float | None = None
    mfu: float | None = None
    rates: Rates = Rates()  # how this log's tracked_stats records give samples/s and tokens/s
    # Outside a submission tree, the folder that holds the log: a campaign, its own group. None in a tree.
    campaign: str | None = None
    # The ruleset that judged the log (set by harness.results.load); None where no ruleset holds it.
    ruleset: str | None = None
    # mlperf-logging's compliance checker's first error (set by harness.results.load); None: the file passed.
    compliance_error: str | None = None
    compliance_failed_keys: tuple[str, ...] = ()  # the keys whose CHECK failed, where nothing else did
    # Trained on synthetic input (its run record says so): a throughput run, with no quality target or score.
    synthetic: bool = False

    @property
    def compliant(self) -> bool | None:
        """The compliance checker's verdict; None where no ruleset judged the log, so the checker did not run."""
        return None if self.ruleset is None else self.compliance_error is None

    @property
    def aborted(self) -> bool:
        """run_stop said aborted: a failed run, whatever the checker finds in its log."""
        return self.status == C.ABORTED

    @property
    def left_out(self) -> bool:
        """Failed by the compliance checker alone: a run that ended aborted failed already, and the checker's
        verdict on its log is noise (a run whose data failed to open never logged train_samples, which the checker
        wants), so it is not named; a finished run's compliance failure always is."""
        return self.compliant is False and not self.aborted

    @property
    def unfinished(self) -> bool:
        return self.run_stop_ms is None

    @property
    def time_to_train_min(self) -> float | None:
        return None if self.run_stop_ms is None else (self.run_stop_ms - self.run_start_ms) / 60000


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def parse_file(path: Path, system: str | None = None, submitter: str | None = None,
               system_id: str | None = None) -> Run:
    """One result file -> Run. `system`, `system_id` and `submitter` override the logged values (submission trees)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise LogError(f"cannot read: {exc.strerror or exc}") from None
    if not data.strip():
        raise LogError("empty file")
    first: dict[str, dict] = {}
    run_start = run_stop = None
    evals: list[tuple[float, float]] = []
    eval_records: list[tuple[object, dict]] = []
    last_batch_size = last_stop = None
    stats: list[dict] = []  # tracked_stats values
    for event in iter_events(data):
        key = event["key"]
        first.setdefault(key, event)
        # The official summarizer's rule: the last run_start seen before the first run_stop.
        if run_stop is None:
            if key == C.RUN_START:
                run_start = event
            elif key == C.RUN_STOP and run_start is not None:
                run_stop = event
        if key == C.GLOBAL_BATCH_SIZE:
            last_batch_size = event.get("value")
        elif key == C.RUN_STOP:
            stop_metadata = event.get("metadata")
            last_stop = (len(eval_records), stop_metadata.get(C.STATUS) if isinstance(stop_metadata, dict) else None)
        if key == C.EVAL_ACCURACY:
            metadata = event.get("metadata")
            eval_records.append((event.get("value"), metadata if isinstance(metadata, dict) else {}))
            if _is_number(event.get("value")):
                evals.append((float(event["time_ms"]), float(event["value"])))
        elif key == TRACKED_STATS and isinstance(event.get("value"), dict):
            stats.append(event["value"])
    if not first:
        raise LogError("no MLLOG records")
    if run_start is None:
        raise LogError("run_start not recorded")
    start_ms = float(run_start["time_ms"])
    stop_ms = None if run_stop is None else float(run_stop["time_ms"])

    def value(key: str, kind: type):
        """The first logged value of `key`, or None where it is missing or of the wrong type."""
        found = first[key].get("value") if key in first else None
        return found if isinstance(found, kind) and not isinstance(found, bool) else None

    metadata = run_stop.get("metadata") if run_stop and isinstance(run_stop.get("metadata"), dict) else {}
    status = metadata.get(C.STATUS)
    evals.sort()
    rates = Rates(value(C.GLOBAL_BATCH_SIZE, int), value(C.MAX_SEQUENCE_LENGTH, int),
                  any(_is_number(record.get(name)) for record in stats for name in STEP_TIMES))

    def mean(rate: Callable[[dict], float | None]) -> float | None:
        return _mean([r for r in map(rate, stats) if r is not None])

    return Run(
        file=str(path), benchmark=value(C.SUBMISSION_BENCHMARK, str),
        system=system or value(C.SUBMISSION_PLATFORM, str), submitter=submitter or value(C.SUBMISSION_ORG, str),
        division=value(C.SUBMISSION_DIVISION, str), status=status if isinstance(status, str) else None,
        seed=value(C.SEED, int), run_start_ms=start_ms, run_stop_ms=stop_ms, quality=evals[-1][1] if evals else None,
        samples_per_s=mean(rates.samples_per_s), tokens_per_s=mean(rates.tokens_per_s),
        mfu=mean(lambda record: float(record["mfu"]) if _is_number(record.get("mfu")) else None), rates=rates,
        global_batch_size=value(C.GLOBAL_BATCH_SIZE, int),
        evals=[(t - start_ms, acc) for t, acc in evals], eval_records=eval_records,
        system_id=system_id or value(C.SUBMISSION_PLATFORM, str), last_batch_size=last_batch_size,
        last_stop=last_stop,
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


def submission_system(path: Path) -> tuple[str, Path] | None:
    """(system folder, its description file) for a file at <org>/results/<folder>/<benchmark>/result_*.txt
    where <org> also holds systems/: a submission tree, as the summarizer reads one. None elsewhere (such as
    a harness run folder, results/runs/<run>/result_*.txt), so the log's own keys count."""
    parts = path.absolute().parts
    if len(parts) < 5 or parts[-4] != "results":
        return None
    org = Path(*parts[:-4])
    return (parts[-3], org / "systems" / f"{parts[-3]}.json") if (org / "systems").is_dir() else None


def _description(file: Path) -> dict:
    """A system description; LogError where the summarizer cannot load it (it then leaves the system out)."""
    try:
        description = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LogError(f"left out, as the summarizer leaves out a system it has no description of: "
                       f"{file}: {getattr(exc, 'strerror', None) or exc}") from None
    if not isinstance(description, dict):
        raise LogError(f"left out, as the summarizer leaves out a system it has no description of: "
                       f"{file} holds no JSON object")
    return description


def _accelerators(description: dict) -> int | None:
    try:
        return int(description["number_of_nodes"]) * max(1, int(description["accelerators_per_node"]))
    except (KeyError, TypeError, ValueError):
        return None


def load_runs(paths: Iterable[Path], on_error: ErrorSink) -> list[Run]:
    runs = []
    for path in result_files(paths):
        tree = submission_system(path)
        try:
            folder, description = (tree[0], _description(tree[1])) if tree else (None, {})
            name = description.get("system_name")  # what the official results table calls the system
            run = parse_file(path, name if isinstance(name, str) and name else folder, description.get("submitter"),
                             folder)
        except LogError as exc:
            on_error(path, str(exc))
            continue
        run.campaign = None if tree else str(path.parent)
        run.synthetic = ran_synthetic(path)
        run.accelerators = _accelerators(description)
        if run.division is None and isinstance(description.get("division"), str):
            run.division = description["division"]
        accounting = None if run.unfinished else account(path, run.run_start_ms, run.run_stop_ms)
        if accounting is not None:
            run.restarts, run.goodput, run.badput = accounting.restarts, accounting.goodput, accounting.badput
            run.stragglers = accounting.stragglers
        runs.append(run)
    return runs
