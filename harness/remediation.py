"""The submitting side of preflight: run the health job (where the training request does not run it inside
its own allocation), show the per-node table as soon as preflight.json appears, and have the launcher tell
the cluster about the nodes kept out (a Slurm drain; a Kubernetes condition, taint and events)."""

from __future__ import annotations

import dataclasses
import shlex
import sys
import time

from harness import preflight
from harness.errors import HarnessError
from harness.health import NODES_DIR
from harness.launchers.base import Handle, JobState, Launcher
from harness.spec import JobSpec


class PreflightWatcher:
    """Called at every poll of a job: the first time a new preflight.json is there, print its table and
    remediate, once per preflight pass (a requeued Slurm job runs preflight again)."""

    def __init__(self, launcher: Launcher, spec: JobSpec):
        self.launcher, self.spec, self.seen = launcher, spec, None

    def __call__(self) -> None:
        record = preflight.read(self.spec.out_dir)
        if record is None or record.get("started") == self.seen:
            return
        self.seen = record.get("started")
        print(preflight.table(record), flush=True)
        lines = self.launcher.remediate(self.spec, record)
        preflight.record_remediation(self.spec.out_dir, lines)
        for line in lines:
            print(f"harness: preflight: {line}", flush=True)


def run_health_job(launcher: Launcher, spec: JobSpec) -> dict:
    """Run the health job on `spec.nodes + spec.spare_nodes` nodes, judge them, remediate; preflight.json's record.
    The job runs in the run folder, so its reports, table and verdicts stay beside the run's results."""
    request = launcher.render_preflight(spec)  # refused requests leave nothing behind
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    preflight_file = spec.out_dir / preflight.PREFLIGHT_FILE
    preflight_file.unlink(missing_ok=True)  # a run folder holds the verdicts of this allocation only
    watcher = PreflightWatcher(launcher, request.spec)  # the health job's spec: its remediation names that job
    # The whole preflight on this machine's clock, never a node's (preflight.decide), from when the job was seen
    # running: its time in the queue (Kueue's admission, the pods' scheduling: hours for 448 nodes) held no node.
    handle, began = None, None
    try:
        handle = launcher.submit(request)
        print(f"harness: preflight on {launcher.name}: {spec.nodes + spec.spare_nodes} node(s), job {handle.job_id}",
              flush=True)
        for state in launcher.watch(handle, tick=watcher):
            if state is JobState.RUNNING and began is None:
                began = time.monotonic()
            if launcher.name != "local":
                print(f"harness: preflight job {handle.job_id} {state.value}", flush=True)
    except BaseException:  # Ctrl-C, SIGTERM (the CLI raises it), a lost API: no one reads this job's verdict now
        if handle is not None:
            _stop_unread(launcher, handle)
        raise
    if not launcher.preflight_in_allocation:
        try:
            ran = launcher.checked_nodes(handle)
            launcher.collect(handle)
        finally:
            launcher.delete(handle)  # read: the next run's health job must not meet it (or its pods)
        reports = [p.stem for p in (spec.out_dir / NODES_DIR).glob("*.json")]
        # A node the job ran on that wrote no report is judged (and fails: health_report missing), not skipped.
        preflight.decide(spec.out_dir, sorted({*reports, *ran}), spec.nodes,
                         seconds=None if began is None else time.monotonic() - began,
                         max_marked_share=spec.profile.preflight.max_marked_share)
    watcher()
    record = preflight.read(spec.out_dir)
    if record is None:
        raise HarnessError(f"the preflight job ended without a verdict; its output: harness logs {spec.out_dir}", 1)
    if len(record["allocated"]) < spec.nodes + spec.spare_nodes:
        print(f"harness: preflight: only {len(record['allocated'])} of {spec.nodes + spec.spare_nodes} node(s) "
              "wrote a report", file=sys.stderr)
    return record


def _stop_unread(launcher: Launcher, handle: Handle) -> None:
    """A health job whose verdict no one will read must not hold its nodes (448 of them, for hours of a hung
    check): cancelled, or, where the cancel cannot be made, said how to."""
    try:
        launcher.cancel(handle)
    except HarnessError as exc:
        print(f"harness: the preflight job {handle.job_id} may still be running ({exc}); "
              f"stop it with: harness cancel {shlex.quote(str(handle.out_dir))}", file=sys.stderr)


def without_excluded(spec: JobSpec, record: dict) -> JobSpec:
    """The training spec after a preflight outside the allocation: the nodes it kept out are excluded, and the
    verdicts of the others go with it (the training pods' preflight_passed metric: preflight.json stays here)."""
    return dataclasses.replace(spec, exclude_nodes=sorted({*spec.exclude_nodes, *record["excluded"]}),
                               node_verdicts=preflight.pod_verdicts(record))
