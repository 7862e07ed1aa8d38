"""The Python API: a campaign as an object, for CI jobs and notebooks, re-exported from `harness`.

    import harness
    campaign = harness.start("resnet", runs=5, out="candidate")   # returns at once; the campaign runs on
    campaign.state                                                  # PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED
    campaign.wait(timeout=3600)                                     # its final state; .exit_code is `harness run`'s
    campaign.results().scores                                       # harness.results.load's ResultSet
    harness.attach("results/runs/resnet-tiny-...").cancel()         # any campaign, by its run folder
    harness.dry_run("resnet", backend="k8s", profile="h100-ib").request   # the YAML documents, as data

The options are `harness run`'s, by their names there (harness.campaign.RUN_OPTIONS), and go through the same
steps (harness.campaign), so the same input gets the same one-line HarnessError. A started campaign's
submitting side (preflight, submit, watch, collect, summary) runs in a `harness.campaign.background` process of
its own session, writing what `harness run` prints into <run folder>/campaign.log: it outlives the notebook cell
and the kernel, and it alone handles its signals (a thread here could not: SIGTERM, which cancels its job, reaches
only the main thread). `attach` finds any campaign again by its folder, as `harness status`, `cancel` and
`collect` do.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import campaign as pipeline
from harness.errors import HarnessError
from harness.launchers.base import JOB_FILE, Handle, JobState

# A pipeline process that ends with these was stopped by a Ctrl-C or SIGTERM: its jobs were cancelled.
STOPPED_EXITS = (130, 143, -signal.SIGINT, -signal.SIGTERM)
WAIT_POLL_S = 1.0  # between two reads of an attached campaign's state
CANCEL_WAIT_S = 120.0  # for a started pipeline to cancel its job (local: the agent's grace, 30 s, and more)


class CampaignTimeout(HarnessError, TimeoutError):
    """`Campaign.wait` ran out of time; the campaign goes on."""


@dataclass(frozen=True)
class DryRun:
    """What `harness run --dry-run` shows, as data, as TorchX's dry run returns its request object.

    `request` is the backend's own: for k8s the list of objects the run creates (parsed YAML documents), for slurm
    the sbatch script, for local {"argv": the node agent's command, "env": its environment}."""

    backend: str
    request: Any
    text: str  # as `harness run --dry-run` prints it
    problems: list[str]  # what `harness run` would refuse, one line each
    notes: list[str]  # the request's notes (the batch plan, the memory per GPU, ...), as `harness run` says them
    spec: Any  # the resolved harness.spec.JobSpec


def dry_run(benchmark: str, backend: str = "local", **options) -> DryRun:
    """Render the campaign `start` would start, without submitting or writing anything."""
    plan = pipeline.Plan.resolve(backend, {"benchmark": benchmark, **options})
    request = plan.render()
    if backend == "k8s":
        import yaml

        data = [doc for doc in yaml.safe_load_all(request.text) if doc]
    else:
        data = request.payload.get("script") if backend == "slurm" else request.payload
    return DryRun(backend, data, request.text, list(plan.problems), plan.notes(request), plan.spec)


def start(benchmark: str, backend: str = "local", **options) -> "Campaign":
    """Check, render and claim the run folder here (bad input raises HarnessError now, as `harness run` refuses
    it), then run the campaign in a process of its own; returns its handle without waiting."""
    plan = pipeline.Plan.resolve(backend, {"benchmark": benchmark, **options})
    plan.refuse_problems()
    plan.render()  # refused before the folder is made
    request = plan.claim()
    return Campaign(plan.spec.out_dir, pipeline.background_process(plan, plan.notes(request)))


def attach(run_dir: str | Path) -> "Campaign":
    """The campaign whose run folder this is (one with a job.json), wherever it runs."""
    handle = Handle.load(Path(run_dir))  # refuses a folder that is not a run folder, in one line
    return Campaign(handle.out_dir)


@dataclass(frozen=True)
class Status:
    """Where a campaign stands: `harness status` prints its line."""

    out_dir: Path
    state: JobState
    backend: str | None
    job_id: str | None
    runs_done: int
    runs: int | None
    exit_code: int | None  # where it ended: `harness run`'s, else the job's

    def line(self) -> str:
        job = f" ({self.backend} job {self.job_id})" if self.job_id else ""
        runs = f"; {self.runs_done} of {self.runs} run(s) done" if self.runs else ""
        code = f"; exit code {self.exit_code}" if self.state.terminal and self.exit_code is not None else ""
        return f"{self.out_dir}: {self.state.value}{job}{runs}{code}"


class Campaign:
    """One campaign, by its run folder; `process` is the pipeline's where this process started it."""

    def __init__(self, out_dir: Path, process=None):
        self.out_dir, self._process = Path(out_dir), process

    def __repr__(self) -> str:
        return f"Campaign({str(self.out_dir)!r}, state={self.state.value})"

    @property
    def log_file(self) -> Path:
        """What the pipeline said, as `harness run` says it (campaigns `start` started)."""
        return self.out_dir / pipeline.CAMPAIGN_LOG

    def _job(self) -> tuple[Any, Handle]:
        from harness.launchers import get_launcher

        handle = Handle.load(self.out_dir)
        return get_launcher(handle.backend), handle

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def state(self) -> JobState:
        """The campaign's state, from its folder's job.json and the backend's status of that job. While its pipeline
        runs (started here, or any `harness run` on this host: campaign.pipeline_alive) it is PENDING or RUNNING,
        its health job and the gaps between its jobs included; SUCCEEDED, FAILED or CANCELLED once the pipeline
        recorded its exit code (0, another, or a stop). A pipeline that died without recording one leaves the job's
        own state, FAILED where the job was its health job or not its last; one on another host, the job's state."""
        if not (self.out_dir / JOB_FILE).exists():  # nothing submitted yet
            if self._process is None or self._alive():
                return JobState.PENDING
            return JobState.CANCELLED if self._process.returncode in STOPPED_EXITS else JobState.FAILED
        launcher, handle = self._job()
        job = launcher.status(handle)
        record = handle.record()
        if job is JobState.CANCELLED or record.get("campaign_cancelled"):
            return JobState.CANCELLED
        marked = pipeline.pipeline_alive(self.out_dir) if self._process is None else False  # one started here
        if self._alive() or marked:  # a stale exit code of an earlier campaign in a reused folder is not this one's
            return JobState.PENDING if job is JobState.PENDING else JobState.RUNNING
        ended = record.get(pipeline.EXIT_KEY)
        if ended is None and self._process is not None:  # it died without recording: its own exit
            ended = self._process.returncode
        if ended is not None:
            return JobState.SUCCEEDED if ended == 0 else \
                JobState.CANCELLED if ended in STOPPED_EXITS else JobState.FAILED
        more = record.get("spec", {}).get("health_only") or _jobs_after(record)
        if marked is None:  # on another host: between two jobs it goes on
            return JobState.RUNNING if job is JobState.SUCCEEDED and more else job
        return JobState.FAILED if job is JobState.SUCCEEDED and more else job  # it died before the next job

    def status(self) -> Status:
        """The state, the job, the runs done of the campaign's and the exit code (`harness status`)."""
        state = self.state
        try:
            record = Handle.load(self.out_dir).record()
        except (HarnessError, OSError, ValueError):
            record = {}
        code = record.get(pipeline.EXIT_KEY, record.get("exit_code"))
        if self._process is not None and self._process.poll() is not None:
            code = self._process.returncode
        return Status(self.out_dir, state, record.get("backend"), record.get("job_id"),
                      runs_done=pipeline.runs_done(self.out_dir), runs=record.get("spec", {}).get("runs"),
                      exit_code=code)

    @property
    def exit_code(self) -> int | None:
        """`harness run`'s exit code once the campaign ended (0: every run reached its target); None before."""
        return self.status().exit_code if self.state.terminal else None

    def wait(self, timeout: float | None = None) -> JobState:
        """Block until the campaign ends; its final state. CampaignTimeout (a HarnessError and a TimeoutError)
        after `timeout` seconds, the campaign going on."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._process is not None:
                import subprocess

                try:
                    self._process.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            state = self.state
            if state.terminal:
                return state
            if deadline is not None and time.monotonic() >= deadline:
                raise CampaignTimeout(f"the campaign in {self.out_dir} is still {state.value} after {timeout:g} s",
                                      1)
            time.sleep(WAIT_POLL_S)

    def cancel(self) -> str:
        """Stop the campaign; results so far stay. A pipeline started here is stopped as Ctrl-C stops `harness run`
        (it cancels its job, whatever step it is at); any other, as `harness cancel` does. What was done, in words."""
        if self._alive():
            import subprocess

            self._process.send_signal(signal.SIGTERM)
            try:  # the pipeline cancels its job, as `harness run` on SIGTERM: a cluster's cancel can take a while
                self._process.wait(CANCEL_WAIT_S)
            except subprocess.TimeoutExpired:
                return (f"asked the campaign to stop; it is still cancelling its job after {CANCEL_WAIT_S:g} s "
                        f"(see {self.log_file}); results so far stay in {self.out_dir}")
            return f"cancelled the campaign; results so far stay in {self.out_dir}"
        launcher, handle = self._job()
        state = launcher.status(handle)
        record = handle.record()
        if state.terminal and _jobs_after(record):  # between two of a campaign's jobs: the `harness run` submitting them stops
            handle.update(campaign_cancelled=True)
            return f"job {handle.job_id} has ended ({state.value}); the campaign's later runs will not be submitted"
        if state.terminal:
            return f"job {handle.job_id} has already ended ({state.value}); nothing to cancel"
        launcher.cancel(handle)
        return f"cancelled job {handle.job_id}; results so far stay in {handle.out_dir}"

    def collect(self) -> list[Path]:
        """Copy a cluster job's result files into the run folder (done when the campaign ends); the files fetched."""
        return pipeline.collect(*self._job())

    def logs(self, **options) -> str:
        """The workers' output so far (the backend's `harness logs`)."""
        launcher, handle = self._job()
        return launcher.logs(handle, **options)

    def results(self, ruleset: str | None = None):
        """The campaign's runs and score so far as harness.results.load's ResultSet (frames: .runs, .scores), each
        log judged by its own ruleset (as `harness report`) unless one is given."""
        from harness.results import load

        return load([self.out_dir], ruleset=ruleset)


def _jobs_after(record: dict) -> bool:
    """This job (job.json's record) is one of a campaign that takes a job a run, and not its last."""
    return record.get("launch") is not None and record["launch"] < record["spec"]["runs"] - 1

