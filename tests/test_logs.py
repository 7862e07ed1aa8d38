"""`harness logs RUN` with --rank, --tail and --follow, on run folders written here (each rank's files and a job.json
as `harness run` leaves them) and on a real tiny local job; Kubernetes' pods are in tests/test_kubernetes.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


from harness.launchers import Handle, JobState, follow, get_launcher
from harness.launchers.base import last_lines_start
from harness.spec import JobSpec
from tests.conftest import REPO, harness


def running_agent() -> subprocess.Popen:
    """A process that passes for a local job's node agent (its command names harness.agent), running until killed."""
    agent = subprocess.Popen([sys.executable, "-c", "print(); import time; time.sleep(600)", "harness.agent"],
                             stdout=subprocess.PIPE)
    agent.stdout.readline()  # it runs its own command (before, /proc shows this process's, forked)
    return agent


def run_folder(tmp_path: Path, backend: str = "local", nodes: int = 1, procs: int = 4, job_id: str | None = None,
               state: JobState = JobState.SUCCEEDED) -> Handle:
    """A run folder as `harness run` leaves one: job.json with the rendered request (which says the job's ranks),
    and each rank's log, three lines, the last saying which rank wrote it. A local job's id, unless given, is a pid
    that is no job's (a child already reaped), so its state is the recorded one."""
    spec = JobSpec("resnet", nodes=nodes, procs_per_node=procs, batch_size=8,  # a global batch LARS's table covers
                   out_dir=tmp_path / "run").resolved()
    request = get_launcher(backend).render(spec)
    if job_id is None:
        child = subprocess.Popen(["true"])
        child.wait()
        job_id = str(child.pid)
    handle = Handle(backend, job_id, spec.out_dir)
    (spec.out_dir / "logs").mkdir(parents=True)
    handle.save(request, state=state.value)
    for rank in range(nodes * procs):
        (spec.out_dir / "logs" / f"rank_{rank}.log").write_text(f"rank {rank} started\nrank {rank} step 1\n"
                                                                 f"rank {rank} done\n")
    return handle


def test_the_last_lines_of_a_text_are_found_from_its_end():
    assert last_lines_start("a\nb\nc\n", 2) == 2 and last_lines_start("a\nb\nc", 2) == 2
    assert last_lines_start("a\nb\n", 5) == 0 and last_lines_start(b"a\nb\n", 5, whole=False) is None
    assert last_lines_start("a\nb\n", 0) == 4


def test_one_rank_of_512_and_its_last_lines(tmp_path):
    """A job of 512 ranks (64 nodes x 8 on Slurm): --rank shows that rank's files alone, --tail each file's last
    lines; a rank the job does not have is refused in one line naming those it has."""
    handle = run_folder(tmp_path, backend="slurm", nodes=64, procs=8, job_id="4242")
    run = str(handle.out_dir)
    (handle.out_dir / "slurm-4242.out").write_text("agent node0: started\nrank 0 progress: step 1\n")
    (handle.out_dir / "logs" / "rank_300.out").write_text("rank 300's own console\n")
    one = harness("logs", run, "--rank", "300", "--tail", "1")
    assert one.returncode == 0, one.stderr
    assert one.stdout == "==> rank_300.log <==\nrank 300 done\n==> rank_300.out <==\nrank 300's own console\n"
    zero = harness("logs", run, "--rank", "0")
    assert zero.stdout.startswith("==> slurm-4242.out <==\nagent node0: started\n") and "rank 0 started" in zero.stdout
    assert "rank 1 " not in zero.stdout and "rank 10 " not in zero.stdout
    every = harness("logs", run, "--tail", "1")
    assert every.stdout.count("==> rank_") == 513 and every.stdout.count(" done\n") == 512
    assert "started" not in every.stdout and every.stdout.index("rank_9.log") < every.stdout.index("rank_10.log")
    refused = harness("logs", run, "--rank", "512")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr == "harness: error: --rank 512: job 4242 has ranks 0-511\n"
    negative = harness("logs", run, "--tail", "-1")
    assert negative.returncode == 2 and "--tail: expected a whole number, 0 or more, got '-1'" in negative.stderr


def test_without_a_recorded_request_the_ranks_are_those_with_files(tmp_path):
    """A job that trains nothing (a health job) names no --nproc-per-node: the ranks there are, are its files."""
    handle = run_folder(tmp_path, procs=4)
    handle.update(request="python -m harness.health --out run")
    (handle.out_dir / "logs" / "rank_2.log").unlink()
    refused = harness("logs", str(handle.out_dir), "--rank", "2")
    assert refused.stderr.endswith(f"--rank 2: job {handle.job_id} has ranks 0-1, 3\n")


def test_follow_yields_what_the_logs_gain_until_the_job_ends(tmp_path):
    """Driven a poll at a time (the generator sleeps only between polls): the last lines first, then each rank's
    new whole lines under its header, a line still being written at the next poll, and everything once the job
    ended, then the end. A rank's file that appears later is followed from its start."""
    agent = running_agent()
    try:
        _follow_a_poll_at_a_time(run_folder(tmp_path, procs=2, job_id=str(agent.pid), state=JobState.RUNNING), agent)
    finally:
        agent.kill()
        agent.wait()


def _follow_a_poll_at_a_time(handle: Handle, agent: subprocess.Popen) -> None:
    logs = handle.out_dir / "logs"
    (logs / "rank_1.log").unlink()
    chunks = follow(get_launcher("local"), handle, tail=1, poll_s=0)
    assert next(chunks) == "==> rank_0.log <==\nrank 0 done\n"
    with open(logs / "rank_0.log", "a") as f:
        f.write("rank 0 step 2\nrank 0 half a li")
    (logs / "rank_1.log").write_text("rank 1 started\nrank 1 step 1\n")
    assert next(chunks) == "rank 0 step 2\n"  # the same source: no header again
    assert next(chunks) == "\n==> rank_1.log <==\nrank 1 started\nrank 1 step 1\n"
    with open(logs / "rank_0.log", "a") as f:
        f.write("ne\nrank 0 last words, unended")
    handle.update(state=JobState.SUCCEEDED.value)  # as its `harness run` records the end
    agent.kill()
    agent.wait()
    assert list(chunks) == ["\n==> rank_0.log <==\nrank 0 half a line\nrank 0 last words, unended"]


def test_follow_of_one_rank_and_of_a_rank_that_is_not_there(tmp_path):
    handle = run_folder(tmp_path, procs=4)
    assert list(follow(get_launcher("local"), handle, rank=3)) == [
        "==> rank_3.log <==\nrank 3 started\nrank 3 step 1\nrank 3 done\n"]
    refused = harness("logs", str(handle.out_dir), "--follow", "--rank", "4")
    assert refused.returncode == 2
    assert refused.stderr == f"harness: error: --rank 4: job {handle.job_id} has ranks 0-3\n"


def test_follow_a_real_tiny_job_to_its_end(tmp_path):
    """`harness logs --follow` beside the `harness run` that started the job ends by itself once the job has
    ended, with the rank's last line."""
    out = tmp_path / "run"
    run = subprocess.Popen([sys.executable, "-m", "harness", "run", "resnet", "--procs-per-node", "2", "--runs", "1",
                            "--max-steps", "2", "--out", str(out)], cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "job.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        followed = harness("logs", str(out), "--follow", "--rank", "1", timeout=300)
        run.wait(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout.startswith("==> rank_1.log <==\n") and "==> rank_0" not in followed.stdout
    assert followed.stdout.rstrip().endswith(f"rank 1 INFO run 1/1: aborted -> {out / 'result_0.txt'}")
    assert Handle.load(out).record()["state"] == JobState.SUCCEEDED.value


def test_ctrl_c_stops_following_a_running_job_with_130(tmp_path):
    agent = running_agent()
    handle = run_folder(tmp_path, procs=2, job_id=str(agent.pid), state=JobState.RUNNING)
    proc = subprocess.Popen([sys.executable, "-m", "harness", "logs", str(handle.out_dir), "--follow"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline()]
        while lines[-1] not in ("rank 1 done\n", ""):  # the logs so far are out: it follows the running job
            lines.append(proc.stdout.readline())
        proc.send_signal(signal.SIGINT)
        rest, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        agent.kill()
        agent.wait()
    assert lines[0] == "==> rank_0.log <==\n" and lines[-1] == "rank 1 done\n" and rest == ""
    assert proc.returncode == 130 and stderr == "", stderr
