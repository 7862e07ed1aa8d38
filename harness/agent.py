"""`python -m harness.agent`: what every node runs, on every backend. It wraps torch's elastic agent.

torchrun's agent restarts its worker group after any failure, but it cannot tell a
lost process or a broken link (worth a retry) from a bug in the training code
(which fails the same way every time). So each attempt runs torchrun's agent with
no restarts of its own, and this wrapper:

1. records the attempt in its node's own file, <out>/attempts/<node>.jsonl: start, end, node,
   exit code or signal, the failed rank, the cause, and the run and step it reached (the
   decider merges every node's file into <out>/attempts.jsonl); on Slurm, where every run of a campaign is
   a step of its own in the same attempt, and for a closed campaign on Kubernetes, where every run is a job of its
   own, also the run the step or job was launched for (`launch`, from --launch:
   an attempt's records are those of one (attempt, launch), workloads.common.run_record.attempt_key);
2. classifies the failure: `infrastructure` (a signal, a lost peer, a NCCL or gloo
   error or timeout, a rendezvous that timed out or could not reach its store, the host out of memory),
   `workload` (an exception in the training code, a diverged loss, an exit with an error code, a GPU out of
   memory: the job's batch or layout, with what to lower in its cause)
   or `configuration` (a command torchrun or the workload refuses: an argument it does not take,
   a preset without its dataset; the same on every node and at every attempt: torchrun's refusal and
   the worker's ConfigurationError only, workloads.common.refusals). A passing file-system errno
   (a stale NFS handle, EIO) or ENOMEM is infrastructure;
3. decides, against one restart budget for every backend: retry an infrastructure
   failure while restarts are left, unless the last 3 attempts failed the same way at
   the same step; never retry a workload or configuration error (harness.blame blames no node for either).

Who restarts differs per backend: locally this loop does (`--restart-here`); on Slurm
the batch script requeues the job when `--decide` says so; on Kubernetes the exit code
does it (a PyTorchJob with restartPolicy ExitCode recreates pods that exit with 128 or
more and gives up on 1 to 127). The workers find the attempt number in HARNESS_ATTEMPT
and continue from their newest checkpoint.

Every node takes its attempt number from the shared record (see next_attempt), and the
nodes of one attempt meet at a rendezvous of that attempt alone (attempt_argv), so a
node restarted for the next attempt never joins peers still in the last one. Those
peers see its start in the record and stop too (NewerAttemptWatch), so that the
scheduler restarts them into the same attempt: one budget, every restart counted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from harness.blame import (CONFIGURATION, GPU_HARDWARE, INFRASTRUCTURE, MACHINE_ERRNO, NOT_RETRIED,
                           OUT_OF_GPU_MEMORY, OUT_OF_GPU_MEMORY_ADVICE, PASSING_IO, PEER_LOSS,
                           STOPPED_BY_NEWER_ATTEMPT, WORKLOAD, culprits, unquoted)
from workloads.common.run_record import (ATTEMPT_ENV, ATTEMPTS_DIR, ATTEMPTS_FILE, BUDGET_ENV, IDENTITY_ENV,
                                         attempt_of, node_attempts_path,
                                         of_launch,
                                         read_attempts, read_json_lines, records_of, run_records,
                                         write_merged_attempts)
from workloads.common.refusals import ConfigurationError
from workloads.common.requirements_check import exit_if_unfit

EXIT_WORKLOAD_ERROR = 3
EXIT_BUDGET_SPENT = 4
EXIT_REPEATED_FAILURE = 5
EXIT_FOLDER_TAKEN = 7  # (6 is harness run's "too few healthy nodes", harness.preflight)
# 128 + SIGUSR1, so that a PyTorchJob's ExitCode policy recreates the pod: the training operator retries
# every code of 128 or more, and its releases before that only 130, 137, 143 and this one.
EXIT_RETRY = 138
EXIT_CODES = {EXIT_WORKLOAD_ERROR: "workload or configuration error (not retried)",
              EXIT_BUDGET_SPENT: "restart budget spent",
              EXIT_REPEATED_FAILURE: "the same failure 3 times at the same step",
              EXIT_FOLDER_TAKEN: "the run folder holds another job's results", EXIT_RETRY: "retry"}
HOST_ENV = "HARNESS_HOST"  # the machine's name where NODE_ENV names a pod: the metrics' node label
NODE_ENV = "HARNESS_NODE"  # the node's name where the hostname is not stable (a Kubernetes pod's name)
CLAIM_FILE = "job-token"  # in the run folder: the token of the job whose results it holds
# How long a node waits for the token of the node that created CLAIM_FILE first. It is written right after, but
# on a shared file system that hundreds of starting nodes hammer it can show seconds later; the deadline only
# matters where the winner died in between, and refusing too early fails the job for good (EXIT_FOLDER_TAKEN).
CLAIM_WAIT_S = 120.0
REPEATS_TO_STOP = 3
# How a worker's refusals read in its error file: torch's ErrorHandler writes "<exception type name>: <text>" as the
# message, and the traceback (extraInfo.py_callstack), whose exception line names the type with its module as
# Python prints it ("workloads.common.refusals.ConfigurationError: <text>"). Ours (workloads.common.refusals) is
# the job's configuration error; another library's ConfigurationError is the workload's, and a plain SystemExit's
# refusal may be one node's.
CONFIGURATION_REFUSAL = f"{ConfigurationError.__module__}.{ConfigurationError.__qualname__}: "
REFUSAL = "SystemExit: "
# Failures of the machine rather than the program: retried within the budget (harness.blame says whose).
# (A GPU out of memory is read before these: OUT_OF_GPU_MEMORY, the job's own; a bare "out of memory" is the host's.)
_INFRASTRUCTURE_ERRORS = re.compile(rf"out of memory|{PEER_LOSS.pattern}|{GPU_HARDWARE.pattern}|"
                                    rf"{PASSING_IO.pattern}|{MACHINE_ERRNO.pattern}")
_ERRNO_ERRORS = re.compile(rf"{PASSING_IO.pattern}|{MACHINE_ERRNO.pattern}")


@dataclass(frozen=True)
class Failure:
    kind: str  # INFRASTRUCTURE, WORKLOAD or CONFIGURATION
    cause: str
    rank: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    stopped_by: str | None = None  # STOPPED_BY_NEWER_ATTEMPT: this node's agent ended it (NewerAttemptWatch)


@dataclass(frozen=True)
class Decision:
    exit_code: int  # 0: done; EXIT_RETRY: restart; otherwise stop
    message: str

    @property
    def retry(self) -> bool:
        return self.exit_code == EXIT_RETRY


def classify(rank: int, exit_code: int, signal_name: str | None, message: str, has_error_file: bool,
             traceback: str = "") -> Failure:
    """One failed worker -> what kind of failure it was, from its error file's message and traceback.
    A ConfigurationError is read first, by its qualified name in the traceback, so that the text it quotes (a
    path, an option) cannot make it read as the machine's."""
    if exit_code < 0:
        return Failure(INFRASTRUCTURE, f"rank {rank} killed by {signal_name}", rank, exit_code, signal_name)
    if not has_error_file:
        return Failure(WORKLOAD, f"rank {rank} exited with code {exit_code}", rank, exit_code)
    first_line = message.strip().splitlines()[0] if message.strip() else "an exception"
    reason = _configuration_refusal(first_line, traceback)
    if reason is not None:
        return Failure(CONFIGURATION, f"rank {rank}: {reason[:300]}", rank, exit_code)
    refusal = first_line.startswith(REFUSAL)
    gpu_memory = None if refusal else _exception_line(message, OUT_OF_GPU_MEMORY)
    if gpu_memory:  # the job's batch or layout, not the machine: stopped, with what to lower (harness.blame)
        said = gpu_memory if len(gpu_memory) <= 200 else gpu_memory[:gpu_memory.rfind(". ", 0, 200) + 1] or \
            gpu_memory[:200]  # torch's own words up to a sentence's end: how much it tried to allocate, of what
        return Failure(WORKLOAD, f"rank {rank}: {said.rstrip('.')}. {OUT_OF_GPU_MEMORY_ADVICE}", rank, exit_code)
    machine = _machine_error(message, refusal)
    if machine:  # named in the cause where it is not the first line (a DataLoader worker's wrapped OSError)
        cause = first_line if machine in first_line else f"{first_line} ({machine})"
        return Failure(INFRASTRUCTURE, f"rank {rank}: {cause[:300]}", rank, exit_code)
    return Failure(WORKLOAD, f"rank {rank}: {first_line[:300]}", rank, exit_code)


def _configuration_refusal(first_line: str, traceback: str) -> str | None:
    """The reason of a worker's ConfigurationError (workloads.common.refusals), or None for any other error. The
    message names only the type ("ConfigurationError: <text>", as several libraries' errors read); the traceback's
    line for that same exception names its module, which is what tells ours apart."""
    name = f"{ConfigurationError.__qualname__}: "
    if not first_line.startswith(name):
        return None
    reason = first_line.removeprefix(name)
    # Compared without trailing blanks: the message is stripped where the traceback's line is not.
    ours = f"{CONFIGURATION_REFUSAL}{reason}".rstrip()
    return reason if any(line.rstrip() == ours for line in traceback.splitlines()) else None


def _machine_error(message: str, refusal: bool) -> str | None:
    """The line of a worker's error that says the machine, the network or a peer failed, if one does. Only the
    exception lines are read (a traceback's source lines are indented) without what they quote, and of a plain
    refusal's text only an errno: a path or value named "timeout" or "nccl" is not the machine's word."""
    return _exception_line(message, _ERRNO_ERRORS if refusal else _INFRASTRUCTURE_ERRORS)


def _exception_line(message: str, pattern: re.Pattern) -> str | None:
    """The first exception line of a worker's error (not a traceback's indented source line) whose own words, without
    what they quote, match `pattern`."""
    for line in message.strip().splitlines():
        if line[:1].strip() and pattern.search(unquoted(line)):
            return line.strip()
    return None


def attempt_failure(failures: list[Failure]) -> Failure:
    """The root cause among the failed ranks: a workload or configuration error if any rank had one (the others
    then lost their peer), else a failure other than the SIGTERM the agent sends to the survivors."""
    return min(failures, key=lambda f: (f.kind not in NOT_RETRIED, f.signal == "SIGTERM", f.rank or 0))


# --- the record ----------------------------------------------------------------------------------

def read_records(out: Path) -> list[dict]:
    return read_attempts(out)


def _append(out: Path, node: str, record: dict) -> None:
    path = node_attempts_path(out, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:  # this node is the file's only writer; fsync so the decider reads it whole
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
    if record.get("event") == "start":  # what NewerAttemptWatch looks for: one path, not every node's file
        started_marker(out, record["attempt"]).touch()


def end_record(attempt: int, identity: dict, failure: Failure | None, run: int | None, step: int | None,
               now: float | None = None) -> dict:
    """A node's end of `attempt` as its agent records it: `identity` is the start record's (node, and host under a
    pod); a failure adds its kind, cause, failed rank, exit code, signal, the run and step reached, and, where this
    node's agent ended the attempt itself because another node began a newer one, `stopped_by` (harness.blame)."""
    end = {"event": "end", "attempt": attempt, **identity, "time": time.time() if now is None else now,
           "ok": failure is None}
    if failure:
        end.update(kind=failure.kind, cause=failure.cause, rank=failure.rank, exit_code=failure.exit_code,
                   signal=failure.signal, run=run, step=step)
        if failure.stopped_by:
            end["stopped_by"] = failure.stopped_by
    return end


def started_marker(out: Path, attempt: int) -> Path:
    return Path(out) / ATTEMPTS_DIR / f"started-{attempt}"


def next_attempt(records: list[dict], node: str, launch: int | None = None) -> int:
    """The attempt number for a (re)started node: Slurm counts requeues itself; elsewhere, one past the
    newest attempt that ended anywhere or that this node started (a node killed outright wrote no end).

    With `launch` (Kubernetes' closed campaigns, a job per run), only that run's job's records count, and its first
    attempt goes on at the campaign's newest: the runs before it ended their attempts by succeeding, which is no
    failure to restart after, and the budget spent on them stays spent (one budget for the campaign, as on Slurm)."""
    if "SLURM_JOB_ID" in os.environ:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    campaign = max((r["attempt"] for r in records), default=0)
    if launch is not None:
        records = of_launch(records, launch)
    seen = [r["attempt"] for r in records if r.get("event") == "end" or r.get("node") == node]
    newest = max(seen) + 1 if seen else 0
    return max(newest, campaign) if launch is not None else newest


def attempt_argv(torchrun_argv: list[str], attempt: int) -> list[str]:
    """torchrun's arguments for one attempt: the rendezvous id names the attempt, so only the nodes of one
    attempt meet. A pod the operator recreated for the next attempt then cannot join the rendezvous its
    surviving peers still hold; there torch's agent would restart their workers as a membership change,
    outside the restart budget and under the old attempt number. The survivors end their attempt instead
    (their workers lose the peer, or NewerAttemptWatch sees the newer one) and are recreated into it.
    Only torchrun's own options change, not the program's after them."""
    options = next((i for i, arg in enumerate(torchrun_argv) if arg == "-m" or not arg.startswith("-")),
                   len(torchrun_argv))
    return [f"{arg}-{attempt}" if arg.startswith("--rdzv-id=") else arg for arg in torchrun_argv[:options]] \
        + torchrun_argv[options:]


def newer_attempt(records: list[dict], attempt: int) -> dict | None:
    """The first start of an attempt after `attempt`, if some node has begun one."""
    return next((r for r in records if r.get("event") == "start" and r["attempt"] > attempt), None)


class NewerAttemptWatch:
    """While this node runs `attempt`, watch the shared record for a node that has begun a newer one (the
    scheduler restarted it after it was lost): then this node's attempt is over too, whether or not its
    workers have noticed the lost peer yet (NCCL may take its whole timeout). `stop` ends the attempt; by
    default it sends this process SIGTERM, which torch's agent turns into stopping the workers."""

    def __init__(self, out: Path, attempt: int, poll_s: float = 5.0, stop=None):
        self.out, self.attempt, self.poll_s = Path(out), attempt, poll_s
        self.stop = stop or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        self.newer: dict | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "NewerAttemptWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        # One stat every poll_s per node: reading all 448 nodes' files from 448 nodes every 5 s would be
        # 40,000 opens a second on the shared file system's server.
        marker = started_marker(self.out, self.attempt + 1)
        while not self._done.wait(self.poll_s):
            if marker.exists():
                self.newer = newer_attempt(read_records(self.out), self.attempt) or \
                    {"node": "another node", "attempt": self.attempt + 1}
                self.stop()
                return

    def failure(self) -> Failure:
        return Failure(INFRASTRUCTURE, f"{self.newer.get('node')} began attempt {self.newer['attempt']} (it was "
                                       "restarted after a failure), so this node's attempt ended to join it",
                       stopped_by=STOPPED_BY_NEWER_ATTEMPT)


def claim_run_folder(out: Path, token: str, wait_s: float = CLAIM_WAIT_S) -> str | None:
    """Claim the run folder for the job `token` names; the reason to refuse it, or None.

    On Kubernetes every job writes into a folder of its own on a shared volume, but the pods cannot ask
    the submitting machine whether a folder is theirs. The first node to start writes the token into
    CLAIM_FILE (created exclusively, so one node wins); every node, restarted ones included, then accepts
    the folder only if the token is its job's. A folder with results and no claim is refused too."""
    out.mkdir(parents=True, exist_ok=True)
    marker = out / CLAIM_FILE
    if not marker.exists() and (any(out.glob("result_*.txt")) or (out / ATTEMPTS_FILE).exists()
                                or (out / ATTEMPTS_DIR).exists()):
        return f"{out} already holds results that no job claimed; this job will not write into them"
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        deadline = time.monotonic() + wait_s
        while not (found := marker.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)  # the winner has created the file but not yet written its token
        if found != token:
            return (f"{out} holds the results of job {found or '(unnamed)'}, not of this job ({token}); "
                    "this job will not write into them")
        return None
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return None


def progress_at_failure(out: Path) -> tuple[int | None, int | None]:
    """(run index, step) the workers had reached: the last step in the record of the newest run (run_records)."""
    records = run_records(out)
    if not records:
        return None, None
    run = max(records)
    steps = [r["steps"] for r in read_json_lines(records[run]) if isinstance(r.get("steps"), list) and r["steps"]]
    return run, (steps[-1][-1] if steps else None)


# --- the decision --------------------------------------------------------------------------------

def _launch(records: list[dict], attempt: int, launch: int | None) -> int:
    """`launch`, or by default the newest launch of `attempt` in the records (0 where none is recorded)."""
    if launch is not None:
        return launch
    key = attempt_of(records, attempt)
    return key[1] if key else 0


def summarize(records: list[dict], attempt: int, launch: int | None = None) -> dict | None:
    """The outcome of one attempt over all its nodes' records; None if it has not started. `launch`: the run whose
    Slurm step it was (workloads.common.run_record.attempt_key); by default the attempt's newest."""
    mine = records_of(records, (attempt, _launch(records, attempt, launch)))
    ends = [r for r in mine if r.get("event") == "end"]
    starts = [r for r in mine if r.get("event") == "start"]
    if not ends:
        if not starts:
            return None
        return {"ok": False, "kind": INFRASTRUCTURE, "run": None, "step": None,
                "cause": "the attempt ended without a record (its node was lost or the job was killed)"}
    failed = [r for r in ends if not r.get("ok")]
    if not failed:
        return {"ok": True}
    worst = next((r for r in failed if r.get("kind") in NOT_RETRIED), failed[0])
    return {"ok": False, "kind": worst.get("kind"), "cause": worst.get("cause"), "run": worst.get("run"),
            "step": worst.get("step")}


def decide(records: list[dict], attempt: int, budget: int, launch: int | None = None) -> Decision:
    """What to do after `attempt`, with `budget` restarts allowed in all. `launch`: the run whose Slurm step ended
    (by default the attempt's newest: an earlier step's success is not this one's); earlier attempts are read at the
    same launch, where a requeued job goes on."""
    launch = _launch(records, attempt, launch)
    outcome = summarize(records, attempt, launch)
    if outcome is None or outcome["ok"]:
        return Decision(0, f"attempt {attempt} succeeded")
    where = "" if outcome.get("run") is None else f" (run {outcome['run'] + 1}" + \
        (f", step {outcome['step']})" if outcome.get("step") is not None else ")")
    what = f"attempt {attempt} failed{where}: {str(outcome['cause']).rstrip('.')}"  # a sentence follows
    if outcome["kind"] == WORKLOAD:
        return Decision(EXIT_WORKLOAD_ERROR, f"{what}. This is a workload error, which a restart would "
                                             "repeat, so the job stops; fix the cause and run again")
    if outcome["kind"] == CONFIGURATION:
        return Decision(EXIT_WORKLOAD_ERROR, f"{what}. This is a configuration error (the job's command or input, "
                                             "the same on every node), which a restart would repeat, so the job "
                                             "stops and no node is blamed; fix it and run again")
    if attempt >= budget:
        return Decision(EXIT_BUDGET_SPENT, f"{what}. The restart budget ({budget}) is spent, so the job stops; "
                                           "raise --max-restarts to allow more")
    recent = [summarize(records, a, launch) for a in range(max(0, attempt - REPEATS_TO_STOP + 1), attempt + 1)]
    signature = lambda o: (o.get("kind"), o.get("cause"), o.get("run"), o.get("step"))  # noqa: E731
    if len(recent) == REPEATS_TO_STOP and all(o and signature(o) == signature(outcome) for o in recent) \
            and outcome.get("step") is not None:
        return Decision(EXIT_REPEATED_FAILURE, f"{what}. The last {REPEATS_TO_STOP} attempts failed the same way "
                                               "at the same step, so another restart would too; the job stops")
    return Decision(EXIT_RETRY, f"{what}. Restarting from the newest checkpoint "
                                f"({attempt + 1} of {budget} restarts used)")


# --- a restart in process (workloads.common.inprocess) ---------------------------------------------

def in_process_verdict(out: Path, identity: dict, attempt: int, budget: int, rank: int, message: str,
                       traceback: str, now: float) -> dict:
    """What follows a worker's exception, asked by the first rank that failed while every process is still alive:
    the same policy as after an attempt (classify as the error file would read, decide against the one budget,
    blame), and `restart` (in process) only where that retries a failure that blames no node and is no lost peer.
    A node to keep out, a lost peer (a process that died) and every failure not retried are left to the agent."""
    failure = classify(rank, 1, None, message, True, traceback)
    run, step = progress_at_failure(out)
    end = {**end_record(attempt, identity, failure, run, step, now), "in_process": True}
    start = {"event": "start", "attempt": attempt, **identity, "time": now}
    decision = decide(read_records(out) + [end], attempt, budget, identity.get("launch"))
    restart = decision.retry and not PEER_LOSS.search(unquoted(failure.cause)) and not culprits([start, end])
    message = decision.message.replace("Restarting from", "Restarting in process from") if restart else \
        decision.message if not decision.retry else f"{failure.cause}: left to the node agent's restart"
    return {"restart": restart, "message": message, "attempt": attempt, "end": end, "run": run, "time": now}


def in_process_records(identity: dict, verdict: dict) -> list[dict]:
    """One node's records of a restart in process (verdict: in_process_verdict's): its end of the attempt (the
    failure's own record on the failed rank's node; elsewhere an end that went down with it, as a victim) and its
    start of the next, both marked `in_process`."""
    attempt, failed = verdict["attempt"], verdict["end"]
    if identity["node"] == failed["node"]:
        end = failed
    else:
        cause = Failure(INFRASTRUCTURE, f"{failed['node']} failed ({failed['cause']}); this node's ranks restarted "
                                        "in process with it", stopped_by=STOPPED_BY_NEWER_ATTEMPT)
        end = {**end_record(attempt, identity, cause, failed.get("run"), failed.get("step"), verdict["time"]),
               "in_process": True}
    return [end, {"event": "start", "attempt": attempt + 1, **identity, "time": time.time(), "in_process": True}]


def in_process_attempt(records: list[dict], node: str, attempt: int) -> int:
    """The attempt this node's workers are in: `attempt`, or the newest they began in process since."""
    return max([attempt] + [r["attempt"] for r in records if r.get("event") == "start" and r.get("in_process")
                            and r.get("node") == node])


# --- one attempt ---------------------------------------------------------------------------------

def run_attempt(torchrun_argv: list[str]) -> tuple[bool, Failure | None]:
    """Run torchrun's agent once with no restarts of its own; (stopped by a signal, failure or None)."""
    from torch.distributed import DistError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    try:
        args = torchrun_args(torchrun_argv)
    except ValueError as exc:
        return False, Failure(CONFIGURATION, f"torchrun refused the node's command: {exc}")
    try:
        torchrun.run(args)
        return False, None
    except ChildFailedError as exc:
        return False, attempt_failure([worker_failure(rank, f) for rank, f in sorted(exc.failures.items())])
    except SignalException as exc:
        return True, signalled(exc)
    except (RendezvousError, DistError, TimeoutError, ConnectionError) as exc:
        # The nodes never met (a node late or lost, the store's host unreachable): no worker ran, so it is the
        # cluster's failure, not the workload's, and worth a retry like any other.
        return False, Failure(INFRASTRUCTURE, f"rendezvous failed: {_rendezvous_reason(exc, args)}")


def torchrun_args(torchrun_argv: list[str]):
    """torchrun's arguments with no restarts of its own, checked as torchrun.run checks them first; ValueError
    with torchrun's reason where it refuses them. Such a command is the job's configuration error (an option the
    image's torch does not take, a malformed value): left to torchrun it would exit 2 or raise before this node
    recorded its attempt's end, and the failure policy would read every node as lost, retry and blame them."""
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()

    def refuse(message: str):  # argparse would print its usage and exit 2
        raise ValueError(message)

    parser.error = refuse
    args = parser.parse_args(torchrun_argv)
    args.max_restarts = 0
    checked = copy.copy(args)
    # torchrun.run's first step, which it repeats on `args`. Without a log folder of its own the check would leave
    # a /tmp/torchelastic_* folder behind on every node at every attempt; this one goes when the check is done.
    with tempfile.TemporaryDirectory(prefix="harness-torchrun-check-") as log_dir:
        checked.log_dir = log_dir
        try:
            torchrun.config_from_args(checked)
        except (ValueError, RuntimeError, AssertionError) as exc:
            raise ValueError(str(exc) or type(exc).__name__) from None
    return args


def _rendezvous_reason(exc: Exception, args) -> str:
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError

    where = f"the c10d store at {args.rdzv_endpoint}" if args.rdzv_endpoint else "the local store"
    if isinstance(exc, RendezvousTimeoutError):
        return (f"not all {args.nnodes} node(s) joined at {where} in time (join_timeout); a node is late, "
                "lost or cannot reach it")
    if isinstance(exc, RendezvousConnectionError):
        return f"cannot reach {where}: {exc or type(exc).__name__}"
    return f"{type(exc).__name__} at {where}: {str(exc).splitlines()[0][:300] if str(exc) else 'no detail'}"


def worker_failure(rank: int, failure) -> Failure:
    """One failed worker as torchelastic reports it (a ProcessFailure, with its error file read) -> classify."""
    message, traceback = _error_text(failure.message)
    return classify(rank, failure.exitcode, failure.signal_name() if failure.exitcode < 0 else None, message,
                    os.path.isfile(failure.error_file), traceback)


def _error_text(message) -> tuple[str, str]:
    """(message, traceback) of a worker's error: torchelastic's error file holds text or {"message": text,
    "extraInfo": {"py_callstack": traceback}} (torch's ErrorHandler.record_exception)."""
    traceback = ""
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        traceback = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
        message = message.get("message", "")
    return (message if isinstance(message, str) else "", traceback if isinstance(traceback, str) else "")


def _say(text: str) -> None:
    print(f"harness: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    exit_if_unfit()  # an image too old for the harness stops here, in one line, before torch is imported
    parser = argparse.ArgumentParser(prog="python -m harness.agent", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the run folder (shared by every node)")
    parser.add_argument("--max-restarts", type=int, default=0, help="restart budget for the whole job")
    parser.add_argument("--restart-here", action="store_true", help="restart attempts in this process (local)")
    parser.add_argument("--job-token", help="claim the run folder for this job (see claim_run_folder)")
    parser.add_argument("--decide", action="store_true",
                        help="only decide, from the record, what follows the newest attempt (Slurm's script)")
    parser.add_argument("--launch", type=int,
                        help="the run of the campaign this launch is for, recorded with each attempt (Slurm starts "
                             "one srun step per run, all in the same attempt: workloads.common.run_record.attempt_key; "
                             "a closed campaign on Kubernetes, one job per run: next_attempt)")
    parser.add_argument("--job", default="harness", help="the job's name, a label on every metric")
    parser.add_argument("--benchmark", default="", help="the benchmark, a label on every metric")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics on this port (the next free one if taken); 0: off")
    parser.add_argument("--pushgateway", help="also push the metrics to this Prometheus Pushgateway URL")
    parser.add_argument("torchrun", nargs=argparse.REMAINDER, help="torchrun's arguments, after --")
    args = parser.parse_args(argv)
    node = os.environ.get("SLURMD_NODENAME") or os.environ.get(NODE_ENV) or socket.gethostname()
    if args.decide:
        records = read_records(args.out)
        write_merged_attempts(args.out, records)
        attempt = max((r["attempt"] for r in records), default=0)
        decision = decide(records, attempt, args.max_restarts)
        if decision.exit_code:
            _say(decision.message)
        return decision.exit_code
    refusal = claim_run_folder(args.out, args.job_token) if args.job_token else None
    if refusal:
        _say(refusal)
        return EXIT_FOLDER_TAKEN
    Path(args.out, "logs").mkdir(parents=True, exist_ok=True)
    exporter, feed_dir = _start_metrics(args, node)
    try:
        return _attempts(args, node)
    finally:
        if exporter is not None:
            exporter.close()
        shutil.rmtree(feed_dir, ignore_errors=True)


def _start_metrics(args, node: str):
    """The workers' feed folder (node-local) and, unless --metrics-port is 0, this node's /metrics endpoint."""
    from workloads.common.metrics_feed import METRICS_DIR_ENV  # here: it loads mlperf-logging (and numpy)

    feed_dir = Path(tempfile.mkdtemp(prefix="harness-metrics-"))
    os.environ[METRICS_DIR_ENV] = str(feed_dir)  # the workers inherit it
    if not args.metrics_port:
        return None, feed_dir
    from harness.metrics import Exporter, Source, write_target

    host = os.environ.get(HOST_ENV) or node  # on Kubernetes the machine, as DCGM's metrics name it, not the pod
    exporter = Exporter(Source(args.out, feed_dir, args.job, args.benchmark, host), args.metrics_port,
                        args.pushgateway)
    if exporter.port is None:
        _say(f"metrics: ports {args.metrics_port} to {args.metrics_port + 15} are all taken; serving none "
             "(training goes on)")
    else:
        try:
            write_target(args.out, node, exporter.port, {"job": args.job, "benchmark": args.benchmark})
        except OSError as exc:  # metrics must never stop a node: it is still served, only not listed
            _say(f"metrics: could not list this node in {args.out}: {exc}")
        _say(f"metrics: http://{socket.gethostname()}:{exporter.port}/metrics")
    return exporter, feed_dir


def _stop_on_sigterm() -> None:
    """SIGTERM ends the attempt in every phase. torch's agent turns it into SignalException only once its
    workers have started; before that (a rendezvous can last 25 minutes at 448 nodes) a pod's agent, which
    is PID 1, would ignore it (the kernel drops signals PID 1 has no handler for), and a bare node's would
    die without recording its attempt's end."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def handler(signum, frame):
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    signal.signal(signal.SIGTERM, handler)


def signalled(exc) -> Failure:
    """What a signal to the node agent (torch's SignalException, or ours: _stop_on_sigterm) makes of its attempt."""
    return Failure(INFRASTRUCTURE, f"the node agent received {exc.sigval.name} (the job was cancelled or preempted, "
                                   "or its node was lost)", signal=exc.sigval.name)


def _attempts(args, node: str) -> int:
    """Run attempts until one succeeds or the decision says stop (or restart elsewhere)."""
    _stop_on_sigterm()
    from torch.distributed.elastic.multiprocessing.api import SignalException

    torchrun_argv = args.torchrun[1:] if args.torchrun[:1] == ["--"] else args.torchrun
    # The run this launch is for (--launch): Slurm's step per run, Kubernetes' job per run; absent elsewhere.
    launch = getattr(args, "launch", None)
    attempt = next_attempt(read_records(args.out), node, launch)
    # Where NODE_ENV names a pod, the machine under it: what a failure is blamed on (harness.preflight).
    identity = {"node": node, **({"host": os.environ[HOST_ENV]} if os.environ.get(HOST_ENV) else {}),
                **({"launch": launch} if launch is not None else {})}
    if attempt > args.max_restarts:  # the scheduler restarted us (a lost node) with no budget left
        _say(f"attempt {attempt} refused: the restart budget ({args.max_restarts}) is spent")
        return EXIT_BUDGET_SPENT
    # What the workers need to restart in process within this budget, recorded as this node.
    os.environ[BUDGET_ENV] = str(args.max_restarts)
    os.environ[IDENTITY_ENV] = json.dumps(identity)
    while True:
        os.environ[ATTEMPT_ENV] = str(attempt)
        watch = NewerAttemptWatch(args.out, attempt)
        _append(args.out, node, {"event": "start", "attempt": attempt, **identity, "time": time.time()})
        try:
            with watch:
                cancelled, failure = run_attempt(attempt_argv(torchrun_argv, attempt))
        except SignalException as exc:
            # Also here, from the start record on, not only inside torchrun's run: importing torchrun alone takes
            # seconds on a busy node, and a SIGTERM then (a cancel just after the start) still ends the attempt
            # with its record instead of a traceback and a start without an end (read as a lost node).
            cancelled, failure = True, signalled(exc)
        if watch.newer and cancelled:  # the SIGTERM was ours: not a cancellation, a restart into the newer attempt
            cancelled, failure = False, watch.failure()
        attempt = in_process_attempt(read_records(args.out), node, attempt)  # the workers may have gone on
        run, step = progress_at_failure(args.out) if failure else (None, None)
        _append(args.out, node, end_record(attempt, identity, failure, run, step))
        if cancelled:
            return 143
        records = read_records(args.out)
        write_merged_attempts(args.out, records)
        decision = decide(records, attempt, args.max_restarts, launch)
        if decision.exit_code:
            _say(decision.message)
        if not (decision.retry and args.restart_here):
            return decision.exit_code
        attempt += 1


if __name__ == "__main__":
    sys.exit(main())
