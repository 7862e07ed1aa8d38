"""Restart in process: a retried failure that left every process alive goes on in those processes.

The node agent (harness.agent) restarts the whole worker group as new processes after a failure it retries: each
new process spends about 2 s importing torch and the harness before it can restore (bench/fault_recovery.py). When
a rank raises an exception that the failure policy retries (a passing I/O error: harness.agent.classify) and no
process died, the ranks instead stay where they are: nvidia-resiliency-ext's in-process restart
(`nvidia_resiliency_ext.inprocess.Wrapper`) aborts and destroys every process group on every rank, and calls the
campaign again in the same processes, which re-form the groups (same world, same ranks), take the attempt's next
number, and continue the run under way in the same result file from its newest checkpoint, as a restarted process
would (workloads.common.campaign.run_campaign). The imported modules, and whatever the process caches (the page
cache of the data, compiled code), are kept.

What is restarted here, and what is left to the agent, is the failure policy's one decision: the rank that failed
first asks harness.agent.in_process_verdict (classify, decide against the one restart budget, blame), which says
restart here only for a failure that is retried and blames no node (a node to keep out needs a new attempt
elsewhere) and that is not a lost peer (a process that died, SIGKILL: the agent restarts the group as before).
Every other failure leaves the wrapper with its own exception, for the agent. The verdict goes to every rank
through the wrapper's store; each node's local rank 0 records its node's end of the attempt and the start of the
next in attempts/<node>.inprocess.jsonl, which the failure policy, the next agent attempt and the report read
like the agent's own records.

nvidia-resiliency-ext 0.4.1 runs on CPU with gloo, with these settings (docs/checkpoints.md#restart-in-process):
its store is a TCPStore (its FileStore raises RuntimeError where the wrapper expects DistStoreError, on torch
2.14); its monitor thread polls that store every 0.1 s, and each poll that times out makes torch's c10d log a
warning, so workers run with TORCH_CPP_LOG_LEVEL=ERROR (workloads.__main__). Its wheels are x86_64 only, so it is an
extra (`pip install -e '.[inprocess]'`, with pynvml pinned to 12.0.0: 13.x makes every `import torch` print a
FutureWarning), without which `--restart in-process` falls back to restarting processes.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import logging
import os
import sys
import time
import traceback as traceback_module
from pathlib import Path
from typing import Callable

from workloads.common.run_record import (ATTEMPT_ENV, BUDGET_ENV, IDENTITY_ENV, RunRecord, node_attempts_path,
                                         run_record_path)

RESTART_CHOICES = ("in-process", "process")
# How long a rank may go without running Python before the wrapper calls it hung (its soft timeout; 60 s by default).
# The wrapper's clock advances only when the main thread runs Python, so a rank blocked in a collective while its
# peer builds something is "hung" to it: the wrapper's default restarted every tiny BERT run whose rank 1 waited at a
# barrier while rank 0 trained the warm start. A real hang is the process group's to catch (its collective timeout
# raises, and the verdict decides); this only has to outlast the longest legitimate wait, the open division's init
# limit (240 minutes).
PROGRESS_TIMEOUT = datetime.timedelta(hours=5)
_KEY = "harness_inprocess"  # the wrapper's store: this module's keys
_restarted_at: float | None = None  # when this process's newest in-process restart re-entered the campaign


def restarted_at() -> float | None:
    """When the campaign was entered again after an in-process restart (None: never): the restarted attempt's
    start-up begins there, not at the process's start (workloads.common.resilience)."""
    return _restarted_at


def available() -> bool:
    try:
        import nvidia_resiliency_ext.inprocess  # noqa: F401
    except ImportError:
        return False
    return True


def wanted(restart: str) -> bool:
    """Whether this worker restarts in process: asked for, the package installed, and a node agent above it (its
    restart budget and identity: without them no attempt could be recorded)."""
    return restart == "in-process" and IDENTITY_ENV in os.environ and available()


class _Stop(BaseException):
    """Leaves nvidia-resiliency-ext's wrapper (which restarts on any Exception): the failure is the agent's."""

    def __init__(self, error: BaseException | None, reason: str):
        super().__init__(reason)
        self.error = error


def run(campaign: Callable[[], None], out: Path) -> None:
    """Run `campaign` (it joins the process group itself), restarting it in process after a failure the policy
    retries here (see the module docstring)."""
    from nvidia_resiliency_ext import inprocess

    from workloads.common import distributed

    out = Path(out)
    identity = json.loads(os.environ[IDENTITY_ENV])
    campaign_log = logging.getLogger("workloads")

    class SameWorld(inprocess.rank_assignment.RankAssignment):
        """Every rank, with its rank, in every iteration; after a failure, only if the verdict says restart here
        and no rank was terminated (a lost rank: the agent's restart)."""

        def __call__(self, ctx):
            state = ctx.state
            if state.mode != inprocess.Mode.INITIALIZED:  # after a failure
                verdict = _verdict(ctx.store.base_store, state.iteration)
                if ctx.terminated_ranks or not verdict or not verdict["restart"]:
                    raise _Stop(None, (verdict or {}).get("message") or "a rank left the in-process restart")
                _record_restart(out, identity, verdict)
                _release(state.fn_exception)
            ctx.state = dataclasses.replace(state, mode=inprocess.Mode.ACTIVE, active_rank=state.rank,
                                            active_world_size=state.world_size)
            return ctx

    class GlooAbort(inprocess.abort.Abort):
        """nvidia-resiliency-ext's AbortTorchDistributed, after closing this process's gloo connections: it aborts
        NCCL communicators only, and a gloo collective cannot be aborted (ProcessGroup.abort and shutdown leave a
        rank blocked in one until its peer's process exits, torch 2.14), so without this a rank waiting in a
        collective for the failed one would wait for the whole collective timeout."""

        def __call__(self, state):
            close_peer_connections()
            return inprocess.abort.AbortTorchDistributed()(state)

    interval = datetime.timedelta(seconds=0.1)
    wrapper = inprocess.Wrapper(
        rank_assignment=SameWorld(), health_check=None, abort=GlooAbort(),
        monitor_thread_interval=interval, last_call_wait=interval, progress_watchdog_interval=interval,
        monitor_process_interval=datetime.timedelta(seconds=0.5), heartbeat_interval=datetime.timedelta(seconds=1),
        soft_timeout=PROGRESS_TIMEOUT, hard_timeout=PROGRESS_TIMEOUT + datetime.timedelta(minutes=5),
        barrier_timeout=PROGRESS_TIMEOUT + datetime.timedelta(minutes=10))

    def restartable(call_wrapper=None):
        global _restarted_at
        store, iteration = call_wrapper.base_store, call_wrapper.iteration
        if iteration:
            verdict = _verdict(store, iteration - 1)
            os.environ[ATTEMPT_ENV] = str(verdict["attempt"] + 1)
            _restarted_at = time.time()
            for handler in list(campaign_log.handlers):  # the campaign adds its rank log's handler again
                campaign_log.removeHandler(handler)
                handler.close()
            if int(os.environ.get("RANK", 0)) == 0 and verdict.get("run") is not None:
                RunRecord(run_record_path(out, verdict["run"]), verdict["attempt"] + 1).interval(
                    "restart", verdict["time"], _restarted_at, details={"in_process": True})
        # Each iteration's groups meet under their own prefix: the last iteration's addresses are stale.
        distributed.use_store(inprocess.store.PrefixStore(f"{_KEY}_pg_{iteration}", store))
        try:
            campaign()
        except Exception as exc:
            _judge(exc, store, iteration, out, identity)
            raise  # the wrapper restarts every rank in process

    # The wrapper passes itself to the parameter annotated with its type: an object, not this module's string
    # annotation (from __future__ import annotations).
    restartable.__annotations__["call_wrapper"] = inprocess.CallWrapper
    try:
        wrapper(restartable)()
    except _Stop as stop:
        if stop.error is not None:
            raise stop.error.with_traceback(stop.error.__traceback__) from None
        import torch.distributed as dist
        raise dist.DistNetworkError(f"a peer left the group: {stop}") from None  # a victim's end (harness.blame)


def _release(failure: BaseException | None) -> None:
    """Free the failed attempt in one full collection, and freeze what survives: the imported modules and torch's own
    state, some 350,000 objects. Without the freeze, each full collection passes over all of them, about 0.2 s on 2
    CPU cores, and there are several: the wrapper collects until nothing is left (`while gc.collect()`), and the
    re-entered campaign's init collects again. Runs here, after every rank has left the failed attempt (the
    wrapper's iteration barrier), so that no rank's failure reaches the others later for it.
    The failure's frames let go of the old workload first: their locals are cleared, and the traceback still names
    every line. The campaign unfreezes everything when its run ends, as after every run."""
    while failure is not None:
        traceback_module.clear_frames(failure.__traceback__)
        failure = failure.__cause__ or failure.__context__
    gc.collect()
    gc.freeze()


def close_peer_connections() -> None:
    """Shut down every established TCP connection of this process but the store's (MASTER_PORT): the process
    groups' gloo pairs, so that a collective blocked on one of them fails at once, on this rank and on its peers."""
    import socket

    import psutil

    store_port = int(os.environ.get("MASTER_PORT", 0))
    for connection in psutil.Process().net_connections(kind="tcp"):
        if connection.status != psutil.CONN_ESTABLISHED or connection.fd < 0 or not connection.raddr \
                or store_port in (connection.laddr.port, connection.raddr.port):
            continue
        try:
            duplicate = socket.socket(fileno=os.dup(connection.fd))  # the group still owns (and closes) its own
        except OSError:
            continue  # closed meanwhile
        with duplicate:
            try:
                duplicate.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _verdict(store, iteration: int) -> dict | None:
    key = f"{_KEY}_verdict_{iteration}"
    return json.loads(store.get(key)) if store.check([key]) else None


def _judge(exc: Exception, store, iteration: int, out: Path, identity: dict) -> None:
    """The first rank to fail in this iteration asks the failure policy and tells every rank through the store;
    the others wait for its verdict. A failure not restarted here leaves the wrapper (_Stop)."""
    key = f"{_KEY}_verdict_{iteration}"
    if store.add(f"{_KEY}_failed_{iteration}", 1) == 1:
        from harness.agent import in_process_verdict  # torch-free: the node agent's own policy

        now = time.time()
        rank = int(os.environ.get("RANK", 0))
        message = f"{type(exc).__name__}: {exc}"
        traceback = "".join(traceback_module.format_exception(exc))
        attempt = int(os.environ.get(ATTEMPT_ENV, "0"))
        verdict = in_process_verdict(out, identity, attempt, int(os.environ[BUDGET_ENV]), rank, message, traceback,
                                     now)
        store.set(key, json.dumps(verdict))
        if verdict["restart"]:  # any other verdict is the agent's to say, once the attempt ends
            print(f"harness: {verdict['message']}", file=sys.stderr, flush=True)
    else:
        store.wait([key], datetime.timedelta(seconds=60))
        verdict = json.loads(store.get(key))
    if not verdict["restart"]:
        raise _Stop(exc, verdict["message"])


def _record_restart(out: Path, identity: dict, verdict: dict) -> None:
    """This node's end of the failed attempt and start of the next, by its local rank 0 (one writer per file)."""
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    from harness.agent import in_process_records

    path = node_attempts_path(out, f"{identity['node']}.inprocess")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for record in in_process_records(identity, verdict):
            f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
