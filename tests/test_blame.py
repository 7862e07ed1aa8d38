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


# --- issue 36: defects 1, 6 and 7 -----------------------------------------------------------------------------------

def test_pods_stopped_because_a_peer_began_a_newer_attempt_are_victims(tmp_path):
    """Kubernetes: node-b's rank died (NCCL's watchdog SIGABRT after a NIC flap), its pod was recreated and began
    attempt 1; the healthy pods, still blocked in NCCL, were stopped by NewerAttemptWatch. They went down with node-b
    and are never blamed, whether their end is read by its structural mark (the agent's end record now) or, in a
    record from before it, by the words the agent wrote ("X began attempt N+1 ...")."""
    from harness.agent import NewerAttemptWatch, end_record

    watch = NewerAttemptWatch(tmp_path, 0, stop=lambda: None)
    watch.newer = {"node": "pod-node-b", "attempt": 1}
    stopped = end_record(0, {"node": "pod-node-x"}, watch.failure(), None, None)
    assert stopped["stopped_by"] == "newer_attempt" and stopped["signal"] is None
    new = {k: v for k, v in stopped.items() if k not in ("event", "attempt", "node", "time", "ok")}
    old = {k: v for k, v in new.items() if k != "stopped_by"}
    for end in (new, old, {**new, "cause": "stopped"}):
        _attempt(tmp_path, {"node-b": ABORTED, "node-a": end, "node-c": end, "node-d": end}, pods=True)
        assert preflight.blamed_nodes(tmp_path) == {}, end



def test_a_stopped_pods_end_in_the_agents_older_record_is_a_victims_too(tmp_path):
    """Records written before the structural mark: the end holds only the failure's kind, cause and signal."""
    from harness.agent import NewerAttemptWatch

    watch = NewerAttemptWatch(tmp_path, 0, stop=lambda: None)
    watch.newer = {"node": "pod-node-b", "attempt": 1}
    failure = watch.failure()
    end = {"kind": failure.kind, "cause": failure.cause, "signal": failure.signal, "rank": None, "exit_code": None}
    _attempt(tmp_path, {"node-b": ABORTED, "node-a": end, "node-c": end, "node-d": end}, pods=True)
    assert preflight.blamed_nodes(tmp_path) == {}

def test_a_stopped_pod_does_not_hide_its_peers_own_failure(tmp_path):
    """The stopped pods' ends are victims', so the failure with a cause of its own (a segfault) is still blamed."""
    from harness.agent import NewerAttemptWatch, end_record

    watch = NewerAttemptWatch(tmp_path, 0, stop=lambda: None)
    watch.newer = {"node": "pod-node-c", "attempt": 1}
    stopped = {k: v for k, v in end_record(0, {"node": "x"}, watch.failure(), None, None).items()
               if k in ("kind", "cause", "signal", "stopped_by")}
    segfault = {"kind": INFRASTRUCTURE, "signal": "SIGSEGV", "cause": "rank 9 killed by SIGSEGV"}
    _attempt(tmp_path, {"node-a": stopped, "node-c": segfault, "node-b": stopped, "node-d": stopped}, pods=True)
    assert list(preflight.blamed_nodes(tmp_path)) == ["node-c"]


CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of "
            "79.10 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.07 GiB memory in "
            "use. Of the allocated memory 75.20 GiB is allocated by PyTorch, and 1.35 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


@pytest.mark.parametrize("message", [
    CUDA_OOM,
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB",
    "RuntimeError: CUDA error: out of memory\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "RuntimeError: Caught an error in rank 3\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8 GiB",
], ids=["oom", "cuda-oom", "cuda-error", "second-line"])
def test_cuda_out_of_memory_is_the_jobs_own_not_retried_and_blames_no_node(tmp_path, message):
    """Out of GPU memory is the job's setting (a batch, a layout), the same on every node and at every attempt: a
    workload error, stopped with exit 3 and a message that says what to lower, and no node is blamed."""
    from harness.agent import EXIT_WORKLOAD_ERROR, decide

    failure = classify(3, 1, None, message, has_error_file=True)
    assert failure.kind == WORKLOAD
    assert "micro batch" in failure.cause and "activation checkpointing" in failure.cause
    oom = {"kind": failure.kind, "signal": None, "cause": failure.cause}
    _attempt(tmp_path, {"node-c": oom, "node-a": ABORTED, "node-b": NCCL_TIMEOUT, "node-d": ABORTED})
    assert preflight.blamed_nodes(tmp_path) == {}
    records = [json.loads(line) for line in (tmp_path / "attempts.jsonl").read_text().splitlines()]
    decision = decide(records, 0, budget=3)
    assert decision.exit_code == EXIT_WORKLOAD_ERROR and "out of memory" in decision.message
    # The machine's memory (ENOMEM, or a plain "out of memory") stays the machine's: retried, its node blamed.
    assert classify(3, 1, None, "OSError: [Errno 12] Cannot allocate memory", True).kind == INFRASTRUCTURE


def _slurm_campaign(out: Path, runs: list[dict[str, dict | None]], attempt: int = 0) -> list[dict]:
    """A Slurm campaign of one allocation (attempt `attempt`): run i is srun step i, whose agents record
    `"launch": i`; runs[i] maps a node to its end in that step (None: never ended; absent: ended well)."""
    records = []
    for launch, ends in enumerate(runs):
        t = 100.0 * (launch + 1)
        for node in NODES:
            records.append({"event": "start", "attempt": attempt, "launch": launch, "node": node, "time": t})
        for seconds, node in enumerate(NODES):
            end = ends.get(node, {"ok": True})
            if end is not None:
                records.append({"event": "end", "attempt": attempt, "launch": launch, "node": node,
                                "time": t + 50 + seconds, "ok": False, **end})
    (out / "attempts").mkdir(exist_ok=True)
    for node in NODES:  # each agent's own file, as the agent writes it
        (out / "attempts" / f"{node}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records if r["node"] == node))
    return records


def test_slurm_a_node_lost_in_a_later_run_of_a_campaign_is_blamed(tmp_path):
    """Each run of a Slurm campaign is its own srun step, all in attempt 0: node-a's agent died in run 2 (a
    later step), and its end from run 0 must not count as this step's end. It is lost, blamed, and retried."""
    from harness.agent import EXIT_RETRY, decide

    records = _slurm_campaign(tmp_path, [{}, {}, {"node-a": None, "node-b": ABORTED, "node-c": NCCL_TIMEOUT,
                                                  "node-d": ABORTED}])
    blamed = preflight.blamed_nodes(tmp_path)
    assert list(blamed) == ["node-a"] and "lost" in blamed["node-a"]
    assert decide(records, 0, budget=3).exit_code == EXIT_RETRY


def test_slurm_a_step_killed_whole_in_a_later_run_is_retried_not_read_as_success(tmp_path):
    """Run 1's step was killed with every agent (no end at all): the attempt did not succeed because run 0 did."""
    from harness.agent import EXIT_RETRY, decide

    records = _slurm_campaign(tmp_path, [{}, dict.fromkeys(NODES)])
    assert decide(records, 0, budget=3).exit_code == EXIT_RETRY
    assert preflight.blamed_nodes(tmp_path) == {}  # the whole step killed at once: no node in particular



def test_slurm_agents_record_the_run_their_step_was_launched_for(tmp_path, monkeypatch):
    """Each run's step passes --launch (tests/test_slurm.py); the agent records it on the start and the end, and its
    decision reads that step's records: run 1's step, which failed, is not read as run 0's success."""
    import argparse

    from harness import agent

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setattr(agent, "_stop_on_sigterm", lambda: None)
    outcomes = iter([(False, None), (False, agent.Failure(INFRASTRUCTURE, "rank 3 killed by SIGKILL", 3, -9,
                                                           "SIGKILL"))])
    monkeypatch.setattr(agent, "run_attempt", lambda argv: next(outcomes))
    for launch in (0, 1):
        args = argparse.Namespace(out=tmp_path, torchrun=[], max_restarts=3, restart_here=False, launch=launch)
        code = agent._attempts(args, "node-a")
    assert code == agent.EXIT_RETRY
    assert [(r["event"], r["attempt"], r["launch"]) for r in agent.read_records(tmp_path)] == [
        ("start", 0, 0), ("end", 0, 0), ("start", 0, 1), ("end", 0, 1)]


def test_culprits_never_judges_two_steps_of_a_campaign_together(tmp_path):
    """Given a whole Slurm attempt's records (run 0's step and run 2's), the policy judges the newest step alone."""
    from harness.blame import culprits

    records = _slurm_campaign(tmp_path, [{}, {}, {"node-c": None, "node-a": ABORTED, "node-b": ABORTED,
                                                  "node-d": NCCL_TIMEOUT}])
    assert list(culprits(records)) == ["node-c"]
