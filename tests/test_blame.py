"""The failure policy: the culprit is blamed, never the peers NCCL aborted after it (harness.blame)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import preflight
from harness.agent import CONFIGURATION, INFRASTRUCTURE, WORKLOAD, classify

NODES = ("node-a", "node-b", "node-c", "node-d")
ABORTED = {"kind": INFRASTRUCTURE, "signal": "SIGABRT", "cause": "rank 9 killed by SIGABRT"}
NCCL_TIMEOUT = {"kind": INFRASTRUCTURE, "signal": None,
                "cause": "rank 13: torch.distributed.DistBackendError: [Rank 13] Watchdog caught collective "
                         "operation timeout: WorkNCCL(SeqNum=4107, OpType=ALLREDUCE) ran for 600000 milliseconds"}


def _attempt(out: Path, ends: dict[str, dict | None], pods: bool = False) -> None:
    """Attempt 0 of a 4-node job: every node started it; `ends` maps a node to its end (None: it never ended),
    each a second after the one before, in the order given. With `pods`, each agent ran in a pod on the node."""
    records = []
    for node in NODES:
        host = {"node": f"pod-{node}", "host": node} if pods else {"node": node}
        records.append({"event": "start", "attempt": 0, **host, "time": 100.0})
    for seconds, (node, end) in enumerate(ends.items()):
        if end is not None:
            host = {"node": f"pod-{node}", "host": node} if pods else {"node": node}
            records.append({"event": "end", "attempt": 0, **host, "time": 200.0 + seconds, "ok": False, **end})
    (out / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("pods", [False, True], ids=["slurm", "kubernetes"])
def test_a_lost_node_is_blamed_and_the_peers_nccl_aborted_are_not(tmp_path, pods):
    _attempt(tmp_path, {"node-a": None, "node-b": ABORTED, "node-c": ABORTED, "node-d": NCCL_TIMEOUT}, pods)
    blamed = preflight.blamed_nodes(tmp_path)
    assert list(blamed) == ["node-a"] and "lost" in blamed["node-a"]


def test_the_first_failure_with_its_own_cause_is_the_culprit(tmp_path):
    """node-c's rank was OOM-killed first; the others aborted after it, one of them SIGKILLed by its own agent
    after the SIGTERM grace period: only node-c is blamed."""
    killed = {"kind": INFRASTRUCTURE, "signal": "SIGKILL", "cause": "rank 8 killed by SIGKILL"}
    _attempt(tmp_path, {"node-c": killed, "node-a": ABORTED, "node-b": NCCL_TIMEOUT,
                        "node-d": {**killed, "cause": "rank 12 killed by SIGKILL"}})
    assert list(preflight.blamed_nodes(tmp_path)) == ["node-c"]


def test_a_gpu_hardware_error_is_retried_and_blames_its_node(tmp_path):
    message = "RuntimeError: CUDA error: unspecified launch failure\nCompile with TORCH_USE_CUDA_DSA"
    failure = classify(5, 1, None, message, has_error_file=True)
    assert failure.kind == INFRASTRUCTURE  # retried within the budget, not stopped as the program's error
    gpu = {"kind": failure.kind, "signal": None, "cause": failure.cause}
    _attempt(tmp_path, {"node-a": ABORTED, "node-b": gpu, "node-c": NCCL_TIMEOUT, "node-d": ABORTED})
    assert preflight.blamed_nodes(tmp_path) == {"node-b": "rank 5: RuntimeError: CUDA error: unspecified launch "
                                                          "failure"}


def test_when_every_rank_only_waited_on_a_peer_no_node_is_named(tmp_path):
    _attempt(tmp_path, {"node-a": NCCL_TIMEOUT, "node-b": ABORTED, "node-c": NCCL_TIMEOUT, "node-d": ABORTED})
    assert preflight.blamed_nodes(tmp_path) == {}


def test_a_workload_error_blames_no_node(tmp_path):
    error = {"kind": "workload", "signal": None, "cause": "rank 2: ValueError: bad shape"}
    _attempt(tmp_path, {"node-a": error, "node-b": ABORTED, "node-c": ABORTED, "node-d": ABORTED})
    assert preflight.blamed_nodes(tmp_path) == {}


def test_a_passing_file_system_error_is_retried_and_blames_no_node_but_exhausted_memory_does(tmp_path):
    """A stale NFS handle or an I/O error while reading data (the DataLoader's wrapped form too) is retried, and,
    like a lost peer, blames no node: a server failing over fails every node's reads and the first to read is not
    its cause (the next preflight's storage check finds a node's own bad mount). ENOMEM is its node's own."""
    wrapped = ("OSError: Caught OSError in DataLoader worker process 3.\nOriginal Traceback (most recent call last):\n"
               '  File "/opt/workloads/resnet/data.py", line 80, in __getitem__\n    image = decode(path)\n'
               "OSError: [Errno 116] Stale file handle: '/nfs/imagenet/train/n01440764/x.JPEG'")
    for message in ("OSError: [Errno 116] Stale file handle", "OSError: [Errno 5] Input/output error", wrapped):
        failure = classify(4, 1, None, message, has_error_file=True)
        assert failure.kind == INFRASTRUCTURE, message
        stale = {"kind": failure.kind, "signal": None, "cause": failure.cause}
        _attempt(tmp_path, {"node-b": stale, "node-a": ABORTED, "node-c": NCCL_TIMEOUT, "node-d": ABORTED})
        assert preflight.blamed_nodes(tmp_path) == {}, message
    assert "Stale file handle" in classify(4, 1, None, wrapped, True).cause  # the cause names the errno
    memory = classify(4, 1, None, "OSError: [Errno 12] Cannot allocate memory", has_error_file=True)
    assert memory.kind == INFRASTRUCTURE
    _attempt(tmp_path, {"node-b": {"kind": memory.kind, "signal": None, "cause": memory.cause},
                        "node-a": ABORTED, "node-c": NCCL_TIMEOUT, "node-d": ABORTED})
    assert list(preflight.blamed_nodes(tmp_path)) == ["node-b"]


def test_what_a_cause_quotes_is_not_read_as_a_peer_or_a_gpu(tmp_path):
    """The failure policy reads a recorded cause as classify reads the error: without what it quotes. A node that
    ran out of memory reading a file under '/ckpt/nccl-timeout/' failed by itself, first: it is the culprit, not a
    victim of a peer's timeout; a path naming an Xid is no GPU fault, so the first failure is still the culprit."""
    oom = classify(3, 1, None, "RuntimeError: out of memory reading '/ckpt/nccl-timeout/shard_3.pt'", True)
    assert oom.kind == INFRASTRUCTURE
    own = {"kind": oom.kind, "signal": None, "cause": oom.cause}
    _attempt(tmp_path, {"node-b": own, "node-a": ABORTED, "node-c": NCCL_TIMEOUT, "node-d": ABORTED})
    assert preflight.blamed_nodes(tmp_path) == {"node-b": oom.cause}
    xid = {**own, "cause": "rank 9: RuntimeError: out of memory reading \"/logs/Xid/ECC error.txt\""}
    _attempt(tmp_path, {"node-b": own, "node-c": xid, "node-a": ABORTED, "node-d": ABORTED})
    assert list(preflight.blamed_nodes(tmp_path)) == ["node-b"]


@pytest.mark.parametrize("kind", [CONFIGURATION, WORKLOAD])
def test_a_node_torn_down_after_the_programs_error_is_not_blamed(tmp_path, kind):
    """node-a never recorded its end because the job was torn down after node-b's configuration or workload error
    (Slurm kills the step, Kubernetes deletes the pods): the job stops anyway, so no node is blamed for it. A GPU
    hardware error in the same attempt still blames its node."""
    refused = {"kind": kind, "signal": None, "cause": "rank 4: workloads: a refusal"}
    _attempt(tmp_path, {"node-b": refused, "node-a": None, "node-c": ABORTED, "node-d": NCCL_TIMEOUT})
    assert preflight.blamed_nodes(tmp_path) == {}
    gpu = {"kind": INFRASTRUCTURE, "signal": None, "cause": "rank 12: RuntimeError: CUDA error: unknown error"}
    _attempt(tmp_path, {"node-b": refused, "node-a": None, "node-c": ABORTED, "node-d": gpu})
    assert list(preflight.blamed_nodes(tmp_path)) == ["node-d"]
