"""The node agent's Prometheus endpoint: what its workers, the attempt record and the run records say, live.

Every node agent (harness.agent) serves /metrics on the profile's port. Workers hand it
their figures through small files (workloads.common.metrics_feed), so a scrape costs the
training nothing; restarts, goodput and badput come from the same records the report
reads. Metric names live here and only here: the Grafana dashboard
(manifests/monitoring/grafana-dashboard.json) and the tests read them from this table.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "mlperf_harness_"
RANK_LABELS = ("job", "benchmark", "run", "node", "rank")
NODE_LABELS = ("job", "benchmark", "node")
# name (without PREFIX) -> (type, help, labels). Base units; counters end in _total once exposed.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "step_seconds": ("histogram", "Time of one training step, checkpoint saves and evals left out", RANK_LABELS),
    "train_step": ("gauge", "Optimizer steps this run has reached", RANK_LABELS),
    "samples_per_second": ("gauge", "Training throughput the MLPerf log's tracked_stats records", RANK_LABELS),
    "tokens_per_second": ("gauge", "Training throughput in tokens, where the workload logs it", RANK_LABELS),
    "mfu_ratio": ("gauge", "Model FLOPs utilisation (0 to 1), where the GPU's peak is known", RANK_LABELS),
    "loss": ("gauge", "The newest training loss a rank read back", RANK_LABELS),
    "eval_quality": ("gauge", "The newest eval_accuracy in the MLPerf log", RANK_LABELS),
    "state": ("gauge", "1 for the rank's current state (init, training, eval, checkpoint, stopped)",
              RANK_LABELS + ("state",)),
    "straggler_score": ("gauge", "Fastest rank's step time / this rank's (1: as fast as the fastest)",
                        RANK_LABELS),
    "restarts": ("counter", "Restarted attempts of the job, by the kind of failure before them",
                 ("job", "benchmark", "kind")),
    # Gauges, not counters: a failure turns work already counted as goodput into lost time.
    "goodput_seconds": ("gauge", "Training and eval time kept so far, per run", ("job", "benchmark", "run")),
    "badput_seconds": ("gauge", "Time lost so far, per run and cause", ("job", "benchmark", "run", "cause")),
    "checkpoint_save_seconds": ("gauge", "Time training waited for checkpoint saves", ("job", "benchmark", "run")),
    "checkpoint_restore_seconds": ("gauge", "Time spent restoring checkpoints", ("job", "benchmark", "run")),
    "preflight_passed": ("gauge", "1 when the node passed the preflight check, 0 when it failed",
                         NODE_LABELS + ("check",)),
}
TARGETS_FILE = "prometheus-targets.json"  # Prometheus file_sd: every node agent's host:port
TARGETS_DIR = "prometheus-targets"  # one file per node, each with a single writer
PORT_TRIES = 16  # nodes sharing a host (tests, small clusters) take the next free port
# The job-level figures (restarts, goodput) read every node's attempt file and the run records from the shared
# file system: at most once per this many seconds per node, so 448 nodes scraped every 15 s do not turn into
# tens of thousands of file opens a second on the file server.
# HARNESS_METRICS_TTL_S sets it (tests, small clusters that want fresher figures).
JOB_FIGURES_TTL_S = float(os.environ.get("HARNESS_METRICS_TTL_S", "30"))


def metric_names() -> list[str]:
    """Every series name a scrape can show, as PromQL sees it."""
    names = []
    for name, (kind, _, _) in METRICS.items():
        full = PREFIX + name
        names += {"counter": [f"{full}_total"], "histogram": [f"{full}_bucket", f"{full}_sum", f"{full}_count"]
                  }.get(kind, [full])
    return names


@dataclass
class Source:
    """Where one node agent finds its figures."""

    out: Path  # the run folder (attempt and run records)
    feed_dir: Path  # the workers' rank_<r>.json files, on this node
    job: str
    benchmark: str
    node: str


class _Collector:
    """Builds the metric families afresh on every scrape from the files the workers and records keep."""

    def __init__(self, source: Source):
        self.source = source
        self._job_figures: tuple[float, tuple] | None = None  # (when read, (restarts, accounting, preflight))

    def job_figures(self) -> tuple:
        now = time.monotonic()
        if self._job_figures is None or now - self._job_figures[0] > JOB_FIGURES_TTL_S:
            s = self.source
            self._job_figures = (now, (_restarts(s.out), _accounting(s.out), _preflight(s.out, s.node)))
        return self._job_figures[1]

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        from workloads.common.metrics_feed import STATES, STEP_BUCKETS

        s = self.source
        families = {}
        for name, (kind, text, labels) in METRICS.items():
            cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}[kind]
            families[name] = cls(PREFIX + name, text, labels=list(labels))
        for figures in _read_feeds(s.feed_dir):
            labels = [s.job, s.benchmark, str(figures.get("run")), s.node, str(figures.get("rank"))]
            counts, running = figures.get("step_buckets") or [], 0
            buckets = []
            for bound, count in zip([*map(str, STEP_BUCKETS), "+Inf"], counts):
                running += count
                buckets.append((bound, running))
            if len(buckets) == len(STEP_BUCKETS) + 1:
                families["step_seconds"].add_metric(labels, buckets, figures.get("step_sum", 0.0))
            families["train_step"].add_metric(labels, figures.get("step", 0))
            for name in ("samples_per_second", "tokens_per_second", "loss", "eval_quality", "straggler_score"):
                if isinstance(figures.get(name), (int, float)):
                    families[name].add_metric(labels, figures[name])
            if isinstance(figures.get("mfu"), (int, float)):
                families["mfu_ratio"].add_metric(labels, figures["mfu"])
            for state in STATES:
                families["state"].add_metric(labels + [state], 1.0 if figures.get("state") == state else 0.0)
        job = [s.job, s.benchmark]
        restarts, accounting_by_run, preflight = self.job_figures()
        for kind, count in restarts.items():
            families["restarts"].add_metric(job + [kind], count)
        for run, accounting in accounting_by_run:
            families["goodput_seconds"].add_metric(job + [run], accounting["goodput_s"])
            for cause, seconds in accounting["badput"].items():
                families["badput_seconds"].add_metric(job + [run, cause], seconds)
            families["checkpoint_save_seconds"].add_metric(job + [run], accounting["badput"].get("save", 0.0))
            families["checkpoint_restore_seconds"].add_metric(job + [run], accounting["badput"].get("restore", 0.0))
        for check, passed in preflight:
            families["preflight_passed"].add_metric(job + [s.node, check], 1.0 if passed else 0.0)
        yield from families.values()


def _read_feeds(folder: Path) -> list[dict]:
    found = []
    for path in sorted(Path(folder).glob("rank_*.json")):
        try:
            figures = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced or removed under us: the next scrape reads it
        if isinstance(figures, dict):
            found.append(figures)
    return found


def _restarts(out: Path) -> dict[str, int]:
    """Failed attempts that were followed by another, by kind (infrastructure, workload)."""
    from workloads.common.run_record import read_attempts

    records = read_attempts(out)
    started = {r["attempt"] for r in records if r.get("event") == "start"}
    kinds: dict[str, int] = {"infrastructure": 0, "workload": 0}
    failed = {r["attempt"]: r.get("kind") for r in records if r.get("event") == "end" and not r.get("ok")}
    for attempt, kind in failed.items():
        if attempt + 1 in started and kind in kinds:
            kinds[kind] += 1
    return kinds


def _accounting(out: Path) -> list[tuple[str, dict]]:
    """Goodput and badput so far of each run with a run record (the report's own accounting)."""
    from harness.results.goodput import account
    from workloads.common.run_record import read_json_lines, run_records

    found = []
    for index, record in run_records(out).items():
        times = [(r["start"], r["end"]) for r in read_json_lines(record)
                 if isinstance(r.get("start"), (int, float)) and isinstance(r.get("end"), (int, float))]
        if not times:
            continue
        # From the run's first interval to its newest (train intervals are flushed every 2 s).
        start, stop = min(t[0] for t in times), max(t[1] for t in times)
        got = account(Path(out) / f"result_{index}.txt", start * 1000, stop * 1000)
        if got is not None:
            found.append((str(index), {"goodput_s": got.goodput * (stop - start), "badput": got.badput}))
    return found


def _preflight(out: Path, node: str) -> list[tuple[str, bool]]:
    """This node's preflight verdicts, where preflight ran: (check, passed), one per check (a check measured on
    every GPU passes where all passed). From the run folder's preflight.json, else (Kubernetes, where preflight
    ran in a job of its own) from what the harness handed the pods (VERDICTS_ENV)."""
    from harness.preflight import VERDICTS_ENV, check_verdicts, read, verdicts_of

    report = read(out)
    if report is None:
        return sorted(verdicts_of(node, os.environ.get(VERDICTS_ENV, "")).items())
    nodes = report.get("nodes") if isinstance(report, dict) else None
    mine = nodes.get(node) if isinstance(nodes, dict) else None
    checks = mine.get("checks") if isinstance(mine, dict) else None
    return sorted(check_verdicts(checks).items()) if isinstance(checks, list) else []


class Exporter:
    """The HTTP endpoint and, where asked, pushes to a Pushgateway; stopped when the agent exits."""

    def __init__(self, source: Source, port: int, pushgateway: str | None = None, push_every_s: float = 15.0):
        from prometheus_client import CollectorRegistry, start_http_server

        self.source, self.pushgateway, self.push_every_s = source, pushgateway, push_every_s
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(source))
        self.server = self.port = None
        for candidate in range(port, port + PORT_TRIES):
            try:
                self.server, _ = start_http_server(candidate, registry=self.registry)
                self.port = candidate
                break
            except OSError:
                continue
        self._stop = threading.Event()
        self._pusher = None
        if pushgateway:
            self._pusher = threading.Thread(target=self._push_loop, name="pushgateway", daemon=True)
            self._pusher.start()

    def push(self) -> None:
        from prometheus_client import push_to_gateway

        try:
            push_to_gateway(self.pushgateway, job=f"mlperf-harness-{self.source.job}", registry=self.registry,
                            grouping_key={"node": self.source.node}, timeout=10)
        except OSError:
            pass  # a gateway that is down must not fail the node; the next push tries again

    def _push_loop(self) -> None:
        while not self._stop.wait(self.push_every_s):
            self.push()

    def close(self) -> None:
        self._stop.set()
        if self.pushgateway:
            self.push()  # the final figures (state stopped, goodput)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def write_target(out: Path, node: str, port: int, labels: dict[str, str]) -> None:
    """Record this node's endpoint for Prometheus' file-based discovery: its own file (prometheus-targets/<node>.json,
    which a file_sd glob reads whole), then the merged list, as complete as this node sees the others (on a
    shared file system the last writer may not see every node yet: the glob never misses one)."""
    host = socket.gethostname()
    folder = Path(out) / TARGETS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    entry = {"targets": [f"{host}:{port}"], "labels": {**labels, "node": node}}
    _replace(folder / f"{node}.json", [entry])
    merged = []
    for path in sorted(folder.glob("*.json")):
        try:
            merged += json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    _replace(Path(out) / TARGETS_FILE, merged)


def _replace(path: Path, data) -> None:
    from workloads.common.run_record import replace_whole

    replace_whole(path, json.dumps(data, indent=1) + "\n")
