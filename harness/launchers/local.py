"""The embedded default: torch's elastic agent on this machine, no cluster needed.

One node agent (harness.agent around torch's elastic agent, standalone) starts the
worker processes (gloo on CPU, NCCL on GPUs: the workload picks) and restarts the
worker group after an infrastructure failure, up to the job's restart budget. The
agent runs in its own process group so that `cancel` can stop it and all its
workers with one signal.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.errors import HarnessError
from harness.launchers.base import (Handle, JobState, Launcher, Request, agent_command, check_procs_fit,
                                    health_command, record_cancel, record_state, workload_plan)
from harness.spec import JobSpec

CANCEL_GRACE_S = 30.0


def visible_gpus() -> int:
    """GPUs torch can use here. NVML answers "none" in a tenth of a second where importing torch takes
    seconds, which every `harness run` on a laptop would pay; where NVML sees GPUs, torch counts the ones it
    may use (CUDA_VISIBLE_DEVICES)."""
    if not _nvml_sees_gpus():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nvml_sees_gpus() -> bool:
    try:
        import pynvml
    except ImportError:
        return True  # nvidia-ml-py missing: let torch decide
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False  # no driver, so no GPU torch could use
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    finally:
        pynvml.nvmlShutdown()


def gpu_memory_gib() -> float:
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class LocalLauncher(Launcher):
    name = "local"
    poll_s = 0.2  # a local job's state is its process's, free to read; `harness run` ends soon after it

    def __init__(self) -> None:
        self._procs: dict[str, subprocess.Popen] = {}

    def render(self, spec: JobSpec) -> Request:
        if spec.nodes != 1:
            raise HarnessError(f"the local backend runs on this machine only, so --nodes must be 1 "
                               f"(got {spec.nodes}); use --backend slurm or k8s for more nodes")
        if spec.gpus_per_node is None:
            gpus = visible_gpus() if spec.procs_per_node is None else 0
        else:
            gpus = spec.gpus_per_node
            if gpus and gpus > visible_gpus():
                raise HarnessError(f"--gpus-per-node {gpus}: this machine has {visible_gpus()} GPU(s) torch can use")
            check_procs_fit(spec, gpus)
        nproc = spec.procs_per_node or gpus or 2
        env = {**spec.profile.env, **spec.env}
        if not gpus:
            # Split the cores between CPU workers instead of letting each oversubscribe them.
            env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_count() // nproc)))
        argv = agent_command(spec, sys.executable, nproc, restart_here=True)
        text = shlex.join([f"{k}={v}" for k, v in sorted(env.items())] + argv) if env else shlex.join(argv)
        plan = workload_plan(spec, nproc, gpu_memory_gib() if gpus else None)
        return Request(backend=self.name, spec=spec, text=text, payload={"argv": argv, "env": env}, notes=plan)

    def render_preflight(self, spec: JobSpec) -> Request:
        """This machine's checks (one node: no pairs between nodes)."""
        if spec.nodes + spec.spare_nodes != 1:
            raise HarnessError("the local backend checks this machine only: --nodes 1 and no --spare-nodes")
        argv = health_command(spec, sys.executable)
        env = {**spec.profile.env, **spec.env}
        return Request(backend=self.name, spec=spec, text=shlex.join(argv), payload={"argv": argv, "env": env})

    def submit(self, request: Request) -> Handle:
        out_dir = request.spec.out_dir
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(request.payload["argv"], env={**os.environ, **request.payload["env"]},
                                start_new_session=True)
        handle = Handle(backend=self.name, job_id=str(proc.pid), out_dir=out_dir)
        self._procs[handle.job_id] = proc
        handle.save(request, state=JobState.RUNNING.value)
        return handle

    def status(self, handle: Handle) -> JobState:
        proc = self._procs.get(handle.job_id)
        running = proc.poll() is None if proc is not None else _job_alive(int(handle.job_id))
        if running:
            return JobState.RUNNING
        record = handle.record()
        recorded = JobState(record.get("state", JobState.UNKNOWN.value))
        if proc is None and not recorded.terminal:  # its watcher died before it recorded the end: the agent's word
            return _ended_unwatched(handle, record)
        if proc is None or recorded is JobState.CANCELLED:  # another process saw it end, or we stopped it
            return recorded
        state = JobState.SUCCEEDED if proc.returncode == 0 else JobState.FAILED
        # What was recorded: a cancel from another shell since the read above stays (Handle.update).
        return record_state(handle, state, exit_code=proc.returncode)

    def cancel(self, handle: Handle) -> None:
        pid = int(handle.job_id)
        if not _job_alive(pid):
            return
        try:
            os.killpg(pid, 0)  # ours to stop: nothing is recorded for a cancel that cannot happen
        except PermissionError:
            raise HarnessError(f"cannot stop job {pid}: its processes are another user's; it is not cancelled",
                               1) from None
        # Recorded before the signal, unlike a cluster's cancel (which the scheduler may refuse): a `harness run`
        # watching from another shell then reads the job's end as the cancel, not as a failure. A record that
        # cannot be written (a full results disk) is said, and the job stopped all the same.
        record_cancel(handle, state=JobState.CANCELLED.value)
        os.killpg(pid, signal.SIGTERM)  # the agent forwards it to its workers
        if not self._wait_gone(handle, CANCEL_GRACE_S):
            os.killpg(pid, signal.SIGKILL)
            self._wait_gone(handle, CANCEL_GRACE_S)  # so that cancel returns with the job gone

    def _wait_gone(self, handle: Handle, timeout: float) -> bool:
        pid, proc = int(handle.job_id), self._procs.get(handle.job_id)

        def alive() -> bool:
            # Our own child is gone once reaped; /proc alone can look empty while it is still exiting.
            return proc.poll() is None if proc is not None else _job_alive(pid)

        deadline = time.monotonic() + timeout
        while alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        return not alive()


def _ended_unwatched(handle: Handle, record: dict) -> JobState:
    """How a job ended that no `harness run` saw end (killed, or its machine restarted): what the node agent's
    attempt records decide of the newest attempt (harness.agent.decide, the agent's own exit), recorded; an attempt
    cut off without its end record failed, and so did a job that recorded no attempt (a health job: its verdict is
    preflight.json's; an agent killed before its first), its exit code unknown."""
    from harness.agent import decide, read_records

    records = read_records(handle.out_dir)
    if not records:
        return record_state(handle, JobState.FAILED)
    newest = max(r["attempt"] for r in records)
    decision = decide(records, newest, int(record.get("spec", {}).get("max_restarts", 0)))
    return record_state(handle, JobState.SUCCEEDED if decision.exit_code == 0 else JobState.FAILED,
                        exit_code=decision.exit_code)


def _job_alive(pid: int) -> bool:
    """True if `pid` is still our job, a node agent or a health job (not a zombie, not a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        return b"harness.agent" in command or b"\0harness.health\0" in command
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
