"""The Python API (harness.api, re-exported from `harness`): a campaign started, watched, cancelled and read from
Python; dry runs as data; the CLI's one-line errors as HarnessError; `harness status` and attach by run folder."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import harness
from harness.campaign import PIPELINE_FILE
from harness.cli import _spec_from_args, build_parser
from harness.errors import HarnessError
from harness.launchers import JobState
from tests.conftest import REPO, TINY_RUNS, harness as harness_cli


def test_import_harness_stays_light():
    """The API comes on first use, and neither it nor `import harness` brings torch (the report path never does)."""
    code = ("import sys, harness; print('torch' in sys.modules, 'harness.api' in sys.modules); harness.attach; "
            "print('torch' in sys.modules, 'harness.api' in sys.modules)")
    shown = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert shown.stdout.split() == ["False", "False", "False", "True"]


def test_the_spec_goes_down_the_floors_once():
    """The pipeline imports no floor above it: neither the command line nor the API that call it."""
    import ast

    for floor, above in (("campaign", {"harness.cli", "harness.api"}), ("api", {"harness.cli"})):
        tree = ast.parse((REPO / "harness" / f"{floor}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {f"{node.module}.{a.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                     for a in node.names}
        imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        assert not imported & above, f"harness/{floor}.py imports {imported & above}"


def test_the_api_takes_the_cli_options_by_their_names(tmp_path):
    """One mapping: `harness run`'s options are the API's keywords, with the same defaults."""
    from harness.campaign import RUN_OPTIONS, resolve_spec

    run = next(a for a in build_parser()._actions if a.dest == "command").choices["run"]
    dests = {a.dest for a in run._actions} - {"help"}
    assert dests - set(RUN_OPTIONS) == {"backend", "dry_run", "pod_monitor", "strict"}
    assert set(RUN_OPTIONS) <= dests
    assert resolve_spec("resnet") == _spec_from_args(build_parser().parse_args(["run", "resnet"]))
    given = ["run", "bert", "--nodes", "2", "--runs", "3", "--seed", "7", "--env", "A=1", "--set", "slurm.partition=gpu",
             "--out", str(tmp_path), "--synthetic", "--straggler-threshold", "0.5"]
    assert resolve_spec("bert", nodes=2, runs=3, seed=7, env={"A": "1"}, overrides={"slurm.partition": "gpu"},
                        out=tmp_path, synthetic=True, straggler_threshold=0.5) == \
        _spec_from_args(build_parser().parse_args(given))


@pytest.mark.parametrize("options, line", [
    ({"benchmark": "resnet50"}, "unknown benchmark 'resnet50'; choose one of: resnet, bert"),
    ({"benchmark": "resnet", "backend": "aws"}, "unknown backend 'aws'; choose one of: local, slurm, k8s"),
    ({"benchmark": "resnet", "nodes": 0}, "--nodes must be at least 1, got 0"),
    ({"benchmark": "resnet", "nodes": "2"}, "option nodes='2': expected int"),
    ({"benchmark": "resnet", "runs": "5"}, "option runs='5': expected None or int"),
    ({"benchmark": "resnet", "colour": "blue"}, "unknown option 'colour'; the options are: benchmark, preset"),
    ({"benchmark": "resnet", "profile": "nope"}, "unknown profile 'nope'; choose one of: "),
    ({"benchmark": "resnet", "preset": "full"}, "give --data PATH, or --synthetic"),
])
def test_bad_options_are_one_line_harness_errors_and_start_nothing(options, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for call in (harness.start, harness.dry_run):
        if call is harness.dry_run and options.get("preset") == "full":
            continue  # a dry run lists what `harness run` refuses (below)
        with pytest.raises(HarnessError) as raised:
            call(**options)
        assert line in str(raised.value) and "\n" not in str(raised.value)
    assert not list(tmp_path.iterdir())


def test_dry_runs_are_data_on_every_backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a dry run writes nothing: any file it made would show up here
    local = harness.dry_run("resnet", seed=3)
    assert local.backend == "local" and local.problems == []
    argv = local.request["argv"]
    assert argv[argv.index("-m", 3):][:3] == ["-m", "workloads", "resnet"] and "--seed" in argv
    assert any("resnet batch: global 64" in note for note in local.notes)
    slurm = harness.dry_run("resnet", backend="slurm", profile="h100-ib", nodes=2)
    assert slurm.request.startswith("#!/bin/bash") and "srun" in slurm.request and slurm.request == slurm.text
    k8s = harness.dry_run("llama31_8b", backend="k8s", profile="coreweave-h100", nodes=64, gpus_per_node=8,
                          preset="full", api="trainjob")
    job = next(doc for doc in k8s.request if doc["kind"] == "TrainJob")
    assert job["spec"]["trainer"]["numNodes"] == 64
    assert any("dataset" in problem for problem in k8s.problems)  # listed, not raised: `harness run` refuses it
    with pytest.raises(HarnessError, match="dataset"):
        harness.start("llama31_8b", backend="k8s", profile="coreweave-h100", nodes=64, gpus_per_node=8,
                      preset="full")
    assert not list(tmp_path.iterdir())


def _job_record(out: Path, **fields) -> None:
    """A job.json of an ended local job (its pid long gone), as `harness run` leaves one."""
    out.mkdir(parents=True, exist_ok=True)
    spec = harness.dry_run("resnet", runs=2).spec.to_dict()
    (out / "job.json").write_text(json.dumps({"backend": "local", "job_id": "4194304", "spec": spec, "request": "",
                                              "state": "SUCCEEDED", **fields}))


def test_a_campaign_between_two_jobs_is_running_and_a_cancel_there_ends_it(tmp_path):
    out = tmp_path / "run"
    _job_record(out, launch=0)  # the first of two jobs (one a run) ended; the pipeline submits the next
    # The pipeline (a `harness run` on this host) is alive: a process whose command names the harness.
    pipeline = subprocess.Popen([sys.executable, "-c", "print(); import time; time.sleep(600)  # harness"],
                                stdout=subprocess.PIPE)
    try:
        pipeline.stdout.readline()  # it runs its command (before, /proc shows this process's, forked)
        (out / PIPELINE_FILE).write_text(f"{socket.gethostname()} {pipeline.pid}\n")
        campaign = harness.attach(out)
        assert campaign.state is JobState.RUNNING and campaign.exit_code is None
        # A stale exit code (an earlier campaign in a reused folder) is not this running one's.
        _job_record(out, launch=0, campaign_exit_code=1)
        assert campaign.state is JobState.RUNNING
    finally:
        pipeline.kill()
        pipeline.wait()
    _job_record(out, launch=0)
    assert campaign.state is JobState.FAILED  # the pipeline died before the next job: nothing will submit it
    (out / PIPELINE_FILE).write_text("another-host 1\n")
    assert campaign.state is JobState.RUNNING  # a pipeline elsewhere cannot be asked: it goes on
    assert campaign.cancel() == "job 4194304 has ended (SUCCEEDED); the campaign's later runs will not be submitted"
    assert campaign.state is JobState.CANCELLED
    _job_record(out, launch=1, campaign_exit_code=1)  # the last job: `harness run` ended with 1
    assert harness.attach(out).state is JobState.FAILED and harness.attach(out).exit_code == 1


def test_a_health_job_is_not_the_campaign(tmp_path):
    """Preflight's job ended and the pipeline died before the training was submitted: not a success."""
    out = tmp_path / "run"
    _job_record(out)
    record = json.loads((out / "job.json").read_text())
    record["spec"]["health_only"] = True
    (out / "job.json").write_text(json.dumps(record))
    assert harness.attach(out).state is JobState.FAILED


def test_a_local_job_whose_watcher_died_ends_as_its_agent_decided(tmp_path):
    """`harness run` killed with its job: job.json stays RUNNING, and the node agent's attempt records say how the
    job ended (a success; a workload error; an attempt cut off without its end record; none recorded)."""
    from harness.agent import CONFIGURATION, Failure, end_record, node_attempts_path

    identity = {"node": "n0"}
    for name, ends, state in (
            ("ok", [end_record(0, identity, None, 0, 40)], JobState.SUCCEEDED),
            ("refused", [end_record(0, identity, Failure(CONFIGURATION, "rank 0: bad input", 0, 1), 0, 0)],
             JobState.FAILED),
            ("cut", [], JobState.FAILED)):
        out = tmp_path / name
        _job_record(out, state="RUNNING")
        path = node_attempts_path(out, "n0")
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in [{"event": "start", "attempt": 0, **identity,
                                                                  "time": 1.0}, *ends]))
        assert harness.attach(out).state is state, name
        assert json.loads((out / "job.json").read_text())["state"] == state.value  # recorded: said once, the same
    _job_record(tmp_path / "health", state="RUNNING")  # no attempt recorded (a health job): failed, code unknown
    assert harness.attach(tmp_path / "health").state is JobState.FAILED


def test_status_of_a_folder_that_is_no_run_folder_is_one_line(tmp_path):
    shown = harness_cli("status", str(tmp_path))
    assert shown.returncode == 2 and shown.stderr == f"harness: error: {tmp_path} is not a run folder: it has no " \
                                                      "job.json\n"
    with pytest.raises(HarnessError, match="is not a run folder"):
        harness.attach(tmp_path)


def test_status_and_attach_of_a_campaign_the_cli_ran(tiny_campaign):
    out, _ = tiny_campaign
    shown = harness_cli("status", str(out))
    assert shown.returncode == 0, shown.stderr
    job = json.loads((out / "job.json").read_text())["job_id"]
    assert shown.stdout == (f"harness: {out}: SUCCEEDED (local job {job}); {TINY_RUNS} of {TINY_RUNS} run(s) done; "
                            "exit code 0\n")
    campaign = harness.attach(out)
    assert campaign.state is JobState.SUCCEEDED and campaign.exit_code == 0
    assert len(campaign.results().runs) == TINY_RUNS and campaign.results().runs.converged.all()
    assert "rank_0.log" in campaign.logs()


def _until(condition, what: str, deadline_s: float = 300) -> None:
    """Wait for an event, with a generous deadline (never a pace)."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_local_campaign_through_the_api(tmp_path):
    out = tmp_path / "run"
    campaign = harness.start("resnet", out=out, seed=5)
    assert campaign.out_dir == out and campaign.state in (JobState.PENDING, JobState.RUNNING)  # it did not block
    with pytest.raises(TimeoutError, match="is still"):
        campaign.wait(timeout=0)
    assert campaign.wait(timeout=600) is JobState.SUCCEEDED and campaign.exit_code == 0
    runs = campaign.results().runs
    assert len(runs) == 1 and runs.converged.all() and runs.seed.tolist() == [5]
    said = campaign.log_file.read_text()
    assert f"harness: resnet (tiny) on local: 1 run(s) -> {out}" in said and "resnet batch: global 64" in said
    assert harness.attach(out).state is JobState.SUCCEEDED


@pytest.mark.slow
def test_a_campaign_cancelled_through_the_api_keeps_its_results(tmp_path):
    out = tmp_path / "run"
    # Rank 0 hangs at step 3, so the job is still running when the cancel comes, however fast it trains.
    campaign = harness.start("resnet", out=out, inject_failure="0:3:hang")
    _until(lambda: campaign.state is JobState.RUNNING and (out / "result_0.txt").is_file()
           and "run_start" in (out / "result_0.txt").read_text(), "the run started")
    assert campaign.cancel() == f"cancelled the campaign; results so far stay in {out}"
    assert campaign.state is JobState.CANCELLED and campaign.exit_code == 143
    assert "run_start" in (out / "result_0.txt").read_text()
    record = json.loads((out / "job.json").read_text())
    assert record["state"] == "CANCELLED"
    alive = Path(f"/proc/{record['job_id']}/cmdline")
    assert not alive.exists() or b"harness.agent" not in alive.read_bytes()
    assert harness.attach(out).cancel() == f"job {record['job_id']} has already ended (CANCELLED); nothing to cancel"
    assert harness_cli("status", str(out)).stdout.startswith(f"harness: {out}: CANCELLED (local job ")
    assert os.listdir(out)  # what the run wrote stays
