"""This rank's live figures, handed to its node agent for Prometheus (see harness.metrics).

A worker never talks to Prometheus and never runs a collective for metrics: it keeps a
few numbers in memory and, at most once a second (and whenever its state changes),
replaces one small JSON file, <HARNESS_METRICS_DIR>/rank_<r>.json, written aside and
renamed so the agent never reads half of it. The agent serves them on /metrics when it
is scraped. Without HARNESS_METRICS_DIR (metrics off, or a run outside the agent) every
call is a no-op. The MLPerf log stays the source of truth: this only copies from it.
"""

from __future__ import annotations

import bisect
import json
import os
import time
from pathlib import Path

from mlperf_logging.mllog import constants as C

METRICS_DIR_ENV = "HARNESS_METRICS_DIR"
STATES = ("init", "training", "eval", "checkpoint", "stopped")
# Step-time histogram bounds in seconds: from a ResNet step on a GPU (ms) to a GPT-3 step (tens of s).
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
WRITE_EVERY_S = 1.0


class MetricsFeed:
    def __init__(self, directory: Path | None, rank: int):
        self.path = Path(directory) / f"rank_{rank}.json" if directory else None
        self.figures = self._fresh(rank, None)
        self._written = 0.0

    @staticmethod
    def _fresh(rank: int, run: int | None) -> dict:
        """A run's figures before its first step: each run's series (labelled with its index) start at zero."""
        return {"rank": rank, "state": "init", "run": run, "step": 0,
                "step_buckets": [0] * (len(STEP_BUCKETS) + 1), "step_sum": 0.0, "step_count": 0}

    @classmethod
    def from_env(cls) -> "MetricsFeed":
        return cls(os.environ.get(METRICS_DIR_ENV) or None, int(os.environ.get("RANK", "0")))

    def run(self, index: int) -> None:
        self.figures = self._fresh(self.figures["rank"], index)
        self._write(now=True)

    def state(self, name: str) -> None:
        if self.figures["state"] != name:
            self.figures["state"] = name
            self._write(now=True)

    def step(self, step: int, seconds: float, loss: float | None = None) -> None:
        """One optimizer step that took `seconds` (checkpoint and eval time are not in it)."""
        f = self.figures
        f["step"], f["state"] = step, "training"
        f["step_buckets"][bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        f["step_sum"] += seconds
        f["step_count"] += 1
        if loss is not None:
            f["loss"] = loss
        self._write()

    def straggler_score(self, score: float) -> None:
        """A window's score, handed over with the next step's figures (within WRITE_EVERY_S): a window closes
        between two steps, and a forced write there was most of the window's own cost (bench/loop_overhead.py)."""
        self.figures["straggler_score"] = score
        self._write()

    def mlperf_event(self, key: str, value, metadata: dict | None) -> None:
        """Copy what the MLPerf log records: quality, throughput, the run's end."""
        f = self.figures
        if key == C.EVAL_ACCURACY and isinstance(value, (int, float)):
            f["eval_quality"] = value
        elif key == "tracked_stats" and isinstance(value, dict):
            for source, name in (("throughput", "samples_per_second"), ("tokens_per_second", "tokens_per_second"),
                                 ("mfu", "mfu")):
                if isinstance(value.get(source), (int, float)):
                    f[name] = value[source]
        elif key == C.RUN_STOP:
            f["state"] = "stopped"
        self._write(now=key in (C.RUN_STOP, C.EVAL_ACCURACY))

    def flush(self) -> None:
        """Hand over the figures now (before the rank stops stepping for a while)."""
        self._write(now=True)

    def _write(self, now: bool = False) -> None:
        if self.path is None or (not now and time.monotonic() - self._written < WRITE_EVERY_S):
            return
        self._written = time.monotonic()
        aside = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            aside.write_text(json.dumps(self.figures))
            os.replace(aside, self.path)
        except OSError:
            pass  # metrics must never stop training (a full disk, a folder removed by the agent at exit)


FEED = MetricsFeed.from_env()  # one per process: the run loop, the result log and the straggler check share it
