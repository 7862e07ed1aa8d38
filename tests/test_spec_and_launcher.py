"""The job spec and the local launcher: what is rendered, and a real job's submit/watch/logs/cancel."""

from __future__ import annotations

import ast
import errno
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from harness.errors import HarnessError
from harness.launchers import Handle, JobState, get_launcher
from harness.launchers.base import agent_command
from workloads.common.requirements_check import AGENT_BOOTSTRAP
from harness.spec import JobSpec, parse_env, validate


def test_seeds_are_distinct_per_run():
    assert JobSpec("resnet", runs=3, seed=7).seeds() == [7, 8, 9]
    assert JobSpec("resnet", runs=2).seeds() == [None, None]  # each run draws its own


def test_worker_args_round_trip_through_the_worker_parser(tmp_path):
    from workloads.common.campaign import RunOptions

    spec = JobSpec("resnet", preset="full", runs=5, seed=1, out_dir=tmp_path, synthetic=True, max_steps=3,
                   batch_size=2, submitter="ACME", system="box").resolved()
    opts = RunOptions.parse(spec.worker_args())
    assert (opts.benchmark, opts.preset, opts.runs, opts.seed, opts.out) == ("resnet", "full", 5, 1, tmp_path)
    assert (opts.synthetic, opts.max_steps, opts.batch_size, opts.submitter, opts.system) == (True, 3, 2, "ACME", "box")
    assert opts.data is None and opts.division == "closed"


@pytest.mark.parametrize("argv, said", [
    (["llama31_8b", "--preset", "full"], "give --data PATH"),
    (["resnet", "--preset", "full"], "give --data PATH"),  # trained a closed ResNet-50 on the tiny images before
    (["gpt3", "--preset", "full", "--synthetic"], None),  # synthetic: no dataset, random weights
    (["gpt3", "--preset", "full", "--data", "/d"], "give --init-checkpoint DIR"),
    (["llama2_70b_lora", "--synthetic"], "also with --synthetic"),  # a LoRA needs its base even on tokens drawn
    (["llama2_70b_lora", "--preset", "huge"], "choose one of: tiny, full"),
    (["nosuchbench"], "invalid choice: 'nosuchbench'"),
])
def test_a_worker_started_by_hand_refuses_missing_inputs_before_anything_starts(argv, said, tmp_path):
    """`python -m workloads` checks what its preset needs on its command line, with the spec's own function
    (workloads.registry.missing_inputs): a refusal is one line, before a process group, a model or a log line
    (before, llama's full preset without --data was refused only once its model was built and run_start logged)."""
    from workloads.common.campaign import RunOptions

    argv = [*argv, "--out", str(tmp_path / "out")]
    if said is None:
        assert RunOptions.parse(argv).preset == "full"
        return
    with pytest.raises(SystemExit) as refused:
        RunOptions.parse(argv)
    assert isinstance(refused.value.code, str) and said in refused.value.code and "\n" not in refused.value.code
    assert refused.value.code.startswith("python -m workloads: error: ")


def test_the_spec_refuses_what_the_worker_would_for_the_same_reason():
    """One decision, both doors: a LoRA on synthetic tokens still needs its base, refused by `harness run` too."""
    with pytest.raises(HarnessError, match="fine-tunes pretrained weights.*also with --synthetic"):
        validate(JobSpec("llama2_70b_lora", synthetic=True))
    assert validate(JobSpec("llama2_70b_lora", synthetic=True), dry_run=True) == [
        "llama2_70b_lora fine-tunes pretrained weights: give --init-checkpoint DIR (a checkpoint `python -m "
        "workloads.decoder.convert` wrote from Hugging Face's), also with --synthetic"]


def test_command_line_and_job_json_round_trip_to_the_same_spec(tmp_path):
    from harness.cli import _spec_from_args, build_parser

    from harness import profiles

    profile = profiles.apply_overrides(profiles.load("h100-ib"), ["slurm.partition=gpu", "env.NCCL_DEBUG=INFO"])
    spec = JobSpec("resnet", preset="full", nodes=4, procs_per_node=8, runs=5, seed=3, out_dir=tmp_path / "o",
                   max_restarts=2, env={"NCCL_DEBUG": "INFO"}, synthetic=True, max_steps=9, batch_size=16,
                   submitter="ACME", system="box", name="rn50", profile=profile).resolved()
    args = build_parser().parse_args(spec.command_line("local")[1:])
    assert args.backend == "local" and _spec_from_args(args).resolved() == spec
    assert JobSpec.from_dict(spec.to_dict()) == spec


def test_default_out_dir_is_under_results_runs():
    spec = JobSpec("resnet").resolved()
    assert spec.out_dir.is_absolute()
    assert spec.out_dir.parent.parts[-2:] == ("results", "runs")
    assert spec.out_dir.name.startswith("resnet-tiny-")


class _Submitted(Exception):
    """What a fake launcher's submit raises: `harness run` got as far as submitting this request."""

    def __init__(self, request):
        super().__init__(str(request.spec.out_dir))
        self.request = request


def _submit_without_starting(monkeypatch, backend: str = "local") -> None:
    """`harness run` goes as far as submit; a submit raises _Submitted with the request it was given."""
    from harness import launchers

    launcher = launchers.get_launcher(backend)

    def submit(request):
        raise _Submitted(request)

    monkeypatch.setattr(launcher, "submit", submit)
    monkeypatch.setattr(launchers, "get_launcher", lambda name: launcher)


def _same_second(monkeypatch) -> str:
    """A clock stopped at one second, as two `harness run` started by a loop within it see it."""
    from datetime import datetime

    from harness import spec as spec_module

    class Stopped(datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 11, 24, 14, 30, 5)

    monkeypatch.setattr(spec_module, "datetime", Stopped)
    return "20261124-143005"


def test_two_runs_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    """A campaign script looping over seeds starts `harness run` without --out several times a second: each
    gets a folder of its own (the default name, then -2, -3, made by mkdir, which only one can win), and
    the request it submits names that folder. A dry run creates nothing."""
    from harness.cli import main

    monkeypatch.chdir(tmp_path)
    name = f"resnet-tiny-{_same_second(monkeypatch)}"
    _submit_without_starting(monkeypatch)
    runs = tmp_path / "results" / "runs"
    assert main(["run", "resnet", "--procs-per-node", "1", "--dry-run"]) == 0
    assert not runs.exists()
    submitted = []
    for seed in range(3):
        with pytest.raises(_Submitted) as got:
            main(["run", "resnet", "--procs-per-node", "1", "--seed", str(seed)])
        submitted.append(got.value.request)
    folders = [request.spec.out_dir for request in submitted]
    assert folders == [runs / name, runs / f"{name}-2", runs / f"{name}-3"]
    assert all(f"--out {folder} " in request.text for folder, request in zip(folders, submitted))
    assert sorted(p.name for p in runs.iterdir()) == [name, f"{name}-2", f"{name}-3"]


def test_two_preflights_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    """`harness preflight` without --out names its folder to the second too, and takes it the same way."""
    from harness.cli import main

    monkeypatch.chdir(tmp_path)
    name = f"preflight-{_same_second(monkeypatch)}"
    _submit_without_starting(monkeypatch)
    runs = tmp_path / "results" / "runs"
    assert main(["preflight", "--dry-run"]) == 0 and not runs.exists()
    submitted = []
    for _ in range(2):
        with pytest.raises(_Submitted) as got:
            main(["preflight"])
        submitted.append(got.value.request.spec.out_dir)
    assert submitted == [runs / name, runs / f"{name}-2"]


def test_a_preflight_without_out_writes_where_the_backends_runs_go(tmp_path, monkeypatch):
    """On Slurm, run folders go to the profile's results_dir (a file system every node mounts); a preflight's too,
    or its nodes would write their reports to a folder under the submitting shell's working folder."""
    from harness.cli import main

    monkeypatch.chdir(tmp_path)
    name = f"preflight-{_same_second(monkeypatch)}"
    _submit_without_starting(monkeypatch, "slurm")
    shared = tmp_path / "shared" / "runs"
    with pytest.raises(_Submitted) as got:
        main(["preflight", "--backend", "slurm", "--nodes", "2", "--set", f"slurm.results_dir={shared}"])
    assert got.value.request.spec.out_dir == shared / name and f"--out {shared / name} " in got.value.request.text
    assert not (tmp_path / "results").exists()


def test_an_explicit_out_is_used_as_given(tmp_path, monkeypatch):
    """--out names the folder: one that exists is used as it is (never renamed to -2), unless it holds results."""
    from harness.cli import main

    _same_second(monkeypatch)
    _submit_without_starting(monkeypatch)
    out = tmp_path / "mine"
    for _ in range(2):
        with pytest.raises(_Submitted) as got:
            main(["run", "resnet", "--procs-per-node", "1", "--out", str(out)])
        assert got.value.request.spec.out_dir == out
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]


def test_a_default_run_folder_that_cannot_be_made_is_one_line(tmp_path, monkeypatch, capsys):
    """A file where the runs folder should be (mkdir says it exists): `harness run` says so in one line, rather than
    trying -2, -3, ... forever."""
    from harness.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "runs").write_text("not a folder\n")
    assert main(["run", "resnet", "--procs-per-node", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "cannot create output folder" in err and "results/runs" in err
    assert (tmp_path / "results" / "runs").read_text() == "not a folder\n"


def test_env_parsing():
    assert parse_env(["A=1", "B_2=x=y"]) == {"A": "1", "B_2": "x=y"}
    with pytest.raises(HarnessError):
        parse_env(["=1"])


def test_validate_rejects_data_with_synthetic(tmp_path):
    with pytest.raises(HarnessError, match="exclude each other"):
        validate(JobSpec("resnet", data=tmp_path, synthetic=True))


def test_agent_command_standalone_and_rendezvous(tmp_path):
    spec = JobSpec("resnet", nodes=4, max_restarts=2, out_dir=tmp_path)
    local = agent_command(spec, "py", 2, restart_here=True)
    assert local[:3] == ["py", "-c", AGENT_BOOTSTRAP] and "--restart-here" in local
    assert local[local.index("--max-restarts") + 1] == "2" and local[local.index("--out") + 1] == str(tmp_path)
    torchrun = local[local.index("--") + 1:]  # what torchrun's own parser gets
    assert "--standalone" in torchrun and "--nproc-per-node=2" in torchrun
    assert torchrun[torchrun.index("-m") + 1] == "workloads"
    cluster = agent_command(spec, "py", 8, rendezvous="node0:29500", rdzv_id="job1")
    assert "--standalone" not in cluster and "--restart-here" not in cluster
    assert {"--nnodes=4", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500", "--rdzv-id=job1"} <= set(cluster)


def test_local_render_is_the_exact_command(tmp_path):
    spec = JobSpec("resnet", procs_per_node=2, out_dir=tmp_path, env={"FOO": "a b"}).resolved()
    request = get_launcher("local").render(spec)
    words = shlex.split(request.text)
    assert "FOO=a b" in words
    assert any(w.startswith("OMP_NUM_THREADS=") for w in words)  # CPU workers share the cores
    assert words[-len(request.payload["argv"]):] == request.payload["argv"]
    assert request.payload["argv"][0] == sys.executable


def test_the_local_gpu_count_asks_nvml_before_importing_torch(monkeypatch):
    """Without a driver, `harness run` does not pay torch's import (seconds) to learn there is no GPU; where NVML
    sees GPUs, torch counts the ones this process may use."""
    import subprocess

    import pynvml
    import torch

    from harness.launchers import local

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:  # no driver here: a fresh interpreter answers 0 without importing torch
        probe = "import sys; from harness.launchers.local import visible_gpus; print(visible_gpus(), 'torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
        assert out.split() == ["0", "False"]

    asked = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: asked.append(1) or 2)  # CUDA_VISIBLE_DEVICES=0,1
    assert local.visible_gpus() == 2 and asked
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 0)
    assert local.visible_gpus() == 0 and len(asked) == 1  # NVML's "none" is final: torch is not asked


def test_dry_run_prints_the_command_and_starts_nothing(tmp_path, capsys):
    from harness.cli import main

    out = tmp_path / "never"
    assert main(["run", "resnet", "--out", str(out), "--dry-run", "--procs-per-node", "2"]) == 0
    printed = capsys.readouterr().out
    assert "harness.agent" in printed and "--nproc-per-node=2" in printed and str(out) in printed
    assert not out.exists()


def _wait_for(predicate, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_submit_watch_logs_cancel_a_real_job(tmp_path):
    """Start a real tiny job, see it run, read its logs, cancel it: its agent and workers are gone."""
    launcher = get_launcher("local")
    spec = JobSpec("resnet", procs_per_node=2, out_dir=tmp_path / "job").resolved()
    request = launcher.render(spec)
    handle = launcher.submit(request)
    assert launcher.status(handle) is JobState.RUNNING
    assert Handle.load(spec.out_dir) == handle  # another process can find the job again
    # The ranks start independently, so either may write first: wait for both.
    assert _wait_for(lambda: all(f"rank {rank}/2" in launcher.logs(handle) for rank in (0, 1))), \
        launcher.logs(handle)
    assert "==> rank_0.log <==" in launcher.logs(handle) and "==> rank_1.log <==" in launcher.logs(handle)
    launcher.cancel(handle)
    state = launcher.status(handle)
    assert state is JobState.CANCELLED, (state, (spec.out_dir / "job.json").read_text(), launcher.logs(handle))
    # A fresh launcher (as in `harness cancel` from another shell) sees the recorded end state.
    assert get_launcher("local").status(handle) is JobState.CANCELLED
    assert not Path(f"/proc/{handle.job_id}").exists() or b"harness.agent" not in \
        Path(f"/proc/{handle.job_id}/cmdline").read_bytes()


FULL_DISK_UPDATE = """
import errno, os, resource, signal, sys
from pathlib import Path
from harness.errors import HarnessError
from harness.launchers import Handle
handle = Handle.load(Path(sys.argv[1]))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))
try:
    handle.update(state="SUCCEEDED", exit_code=0)
except HarnessError as exc:  # one line, naming job.json and the errno's words
    too_large = str(exc).endswith(f"job.json: {os.strerror(errno.EFBIG)}")
    sys.exit(0 if too_large and "\\n" not in str(exc) else f"failed otherwise: {exc}")
sys.exit("the write went through")
"""


def test_job_json_is_replaced_whole(tmp_path):
    """`harness logs`, `cancel` or `collect` in another shell read job.json while `harness run` records a state in
    it, and a write can fail half way (a results disk full of checkpoints): it is written aside and renamed over,
    so no reader sees half of it and a failed write keeps the record it had. It keeps the mode a plain write
    gives it (the umask's), so the rest of the team can still read it."""
    import json
    import subprocess

    folder = tmp_path / "job"
    folder.mkdir()
    path = folder / "job.json"
    path.write_text(json.dumps({"backend": "local", "job_id": "1", "state": "RUNNING"}, indent=2) + "\n")
    before, plain_mode = path.read_text(), path.stat().st_mode
    failed = subprocess.run([sys.executable, "-c", FULL_DISK_UPDATE, str(folder)], capture_output=True, text=True,
                            timeout=120)
    assert failed.returncode == 0, failed.stdout + failed.stderr
    # Nothing left aside; the writers' lock stays (removing it would race a writer waiting on it).
    assert path.read_text() == before and sorted(p.name for p in folder.iterdir()) == [".job.json.lock", "job.json"]
    Handle.load(folder).update(state="SUCCEEDED")
    assert Handle.load(folder).record()["state"] == "SUCCEEDED" and path.stat().st_mode == plain_mode


UPDATES_EACH = 300  # enough that, unlocked, two writers lose some of each other's updates on any machine


def _update_own_key(folder: Path, key: str, start, losses) -> None:
    """One `harness` process: UPDATES_EACH read-change-writes of its own key. Before each it checks that its last
    value is still there: a value gone is an update the other writer lost (overwritten from a stale copy)."""
    handle = Handle.load(folder)
    start.wait()
    lost = 0
    for value in range(UPDATES_EACH):
        lost += value > 0 and handle.record().get(key) != value - 1
        handle.update(**{key: value})
    losses[key] = lost


def _write_job(folder: Path, **fields) -> Path:
    import json

    folder.mkdir(exist_ok=True)
    path = folder / "job.json"
    path.write_text(json.dumps({"backend": "local", "job_id": "1", **fields}, indent=2) + "\n")
    return path


def test_two_processes_updating_job_json_lose_nothing(tmp_path):
    """`harness run` records states while `harness cancel` or `collect` in another shell records theirs: each
    update is read, changed and replaced under one lock across processes, so neither loses the other's fields."""
    import multiprocessing

    folder = tmp_path / "job"
    _write_job(folder, state="RUNNING")
    context = multiprocessing.get_context("spawn")  # not fork: a child forked beside torch's threads can hang
    start, losses = context.Barrier(2), context.Manager().dict()
    writers = [context.Process(target=_update_own_key, args=(folder, key, start, losses)) for key in ("run", "cancel")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=300)
    assert [writer.exitcode for writer in writers] == [0, 0]
    record = Handle.load(folder).record()
    assert dict(losses) == {"run": 0, "cancel": 0}
    assert (record["run"], record["cancel"], record["state"]) == (UPDATES_EACH - 1, UPDATES_EACH - 1, "RUNNING")


def test_a_recorded_cancel_is_not_replaced_by_a_state_read_before_it(tmp_path):
    """A status poll works out FAILED (the job died of the cancel's signal) from a record read just before
    `harness cancel` recorded CANCELLED in another shell: the cancel stays, the poll's other facts are kept."""
    _write_job(tmp_path, state="RUNNING")
    Handle.load(tmp_path).update(state="CANCELLED")
    written = Handle.load(tmp_path).update(state="FAILED", exit_code=-15)
    assert written == Handle.load(tmp_path).record()
    assert (written["state"], written["exit_code"]) == ("CANCELLED", -15)


def test_a_cancel_from_another_shell_while_the_run_reads_the_end_is_what_the_run_says(tmp_path):
    """`harness cancel` in another shell records CANCELLED just as `harness run`'s status poll works out how the
    job ended (its agent died of the cancel's SIGTERM): the poll answers CANCELLED, not FAILED, and keeps the
    exit code it saw."""
    from harness.launchers.local import LocalLauncher

    _write_job(tmp_path, state="RUNNING")

    class EndedByTheCancel:
        def poll(self):
            return -15

        @property
        def returncode(self):  # read after the poll read job.json: the other shell's cancel lands now
            Handle.load(tmp_path).update(state="CANCELLED")
            return -15

    launcher = LocalLauncher()
    launcher._procs["1"] = EndedByTheCancel()
    assert launcher.status(Handle.load(tmp_path)) is JobState.CANCELLED
    assert Handle.load(tmp_path).record()["exit_code"] == -15


def test_a_file_system_without_locks_still_records(tmp_path, monkeypatch, capsys):
    """NFS without its lock manager answers ENOLCK: the record is still written (unlocked, as before locks), and
    said once, not at each of a watch's status polls."""
    import errno

    from harness.launchers import base

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    _write_job(tmp_path, state="RUNNING")
    monkeypatch.setattr(base.fcntl, "lockf", no_locks)
    for poll in range(3):
        assert Handle.load(tmp_path).update(state="RUNNING", polls=poll)["polls"] == poll
    assert Handle.load(tmp_path).update(state="SUCCEEDED")["state"] == "SUCCEEDED"
    assert Handle.load(tmp_path).record()["state"] == "SUCCEEDED"
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "No locks available" in warning, warning


def _hold_job_lock(folder: Path, held, release) -> None:
    import fcntl

    with open(folder / ".job.json.lock", "a") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        held.set()
        release.wait()


def test_a_stuck_lock_holder_is_said_and_the_record_written_without_it(tmp_path, monkeypatch, capsys):
    """Readers (`harness status`, `logs`) never take the lock: job.json is replaced whole. A writer that waits
    past the limit for a holder (a stopped process, a crashed host's lock kept by the NFS server for its lease)
    says so in one line and records all the same: a `harness cancel` or a watch never stops for the lock."""
    import multiprocessing

    from harness.launchers import base

    _write_job(tmp_path, state="RUNNING")
    context = multiprocessing.get_context("spawn")  # not fork: a child forked beside torch's threads can hang
    held, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_job_lock, args=(tmp_path, held, release))
    holder.start()
    try:
        assert held.wait(timeout=120)
        assert Handle.load(tmp_path).record()["state"] == "RUNNING"
        monkeypatch.setattr(base, "LOCK_WAIT_S", 0.1)
        assert Handle.load(tmp_path).update(state="CANCELLED")["state"] == "CANCELLED"
        assert Handle.load(tmp_path).record()["state"] == "CANCELLED"
        warning = capsys.readouterr().err
        assert warning.count("\n") == 1 and "stayed locked" in warning and "without the lock" in warning, warning
    finally:
        release.set()
        holder.join(timeout=120)
    Handle.load(tmp_path).update(exit_code=-15)  # the holder gone, the lock is free again: no warning
    assert Handle.load(tmp_path).record()["exit_code"] == -15 and capsys.readouterr().err == ""


def test_a_lock_file_another_user_made_still_records(tmp_path, monkeypatch, capsys):
    """A teammate's `harness run` made .job.json.lock with its umask (0644): an operator's `harness cancel` may
    not open it (EACCES). It records anyway, written aside and renamed over as before locks, and says so."""
    from harness.launchers import base

    _write_job(tmp_path, state="RUNNING")
    lock, real_open = str(tmp_path / base.JOB_LOCK), os.open

    def not_ours(path, *args, **kwargs):
        if str(path) == lock:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(base.os, "open", not_ours)
    assert Handle.load(tmp_path).update(state="CANCELLED")["state"] == "CANCELLED"
    assert Handle.load(tmp_path).record()["state"] == "CANCELLED"
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "Permission denied" in warning and "without the lock" in warning, warning


def _stand_in_agent():
    """A process the local launcher takes for its node agent (a session of its own; `harness.agent` on its
    command line) without starting a job."""
    import subprocess

    from harness.launchers.local import _job_alive

    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "harness.agent"],
                             start_new_session=True)
    assert _wait_for(lambda: _job_alive(agent.pid))  # exec'd: its command line is its own
    return agent


def _disk_full(monkeypatch) -> None:
    """job.json cannot be replaced: a full results disk (or a folder we may not write)."""
    from harness.launchers import base

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(base, "replace_whole", full)


def test_a_record_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """A teammate's run folder (umask 022: neither its lock file nor the folder ours to write) or a full disk:
    recording is refused in one line naming job.json, never a traceback; what was recorded stays."""
    _write_job(tmp_path, state="RUNNING")
    _disk_full(monkeypatch)
    with pytest.raises(HarnessError, match=r"cannot record in .*job\.json: No space left on device$"):
        Handle.load(tmp_path).update(state="CANCELLED")
    assert Handle.load(tmp_path).record()["state"] == "RUNNING"


def test_a_local_cancel_stops_the_job_even_when_it_cannot_be_recorded(tmp_path, monkeypatch, capsys):
    """A record that cannot be written (a full results disk) is said in one line, and the job stopped all the
    same: a cancel never depends on job.json."""
    from harness.launchers.local import LocalLauncher

    _write_job(tmp_path, state="RUNNING")
    agent = _stand_in_agent()
    try:
        handle = Handle(backend="local", job_id=str(agent.pid), out_dir=tmp_path)

        _disk_full(monkeypatch)
        launcher = LocalLauncher()
        launcher._procs[handle.job_id] = agent
        launcher.cancel(handle)
        assert agent.poll() is not None
        warning = capsys.readouterr().err
        assert warning.count("\n") == 1 and "cannot record in" in warning and "No space" in warning, warning
        assert "the cancel goes on" in warning
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait(timeout=120)


def test_a_local_job_another_user_owns_is_not_cancelled_nor_recorded_so(tmp_path, monkeypatch):
    """A job whose processes may not be signalled (another user's) is refused in one line before anything is
    recorded: job.json does not call a job that runs on cancelled."""
    from harness.launchers import local

    _write_job(tmp_path, state="RUNNING")
    agent = _stand_in_agent()
    try:
        handle = Handle(backend="local", job_id=str(agent.pid), out_dir=tmp_path)

        def not_ours(pid, sig):
            raise PermissionError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(local.os, "killpg", not_ours)
        with pytest.raises(HarnessError, match=f"cannot stop job {agent.pid}: .*another user's; it is not cancelled"):
            local.LocalLauncher().cancel(handle)
        assert agent.poll() is None and handle.record()["state"] == "RUNNING"
    finally:
        agent.kill()
        agent.wait(timeout=120)


def launcher_imports() -> dict[str, set[str]]:
    """{module: the harness/launchers modules it imports} for every module there, from the source (ast), lazy
    imports inside functions included: a cycle through one is still a cycle."""
    from tests.conftest import REPO

    folder = REPO / "harness" / "launchers"
    modules = {path.stem for path in folder.glob("*.py")}
    graph = {}
    for module in modules:
        edges = set()
        for node in ast.walk(ast.parse((folder / f"{module}.py").read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness.launchers"):
                # `from harness.launchers import kubernetes_nodes` imports that module; `import Handle`, the package
                names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}".rpartition(".")[2] in modules
                         and node.module == "harness.launchers" else node.module for alias in node.names]
            for name in names:
                if name == "harness.launchers":
                    edges.add("__init__")
                elif name.startswith("harness.launchers."):
                    edges.add(name.split(".")[2])
        graph[module] = edges - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if cycle := visit(target):
                return cycle
        path.pop()
        done.add(module)
        return None

    return next((cycle for module in sorted(graph) if (cycle := visit(module))), None)


def test_the_launchers_import_one_another_without_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check finds one
    graph = launcher_imports()
    assert {"kubernetes_api", "kubernetes_render", "kubernetes_collect"} <= set(graph)
    assert "kubernetes_blame" in graph["kubernetes"] and "kubernetes_api" in graph["kubernetes_blame"]
    assert find_cycle(graph) is None


def test_no_shared_workload_module_imports_a_benchmark():
    """workloads/common is the floor every benchmark stands on: a benchmark's own options reach it through the
    registry (Benchmark.options), never by importing the benchmark, lazily inside a function or not."""
    from tests.conftest import REPO

    packages = {path.parent.name for path in (REPO / "workloads").glob("*/__init__.py")} - {"common"}
    assert {"resnet", "bert", "decoder", "flux", "gpt3"} <= packages
    found = []
    for path in sorted((REPO / "workloads" / "common").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name}:{node.lineno} imports {name}" for name in names
                      if name.split(".")[:2] in (["workloads", package] for package in packages)]
    assert found == []


@pytest.mark.parametrize("argv, said", [
    (["bert", "--decode", "device"], "--decode applies to resnet only, not bert"),
    (["resnet", "--decode", "gpu"], "argument --decode: invalid choice: 'gpu' (choose from 'workers', 'device')"),
    (["resnet", "--learning-rate", "0.1"],
     "--learning-rate applies to llama31_8b, gpt_oss_20b, llama2_70b_lora, deepseekv3_671b, flux1 only, not resnet"),
    (["llama2_70b_lora", "--warmup-samples", "8"], "--warmup-samples applies to llama31_8b, gpt_oss_20b, flux1 only"),
    (["llama2_70b_lora", "--pipeline-parallel", "2"],
     "--pipeline-parallel applies to llama31_8b, gpt_oss_20b, deepseekv3_671b only, not llama2_70b_lora"),
])
def test_a_benchmarks_own_worker_options_are_refused_to_the_others(argv, said, tmp_path):
    """Each benchmark's own options come from its registry entry; the worker refuses them to the rest in one line."""
    from workloads.common.campaign import RunOptions

    with pytest.raises(SystemExit) as refused:
        RunOptions.parse([*argv, "--out", str(tmp_path)])
    assert said in refused.value.code


def test_a_benchmarks_own_worker_options_reach_the_worker(tmp_path):
    from workloads.common.campaign import RunOptions

    assert RunOptions.parse(["resnet", "--decode", "device", "--out", str(tmp_path)]).decode == "device"
    opts = RunOptions.parse(["llama31_8b", "--learning-rate", "0.001", "--warmup-samples", "16",
                             "--pipeline-parallel", "2", "--out", str(tmp_path)])
    assert (opts.learning_rate, opts.warmup_samples, opts.pipeline_parallel) == (0.001, 16, 2)
