"""A launch that holds on a real cluster: paths through container mounts, rendezvous failures retried,
timeouts that scale, per-rank output, per-node attempt files, SIGTERM, and values checked strictly."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.agent import EXIT_BUDGET_SPENT, EXIT_RETRY, read_records
from harness.errors import HarnessError
from harness.launchers.base import rendezvous_timeouts
from harness.spec import JobSpec, parse_env
from tests.conftest import REPO, free_port, harness, harness_stopped_by_sigterm, training_job
from workloads.common.run_record import ATTEMPTS_FILE, node_attempts_path, read_attempts

CW = ("--profile", "coreweave-h100")


def _dry(*args: str):
    return harness("run", *args, "--dry-run")


# --- paths through mounts -----------------------------------------------------------------------

def test_slurm_pyxis_paths_are_translated_through_the_profile_mounts(tmp_path):
    result = _dry("gpt3", "--preset", "full", "--backend", "slurm", *CW, "--nodes", "448", "--gpus-per-node", "8",
                  "--out", "/mnt/results/gpt3-a", "--data", "/mnt/data/c4", "--init-checkpoint", "/mnt/data/ckpt")
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert "#SBATCH --output=/mnt/results/gpt3-a/slurm-%j.out" in script  # Slurm writes it outside the container
    train = next(line for line in script.splitlines() if "--rdzv-endpoint" in line)
    assert "--out /results/gpt3-a" in train and "--data /data/c4" in train and "--init-checkpoint /data/ckpt" in train
    assert "/mnt/" not in train.split("--container-mounts=")[1].split(" ", 1)[1]  # no host path reaches a rank
    decide = next(line for line in script.splitlines() if "--decide" in line)
    assert "--out /results/gpt3-a" in decide
    # One named container for both steps: the decide step reuses it instead of importing the image again.
    assert train.count("--container-name=mlperf-harness") == 1 and "--container-name=mlperf-harness" in decide


def test_slurm_default_run_folder_is_the_profiles_results_dir():
    result = _dry("gpt3", "--preset", "full", "--backend", "slurm", *CW, "--nodes", "448", "--gpus-per-node", "8")
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --output=/mnt/results/gpt3-full-" in result.stdout
    assert " --out /results/gpt3-full-" in result.stdout


def test_a_path_no_mount_covers_is_refused_with_the_mount_list(tmp_path):
    result = _dry("gpt3", "--preset", "full", "--backend", "slurm", *CW, "--out", "/mnt/results/x",
                  "--data", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--data {tmp_path} is outside every container mount (/mnt/data:/data, /mnt/results:/results)" \
        in result.stderr


def test_a_run_folder_outside_the_mounts_is_mounted_at_its_own_path(tmp_path):
    result = _dry("resnet", "--backend", "slurm", *CW, "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert f"--container-mounts=/mnt/data:/data,/mnt/results:/results,{tmp_path}/run:{tmp_path}/run" in result.stdout
    assert f"--out {tmp_path}/run" in result.stdout


def test_kubernetes_paths_must_lie_on_a_volume_the_pods_mount(tmp_path):
    ok = _dry("bert", "--preset", "full", "--backend", "k8s", *CW, "--nodes", "2", "--out", str(tmp_path / "o"),
              "--data", "/data/bert", "--init-checkpoint", "/data/model.ckpt-28252.pt")
    assert ok.returncode == 0, ok.stderr
    job = training_job(ok.stdout)
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    claims = {v["persistentVolumeClaim"]["claimName"]: v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts[claims["mlperf-data"]]["mountPath"] == "/data" and mounts[claims["mlperf-data"]]["readOnly"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["HARNESS_IMAGE"] == pod["containers"][0]["image"]
    refused = _dry("bert", "--preset", "full", "--backend", "k8s", *CW, "--out", str(tmp_path / "o"),
                   "--data", "/scratch/c4")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "--data /scratch/c4 is not on any volume the pods mount (mlperf-data:/data:ro, " \
           "mlperf-results:/results)" in refused.stderr


# --- GPUs and processes per node are different facts --------------------------------------------

def test_gpus_and_processes_per_node_stay_apart(tmp_path):
    k8s = _dry("resnet", "--backend", "k8s", *CW, "--gpus-per-node", "8", "--procs-per-node", "4",
               "--out", str(tmp_path / "k"))
    assert k8s.returncode == 0, k8s.stderr
    master = training_job(k8s.stdout)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert master["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert "--nproc-per-node=4" in master["containers"][0]["args"]
    slurm = _dry("resnet", "--backend", "slurm", *CW, "--gpus-per-node", "4", "--out", "/mnt/results/s")
    assert "#SBATCH --gpus-per-node=4" in slurm.stdout and "--nproc-per-node=4" in slurm.stdout
    too_many = _dry("resnet", "--backend", "slurm", *CW, "--gpus-per-node", "4", "--procs-per-node", "8")
    assert too_many.returncode == 2 and "--procs-per-node 8 is more than --gpus-per-node 4" in too_many.stderr
    # The profile's GPUs count as much as the option's: before, 16 processes on the profile's 8 GPUs rendered.
    for backend in ("slurm", "k8s"):
        too_many = _dry("resnet", "--backend", backend, *CW, "--procs-per-node", "16")
        assert too_many.returncode == 2, too_many.stdout
        assert too_many.stderr == ("harness: error: --procs-per-node 16 is more than the profile's gpus_per_node 8: "
                                   "each process drives one GPU\n")


# --- values checked strictly -------------------------------------------------------------------

def test_an_env_name_with_a_trailing_newline_is_refused():
    with pytest.raises(HarnessError, match="expected KEY=VALUE"):
        parse_env(["NAME\n=x"])
    result = _dry("resnet", "--backend", "slurm", "--env", "NAME\n=x")
    assert result.returncode == 2 and "export NAME" not in result.stdout


def test_a_slurm_account_with_a_space_does_not_become_options():
    result = _dry("resnet", "--backend", "slurm", "--set", "slurm.account=lab --qos=high")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--account must be one word" in result.stderr and "#SBATCH" not in result.stdout


# --- rendezvous: timeouts that scale, failures retried ------------------------------------------

def test_rendezvous_timeouts_scale_with_nodes_and_come_from_the_profile():
    small = JobSpec("resnet", nodes=2)
    assert rendezvous_timeouts(small) == (604, 60)
    assert rendezvous_timeouts(JobSpec("resnet", nodes=448)) == (1496, 172)
    result = _dry("resnet", "--backend", "slurm", "--nodes", "2", "--set", "rendezvous.join_timeout_s=900",
                  "--set", "rendezvous.store_timeout_s=120")
    assert "--rdzv-conf=join_timeout=900,read_timeout=120" in result.stdout, result.stderr
    bad = _dry("resnet", "--backend", "slurm", "--set", "rendezvous.join_timeout_s=0")
    assert bad.returncode == 2 and "rendezvous.join_timeout_s must be at least 1 second" in bad.stderr


def test_a_free_port_is_drawn_where_no_other_process_is_handed_it_meanwhile():
    """A test picks a port, then starts a process that listens on it seconds later. A port from bind(0), closed
    again, is the next bind(0)'s of any process (the other worker's gloo pairs and stores listen on port 0: one
    took it after 6,924 such listeners here); one below the kernel's ephemeral range is never handed out."""
    from tests.conftest import ephemeral_ports

    ports = {free_port() for _ in range(20)}
    assert not ports & set(ephemeral_ports()) and len(ports) > 1  # outside the range, and drawn, not fixed
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def _agent(out: Path, *agent_args: str, rdzv_conf: str, nnodes: int = 2) -> subprocess.CompletedProcess:
    """The node agent with a rendezvous that cannot complete: one node of `nnodes`, short timeouts."""
    argv = [sys.executable, "-m", "harness.agent", "--out", str(out), *agent_args, "--", "--nproc-per-node=1",
            f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "--rdzv-id=test", f"--rdzv-conf={rdzv_conf}", "-m", "workloads", "resnet", "--out", str(out)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=REPO)


def test_a_rendezvous_timeout_is_an_infrastructure_failure_retried_within_the_budget(tmp_path):
    """Locally (and on Slurm, whose --decide step reads the same record) the agent retries it in budget."""
    proc = _agent(tmp_path, "--max-restarts", "1", "--restart-here", rdzv_conf="join_timeout=2")
    assert proc.returncode == EXIT_BUDGET_SPENT, proc.stderr
    ends = [r for r in read_records(tmp_path) if r["event"] == "end"]
    assert [r["attempt"] for r in ends] == [0, 1]
    assert all(r["kind"] == "infrastructure" and "rendezvous failed: not all 2 node(s) joined" in r["cause"]
               for r in ends)
    assert "Restarting from the newest checkpoint (1 of 1 restarts used)" in proc.stderr
    merged = [json.loads(line) for line in (tmp_path / ATTEMPTS_FILE).read_text().splitlines()]
    assert merged == read_records(tmp_path)


def test_on_kubernetes_a_rendezvous_failure_exits_for_a_pod_restart(tmp_path):
    """Without --restart-here (Kubernetes), the agent exits 138 (EXIT_RETRY), which restartPolicy ExitCode retries, instead of
    1, which the operator treats as final; an unreachable store is the same kind of failure."""
    proc = _agent(tmp_path, "--max-restarts", "2", rdzv_conf="is_host=0,read_timeout=2,join_timeout=10")
    assert proc.returncode == EXIT_RETRY, proc.stderr
    (end,) = [r for r in read_records(tmp_path) if r["event"] == "end"]
    assert end["kind"] == "infrastructure" and "rendezvous failed: cannot reach the c10d store" in end["cause"]


# --- one attempts file per node ------------------------------------------------------------------

def test_each_node_writes_its_own_attempts_file_and_the_decider_merges_them(tmp_path):
    for node, t in (("node-b", 2.0), ("node-a", 1.0)):
        path = node_attempts_path(tmp_path, node)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"event": "start", "attempt": 0, "node": node, "time": t}) + "\n"
                        + json.dumps({"event": "end", "attempt": 0, "node": node, "time": t + 5, "ok": True}) + "\n"
                        + '{"event": "end", "att')  # a line cut by a killed writer
    assert node_attempts_path(tmp_path, "../evil").parent == tmp_path / "attempts"
    records = read_attempts(tmp_path)
    assert [(r["node"], r["event"]) for r in records] == [("node-a", "start"), ("node-b", "start"),
                                                          ("node-a", "end"), ("node-b", "end")]
    proc = subprocess.run([sys.executable, "-m", "harness.agent", "--decide", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line) for line in (tmp_path / ATTEMPTS_FILE).read_text().splitlines()] == records


# --- the run itself: per-rank output, SIGTERM ---------------------------------------------------

@pytest.mark.slow
def test_ranks_write_their_own_output_files_when_asked(tmp_path):
    """As on Slurm: rank 1's traceback goes to its own file, not into the one console every rank shares."""
    out = tmp_path / "run"
    result = harness("run", "resnet", "--max-steps", "5", "--out", str(out), "--env", "HARNESS_RANK_OUTPUT=1",
                     "--inject-failure", "1:2:exception")
    assert result.returncode == 3, result.stderr  # a workload error, named in one line
    assert "rank 1: InjectedFault: injected workload error at step 2" in result.stderr
    assert "[rank1]: Traceback" in (out / "logs" / "rank_1.out").read_text()
    assert "[rank1]" not in result.stderr
    assert not (out / "logs" / "rank_0.out").exists()  # rank 0 keeps the console
    assert "rank_1.out" in harness("logs", str(out)).stdout


@pytest.mark.slow
def test_sigterm_cancels_the_local_job_as_ctrl_c_does(tmp_path):
    out = tmp_path / "run"
    # Rank 0 hangs at step 3, so the job is still running when the signal comes, however fast it trains.
    stopped = harness_stopped_by_sigterm("run", "resnet", "--inject-failure", "0:3:hang", "--out", str(out),
                                         when=lambda: (out / "logs" / "rank_1.log").exists())
    assert stopped.returncode == 143, stopped.stderr
    assert "cancelled; results so far stay in" in stopped.stderr and "Traceback" not in stopped.stderr
    record = json.loads((out / "job.json").read_text())
    assert record["state"] == "CANCELLED"
    alive = Path(f"/proc/{record['job_id']}/cmdline")
    assert not alive.exists() or b"harness.agent" not in alive.read_bytes()


def test_the_resnet_optimizer_can_be_forced_and_is_checked():
    forced = _dry("resnet", "--optimizer", "lars")
    assert forced.returncode == 0 and "--optimizer lars" in forced.stdout
    for args in (("resnet", "--optimizer", "adam"), ("bert", "--optimizer", "lars")):
        refused = _dry(*args)
        assert refused.returncode == 2 and "resnet takes one of sgd, lars" in refused.stderr


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return True
    except OSError:
        return False


def test_sigterm_during_a_rendezvous_ends_the_attempt_with_a_record(tmp_path):
    """Before torch's agent starts workers it has no SIGTERM handler of its own: the node agent's ends the
    attempt anyway (a pod's agent is PID 1, which would otherwise ignore the signal), and records it."""
    port = free_port()
    argv = [sys.executable, "-m", "harness.agent", "--out", str(tmp_path), "--max-restarts", "2", "--",
            "--nproc-per-node=1", "--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=test", "--rdzv-conf=join_timeout=120", "-m", "workloads", "resnet", "--out", str(tmp_path)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # In the rendezvous once this node's c10d store listens (it hosts it), waiting for a second node that
        # never comes: an event, not a pause (importing torchrun alone can take seconds on a busy machine).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not _listening(port):
            time.sleep(0.2)
        assert read_records(tmp_path) and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr
    (end,) = [r for r in read_records(tmp_path) if r["event"] == "end"]
    assert end["signal"] == "SIGTERM" and end["kind"] == "infrastructure"


def test_a_sigterm_before_torchrun_has_started_still_ends_the_attempt_with_a_record(tmp_path, monkeypatch):
    """Between the attempt's start record and torch's rendezvous the node agent imports torchrun, seconds on a
    busy node: a SIGTERM there (a cancel right after the start) ends the attempt as one in the rendezvous does,
    with its end recorded, not with a traceback and a start without an end (read as a lost node)."""
    import argparse

    from torch.distributed import run as torchrun

    from harness import agent

    def signalled():  # the real signal and the agent's real handler, while torchrun reads its arguments
        signal.raise_signal(signal.SIGTERM)  # its handler has run when this returns
        raise AssertionError("the SIGTERM handler did not run")

    monkeypatch.setattr(torchrun, "get_args_parser", signalled)
    monkeypatch.setenv(agent.ATTEMPT_ENV, "0")  # the agent sets it for its workers: undone after the test
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = agent._attempts(argparse.Namespace(out=tmp_path, torchrun=[], max_restarts=2, restart_here=True),
                               "node-a")
    finally:
        signal.signal(signal.SIGTERM, before)
    assert code == 143
    assert [(r["event"], r.get("signal")) for r in read_records(tmp_path)] == [("start", None), ("end", "SIGTERM")]
