"""The Slurm backend: the rendered sbatch script, and real jobs on a private two-node Slurm cluster."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from harness import profiles
from harness.errors import HarnessError
from harness.launchers import JobState, get_launcher
from harness.results import parse_file
from harness.spec import JobSpec
from tests.conftest import compliance, harness
from workloads.common.mlperf import logged_run
from workloads.common.page_cache import host_flush_script
from workloads.common.run_record import read_json_lines


def test_the_448_node_h100_script(tmp_path):
    # NVIDIA+CoreWeave's v3.0 shape: 448 x 8 GPUs x 16 = 57,344, a batch the LARS table covers (the tiny preset's
    # 32 a GPU, 114,688, is refused when the script is rendered, as its workers would refuse it).
    args = ("run", "resnet", "--preset", "full", "--synthetic", "--batch-size", "16", "--backend", "slurm",
            "--profile", "coreweave-h100", "--nodes", "448", "--gpus-per-node", "8", "--out", str(tmp_path / "out"),
            "--dry-run")
    first, second = harness(*args), harness(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout  # deterministic: a dry run can be diffed and reviewed
    script = first.stdout
    # 448 nodes and the profile's 3% spares (preflight is on for a full multi-node run); the plan's time: preflight's
    # 30 minutes and one synthetic run (a throughput run), 10 minutes of init and 10 to train (harness.campaign_plan).
    for line in ("#SBATCH --nodes=462", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --exclusive", "#SBATCH --requeue", "#SBATCH --partition=h100", "#SBATCH --time=01:00:00",
                 "export NCCL_COLLNET_ENABLE=1", "export NCCL_IB_HCA=ibp", "export CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert line in script.splitlines(), line
    [srun] = [line.strip() for line in script.splitlines() if "srun " in line and "--kill-on-bad-exit" in line]
    assert "--container-image=registry.example.com/mlperf/mlperf-harness:0.1.0" in srun
    assert "--container-mounts=/mnt/data:/data,/mnt/results:/results" in srun
    assert "--nnodes=448" in srun and "--nproc-per-node=8" in srun
    assert '--rdzv-endpoint="${head_addr}:29500"' in srun and '--rdzv-id="${SLURM_JOB_ID}-${run}"' in srun
    # Each run's step tells its agents the run it was launched for: their attempt records are told apart by it.
    assert '--launch "${run}"' in srun and srun.index("--launch") < srun.index(" -- ")
    assert not (tmp_path / "out").exists()  # a dry run starts and writes nothing


def _flush_step(script: str) -> str:
    [line] = [line.strip() for line in script.splitlines() if "/page_cache" in line and "srun " in line]
    return line


def test_the_page_cache_is_flushed_on_the_host_before_the_training_step(tmp_path):
    """One task per training node, outside the container (no pyxis options), before the training step, with the
    profile's command (NVIDIA's run.sub: `srun --ntasks="${SLURM_JOB_NUM_NODES}" bash -c "... sync &&
    ${DROPCACHE_CMD}"`); a failed step does not stop the job. A profile can name its command or turn it off."""
    args = ("run", "resnet", "--preset", "full", "--backend", "slurm", "--profile", "coreweave-h100", "--nodes", "4",
            "--gpus-per-node", "8", "--out", str(tmp_path / "it's"), "--synthetic", "--dry-run")
    script = harness(*args).stdout
    step = _flush_step(script)
    lines = [line.strip() for line in script.splitlines()]
    assert lines.index(step) < lines.index(next(line for line in lines if "--kill-on-bad-exit" in line))
    assert step.startswith('srun --nodes=4 --ntasks=4 --ntasks-per-node=1 --nodelist="${training_nodes}" bash -c ')
    assert "--container" not in step and step.endswith(" || true")
    # The script bash runs, once the shell has unquoted it: the reference's flush, the run folder quoted.
    assert shlex.split(step.removesuffix(" || true"))[-1] == host_flush_script(str(tmp_path / "it's"),
                                                                                "sync && echo 3 > /proc/sys/vm/drop_caches")
    sudo = harness(*args, "--set", "slurm.flush_page_cache=sudo /sbin/sysctl vm.drop_caches=3").stdout
    assert "( sudo /sbin/sysctl vm.drop_caches=3 )" in shlex.split(_flush_step(sudo).removesuffix(" || true"))[-1]
    assert "/page_cache" not in harness(*args, "--set", "slurm.flush_page_cache=").stdout


FAKE_SRUN = """#!{python}
# The batch script's srun, faked: the flush step runs its bash script here; a training step logs the run it does,
# with the flush records it finds, and ends that run (run_stop in its log) unless FAIL_RUN names it.
import json, os, subprocess, sys
from pathlib import Path
argv = sys.argv[1:]
with open(os.environ["STEPS"], "a") as steps:
    if "--decide" in argv:
        steps.write("decide\\n")
    elif "workloads" in argv:
        run = argv[argv.index("--last-run") + 1] if "--last-run" in argv else "every"
        out = Path(argv[argv.index("--out") + 1])
        taken = sorted(p.read_text().strip() for p in (out / "page_cache").glob("*"))
        steps.write(f"train {{run}} {{taken}}\\n")
        if run == os.environ.get("FAIL_RUN"):
            sys.exit(1)
        line = json.dumps({{"key": "{run_stop}", "value": None, "metadata": {{"status": "success"}}}})
        (out / f"result_{{run}}.txt").write_text(f":::MLLOG {{line}}\\n")
    else:
        steps.write("flush\\n")
        subprocess.run(argv[argv.index("bash"):], check=True)
"""


def _run_the_batch_script(tmp_path, runs: int, fail_run: str = "") -> list[str]:
    """The rendered sbatch script, run by bash with srun and scontrol faked: the steps it ran, in order."""
    import dataclasses

    from mlperf_logging.mllog import constants as C

    profile = profiles.load("local-cpu")
    profile = dataclasses.replace(profile, slurm=dataclasses.replace(profile.slurm, flush_page_cache="true"))
    spec = JobSpec("resnet", nodes=2, runs=runs, out_dir=tmp_path / "run", profile=profile).resolved()
    script = get_launcher("slurm").render(spec).text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable, run_stop=C.RUN_STOP))
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node1\n")
    for fake in bin_dir.iterdir():
        fake.chmod(0o755)
    steps = tmp_path / "steps"
    steps.unlink(missing_ok=True)
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1",
                               "STEPS": str(steps), "FAIL_RUN": fail_run})
    assert done.returncode == (1 if fail_run else 0), done.stderr
    return steps.read_text().splitlines()


def test_each_run_is_a_step_of_its_own_after_its_own_host_flush(tmp_path):
    """As NVIDIA's run.sub loops over its experiments (a host-side DROPCACHE_CMD srun, then that run's srun), the
    batch script flushes on the host before every run, not once per job: each run's step finds the record of its
    own flush. A failed run ends the loop (the decide step follows, as before); a requeued job goes on at the
    first run without run_stop, with a flush of its own, and does not redo the finished ones."""
    assert _run_the_batch_script(tmp_path, runs=3) == [
        "flush", "train 0 ['flushed']", "flush", "train 1 ['flushed']", "flush", "train 2 ['flushed']", "decide"]
    (tmp_path / "run" / "result_2.txt").unlink()  # as if run 2 had failed and the job was requeued
    (tmp_path / "run" / "page_cache" / "stale").write_text("flushed")  # an earlier step's record is no flush of this one
    assert _run_the_batch_script(tmp_path, runs=3) == ["flush", "train 2 ['flushed']", "decide"]
    for result in (tmp_path / "run").glob("result_*.txt"):
        result.unlink()
    assert _run_the_batch_script(tmp_path, runs=3, fail_run="1") == [
        "flush", "train 0 ['flushed']", "flush", "train 1 ['flushed']", "decide"]


def test_torchrun_passes_the_run_to_the_workers():
    """torchrun's own parser reads the training step's words: the worker's --last-run reaches the workers intact
    (a bare `--run` is a prefix of torchrun's --run-path, which argparse refuses as ambiguous before the script)."""
    from torch.distributed.run import get_args_parser

    script = get_launcher("slurm").render(JobSpec("resnet", nodes=2, runs=3).resolved()).text
    train = next(line for line in script.splitlines() if "--rdzv-endpoint" in line)
    words = shlex.split(train.split(" || ")[0])
    args = get_args_parser().parse_args(words[words.index("--") + 1:])
    assert args.training_script == "workloads" and args.training_script_args[-2:] == ["--last-run", "${run}"]


def test_gres_and_overrides(tmp_path):
    result = harness("run", "resnet", "--backend", "slurm", "--profile", "h100-ib", "--nodes", "2",
                     "--set", "slurm.use_gres=true", "--set", "slurm.account=mlperf", "--set", "env.NCCL_DEBUG=WARN",
                     "--out", str(tmp_path), "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "#SBATCH --gres=gpu:8" in lines and "#SBATCH --account=mlperf" in lines
    assert "export NCCL_DEBUG=WARN" in lines


@pytest.mark.parametrize("name", ["x$(touch pwned)", "a'b", 'a"b', "a\nb", "UPPER", "-lead", "x" * 41])
def test_hostile_job_names_are_refused(tmp_path, name):
    result = harness("run", "resnet", "--backend", "slurm", f"--name={name}", "--out", str(tmp_path), "--dry-run")
    assert result.returncode == 2 and "RFC 1123" in result.stderr and "Traceback" not in result.stderr


def test_values_reach_the_shell_quoted(tmp_path):
    """Everything user-supplied in a shell line is one quoted word: bash sees no command substitution."""
    spec = JobSpec("resnet", nodes=2, out_dir=tmp_path / "o", submitter="a'b\"c $(touch pwned)",
                   env={"EVIL": "$(touch pwned); `touch pwned`"}).resolved()
    script = get_launcher("slurm").render(spec).text
    # bash -n parses the script; then run just its export and srun words through bash with srun echoing.
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    body = (script.replace("srun ", "printf '%s\\n' ").replace("scontrol", "true")
            .replace('exit "$(( decision', ': "$(( decision'))  # run on to the final printf
    out = subprocess.run(["bash", "-c", body + 'printf "%s\\n" "$EVIL"'], cwd=tmp_path, capture_output=True,
                         text=True, env={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "PATH": "/usr/bin:/bin"})
    words = out.stdout.splitlines()
    assert "a'b\"c $(touch pwned)" in words and "$(touch pwned); `touch pwned`" in words
    assert "--rdzv-id=7-0" in words  # the job's first run
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("usable, verdict", [("4\n", None), ("1\n2\n", None), ("2\n", "has 2 usable"),
                                            ("", "has 0 usable")])
def test_a_requeued_job_pending_on_busy_nodes_waits_and_one_without_enough_nodes_is_given_up(monkeypatch, usable,
                                                                                            verdict):
    """ReqNodeNotAvail is routine on a busy partition: only fewer usable nodes than the job needs end it."""
    import harness.launchers.slurm as slurm

    answers = {"scontrol": "JobId=7 Restarts=1 Reason=ReqNodeNotAvail,_UnavailableNodes:node3 NumNodes=3-3 "
                           "Partition=gpu", "sinfo": usable}
    monkeypatch.setattr(slurm, "_run", lambda argv: subprocess.CompletedProcess(argv, 0, answers[argv[0]], ""))
    unfit = get_launcher("slurm")._cannot_fit("7")
    if verdict is None:
        assert unfit is None
    else:
        assert verdict in unfit and "needs 3 node(s)" in unfit and "ReqNodeNotAvail" in unfit


def _slurm_answers(monkeypatch, answers: dict[str, tuple[int, str, str]]) -> None:
    """Slurm's client commands, answered from `answers` ({command: (exit code, stdout, stderr)}): no cluster."""
    import harness.launchers.slurm as slurm

    monkeypatch.setattr(slurm, "_run", lambda argv: subprocess.CompletedProcess(argv, *answers[argv[0]]))


def test_a_scancel_slurm_refuses_is_said_and_records_no_cancel(monkeypatch, tmp_path):
    """A cancel is recorded only once Slurm took it: a refused scancel (another user's job, a controller that is
    down) says why in one line and leaves the job's state as it was, not a CANCELLED that nothing corrects."""
    from harness.launchers import Handle

    (tmp_path / "job.json").write_text(json.dumps({"backend": "slurm", "job_id": "7", "state": "RUNNING"}))
    _slurm_answers(monkeypatch, {"squeue": (0, "RUNNING\n", ""),
                                 "scancel": (1, "", "scancel: error: Kill job error on job id 7: Access/permission "
                                                    "denied\n")})
    handle = Handle.load(tmp_path)
    with pytest.raises(HarnessError, match="scancel 7 failed, the job is not cancelled: .*permission denied$"):
        get_launcher("slurm").cancel(handle)
    assert handle.record()["state"] == "RUNNING"


def test_a_slurm_cancel_whose_record_cannot_be_written_is_said_after_the_scancel(monkeypatch, tmp_path, capsys):
    """Slurm took the cancel; the run folder is a teammate's (not ours to write): one warning line, no traceback."""
    import errno

    from harness.launchers import Handle, base

    (tmp_path / "job.json").write_text(json.dumps({"backend": "slurm", "job_id": "7", "state": "RUNNING"}))
    _slurm_answers(monkeypatch, {"squeue": (0, "RUNNING\n", ""), "scancel": (0, "", "")})

    def not_ours(path, text):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(base, "replace_whole", not_ours)
    get_launcher("slurm").cancel(Handle.load(tmp_path))
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "cannot record in" in warning and "the cancel goes on" in warning, warning


def test_a_slurm_poll_that_crosses_a_cancel_answers_the_recorded_cancel(monkeypatch, tmp_path):
    """`harness cancel` in another shell records CANCELLED while `harness run`'s poll reads the job's end from
    Slurm: the poll answers CANCELLED, as job.json says, with the facts it read."""
    from harness.launchers import Handle

    (tmp_path / "job.json").write_text(json.dumps({"backend": "slurm", "job_id": "7", "state": "RUNNING"}))
    handle = Handle.load(tmp_path)
    launcher = get_launcher("slurm")

    def read_as_the_cancel_lands(job_id):
        handle.update(state=JobState.CANCELLED.value)
        return "FAILED"

    monkeypatch.setattr(launcher, "_slurm_state", read_as_the_cancel_lands)
    monkeypatch.setattr(launcher, "_exit_code", lambda job_id: 143)
    assert launcher.status(handle) is JobState.CANCELLED
    assert (handle.record()["state"], handle.record()["exit_code"]) == ("CANCELLED", 143)


@pytest.mark.slurm
def test_tiny_resnet_across_two_slurm_nodes(slurm_cluster, tmp_path):
    out = tmp_path / "run"
    result = harness("run", "resnet", "--backend", "slurm", "--nodes", "2", "--out", str(out),
                     "--submitter", "it's $(not) run", *slurm_cluster.run_args, env=slurm_cluster.env)
    assert result.returncode == 0, result.stdout + result.stderr + slurm_cluster.logs()
    assert "time-to-train (min)" in result.stdout and "RUNNING" in result.stdout
    run = parse_file(out / "result_0.txt")
    assert run.status == "success" and run.submitter == "it's $(not) run"
    assert compliance(out / "result_0.txt", "4.0.0", cwd=tmp_path).returncode == 0
    # One rank on each slurmd: the job ran on node1 and node2, a world of two.
    job_id = re.search(r"job (\d+)", result.stdout).group(1)
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", **slurm_cluster.env}).stdout
    assert "NodeList=node[1-2]" in shown and "NumNodes=2" in shown and "JobState=COMPLETED" in shown
    logs = harness("logs", str(out)).stdout
    assert "rank 0/2" in logs and "rank 1/2" in logs and f"slurm-{job_id}.out" in logs
    # One rank's files alone, followed to the job's end (read from Slurm: it has ended), and a rank it lacks.
    one = harness("logs", str(out), "--follow", "--rank", "1", env=slurm_cluster.env)
    assert one.returncode == 0 and one.stdout.startswith("==> rank_1.log <==\n"), one.stderr
    assert "rank 1/2" in one.stdout and "rank 0/2" not in one.stdout and "slurm-" not in one.stdout
    zero = harness("logs", str(out), "--rank", "0", "--tail", "1").stdout
    assert zero.startswith(f"==> slurm-{job_id}.out <==\n") and zero.count("\n") == 4  # two headers, two lines
    refused = harness("logs", str(out), "--rank", "2")
    assert refused.stderr == f"harness: error: --rank 2: job {job_id} has ranks 0-1\n"
    assert (out / "job.sbatch").read_text().startswith("#!/bin/bash")


@pytest.mark.slurm
def test_cancel_a_running_slurm_job(slurm_cluster, tmp_path, monkeypatch):
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    launcher = get_launcher("slurm")
    profile = profiles.apply_overrides(profiles.load("local-cpu"), slurm_cluster.overrides)
    spec = JobSpec("resnet", nodes=2, runs=3, out_dir=tmp_path / "job", profile=profile)
    handle = launcher.submit(launcher.render(spec.resolved()))
    states = []
    for state in launcher.watch(handle, poll_s=0.5):
        states.append(state)
        if state is JobState.RUNNING:
            break
    assert states[-1] is JobState.RUNNING
    launcher.cancel(handle)
    assert launcher.status(handle) is JobState.CANCELLED
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and subprocess.run(["squeue", "-h", "-j", handle.job_id], capture_output=True,
                                                         text=True).stdout.strip():
        time.sleep(0.5)
    assert not subprocess.run(["squeue", "-h", "-j", handle.job_id], capture_output=True, text=True).stdout.strip()
    assert get_launcher("slurm").status(handle) is JobState.CANCELLED  # as another shell would see it


@pytest.mark.slurm
def test_a_stopped_test_cluster_leaves_no_job_running(tmp_path):
    """A failed test can leave its job running, and slurmd leaves its jobs' steps running when it stops: the test
    cluster cancels what is left before it stops, so nothing of it outlives the session (a cluster of its own
    here, so that the session's is not stopped). Its root is deep, and its jobs still run."""
    import uuid

    from tests.slurm_cluster import SlurmCluster, unavailable

    if why := unavailable():
        pytest.skip(why)
    marker = f"harness-test-{uuid.uuid4().hex}"  # in the job's command line, to find its process by

    def running() -> list[str]:
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if marker.encode() in cmdline.read_bytes():
                    found.append(cmdline.parent.name)
            except OSError:
                continue  # gone meanwhile
        return found

    # Deeper than any pytest folder: the cluster's sockets must not live under its root (a socket's path holds
    # at most 107 bytes; on CI a job's step socket under pytest's folder came to 109 and the job failed).
    root = tmp_path.joinpath(*["a-deep-folder"] * 8) / "slurm"
    cluster = SlurmCluster(root).start()
    try:
        wrap = f"exec {shlex.quote(sys.executable)} -c 'import time; time.sleep(600)' {marker}"
        submitted = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/job-%j.out", "--wrap", wrap],
                                   capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **cluster.env},
                                   timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        deadline = time.monotonic() + 120
        while not running() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert running(), cluster.logs()
    finally:
        cluster.stop()
    assert not running()


def _slurm(slurm_cluster, *argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin:/usr/sbin", **slurm_cluster.env}).stdout


class _Admin(threading.Thread):
    """Beside a running `harness run`: calls `on_step(step)` with the step the run has reached until it
    returns True (here: to set a node DOWN mid-run)."""

    def __init__(self, out, on_step):
        super().__init__(daemon=True)
        self.out, self.on_step, self.stopped = out, on_step, False

    def run(self):
        while not self.stopped and self.on_step:
            steps = [r.get("steps") for r in read_json_lines(self.out / "run_0.jsonl")]
            if self.on_step(max((s[-1] for s in steps if s), default=0)):
                return
            time.sleep(0.3)


def _run_with_admin(slurm_cluster, out, *args, on_step=None):
    admin = _Admin(out, on_step)
    admin.start()
    try:
        return harness("run", "resnet", "--backend", "slurm", "--out", str(out), *args, *slurm_cluster.run_args,
                       env=slurm_cluster.env)
    finally:
        admin.stopped = True
        admin.join()


# The first attempt hangs at HANG_STEP (--inject-failure 0:HANG_STEP:hang), so a test acts on a job that
# is still running however fast the machine trains, and the requeued attempt (which injects nothing) finishes.
HANG_STEP = 8


def _down_when_hung(slurm_cluster, downed: list, node: str | None = None):
    """An on_step callback: once the job hangs at HANG_STEP, set `node` (default: the node it runs on) DOWN."""

    def act(step: int) -> bool:
        if step < HANG_STEP:
            return False
        name = node or _slurm(slurm_cluster, "squeue", "-h", "-o", "%N").split()[0]
        _slurm(slurm_cluster, "scontrol", "update", f"nodename={name}", "state=down", "reason=harness-test")
        downed.append(name)
        return True

    return act


def _resume(slurm_cluster, nodes: list) -> None:
    for node in nodes:
        _slurm(slurm_cluster, "scontrol", "update", f"nodename={node}", "state=resume")


def _attempt_ends(out):
    lines = (out / "attempts.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "end"]


@pytest.mark.slurm
def test_a_killed_rank_requeues_the_job_and_it_finishes(slurm_cluster, tmp_path):
    out = tmp_path / "run"
    result = _run_with_admin(slurm_cluster, out, "--nodes", "2", "--inject-failure", "1:10", "--checkpoint-every", "5",
                             "--max-steps", "20")
    job = json.loads((out / "job.json").read_text())
    assert job["state"] == "SUCCEEDED", result.stdout + result.stderr + slurm_cluster.logs()
    assert "Restarts=1" in _slurm(slurm_cluster, "scontrol", "show", "job", job["job_id"])  # Slurm's own count
    ends = _attempt_ends(out)
    assert {r["attempt"] for r in ends if not r["ok"]} == {0} and ends[-1]["ok"] and ends[-1]["attempt"] == 1
    assert "PENDING" in result.stdout  # the requeue, as `harness run` watched it
    # Each node wrote its own attempts file; each rank but 0 its own output file, not the job's one file.
    assert sorted(p.stem for p in (out / "attempts").glob("*.jsonl")) == ["node1", "node2"]
    assert (out / "logs" / "rank_1.out").is_file() and not (out / "logs" / "rank_0.out").exists()
    text = (out / "result_0.txt").read_text()
    assert text.count('"key": "run_start"') == 1 and text.count('"key": "run_stop"') == 1
    assert compliance(out / "result_0.txt", "4.0.0", cwd=tmp_path).returncode == 0


@pytest.mark.slurm
def test_a_node_set_down_requeues_the_job_onto_the_other_node(slurm_cluster, tmp_path):
    out = tmp_path / "run"
    downed = []
    try:
        result = _run_with_admin(slurm_cluster, out, "--nodes", "1", "--checkpoint-every", "4", "--max-steps", "16",
                                 "--inject-failure", f"0:{HANG_STEP}:hang", on_step=_down_when_hung(slurm_cluster, downed))
    finally:
        _resume(slurm_cluster, downed)
    job = json.loads((out / "job.json").read_text())
    assert downed and job["state"] == "SUCCEEDED", result.stdout + result.stderr + slurm_cluster.logs()
    shown = _slurm(slurm_cluster, "scontrol", "show", "job", job["job_id"])
    assert "Restarts=1" in shown and f"NodeList={downed[0]}" not in shown  # it finished on the other node
    text = (out / "result_0.txt").read_text()
    assert text.count('"key": "run_start"') == 1 and text.count('"key": "run_stop"') == 1


@pytest.mark.slurm
def test_a_requeued_job_that_no_longer_fits_fails_with_the_reason(slurm_cluster, tmp_path):
    out = tmp_path / "run"
    downed = []
    try:
        result = _run_with_admin(slurm_cluster, out, "--nodes", "2", "--checkpoint-every", "4", "--max-steps", "16",
                                 "--inject-failure", f"0:{HANG_STEP}:hang",
                                 on_step=_down_when_hung(slurm_cluster, downed, node="node2"))
    finally:
        _resume(slurm_cluster, downed)
    assert downed and result.returncode == 1, result.stdout + result.stderr
    assert "was requeued after a failure but cannot start again: it needs 2 node(s)" in result.stderr
    assert "has 1 usable" in result.stderr and "Traceback" not in result.stderr
    assert json.loads((out / "job.json").read_text())["state"] == "FAILED"
    assert any((out / "checkpoints" / "run_0").glob("step_*"))  # kept for a rerun


@pytest.mark.slurm
def test_a_slurm_job_lists_metrics_targets_that_answer(slurm_cluster, tmp_path):
    """Each node agent adds its host:port to the run folder's prometheus-targets/ (the glob Prometheus' file_sd
    reads: the merged prometheus-targets.json may lack a node when both agents write it at once); every address
    answers."""
    out = tmp_path / "run"
    answered: dict[str, bool] = {}

    def scrape(step: int) -> bool:
        if step < HANG_STEP:
            return False
        try:
            groups = [g for path in sorted((out / "prometheus-targets").glob("*.json"))
                      for g in json.loads(path.read_text())]
        except (OSError, ValueError):
            return False
        for group in groups:
            for target in group["targets"]:
                try:
                    body = urllib.request.urlopen(f"http://{target}/metrics", timeout=5).read().decode()
                except OSError:
                    continue
                answered[group["labels"]["node"]] = f'node="{group["labels"]["node"]}"' in body
        if len(answered) < 2:
            return False
        _slurm(slurm_cluster, "scancel", json.loads((out / "job.json").read_text())["job_id"])  # it hangs
        return True

    result = _run_with_admin(slurm_cluster, out, "--nodes", "2", "--max-steps", "16", "--metrics-port", "9460",
                             "--inject-failure", f"0:{HANG_STEP}:hang", on_step=scrape)
    assert "Traceback" not in result.stderr, result.stderr
    assert answered == {"node1": True, "node2": True}, (answered, result.stdout + result.stderr + slurm_cluster.logs())
    assert json.loads((out / "job.json").read_text())["state"] == "CANCELLED"


@pytest.mark.slurm
def test_preflight_on_both_slurm_nodes(slurm_cluster, tmp_path):
    out = tmp_path / "check"
    result = harness("preflight", "--backend", "slurm", "--nodes", "2", "--out", str(out), *slurm_cluster.run_args,
                     env=slurm_cluster.env)
    assert result.returncode == 0, result.stdout + result.stderr + slurm_cluster.logs()
    record = json.loads((out / "preflight.json").read_text())
    assert record["passed"] and record["kept"] == ["node1", "node2"]
    # The judge timed the whole from the batch script's stamp (launches included), each node its own checks.
    assert record["seconds"] > max(record["nodes"][node]["seconds"] for node in ("node1", "node2")) > 0
    for node in ("node1", "node2"):
        names = {c["name"] for c in record["nodes"][node]["checks"]}
        assert {"allreduce_busbw", "pair_busbw", "shared_fs_rw", "gpu_count"} <= names
        assert re.search(rf"^{node}\s+pair_busbw\s+rank 0: median with node\d .* pass$", result.stdout, re.M)
        assert re.search(rf"^{node}\s+gpu_count\s.*skipped: no GPU$", result.stdout, re.M)


@pytest.mark.slurm
def test_a_spare_replaces_a_node_that_fails_preflight_and_the_bad_one_is_drained(slurm_cluster, tmp_path):
    out = tmp_path / "run"
    try:
        result = harness("run", "resnet", "--backend", "slurm", "--nodes", "1", "--spare-nodes", "1", "--preflight",
                         "--drain-bad-nodes", "--max-steps", "2", "--out", str(out),
                         "--env", "HARNESS_PREFLIGHT_FAULT=node2:allreduce_busbw:0.001", *slurm_cluster.run_args,
                         env=slurm_cluster.env)
        drained = _slurm(slurm_cluster, "sinfo", "-R", "-h", "-o", "%N|%E")
    finally:
        _resume(slurm_cluster, ["node2"])
    job = json.loads((out / "job.json").read_text())
    assert job["state"] == "SUCCEEDED", result.stdout + result.stderr + slurm_cluster.logs()
    record = json.loads((out / "preflight.json").read_text())
    assert record["kept"] == ["node1"] and list(record["excluded"]) == ["node2"]
    [why] = record["excluded"]["node2"]
    assert why.startswith("allreduce_busbw ") and why.endswith(" GB/s < 0.005 (2 CPU processes, 4 MiB)")
    assert f"node2|harness preflight: {why}" in drained.splitlines()
    # Trained on node1 alone; the table, the JSON and the report say the same about node2.
    assert sorted(p.stem for p in (out / "attempts").glob("*.jsonl")) == ["node1"]
    [failed] = [c for c in record["nodes"]["node2"]["checks"] if c["verdict"] == "fail"]
    assert re.search(rf"^node2\s+allreduce_busbw\s.*{failed['measured']} GB/s\s+>= 0.005\s+fail$", result.stdout, re.M)
    report = harness("report", str(out))
    assert f"preflight: kept out node2: {why}" in report.stdout
    assert f"preflight: node2 drained: harness preflight: {why}" in report.stdout
    assert json.loads(harness("report", str(out), "--format", "json").stdout)[0]["runs"][0]["badput"]["preflight"] > 0


@pytest.mark.slurm
def test_the_host_flush_step_runs_on_every_node_of_a_real_cluster(slurm_cluster, tmp_path):
    """The rendered flush step, alone in a batch job on both nodes: each node leaves its record, either flushed
    or the reason it could not (this cluster's nodes share one host, so they share one record name)."""
    from harness.cache_flush import slurm_flush_lines

    profile = profiles.load("local-cpu")
    spec = JobSpec(benchmark="resnet", nodes=2, out_dir=tmp_path / "run", profile=profile)
    script = tmp_path / "flush.sbatch"
    script.write_text("\n".join(["#!/bin/bash", "#SBATCH --nodes=2", f"#SBATCH --output={tmp_path}/flush-%j.out",
                                 "set -euo pipefail", *slurm_flush_lines(spec, None), ""]))
    done = subprocess.run(["sbatch", "--wait", str(script)], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", **slurm_cluster.env})
    assert done.returncode == 0, done.stdout + done.stderr + slurm_cluster.logs()
    records = list((tmp_path / "run" / "page_cache").iterdir())
    assert records, slurm_cluster.logs()
    for record in records:
        text = record.read_text().strip()
        assert text == "flushed" or text.startswith("host flush failed (sync && echo 3 > /proc/sys/vm/drop_caches): ")


@pytest.mark.slurm
def test_each_run_of_a_campaign_is_flushed_by_its_own_host_step_on_a_real_cluster(slurm_cluster, tmp_path):
    """Two runs in one job: each run's workers find the record of a host-side flush made for that run, so no run
    needs to flush from inside (where a rootless container cannot, and a closed run would stop). The profile's flush
    command here is harmless (the shared test machine keeps its cache) and counts itself."""
    out, flushes = tmp_path / "run", tmp_path / "flushes"
    result = harness("run", "resnet", "--backend", "slurm", "--nodes", "1", "--runs", "2", "--max-steps", "1",
                     "--seed", "1", "--out", str(out), "--set", f"slurm.flush_page_cache=echo done >> {flushes}",
                     *slurm_cluster.run_args, env=slurm_cluster.env)
    job = json.loads((out / "job.json").read_text())  # (one step is too short to reach the target: exit 1)
    assert job["state"] == "SUCCEEDED", result.stdout + result.stderr + slurm_cluster.logs()
    assert flushes.read_text().splitlines() == ["done", "done"]  # one host step per run, no requeue
    for run in range(2):
        [noted] = [r for r in read_json_lines(out / f"run_{run}.jsonl") if r.get("kind") == "cache_clear"]
        assert noted["cleared"] is True and noted["by"] == ["host"], (run, noted)
        assert logged_run(out / f"result_{run}.txt").stopped  # each run went to its run_stop
