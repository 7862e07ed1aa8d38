"""The failure policy: which node failed first with a cause of its own, and which only went down with it.

At 448 nodes one part fails and the rest follow. NCCL's watchdog aborts every rank that waits on a lost peer
(SIGABRT, or an NCCL or gloo error: a timeout, a closed connection), and each node agent SIGTERMs its own
ranks once one of them fails. Blaming every node that ended badly would keep the healthy peers out of the
next attempt (which then has too few nodes) and drain or taint them. So, for one attempt's records (each
node agent's start and end, harness.agent; on Slurm those of one run's step: workloads.common.run_record.attempt_key):

- a node that started the attempt and never recorded its end was lost: a culprit;
- a GPU that failed under the program (GPU_HARDWARE: an Xid, a device off the bus, a dead launch) blames its
  node wherever it came in the order;
- otherwise the failure with a cause of its own (a SIGKILL from the OOM killer, a segfault) that ended first
  is the culprit, and only when no node was lost;
- a rank stopped by SIGTERM or SIGABRT, or by a peer-loss error (PEER_LOSS), and a node whose agent ended the
  attempt because another node began a newer one (an end record's `stopped_by`: STOPPED_BY_NEWER_ATTEMPT; on
  Kubernetes the failed node's pod is recreated at once, and its healthy peers, still blocked in NCCL, stop to join
  it) are victims, never blamed; when only victims ended, no node can be named, and none is (the next attempt's
  preflight tests the links);
- a workload error is the program's (out of GPU memory included: OUT_OF_GPU_MEMORY, the job's batch or layout),
  and a configuration error (a command torchrun or the workload refuses, the same on every node) the job's:
  neither blames a node, and an attempt that ended with either blames only a GPU hardware error: a node without
  an end record was torn down with the failed job (Slurm's step kill, a deleted pod), and the job stops anyway,
  so draining it would only take a healthy node away;
- a passing file-system or network errno (PASSING_IO: a stale handle, an I/O error) is retried like a lost peer
  and, like it, blames no node: a server failing over fails every node's reads, and the first to read is not
  its cause; a node whose own mount is bad fails the next attempt's preflight storage check. A machine's errno
  (MACHINE_ERRNO: its memory exhausted) is that node's own cause.

Nodes are ordered by when their agent recorded the end: the culprit's agent ends as soon as its rank dies,
its peers' only after NCCL gave up on it. Stragglers are judged apart (harness.results.goodput).
"""

from __future__ import annotations

import os
import re

from workloads.common.refusals import MACHINE_ERRNOS, PASSING_ERRNOS
from workloads.common.run_record import attempt_key


def _errno_pattern(errnos: frozenset[int]) -> re.Pattern:
    """An OSError's own words for these errnos, as Python prints them: "[Errno 116] Stale file handle"."""
    return re.compile("|".join([rf"\[Errno ({'|'.join(map(str, sorted(errnos)))})\]",
                                *(re.escape(os.strerror(n)) for n in sorted(errnos))]))


# Errors a rank raises when a peer went away or the network failed between them: a victim's, not a cause.
PEER_LOSS = re.compile(r"DistBackendError|DistNetworkError|DistStoreError|NCCL|[Gg]loo|Connection (reset|closed|"
                       r"refused)|Broken pipe|[Tt]imed? ?out|Socket Timeout")
# A GPU that failed under the program (Xid 13/31/43/48/79 and ECC faults leave these): its node is at fault.
GPU_HARDWARE = re.compile(r"ECC error|unspecified launch failure|CUDA error: unknown error|fallen off the bus|"
                          r"\bXid\b|CUDA-capable device\(s\) is/are busy or unavailable")
# A shared file system or the network under it failing for a while (a server failing over, a stale handle):
# retried, and, like a lost peer, never blamed on the node that happened to read first; a node whose own mount is
# bad fails the next attempt's preflight storage check (harness.health.storage) instead.
PASSING_IO = _errno_pattern(PASSING_ERRNOS)
# The node's machine failing the program (ENOMEM: its memory exhausted): retried, and its node is the culprit.
MACHINE_ERRNO = _errno_pattern(MACHINE_ERRNOS)
# A GPU's memory too small for what the job asks of it (torch.OutOfMemoryError, "CUDA out of memory", "CUDA error:
# out of memory"): the job's own setting, the same on every node and at every attempt, so harness.agent classifies it
# as a WORKLOAD error: never retried, no node blamed. The machine's own memory (ENOMEM: MACHINE_ERRNO; a rank the
# kernel's OOM killer SIGKILLed) stays that node's.
OUT_OF_GPU_MEMORY = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory")
# What the agent adds to such a failure's cause, so that the job's stop says what to change.
OUT_OF_GPU_MEMORY_ADVICE = ("Out of GPU memory is the job's own setting, not the node's: lower what one GPU holds "
                            "(the micro batch: --batch-size where the workload takes it; the global batch per rank: "
                            "a smaller --global-batch or more --nodes), turn activation checkpointing on, or shard "
                            "the model over more GPUs (a larger FSDP group); --dry-run shows the plan's memory")
VICTIM_SIGNALS = ("SIGTERM", "SIGABRT")
# An end record's `stopped_by` when the node agent ended its attempt itself because another node began a newer one
# (harness.agent.NewerAttemptWatch: that node was restarted after a failure): the node went down with it, a victim.
STOPPED_BY_NEWER_ATTEMPT = "newer_attempt"
# The same end in a record from before `stopped_by`, by the words the agent wrote then (and still writes).
_NEWER_ATTEMPT_CAUSE = re.compile(r"began attempt \d+ \(it was restarted after a failure\)")
_QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")  # a path or value Python quotes in an exception's text
# harness.agent's kinds of failure. The program's own errors and a job whose command is wrong fail the same way on
# any node, at every attempt: never retried, never blamed on a node.
INFRASTRUCTURE, WORKLOAD, CONFIGURATION = "infrastructure", "workload", "configuration"
NOT_RETRIED = (WORKLOAD, CONFIGURATION)


def unquoted(text: str) -> str:
    """`text` without what an exception quotes (a path, a value): the patterns above read only the exception's own
    words, so that a file under /data/nccl-timeout/ or a column named 'Xid' is not read as the machine's failure.
    harness.agent classifies a worker's error by it, and the failure policy judges the recorded cause by it."""
    return _QUOTED.sub("''", text)


def culprits(records: list[dict]) -> dict[str, str]:
    """{node: why} for the nodes one attempt's failure is pinned on (see the module docstring). `records` are
    that attempt's start and end records; a record's `host` (the Kubernetes node under a pod) is what is named.
    Records of several (attempt, launch) (workloads.common.run_record.attempt_key: on Slurm every run's step of one
    allocation shares the attempt) are never judged together: the newest is."""
    keys = {attempt_key(r) for r in records if isinstance(r.get("attempt"), int)}
    if len(keys) > 1:
        records = [r for r in records if isinstance(r.get("attempt"), int) and attempt_key(r) == max(keys)]
    host = {r["node"]: r.get("host", r["node"]) for r in records if r.get("event") == "start"}
    ends = [r for r in records if r.get("event") == "end"]
    if not ends or all(r.get("ok") for r in ends):
        return {}  # a whole job killed at once (no node ended it) loses none in particular; a success, none
    blamed: dict[str, str] = {}
    ended = {r["node"] for r in ends}
    program_failed = any(r.get("kind") in NOT_RETRIED for r in ends)
    for node in host:
        if node not in ended and not program_failed:
            blamed[host[node]] = "the node was lost: its agent never recorded the attempt's end"
    failed = sorted((r for r in ends if not r.get("ok") and r.get("kind") not in NOT_RETRIED),
                    key=lambda r: r.get("time") if isinstance(r.get("time"), (int, float)) else float("inf"))
    for record in failed:
        if not _stopped_by_newer_attempt(record) and GPU_HARDWARE.search(unquoted(record.get("cause") or "")):
            blamed[host.get(record["node"], record["node"])] = record["cause"]
    own = [r for r in failed if not _victim(r)]
    if own and not blamed and not program_failed:
        first = own[0]
        blamed[host.get(first["node"], first["node"])] = first.get("cause") or "failed"
    return blamed


def _victim(record: dict) -> bool:
    """Whether a failed node's end reads as going down with a peer rather than failing by itself."""
    cause = unquoted(record.get("cause") or "")
    if _stopped_by_newer_attempt(record):
        return True
    return record.get("signal") in VICTIM_SIGNALS or (bool(PEER_LOSS.search(cause) or PASSING_IO.search(cause))
                                                      and not GPU_HARDWARE.search(cause)
                                                      and not MACHINE_ERRNO.search(cause))


def _stopped_by_newer_attempt(record: dict) -> bool:
    """Whether the node's agent ended the attempt because another node began a newer one: by `stopped_by`, or, in a
    record written before that field, by the agent's words for it."""
    return record.get("stopped_by") == STOPPED_BY_NEWER_ATTEMPT or (
        "stopped_by" not in record and bool(_NEWER_ATTEMPT_CAUSE.search(record.get("cause") or "")))
