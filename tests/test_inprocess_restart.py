"""Restart in process (workloads.common.inprocess): the policy's verdict, and real 2-rank runs whose rank 1 fails
with a retried error (its processes go on) or is killed (new processes, through the node agent)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.agent import in_process_records, in_process_verdict
from harness.blame import culprits
from tests.conftest import compliance, failed_checks, harness
from workloads.common import inprocess

NODE = {"node": "n1"}


def _verdict(tmp_path: Path, message: str, attempt: int = 0, budget: int = 3) -> dict:
    (tmp_path / "attempts").mkdir(exist_ok=True)
    (tmp_path / "attempts" / "n1.jsonl").write_text(json.dumps({"event": "start", "attempt": attempt, **NODE,
                                                                "time": 1.0}) + "\n")
    return in_process_verdict(tmp_path, NODE, attempt, budget, 1, message, "", 2.0)


def test_only_a_retried_failure_that_blames_no_node_and_lost_no_peer_restarts_in_process(tmp_path):
    assert _verdict(tmp_path, "OSError: [Errno 5] Input/output error")["restart"]
    assert _verdict(tmp_path, "OSError: [Errno 116] Stale file handle")["restart"]
    # A workload error is never retried; a lost peer is a process that died: the agent restarts the group.
    assert not _verdict(tmp_path, "InjectedFault: injected workload error at step 5")["restart"]
    assert not _verdict(tmp_path, "RuntimeError: [gloo/pair.cc:561] Connection closed by peer")["restart"]
    # The node's own memory: retried without that node, which needs a new attempt elsewhere.
    assert not _verdict(tmp_path, "OSError: [Errno 12] Cannot allocate memory")["restart"]
    # One budget: the last restart allowed has been used.
    spent = _verdict(tmp_path, "OSError: [Errno 5] Input/output error", attempt=3, budget=3)
    assert not spent["restart"] and "budget" in spent["message"]


def test_an_in_process_restart_is_recorded_as_an_attempt_whose_peers_are_victims(tmp_path):
    verdict = _verdict(tmp_path, "OSError: [Errno 5] Input/output error")
    assert "Restarting in process" in verdict["message"]
    failed_end, failed_start = in_process_records(NODE, verdict)
    other_end, other_start = in_process_records({"node": "n2"}, verdict)
    assert failed_end["cause"].startswith("rank 1: OSError: [Errno 5]") and failed_end["in_process"]
    assert failed_start == {**failed_start, "event": "start", "attempt": 1, "node": "n1", "in_process": True}
    assert other_end["stopped_by"] == "newer_attempt" and other_start["attempt"] == 1
    starts = [{"event": "start", "attempt": 0, "node": n, "time": 1.0} for n in ("n1", "n2")]
    assert culprits(starts + [failed_end, other_end]) == {}  # a passing I/O error blames no node


def _pids(out: Path) -> dict[int, list[tuple[int, int]]]:
    """{rank: [(attempt, pid) in the order the rank's log says it began them]}."""
    found = {}
    for rank in (0, 1):
        text = (out / "logs" / f"rank_{rank}.log").read_text()
        found[rank] = [(int(a), int(p)) for a, p in re.findall(r", attempt (\d+), pid (\d+)", text)]
    return found


def _accuracies(out: Path) -> list[float]:
    return [json.loads(line.split(":::MLLOG", 1)[1])["value"] for line in (out / "result_0.txt").read_text()
            .splitlines() if '"key": "eval_accuracy"' in line]


@pytest.mark.slow
@pytest.mark.skipif(not inprocess.available(), reason="nvidia-resiliency-ext is not installed (pip install '.[inprocess]')")
def test_a_retried_error_restarts_in_process_and_ends_where_a_process_restart_does(tmp_path):
    common = ["--inject-failure", "1:12:io-error", "--checkpoint-every", "5", "--max-steps", "30", "--seed", "5"]
    here, there = tmp_path / "in-process", tmp_path / "process"
    result = harness("run", "resnet", *common, "--out", str(here))
    assert _accuracies(here), result.stdout + result.stderr  # the run went on to its evaluations
    assert "Restarting in process from the newest checkpoint (1 of 3 restarts used)" in result.stderr
    pids = _pids(here)
    for rank in (0, 1):  # the same processes went on into attempt 1
        assert [a for a, _ in pids[rank]] == [0, 1] and len({p for _, p in pids[rank]}) == 1, pids
    ends = [r for r in map(json.loads, (here / "attempts.jsonl").read_text().splitlines()) if r["event"] == "end"]
    assert [(r["attempt"], r["ok"], r.get("in_process", False)) for r in ends] == [(0, False, True), (1, True, False)]
    kinds = [(r["attempt"], r["kind"]) for r in map(json.loads, (here / "run_0.jsonl").read_text().splitlines())
             if r["kind"] in ("fault", "restart", "restore")]
    assert kinds == [(0, "fault"), (1, "restart"), (1, "restore")]
    [run] = json.loads(harness("report", str(here), "--format", "json").stdout)[0]["runs"]
    assert run["restarts"] == 1 and run["badput"]["recovery"] > 0
    checked = compliance(here / "result_0.txt", "4.0.0", cwd=tmp_path)
    assert checked.returncode == 0 and not failed_checks(checked), checked.stdout + checked.stderr
    # Today's path, the same fault: new processes, and the run ends with the same evaluations.
    result = harness("run", "resnet", *common, "--restart", "process", "--out", str(there))
    assert "Input/output error (injected at step 12). Restarting from the newest checkpoint" in result.stderr
    assert len({p for _, p in _pids(there)[1]}) == 2
    assert _accuracies(here) == _accuracies(there) and _accuracies(here)


@pytest.mark.slow
@pytest.mark.skipif(not inprocess.available(), reason="nvidia-resiliency-ext is not installed (pip install '.[inprocess]')")
def test_a_killed_rank_still_restarts_as_new_processes(tmp_path):
    out = tmp_path / "run"
    result = harness("run", "resnet", "--inject-failure", "1:8", "--checkpoint-every", "5", "--max-steps", "14",
                     "--out", str(out))
    assert "rank 1 killed by SIGKILL. Restarting from the newest checkpoint" in result.stderr
    pids = _pids(out)
    for rank in (0, 1):
        assert [a for a, _ in pids[rank]] == [0, 1] and len({p for _, p in pids[rank]}) == 2, pids
    assert "in_process" not in (out / "attempts.jsonl").read_text()


def test_the_wrappers_hang_timeout_outlasts_the_longest_legitimate_wait():
    """nvidia-resiliency-ext calls a rank hung when its main thread runs no Python for its soft timeout (60 s by
    default): a rank waiting at a barrier while its peer builds something (rank 0 training BERT's tiny warm start
    took minutes, and every BERT run restarted at 60 s). The harness's timeout outlasts the longest init the rules
    allow (the open division's); a real hang is the process group's collective timeout to catch."""
    from datetime import timedelta

    from mlperf_logging.mllog import constants as C

    from workloads.common.campaign import INIT_LIMIT_MINUTES

    assert inprocess.PROGRESS_TIMEOUT > timedelta(minutes=max(INIT_LIMIT_MINUTES.values()))
    assert INIT_LIMIT_MINUTES[C.OPEN] == max(INIT_LIMIT_MINUTES.values())
