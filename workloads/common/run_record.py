"""The run record: where a run's wall time went, beside its MLPerf log (torch-free; the report reads it).

<out>/run_<i>.jsonl gets one JSON line per finished interval, written by rank 0:
    {"attempt": 1, "kind": "restore", "start": 1700000000.1, "end": 1700000002.3, "steps": [40, 40]}
kinds: startup (process start, or run_start, to the first step), restore, train (steps done,
flushed every few seconds, an attempt's first step alone; "compile_s": the seconds of it torch.compile spent), eval
("compile_s" too), warm_up (before run_start, in the untimed init: workloads.common.warm_up; or a moment with the
reason it was skipped), save (the time training waited for a checkpoint), and
fault (an injected failure, at the moment it fires), cache_clear (before a fresh run: whether
every node's page cache was dropped, and if not, why), and input (before a fresh run: whether the
input is synthetic, {"synthetic": true}: a throughput run, which results.load keeps out of scores). Times are Unix seconds, as the
MLPerf log's time_ms / 1000. Each node agent records its attempts in <out>/attempts/<node>.jsonl
(see harness.agent; on Slurm each with the run its step was launched for: attempt_key), and the decider merges
them into <out>/attempts.jsonl; together with the run
records they give the report its restarts, goodput and badput.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Callable

ATTEMPT_ENV = "HARNESS_ATTEMPT"  # the attempt number, 0 first; set by the node agent
# Set by the node agent for its workers, which restart in process (workloads.common.inprocess) within the same budget
# and record those attempts as this node: the restart budget (--max-restarts), and the node's identity in its records.
BUDGET_ENV = "HARNESS_MAX_RESTARTS"
IDENTITY_ENV = "HARNESS_AGENT_IDENTITY"
ATTEMPTS_FILE = "attempts.jsonl"  # every node's attempts merged, rewritten whole by the decider
# One file per node, each with a single writer: appends from many NFS clients to one file are not atomic
# (O_APPEND is emulated client-side), so 448 nodes appending to one file could interleave or lose lines.
ATTEMPTS_DIR = "attempts"
FLUSH_S = 2.0  # how stale the newest train record may get (the agent reads the step at a failure from it)


def read_json_lines(path: Path) -> list[dict]:
    """The JSON objects of a record file; a line cut by a killed writer (or any other damage) is skipped."""
    if not Path(path).is_file():
        return []
    found = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            found.append(record)
    return found


def node_attempts_path(out: Path, node: str) -> Path:
    """This node's own attempts file (node names are host names; anything else is replaced)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in node).lstrip(".") or "node"
    return Path(out) / ATTEMPTS_DIR / f"{safe}.jsonl"


def attempt_key(record: dict) -> tuple[int, int]:
    """(attempt, launch): what one attempt's records share. On Slurm every run of a campaign is an srun step of its
    own, and every step of one allocation runs the same attempt (SLURM_RESTART_COUNT): each agent records the run
    its step was launched for as `launch` (harness.agent --launch), so that a node lost in run 2 is not taken to have
    ended by its end of run 0. Where one launch does every run (Kubernetes, local), and in records from before
    `launch`, it is absent: 0."""
    launch = record.get("launch")
    return record["attempt"], launch if isinstance(launch, int) and not isinstance(launch, bool) else 0


def read_attempts(out: Path) -> list[dict]:
    """Every node's attempt records, oldest first (by attempt, launch, then time). Run folders from before per-node
    files have only the merged file, which is then read instead."""
    files = sorted((Path(out) / ATTEMPTS_DIR).glob("*.jsonl"))
    if not files:
        files = [Path(out) / ATTEMPTS_FILE]
    records = [r for f in files for r in read_json_lines(f) if isinstance(r.get("attempt"), int)]
    return sorted(records, key=lambda r: (*attempt_key(r), r.get("time") if isinstance(r.get("time"), (int, float))
                                          else 0.0))


def attempt_of(records: list[dict], attempt: int | None = None) -> tuple[int, int] | None:
    """The (attempt, launch) that `attempt` means in these records: its newest launch; with None, the newest
    attempt's. None when no record has it."""
    keys = [attempt_key(r) for r in records if attempt is None or r["attempt"] == attempt]
    return max(keys) if keys else None


def of_launch(records: list[dict], launch: int) -> list[dict]:
    """The records of one launch (see attempt_key): a Kubernetes job per run judges and numbers its own attempts."""
    return [r for r in records if attempt_key(r)[1] == launch]


def records_of(records: list[dict], key: tuple[int, int]) -> list[dict]:
    """One attempt's records (of one launch: see attempt_key)."""
    return [r for r in records if attempt_key(r) == key]


def replace_whole(path: Path, text: str) -> None:
    """Write `path` aside, then rename it over: a reader never sees half of it. The aside name is unique to
    this writer (not just its PID: every pod's agent is PID 1), so writers on many nodes never collide. It is
    created as any file is, with the mode the umask gives (mkstemp's 0600 would hide job.json from the rest of
    the team, and the metrics targets from a Prometheus that runs as another user)."""
    path = Path(path)
    aside = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        with open(aside, "x") as f:
            f.write(text)
        os.replace(aside, path)
    except BaseException:
        aside.unlink(missing_ok=True)
        raise


def write_merged_attempts(out: Path, records: list[dict]) -> None:
    """The merged view, replaced whole; deciders on several nodes may each write it (the last one stays)."""
    replace_whole(Path(out) / ATTEMPTS_FILE, "".join(json.dumps(r) + "\n" for r in records))


def run_record_path(out: Path, index: int) -> Path:
    return Path(out) / f"run_{index}.jsonl"


def run_records(out: Path) -> dict[int, Path]:
    """{run index: record} of a folder's run records, in run order. A campaign starts run i+1, and its record,
    only once run i has stopped (workloads.common.campaign), so the index orders them; names would not (run_10
    before run_2), nor modification times (1 s granular on NFS and some overlay file systems)."""
    found = {int(match.group(1)): path for path in Path(out).glob("run_*.jsonl")
             if (match := re.fullmatch(r"run_(\d+)\.jsonl", path.name))}
    return dict(sorted(found.items()))


def record_beside(result_file: Path) -> Path | None:
    """The run record of a result_<i>.txt (its folder's run_<i>.jsonl); None for a file of another name."""
    found = re.fullmatch(r"result_(\d+)\.txt", Path(result_file).name)
    return run_record_path(Path(result_file).parent, int(found.group(1))) if found else None


def ran_synthetic(result_file: Path) -> bool:
    """Whether the run's record says it trained on synthetic input (a throughput run: no quality target)."""
    record = record_beside(result_file)
    return record is not None and any(r.get("kind") == "input" and r.get("synthetic") is True
                                      for r in read_json_lines(record))


def current_attempt() -> int:
    return int(os.environ.get(ATTEMPT_ENV, "0"))


class RunRecord:
    """Appends the intervals of one run. On ranks other than 0 every call is a no-op."""

    def __init__(self, path: Path | None, attempt: int, compile_clock: Callable[[], float] | None = None):
        self.path, self.attempt = path, attempt
        self._train: list | None = None  # [start, end, first_step, last_step] not yet written
        self._first_step = True  # an attempt's first step gets a record of its own: what it cost shows
        # Seconds torch.compile has spent so far in this process (workloads.common.compiling.compile_seconds): what
        # a train or eval record's time spent compiling ("compile_s"), which the report counts as badput.
        self._compile_clock = compile_clock
        self._compiled = compile_clock() if compile_clock else 0.0

    def compiled_since(self) -> dict[str, float]:
        """{"compile_s": seconds} compiled since the last call, if any: the details of the interval just ended."""
        if self._compile_clock is None:
            return {}
        now = self._compile_clock()
        spent, self._compiled = now - self._compiled, now
        return {"compile_s": round(spent, 3)} if spent >= 0.001 else {}

    def interval(self, kind: str, start: float, end: float, steps: tuple[int, int] | None = None,
                 details: dict | None = None) -> None:
        if self.path is None:
            return
        line = {"attempt": self.attempt, "kind": kind, "start": round(start, 4), "end": round(end, 4)}
        if steps is not None:
            line["steps"] = list(steps)
        line.update(details or {})
        with open(self.path, "a") as f:  # one short write per line: a killed writer leaves whole lines
            f.write(json.dumps(line) + "\n")

    def moment(self, kind: str, **facts) -> None:
        """Something that happened at one moment (no duration), with what is known about it."""
        if self.path is None:
            return
        now = time.time()
        with open(self.path, "a") as f:
            f.write(json.dumps({"attempt": self.attempt, "kind": kind, "start": round(now, 4), "end": round(now, 4),
                                **facts}) + "\n")

    def trained(self, step: int, step_started: float) -> None:
        """Step `step` ran from `step_started` until now; written in batches (see FLUSH_S)."""
        now = time.time()
        if self._train is None:
            self._train = [step_started, now, step, step]
        else:
            self._train[1], self._train[3] = now, step
        if self._first_step or now - self._train[0] >= FLUSH_S:
            self._first_step = False
            self.flush()

    def flush(self) -> None:
        if self._train is not None:
            start, end, first, last = self._train
            self._train = None
            self.interval("train", start, end, (first, last), self.compiled_since())
