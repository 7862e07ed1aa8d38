"""The foundation's promise: `harness run resnet` trains to its target with compliant MLPerf logs."""

from __future__ import annotations

import json
import re

from mlperf_logging.mllog import constants as C

from harness.results import parse_file
from harness.results.parse import iter_events
from tests.conftest import TINY_RUNS, compliance, failed_checks, harness
from workloads.common.run_record import read_json_lines


def test_tiny_campaign_reaches_target_and_prints_time_to_train(tiny_campaign):
    out, result = tiny_campaign
    assert re.search(r"time-to-train \(min\)", result.stdout)
    rows = [line for line in result.stdout.splitlines() if re.match(r"\s+\d+\s+success\s+\d+\.\d+", line)]
    assert len(rows) == TINY_RUNS, result.stdout
    for i in range(TINY_RUNS):
        run = parse_file(out / f"result_{i}.txt")
        assert run.status == C.SUCCESS and run.quality >= 0.90
        assert run.division == C.OPEN and run.benchmark == C.RESNET
        assert run.samples_per_s > 0 and 0 < run.time_to_train_min < 5


def test_tiny_logs_pass_the_official_checker(tiny_campaign, tmp_path):
    out, _ = tiny_campaign
    for i in range(TINY_RUNS):
        result = compliance(out / f"result_{i}.txt", "4.0.0", cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout + result.stderr


def test_runs_log_distinct_seeds_and_the_required_keys(tiny_campaign):
    out, _ = tiny_campaign
    seeds = []
    for i in range(TINY_RUNS):
        events = list(iter_events((out / f"result_{i}.txt").read_bytes()))
        keys = [e["key"] for e in events]
        for key in (C.CACHE_CLEAR, C.INIT_START, C.INIT_STOP, C.SUBMISSION_ORG, C.SEED, C.GLOBAL_BATCH_SIZE,
                    C.RUN_START, C.BLOCK_START, C.EPOCH_START, C.EVAL_START, C.EVAL_ACCURACY, C.EVAL_STOP,
                    C.TRAIN_SAMPLES, C.EVAL_SAMPLES, C.RUN_STOP):
            assert key in keys, key
        assert keys.count(C.RUN_START) == 1 and keys.count(C.RUN_STOP) == 1
        assert keys.index(C.INIT_STOP) < keys.index(C.RUN_START) < keys.index(C.RUN_STOP)
        assert all(C.EPOCH_NUM in e["metadata"] for e in events if e["key"] == C.EVAL_ACCURACY)
        seeds.append(next(e["value"] for e in events if e["key"] == C.SEED))
    assert len(set(seeds)) == TINY_RUNS


def test_cache_clear_logs_whether_the_page_cache_was_dropped(tiny_campaign):
    """Each run logs cache_clear as it happened, and its run record says why not when it was not dropped."""
    out, result = tiny_campaign
    for i in range(TINY_RUNS):
        logged = [e["value"] for e in iter_events((out / f"result_{i}.txt").read_bytes()) if e["key"] == C.CACHE_CLEAR]
        [noted] = [r for r in read_json_lines(out / f"run_{i}.jsonl") if r["kind"] == "cache_clear"]
        assert logged == [noted["cleared"]]
        assert noted["cleared"] or ("why_not" in noted and "was not dropped" in result.stderr)


def test_only_rank_zero_writes_the_log_and_every_rank_logs_progress(tiny_campaign):
    out, _ = tiny_campaign
    assert sorted(p.name for p in out.glob("result_*.txt")) == [f"result_{i}.txt" for i in range(TINY_RUNS)]
    assert {p.name for p in (out / "logs").glob("*.log")} == {"rank_0.log", "rank_1.log"}
    assert "eval top-1" in (out / "logs" / "rank_0.log").read_text()
    job = json.loads((out / "job.json").read_text())
    assert job["backend"] == "local" and job["state"] == "SUCCEEDED" and "harness.agent" in job["request"]


def test_report_reads_the_campaign_in_every_format(tiny_campaign):
    out, _ = tiny_campaign
    groups = json.loads(harness("report", str(out), "--format", "json").stdout)
    assert len(groups) == 1
    group = groups[0]
    assert group["benchmark"] == "resnet" and group["submitter"] == "harness"
    assert [r["status"] for r in group["runs"]] == ["success"] * TINY_RUNS
    assert all(r["time_to_train_min"] > 0 for r in group["runs"])
    middle = sorted(r["time_to_train_min"] for r in group["runs"])[1:-1]  # olympic: drop fastest and slowest
    assert abs(group["score_min"] - sum(middle) / len(middle)) < 1e-12
    csv = harness("report", str(out), "--format", "csv").stdout.splitlines()
    assert csv[0].startswith("submitter,system,benchmark,score_min,file,status,time_to_train_min")
    assert len(csv) == 1 + TINY_RUNS
    table = harness("report", str(out)).stdout
    assert f"score {group['score_min']:.4f} min" in table
    few = harness("report", str(out / "result_0.txt"), str(out / "result_1.txt")).stdout
    assert "no score (2 of 5 required runs)" in few


def test_closed_preset_logs_every_closed_key(tmp_path):
    """ResNet-50, synthetic input, 3 steps: the checker's only complaint is the unreached target."""
    out = tmp_path / "closed"
    result = harness("run", "resnet", "--preset", "full", "--synthetic", "--max-steps", "3", "--batch-size", "2",
                     "--out", str(out))
    assert result.returncode == 1 and "did not reach the quality target" in result.stderr
    checked = compliance(out / "result_0.txt", "4.0.0", cwd=tmp_path)
    assert checked.returncode != 0
    failures = failed_checks(checked)
    assert len(failures) == 1 and "eval_accuracy" in failures[0] and "0.7590" in failures[0], failures
    assert "closed_resnet.yaml" in checked.stdout + checked.stderr
    run = parse_file(out / "result_0.txt")
    assert run.division == C.CLOSED and run.status == C.ABORTED
