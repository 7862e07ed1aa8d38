"""`python -m harness.agent`: what every node runs, on every backend. It wraps torch's elastic agent.

torchrun's agent restarts its worker group after any failure, but it cannot tell a
lost process or a broken link (worth a retry) from a bug in the training code
(which fails the same way every time). So each attempt runs torchrun's agent with
no restarts of its own, and this wrapper:

1. records the attempt in <out>/attempts.jsonl: start, end, node, exit code or signal,
   the failed rank, the cause, and the run and step it reached;
2. classifies the failure: `infrastructure` (a signal, a lost peer, a NCCL or gloo
   error or timeout, out of memory) or `workload` (an exception in the training code,
   a diverged loss, an exit with an error code);
3. decides, against one restart budget for every backend: retry an infrastructure
   failure while restarts are left, unless the last 3 attempts failed the same way at
   the same step; never retry a workload error.

Who restarts differs per backend: locally this loop does (`--restart-here`); on Slurm
the batch script requeues the job when `--decide` says so; on Kubernetes the exit code
does it (a PyTorchJob with restartPolicy ExitCode restarts pods that exit with 128 or
more and gives up on 1 to 127). The workers find the attempt number in HARNESS_ATTEMPT
and continue from their newest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.requirements_check import exit_if_unfit
from workloads.common.run_record import ATTEMPT_ENV, ATTEMPTS_FILE, read_json_lines

EXIT_WORKLOAD_ERROR = 3
EXIT_BUDGET_SPENT = 4
EXIT_REPEATED_FAILURE = 5
EXIT_RETRY = 199  # 128 or more, so that Kubernetes' ExitCode policy restarts the pod
EXIT_CODES = {EXIT_WORKLOAD_ERROR: "workload error (not retried)", EXIT_BUDGET_SPENT: "restart budget spent",
              EXIT_REPEATED_FAILURE: "the same failure 3 times at the same step", EXIT_RETRY: "retry"}
REPEATS_TO_STOP = 3
INFRASTRUCTURE, WORKLOAD = "infrastructure", "workload"
# Exception text that means the machine, the network or a peer failed, not the training code.
_INFRASTRUCTURE_ERRORS = re.compile(
    r"OutOfMemoryError|out of memory|DistBackendError|DistNetworkError|DistStoreError|NCCL|[Gg]loo|"
    r"Connection (reset|closed|refused)|Broken pipe|[Tt]imed? ?out|ECC error|Socket Timeout")


@dataclass(frozen=True)
class Failure:
    kind: str  # INFRASTRUCTURE or WORKLOAD
    cause: str
    rank: int | None = None
    exit_code: int | None = None
    signal: str | None = None


@dataclass(frozen=True)
class Decision:
    exit_code: int  # 0: done; EXIT_RETRY: restart; otherwise stop
    message: str

    @property
    def retry(self) -> bool:
        return self.exit_code == EXIT_RETRY


def classify(rank: int, exit_code: int, signal_name: str | None, message: str, has_error_file: bool) -> Failure:
    """One failed worker -> what kind of failure it was."""
    if exit_code < 0:
        return Failure(INFRASTRUCTURE, f"rank {rank} killed by {signal_name}", rank, exit_code, signal_name)
    if has_error_file:
        first_line = message.strip().splitlines()[0] if message.strip() else "an exception"
        kind = INFRASTRUCTURE if _INFRASTRUCTURE_ERRORS.search(message) else WORKLOAD
        return Failure(kind, f"rank {rank}: {first_line[:300]}", rank, exit_code)
    return Failure(WORKLOAD, f"rank {rank} exited with code {exit_code}", rank, exit_code)


def attempt_failure(failures: list[Failure]) -> Failure:
    """The root cause among the failed ranks: a workload error if any rank had one (the others then lost
    their peer), else a failure other than the SIGTERM the agent sends to the survivors."""
    return min(failures, key=lambda f: (f.kind != WORKLOAD, f.signal == "SIGTERM", f.rank or 0))


# --- the record ----------------------------------------------------------------------------------

def read_records(out: Path) -> list[dict]:
    return [r for r in read_json_lines(Path(out) / ATTEMPTS_FILE) if isinstance(r.get("attempt"), int)]


def _append(out: Path, record: dict) -> None:
    with open(Path(out) / ATTEMPTS_FILE, "a") as f:  # one short append: whole lines from every node
        f.write(json.dumps(record) + "\n")


def next_attempt(records: list[dict], node: str) -> int:
    """The attempt number for a (re)started node: Slurm counts requeues itself; elsewhere, one past the
    newest attempt that ended anywhere or that this node started (a node killed outright wrote no end)."""
    if "SLURM_JOB_ID" in os.environ:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    seen = [r["attempt"] for r in records if r.get("event") == "end" or r.get("node") == node]
    return max(seen) + 1 if seen else 0


def progress_at_failure(out: Path) -> tuple[int | None, int | None]:
    """(run index, step) the workers had reached: the newest run record's last step."""
    records = sorted(Path(out).glob("run_*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not records:
        return None, None
    run = int(records[-1].stem.split("_")[1])
    steps = [r["steps"] for r in read_json_lines(records[-1]) if isinstance(r.get("steps"), list) and r["steps"]]
    return run, (steps[-1][-1] if steps else None)


# --- the decision --------------------------------------------------------------------------------

def summarize(records: list[dict], attempt: int) -> dict | None:
    """The outcome of one attempt over all its nodes' records; None if it has not started."""
    ends = [r for r in records if r["attempt"] == attempt and r.get("event") == "end"]
    starts = [r for r in records if r["attempt"] == attempt and r.get("event") == "start"]
    if not ends:
        if not starts:
            return None
        return {"ok": False, "kind": INFRASTRUCTURE, "run": None, "step": None,
                "cause": "the attempt ended without a record (its node was lost or the job was killed)"}
    failed = [r for r in ends if not r.get("ok")]
    if not failed:
        return {"ok": True}
    worst = next((r for r in failed if r.get("kind") == WORKLOAD), failed[0])
    return {"ok": False, "kind": worst.get("kind"), "cause": worst.get("cause"), "run": worst.get("run"),
            "step": worst.get("step")}


def decide(records: list[dict], attempt: int, budget: int) -> Decision:
    """What to do after `attempt`, with `budget` restarts allowed in all."""
    outcome = summarize(records, attempt)
    if outcome is None or outcome["ok"]:
        return Decision(0, f"attempt {attempt} succeeded")
    where = f" (run {outcome['run'] + 1}, step {outcome['step']})" if outcome.get("run") is not None else ""
    what = f"attempt {attempt} failed{where}: {outcome['cause']}"
    if outcome["kind"] == WORKLOAD:
        return Decision(EXIT_WORKLOAD_ERROR, f"{what}. This is a workload error, which a restart would "
                                             "repeat, so the job stops; fix the cause and run again")
    if attempt >= budget:
        return Decision(EXIT_BUDGET_SPENT, f"{what}. The restart budget ({budget}) is spent, so the job stops; "
                                           "raise --max-restarts to allow more")
    recent = [summarize(records, a) for a in range(max(0, attempt - REPEATS_TO_STOP + 1), attempt + 1)]
    signature = lambda o: (o.get("kind"), o.get("cause"), o.get("run"), o.get("step"))  # noqa: E731
    if len(recent) == REPEATS_TO_STOP and all(o and signature(o) == signature(outcome) for o in recent) \
            and outcome.get("step") is not None:
        return Decision(EXIT_REPEATED_FAILURE, f"{what}. The last {REPEATS_TO_STOP} attempts failed the same way "
                                               "at the same step, so another restart would too; the job stops")
    return Decision(EXIT_RETRY, f"{what}. Restarting from the newest checkpoint "
                                f"({attempt + 1} of {budget} restarts used)")


# --- one attempt ---------------------------------------------------------------------------------

def run_attempt(torchrun_argv: list[str]) -> tuple[bool, Failure | None]:
    """Run torchrun's agent once with no restarts of its own; (stopped by a signal, failure or None)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(torchrun_argv)
    args.max_restarts = 0
    try:
        torchrun.run(args)
        return False, None
    except ChildFailedError as exc:
        failures = [classify(rank, f.exitcode, f.signal_name() if f.exitcode < 0 else None, _error_text(f.message),
                             os.path.isfile(f.error_file))
                    for rank, f in sorted(exc.failures.items())]
        return False, attempt_failure(failures)
    except SignalException as exc:
        return True, Failure(INFRASTRUCTURE, f"the node agent received {exc.sigval.name} (the job was cancelled "
                                             "or preempted, or its node was lost)", signal=exc.sigval.name)


def _error_text(message) -> str:
    """A worker's error message: torchelastic's error file holds text or {"message": text, "extraInfo": ...}."""
    if isinstance(message, dict):
        message = message.get("message", "")
    return message if isinstance(message, str) else ""


def _say(text: str) -> None:
    print(f"harness: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    exit_if_unfit()  # an image too old for the harness stops here, in one line, before torch is imported
    parser = argparse.ArgumentParser(prog="python -m harness.agent", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the run folder (shared by every node)")
    parser.add_argument("--max-restarts", type=int, default=0, help="restart budget for the whole job")
    parser.add_argument("--restart-here", action="store_true", help="restart attempts in this process (local)")
    parser.add_argument("--decide", action="store_true",
                        help="only decide, from the record, what follows the newest attempt (Slurm's script)")
    parser.add_argument("torchrun", nargs=argparse.REMAINDER, help="torchrun's arguments, after --")
    args = parser.parse_args(argv)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if args.decide:
        records = read_records(args.out)
        attempt = max((r["attempt"] for r in records), default=0)
        decision = decide(records, attempt, args.max_restarts)
        if decision.exit_code:
            _say(decision.message)
        return decision.exit_code
    torchrun_argv = args.torchrun[1:] if args.torchrun[:1] == ["--"] else args.torchrun
    Path(args.out, "logs").mkdir(parents=True, exist_ok=True)
    attempt = next_attempt(read_records(args.out), node)
    if attempt > args.max_restarts:  # the scheduler restarted us (a lost node) with no budget left
        _say(f"attempt {attempt} refused: the restart budget ({args.max_restarts}) is spent")
        return EXIT_BUDGET_SPENT
    while True:
        os.environ[ATTEMPT_ENV] = str(attempt)
        _append(args.out, {"event": "start", "attempt": attempt, "node": node, "time": time.time()})
        cancelled, failure = run_attempt(torchrun_argv)
        run, step = progress_at_failure(args.out) if failure else (None, None)
        end = {"event": "end", "attempt": attempt, "node": node, "time": time.time(), "ok": failure is None}
        if failure:
            end.update(kind=failure.kind, cause=failure.cause, rank=failure.rank, exit_code=failure.exit_code,
                       signal=failure.signal, run=run, step=step)
        _append(args.out, end)
        if cancelled:
            return 143
        decision = decide(read_records(args.out), attempt, args.max_restarts)
        if decision.exit_code:
            _say(decision.message)
        if not (decision.retry and args.restart_here):
            return decision.exit_code
        attempt += 1


if __name__ == "__main__":
    sys.exit(main())
