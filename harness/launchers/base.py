"""The one small interface every backend implements, TorchX-style.

render(spec) -> Request     the exact thing that would be submitted; `--dry-run` prints `request.text`
submit(request) -> Handle   starts it; the handle is saved as <out>/job.json so other commands can find it
status / watch / logs / cancel on a handle

Every backend starts the same program on every node: the harness's node agent
(`python -m harness.agent`), which runs torch's elastic agent (the machinery behind
torchrun) running `python -m workloads ...`, and records and classifies failures.
Only how that command reaches the nodes, and who restarts it, differs.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator

from harness.errors import HarnessError
from harness.requirements_check import AGENT_BOOTSTRAP
from harness.spec import JobSpec

JOB_FILE = "job.json"


class JobState(str, enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class Request:
    """What a launcher would submit: `text` is shown verbatim, `payload` is what submit() uses."""

    backend: str
    spec: JobSpec
    text: str
    payload: Any
    notes: tuple[str, ...] = ()  # what the user should know about the request (printed on stderr)


@dataclass
class Handle:
    """A submitted job: enough to find it again from another process."""

    backend: str
    job_id: str
    out_dir: Path

    def save(self, request: Request, **extra: Any) -> None:
        record = {"backend": self.backend, "job_id": self.job_id, "spec": request.spec.to_dict(),
                  "request": request.text, **extra}
        (self.out_dir / JOB_FILE).write_text(json.dumps(record, indent=2) + "\n")

    def record(self) -> dict:
        return json.loads((self.out_dir / JOB_FILE).read_text())

    def update(self, **fields: Any) -> None:
        """Record facts about the job (its state, exit code) in job.json."""
        record = self.record()
        record.update(fields)
        (self.out_dir / JOB_FILE).write_text(json.dumps(record, indent=2) + "\n")

    @classmethod
    def load(cls, run_dir: Path) -> "Handle":
        path = Path(run_dir) / JOB_FILE
        try:
            record = json.loads(path.read_text())
            return cls(backend=record["backend"], job_id=str(record["job_id"]), out_dir=Path(run_dir).absolute())
        except FileNotFoundError:
            raise HarnessError(f"{run_dir} is not a run folder: it has no {JOB_FILE}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise HarnessError(f"{path} is unreadable: {exc}") from None


class Launcher(ABC):
    """One backend. Subclasses stay small enough to read in one sitting."""

    name: ClassVar[str]
    paths_here: ClassVar[bool] = True  # the nodes see this machine's files (see spec.validate)

    @abstractmethod
    def render(self, spec: JobSpec) -> Request:
        """Build the exact request for a resolved, validated spec. Has no side effects."""

    @abstractmethod
    def submit(self, request: Request) -> Handle:
        """Start the job and save its handle in the run folder."""

    @abstractmethod
    def status(self, handle: Handle) -> JobState:
        """The job's state now."""

    @abstractmethod
    def logs(self, handle: Handle) -> str:
        """The job's worker output so far."""

    @abstractmethod
    def cancel(self, handle: Handle) -> None:
        """Stop the job; results already written stay in place."""

    def collect(self, handle: Handle) -> list[Path]:
        """Bring the run's result files into handle.out_dir; returns the files fetched.

        Local and Slurm ranks write there directly (Slurm needs a shared file system),
        so only backends with their own storage override this.
        """
        return []

    def watch(self, handle: Handle, poll_s: float = 1.0) -> Iterator[JobState]:
        """Yield each state change until the job reaches a terminal state."""
        last = None
        while True:
            state = self.status(handle)
            if state != last:
                yield state
                last = state
            if state.terminal:
                return
            time.sleep(poll_s)


def workload_plan(spec: JobSpec, nproc_per_node: int, gpu_memory_gib: float | None) -> tuple[str, ...]:
    """What the workload will make of this many processes, shown with the request: for bert the batch plan
    (an MLPerf reference batch and its split), for gpt3 the parallel layout and the memory estimate per GPU.
    A world that cannot take the batch, or a config that cannot fit, is refused here, with the numbers."""
    world = spec.nodes * nproc_per_node
    try:
        if spec.benchmark == "bert":
            from workloads.bert import config as bert  # torch-free: sizes and arithmetic only

            preset = bert.PRESETS[spec.preset]
            return tuple(bert.describe(preset, bert.plan_batch(preset, world, spec.batch_size)))
        if spec.benchmark == "gpt3":
            from workloads.gpt3 import config as gpt3

            cfg = gpt3.PRESETS[spec.preset]
            if spec.batch_size:
                cfg = dataclasses.replace(cfg, micro_batch=spec.batch_size)
            layout = gpt3.plan_layout(cfg, world, nproc_per_node)
            if gpu_memory_gib:
                gpt3.check_fits(cfg, layout, gpu_memory_gib)
            return tuple(gpt3.describe(cfg, layout, gpu_memory_gib))
    except ValueError as exc:
        raise HarnessError(str(exc)) from None
    return ()


def cluster_procs_per_node(spec: JobSpec) -> int:
    """Processes per node on a cluster: as asked, else one per GPU of the profile, else its CPU default."""
    return spec.procs_per_node or spec.profile.gpus_per_node or spec.profile.procs_per_node or 1


def agent_command(spec: JobSpec, python: str, nproc_per_node: int, rendezvous: str | None = None,
                  rdzv_id: str = "harness", restart_here: bool = False) -> list[str]:
    """The command one node runs: the harness's node agent around torchrun's, then the workload.

    `python -c AGENT_BOOTSTRAP` is `python -m harness.agent`, except that in an image without the harness
    it says so in one line naming the image (see harness.requirements_check).

    Without `rendezvous` the agent runs standalone (one node, a private port);
    otherwise all nodes meet at the c10d store at `rendezvous` (host:port).
    `restart_here`: the node agent restarts failed attempts itself (local); on clusters
    the scheduler restarts the job (see harness.agent).
    """
    cmd = [python, "-c", AGENT_BOOTSTRAP, "--out", str(spec.out_dir), "--max-restarts", str(spec.max_restarts)]
    if restart_here:
        cmd.append("--restart-here")
    cmd += ["--", f"--nproc-per-node={nproc_per_node}"]
    if rendezvous is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={spec.nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous}",
                f"--rdzv-id={rdzv_id}"]
    return cmd + ["-m", "workloads", *spec.worker_args()]
