"""The MLPerf result log: one `result_<i>.txt` per run, written by rank 0 through mllog.

Key names come from `mlperf_logging.mllog.constants`. The few keys that module
lacks are spelled once, below, exactly as the compliance checker's rule files
(or, for `tracked_stats`, NVIDIA's logs) spell them.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlperf_logging.mllog.mllog import MLLogger
from mlperf_logging.mllog import constants as C

from workloads.common.metrics_feed import FEED
from workloads.common.mllog_reader import iter_events
from workloads.common.refusals import ConfigurationError

TRACKED_STATS = "tracked_stats"  # throughput, as NVIDIA's submissions log it
LORA_RANK = "lora_rank"  # closed_llama2_70b_lora.yaml (mllog's constants have LORA_ALPHA only)
# ResNet's SGD keys (compliance_checker/training_*/closed_resnet_sgd.yaml).
SGD_OPT_BASE_LR = "sgd_opt_base_learning_rate"
SGD_OPT_END_LR = "sgd_opt_end_learning_rate"
SGD_OPT_LR_DECAY_POLY_POWER = "sgd_opt_learning_rate_decay_poly_power"
SGD_OPT_LR_DECAY_STEPS = "sgd_opt_learning_rate_decay_steps"
SGD_OPT_WEIGHT_DECAY = "sgd_opt_weight_decay"
SGD_OPT_MOMENTUM = "sgd_opt_momentum"
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class LoggedRun:
    """How far a result file got: what a restarted attempt needs to continue the same run."""

    started: bool  # run_start is logged: the timed run is under way
    stopped: bool  # run_stop is logged: the run is over
    seed: int | None
    init_started: bool = False  # init_start is logged (by this attempt's init, or one that failed)
    init_start_ms: float | None = None  # the first init_start's time: the checker times the init from it
    values: dict[str, Any] = field(default_factory=dict)  # each POINT_IN_TIME key's first value


def logged_run(path: Path) -> LoggedRun:
    started = stopped = init_started = False
    seed = init_start_ms = None
    values: dict[str, Any] = {}
    if path.is_file():
        # A line cut by the failure is left out (ResultLog drops it on reopening).
        for event in iter_events(path.read_bytes(), skip_damaged=True):
            key = event["key"]
            started |= key == C.RUN_START
            stopped |= key == C.RUN_STOP
            init_started |= key == C.INIT_START
            if key == C.INIT_START and init_start_ms is None and isinstance(event.get("time_ms"), (int, float)):
                init_start_ms = event["time_ms"]
            if key == C.SEED and isinstance(event.get("value"), int):
                seed = event["value"]
            if event.get("event_type") == "POINT_IN_TIME":
                values.setdefault(key, event.get("value"))
    return LoggedRun(started, stopped, seed, init_started, init_start_ms, values)


def _drop_cut_line(path: Path) -> None:
    """A writer killed mid-line leaves a partial record; cut it so the log stays parseable."""
    with open(path, "r+b") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


class ResultLog:
    """mllog bound to one result file. On ranks other than 0 every call is a no-op.

    A run resumed after a failure appends to its own file, so the run keeps one run_start
    and one run_stop and its time-to-train includes the time the failure cost.
    """

    def __init__(self, path: Path | None):
        self._handler = None
        self._logger = None
        if path is None:
            return
        if path.is_file():
            _drop_cut_line(path)
        logger = logging.Logger(f"mlperf:{path}")  # private: never shared with other runs or libraries
        self._handler = logging.FileHandler(path, mode="a")
        logger.addHandler(self._handler)
        # Stack offset 2 reports our caller, not this wrapper, as the logging site.
        self._logger = MLLogger(logger=logger, default_stack_offset=2, root_dir=_PROJECT_ROOT)

    def event(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        if self._logger:
            self._logger.event(key=key, value=value, metadata=metadata)
            FEED.mlperf_event(key, value, metadata)  # a copy for /metrics, after the log has it

    def start(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        if self._logger:
            self._logger.start(key=key, value=value, metadata=metadata)
            FEED.mlperf_event(key, value, metadata)

    def end(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        if self._logger:
            self._logger.end(key=key, value=value, metadata=metadata)
            FEED.mlperf_event(key, value, metadata)

    def events(self, values: dict[str, Any], logged: dict[str, Any] | None = None) -> None:
        """Log a dict of hyperparameters, one POINT_IN_TIME line each. Keys in `logged` (what an init that failed
        logged before this retry: LoggedRun.values) are there already, and are not logged twice; a value that
        changed since is refused, since the log could then say only one of them."""
        for key, value in values.items():
            if logged and key in logged:
                if json.loads(json.dumps(value)) != logged[key]:
                    raise ConfigurationError(f"workloads: an earlier, failed init of this run logged {key} "
                                             f"{logged[key]!r}; this one has {value!r}: delete the run's result file "
                                             "to start it over")
                continue
            if self._logger:
                self._logger.event(key=key, value=value)

    def sync(self) -> None:
        """Force what is logged so far onto the disk (a checkpoint is about to be taken from this point)."""
        if self._handler:
            self._handler.flush()
            os.fsync(self._handler.stream.fileno())

    def close(self) -> None:
        if self._handler:
            self._handler.close()


def division(preset: str) -> str:
    """Tiny presets change the benchmark, so they are open division; full presets are closed."""
    return C.CLOSED if preset == "full" else C.OPEN


def submission_keys(benchmark: str, division: str, org: str, platform: str, status: str = C.ONPREM) -> dict:
    return {
        C.SUBMISSION_BENCHMARK: benchmark,
        C.SUBMISSION_DIVISION: division,
        C.SUBMISSION_ORG: org,
        C.SUBMISSION_PLATFORM: platform,
        C.SUBMISSION_STATUS: status,
    }
