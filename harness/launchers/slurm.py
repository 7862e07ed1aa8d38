"""Slurm: one sbatch script whose `srun` starts one elastic agent per node, once per run of the campaign.

The agents meet at a c10d rendezvous on the first node of the allocation (its
NodeAddr as Slurm knows it) and each starts one process per GPU. After a failure
the script asks `harness.agent --decide` and requeues itself while the restart
budget allows (Slurm counts requeues in SLURM_RESTART_COUNT); a lost node makes
Slurm requeue the job itself (--requeue). The same script
works on a plain Slurm cluster and on Slurm-on-Kubernetes login nodes (SUNK,
Slinky), since it only uses sbatch, srun and scontrol; with an `image` in the
profile, pyxis runs each agent inside that container.

User-supplied values reach the script in two ways only: #SBATCH directives,
which Slurm reads without a shell (values are checked for control characters),
and shell lines, where every value is quoted with shlex.quote.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from mlperf_logging.mllog import constants as C

from harness.agent import EXIT_RETRY
from harness.cache_flush import slurm_flush_lines
from harness.campaign_plan import campaign_minutes, parse_slurm_time, slurm_time
from harness.errors import HarnessError
from harness.health import NODES_DIR
from harness.mounts import pyxis_mount, translate
from harness.launchers.base import (FileLog, Handle, JobState, Launcher, LogSource, Request, agent_command,
                                    cluster_procs_per_node, health_command, record_cancel, record_state, workload_plan)
from harness.preflight import EXIT_PREFLIGHT, to_mark
from harness.spec import JobSpec
from workloads.common.requirements_check import AGENT_BOOTSTRAP, IMAGE_ENV
from workloads.common.rank_output import RANK_OUTPUT_ENV

SCRIPT_FILE = "job.sbatch"
OUTPUT_PATTERN = "slurm-%j.out"
# pyxis keeps a named container for the job's later steps, so the `--decide` step reuses the training step's
# container instead of importing the image again on the node.
CONTAINER_NAME = "mlperf-harness"

# Slurm's job states (squeue %T, scontrol JobState, sacct State) -> ours.
STATES = {
    "PENDING": JobState.PENDING, "CONFIGURING": JobState.PENDING, "REQUEUED": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING, "REQUEUE_FED": JobState.PENDING, "RESV_DEL_HOLD": JobState.PENDING,
    "SUSPENDED": JobState.PENDING, "RUNNING": JobState.RUNNING, "COMPLETING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING, "SIGNALING": JobState.RUNNING, "RESIZING": JobState.RUNNING,
    "COMPLETED": JobState.SUCCEEDED, "CANCELLED": JobState.CANCELLED, "FAILED": JobState.FAILED,
    "TIMEOUT": JobState.FAILED, "NODE_FAIL": JobState.FAILED, "OUT_OF_MEMORY": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED, "DEADLINE": JobState.FAILED, "PREEMPTED": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED, "REVOKED": JobState.FAILED,
}


# Pending reasons that mean "not with the nodes there are now", as opposed to waiting for a turn.
UNFIT_REASON = re.compile(r"ReqNodeNotAvail|PartitionNodeLimit|NodeDown|Nodes_required_for_job_are_DOWN")


def _directive(option: str, value: object) -> str:
    # sbatch splits a directive's value at whitespace: "--account=a --qos=x" would add an option.
    text = str(value)
    if not text or any(ord(c) < 32 or c.isspace() for c in text):
        raise HarnessError(f"the Slurm option --{option} must be one word without whitespace or control "
                           f"characters: {text!r}")
    return f"#SBATCH --{option}={text}"


def in_container(spec: JobSpec) -> tuple[JobSpec, list[str]]:
    """The spec with its paths as pyxis's container sees them, and pyxis's srun options; unchanged on bare nodes.

    --data and --init-checkpoint must lie under one of the profile's container mounts (refused otherwise,
    with the list). The run folder too, or else it is mounted at its own path: it must be on the shared
    file system anyway, since Slurm writes the job's output there from outside the container."""
    image = spec.profile.image
    if not image:
        return spec, []
    mounts = [pyxis_mount(entry) for entry in spec.profile.slurm.container_mounts]
    entries = list(spec.profile.slurm.container_mounts)
    try:
        out_dir = translate(spec.out_dir, mounts, "--out")
    except HarnessError:
        out_dir = spec.out_dir
        entries.append(f"{spec.out_dir}:{spec.out_dir}")
    paths = {key: translate(getattr(spec, key), mounts, flag) for key, flag in
             (("data", "--data"), ("init_checkpoint", "--init-checkpoint")) if getattr(spec, key) is not None}
    inside = dataclasses.replace(spec, out_dir=Path(out_dir), **{k: Path(v) for k, v in paths.items()})
    return inside, [f"--container-image={image}", f"--container-name={CONTAINER_NAME}",
                    f"--container-mounts={','.join(entries)}"]


def preflight_lines(spec: JobSpec, inside: JobSpec, container: list[str], python: str) -> list[str]:
    """Preflight inside the allocation: every node runs its checks, then one step judges them and prints the
    nodes training uses into ${training_nodes} (the healthiest --nodes; too few stops the job)."""
    # No --kill-on-bad-exit: one node's crash must not stop the others' checks (it is judged failed below).
    # srun's --time is in minutes, and counts the image's import too: the nodes' own deadline_s counts from their
    # start, and the step's end (HARNESS_HEALTH_KILL_AT, this cluster's clock) caps it (harness.health.phase_seconds).
    checks = spec.profile.preflight
    deadline_min = max(1, math.ceil((checks.deadline_s + checks.start_allowance_s) / 60))
    health = shlex.join(["srun", "--ntasks-per-node=1", f"--time={deadline_min}", *container,
                         *health_command(inside, python)])
    # The judge runs on the batch host, which runs this script: never on a node it may keep out.
    judge = ["srun", "--nodes=1", "--ntasks=1", *container, python, "-m", "harness.preflight", "--out",
             str(inside.out_dir), "--nodes", str(spec.nodes), "--max-marked-share", str(checks.max_marked_share),
             "--allocated"]
    blame = ["--blame-failures"] if spec.max_restarts else []  # after a requeue: keep out the node that failed
    return [
        "# Preflight: every node of the allocation checks itself (harness.health); the healthiest "
        f"{spec.nodes} train.",
        'allocated=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | paste -sd, -)',
        "# Reports of an earlier attempt would pass for this one's: every node writes afresh.",
        f"rm -rf -- {shlex.quote(str(spec.out_dir / NODES_DIR))}",
        "# The judge times the whole preflight on this host's monotonic clock (harness.preflight.boot_clock).",
        "preflight_began=$(cut -d ' ' -f 1 /proc/uptime)",
        "# The nodes meet for the between-node all-reduces at the first node (these variables reach this step only).",
        f'MASTER_ADDR="$(node_addr "${{allocated%%,*}}")" MASTER_PORT={spec.profile.slurm.rendezvous_port + 1} '
        f'HARNESS_HEALTH_KILL_AT="$(( $(date +%s) + {deadline_min * 60} ))" '
        f"{health} || true  # a node without a report is judged failed below",
        f'training_nodes=$({shlex.join(judge[:3])} --nodelist="${{SLURMD_NODENAME}}" {shlex.join(judge[3:])} '
        f'"${{allocated}}" --began "${{preflight_began}}" {shlex.join(blame)}) || exit {EXIT_PREFLIGHT}',
    ]


def sbatch_script(spec: JobSpec, train: bool = True) -> str:
    """The whole batch script for a resolved spec: deterministic, so a dry run can be diffed.
    With spec.preflight the nodes are checked first; `train=False`: preflight only (`harness preflight`)."""
    profile, slurm = spec.profile, spec.profile.slurm
    nproc = cluster_procs_per_node(spec)
    allocation = spec.nodes + spec.spare_nodes if spec.preflight else spec.nodes
    directives = [_directive("job-name", spec.name), _directive("nodes", allocation),
                  _directive("ntasks-per-node", 1)]
    if spec.gpus():
        directives.append(_directive("gres", f"gpu:{spec.gpus()}") if slurm.use_gres
                          else _directive("gpus-per-node", spec.gpus()))
    if slurm.exclusive:
        directives.append("#SBATCH --exclusive")
    directives.append(_directive("time", slurm.time or slurm_time(campaign_minutes(spec)[0])))
    if slurm.requeue or spec.max_restarts:  # a lost node requeues the job too (the agent keeps the budget)
        directives.append("#SBATCH --requeue")
    for option in ("partition", "account", "constraint"):
        if getattr(slurm, option):
            directives.append(_directive(option, getattr(slurm, option)))
    directives += [_directive("output", spec.out_dir / OUTPUT_PATTERN), "#SBATCH --open-mode=append"]

    # Every rank but 0 writes its output to <out>/logs/rank_<r>.out, so the job's output file holds rank 0
    # and the node agents rather than thousands of ranks interleaved (workloads.__main__ reads this).
    env = {**profile.env, **spec.env, RANK_OUTPUT_ENV: "1"}
    if profile.image:
        env[IMAGE_ENV] = profile.image  # named by the start-up check when the image cannot run the harness
    exports = [f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())]
    inside, container = in_container(spec)
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", *container]
    expanded = set()
    if spec.preflight:  # the training step runs on the nodes preflight kept, inside the same allocation
        srun[1:1] = [f"--nodes={spec.nodes}", f"--ntasks={spec.nodes}", '--nodelist="${training_nodes}"']
        expanded.add('--nodelist="${training_nodes}"')
    # Inside a container the image's python runs the agent; on bare nodes, the one that runs us here.
    python = "python" if profile.image else sys.executable
    # Three values exist only on the allocation, so they stay shell variables; every other word is quoted.
    # Each run is a step of its own (see _training_lines), with a rendezvous of its own (the last step's is closed):
    # its workers do run ${run} (and any unfinished before it).
    endpoint, step_id, run = f'"${{head_addr}}:{slurm.rendezvous_port}"', '"${SLURM_JOB_ID}-${run}"', '"${run}"'
    # --launch: every run's step records its attempts with that run, since all of one allocation share an attempt.
    agent = [*agent_command(inside, python, nproc, rendezvous=endpoint, rdzv_id=step_id, launch=run), "--last-run", run]
    expanded |= {f"--rdzv-endpoint={endpoint}", f"--rdzv-id={step_id}", run}
    command = " ".join(word if word in expanded else shlex.quote(word) for word in srun + agent)
    # After every attempt one process reads every node's attempt record, merges them and decides.
    # After preflight the decide step runs on a training node, never on one preflight kept out.
    on_node = ['--nodelist="${training_nodes%%,*}"'] if spec.preflight else []
    decide = " ".join(word if word in on_node else shlex.quote(word) for word in [
        "srun", "--nodes=1", "--ntasks=1", *on_node, *container, python, "-c", AGENT_BOOTSTRAP, "--decide",
        "--out", str(inside.out_dir), "--max-restarts", str(spec.max_restarts)])
    lines = [
        "#!/bin/bash",
        f"# mlperf-harness: {spec.benchmark} ({spec.preset}), {spec.nodes} node(s) x {nproc} process(es), "
        f"profile {profile.name}",
        *directives,
        "",
        "set -euo pipefail",
        *exports,
        "# Threads per process: the CPUs Slurm gave this node, shared by its processes (unless set above).",
        f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-$(( ${{SLURM_CPUS_ON_NODE:-{nproc}}} / {nproc} > 0 ? '
        f'${{SLURM_CPUS_ON_NODE:-{nproc}}} / {nproc} : 1 ))}}"',
        "# A node's address as Slurm knows it (its NodeAddr), else its name.",
        'node_addr() { addr=$(scontrol show node "$1" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\'); '
        'echo "${addr:-$1}"; }',
        *(preflight_lines(spec, inside, container, python) if spec.preflight or not train else []),
        *(_training_lines(spec, command, decide) if train else []),
        "",
    ]
    return "\n".join(lines)


def _training_lines(spec: JobSpec, command: str, decide: str) -> list[str]:
    """One training step per run, each after its own flush step, as NVIDIA's run.sub loops over its experiments
    (`for _experiment_index in $(seq -w 1 "${NEXP}")`: the host-side drop_caches srun, then that run's srun;
    mlcommons/training_results_v3.1 NVIDIA/benchmarks/bert/implementations/v30-pytorch/run.sub).
    A requeued job goes on at the first run whose log has no run_stop: the finished ones keep their results."""
    first = '${training_nodes%%,*}' if spec.preflight else \
        '$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)'
    stopped = json.dumps({"key": C.RUN_STOP})[1:-1]  # the line mllog writes for run_stop
    result = shlex.quote(str(spec.out_dir / "result_"))  # result_<run>.txt, outside the container
    flush = slurm_flush_lines(spec, '--nodelist="${training_nodes}"' if spec.preflight else None)
    return [
        "# The rendezvous host: the first training node, at the address Slurm uses for it.",
        f'head_addr=$(node_addr "{first}")',
        "status=0",
        f"for run in $(seq 0 {spec.runs - 1}); do",
        f'  if grep -qsF {shlex.quote(stopped)} {result}"${{run}}.txt"; then continue; fi  # finished before a requeue',
        *(f"  {line}" for line in flush),
        f"  {command} || {{ status=$?; break; }}",
        "done",
        f"decision=0; {decide} || decision=$?",
        f'if [ "${{decision}}" -eq {EXIT_RETRY} ]; then',
        "  # An infrastructure failure with restarts left: back into the queue; SLURM_RESTART_COUNT counts it.",
        '  scontrol requeue "${SLURM_JOB_ID}"',
        "  exit 0",
        "fi",
        'exit "$(( decision != 0 ? decision : status ))"',
    ]


DRAIN_REASON = "harness preflight:"  # how every drain reason the harness writes begins, and only those


def _drained_by_harness(node: str) -> bool:
    """Whether `node` is drained (DRAIN in its state) with a reason the harness wrote (scontrol show node)."""
    shown = _run(["scontrol", "show", "node", node]).stdout
    state = re.search(r"\bState=(\S+)", shown)
    reason = re.search(r"\bReason=(.*?)(?: \[[^\]]*\])?\s*$", shown, re.M)
    return bool(state and "DRAIN" in state.group(1) and reason and reason.group(1).startswith(DRAIN_REASON))


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    if shutil.which(argv[0]) is None:
        raise HarnessError(f"{argv[0]} not found: the slurm backend runs on a Slurm login node "
                           "(plain Slurm, SUNK or Slinky) with the Slurm client commands on PATH")
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


class SlurmLauncher(Launcher):
    name = "slurm"
    preflight_in_allocation = True

    def runs_root(self, spec: JobSpec) -> Path | None:
        return Path(spec.profile.slurm.results_dir) if spec.profile.slurm.results_dir else None

    def render(self, spec: JobSpec) -> Request:
        script = sbatch_script(spec)
        plan = workload_plan(spec, cluster_procs_per_node(spec), spec.profile.gpu_memory_gib if spec.gpus() else None)
        minutes, parts = campaign_minutes(spec)
        if not spec.profile.slurm.time:
            plan += (f"note: --time={slurm_time(minutes)} from the campaign's plan ({parts}); "
                     "--run-minutes or --set slurm.time=... to change it",)
        return Request(backend=self.name, spec=spec, text=script, payload={"script": script}, notes=plan)

    def problems(self, spec: JobSpec) -> list[str]:
        """A profile's slurm.time shorter than the campaign's plan: the allocation would end mid-campaign."""
        if not spec.profile.slurm.time:
            return []
        given = parse_slurm_time(spec.profile.slurm.time)
        minutes, parts = campaign_minutes(spec)
        if given is None or given >= minutes:
            return []
        return [f"slurm.time {spec.profile.slurm.time} is shorter than the campaign's plan, {slurm_time(minutes)} "
                f"({parts}): --set slurm.time={slurm_time(minutes)}, fewer --runs, or --run-minutes if this "
                "cluster's runs are faster"]

    def render_preflight(self, spec: JobSpec) -> Request:
        script = sbatch_script(spec, train=False)
        return Request(backend=self.name, spec=spec, text=script, payload={"script": script})

    def remediate(self, spec: JobSpec, preflight: dict) -> list[str]:
        """Drain each node the decision marks (with --drain-bad-nodes; none where the failure is systemic), its first
        failed check as the reason; the training step already ran without it (srun --nodelist). A node that passed
        and that the harness drained before (its reason is the harness's own) is resumed; no other drain is
        touched."""
        done = [preflight["systemic"]] if preflight.get("systemic") else []
        marked = to_mark(preflight)
        for node, reasons in preflight["excluded"].items():
            if node not in marked:
                continue
            if not spec.drain_bad_nodes:
                done.append(f"{node} kept out of the training step (--drain-bad-nodes would drain it)")
                continue
            why = f"{DRAIN_REASON} {reasons[0]}"
            proc = _run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={why}"])
            done.append(f"{node} drained: {why}" if proc.returncode == 0 else
                        f"{node} not drained: scontrol said {proc.stderr.strip() or proc.stdout.strip()}")
        for node, verdict in preflight["nodes"].items():
            if verdict["ok"] and _drained_by_harness(node):
                proc = _run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
                done.append(f"{node} resumed: it passed again (drained by {DRAIN_REASON[:-1]} before)"
                            if proc.returncode == 0 else
                            f"{node} not resumed: scontrol said {proc.stderr.strip() or proc.stdout.strip()}")
        return done

    def submit(self, request: Request) -> Handle:
        out_dir = request.spec.out_dir
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        script = out_dir / SCRIPT_FILE
        script.write_text(request.payload["script"])
        proc = _run(["sbatch", "--parsable", str(script)])
        if proc.returncode != 0:
            raise HarnessError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}", 1)
        job_id = proc.stdout.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"
        if not job_id.isdigit():
            raise HarnessError(f"sbatch answered {proc.stdout.strip()!r}, not a job id", 1)
        handle = Handle(backend=self.name, job_id=job_id, out_dir=out_dir)
        handle.save(request, state=JobState.PENDING.value, script=str(script))
        return handle

    def _slurm_state(self, job_id: str) -> str | None:
        """The job's state from squeue, else scontrol (finished jobs, for MinJobAge), else sacct."""
        proc = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.split()[0]
        squeue_error = proc.stderr.strip() if proc.returncode != 0 else ""
        proc = _run(["scontrol", "show", "job", "-o", job_id])
        found = re.search(r"\bJobState=(\S+)", proc.stdout)
        if found:
            return found.group(1)
        if squeue_error and proc.returncode != 0 and "Invalid job id" not in proc.stderr:
            raise HarnessError(f"cannot reach the Slurm controller ({squeue_error}); job {job_id} may still "
                               "run: check it with squeue, or stop it with `harness cancel`", 1)
        if shutil.which("sacct"):
            proc = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"], capture_output=True,
                                  text=True, timeout=60)
            if proc.returncode == 0 and proc.stdout.strip():
                return proc.stdout.split()[0]  # e.g. "CANCELLED by 0" -> CANCELLED
        return None

    def status(self, handle: Handle) -> JobState:
        recorded = JobState(handle.record().get("state", JobState.UNKNOWN.value))
        if recorded.terminal:
            return recorded
        slurm_state = self._slurm_state(handle.job_id)
        state = STATES.get(slurm_state or "", JobState.UNKNOWN)
        if state is JobState.PENDING:
            unfit = self._cannot_fit(handle.job_id)
            if unfit:  # a requeued job that lost a node it needs: fail now, with why, rather than wait forever
                _run(["scancel", handle.job_id])
                return record_state(handle, JobState.FAILED, slurm_state=slurm_state, failure=unfit)
        if state.terminal:
            return record_state(handle, state, slurm_state=slurm_state, exit_code=self._exit_code(handle.job_id))
        return state

    def _cannot_fit(self, job_id: str) -> str | None:
        """Why a requeued job can no longer start, or None. Slurm's reason alone is no verdict: a job pending
        on ReqNodeNotAvail on a busy partition starts once nodes free up, so it is given up only when the
        partition's usable nodes (up, not drained: idle, mixed or allocated) are fewer than it needs."""
        shown = _run(["scontrol", "show", "job", "-o", job_id]).stdout
        fields = dict(re.findall(r"\b(Restarts|Reason|NumNodes|Partition)=(\S+)", shown))
        if int(fields.get("Restarts", "0")) == 0 or not UNFIT_REASON.search(fields.get("Reason", "")):
            return None
        listed = _run(["sinfo", "-h", "-p", fields.get("Partition", ""), "-t", "idle,mixed,allocated",
                       "-o", "%D"]).stdout.split()
        usable = sum(int(n) for n in listed if n.isdigit())
        needed = re.match(r"\d+", fields.get("NumNodes", ""))
        if needed is None or usable >= int(needed.group()):
            return None
        return (f"Slurm job {job_id} was requeued after a failure but cannot start again: it needs "
                f"{needed.group()} node(s) and partition {fields.get('Partition', '?')} has {usable} usable "
                f"(Slurm's reason: {fields['Reason']}); the job was cancelled: run it again with fewer --nodes, "
                "or once the nodes are back")

    def _exit_code(self, job_id: str) -> int | None:
        """The batch script's exit code (scontrol's ExitCode=<code>:<signal>), while Slurm remembers the job."""
        found = re.search(r"\bExitCode=(\d+):", _run(["scontrol", "show", "job", "-o", job_id]).stdout)
        return int(found.group(1)) if found else None

    def log_sources(self, handle: Handle, rank: int | None = None) -> list[LogSource]:
        """The job's output file first, which holds rank 0's console and the node agents' (every other rank writes
        its own, logs/rank_<r>.out: workloads.common.rank_output), where rank 0 or every rank is asked for."""
        output = handle.out_dir / OUTPUT_PATTERN.replace("%j", handle.job_id)
        first = [FileLog(output)] if rank in (None, 0) and output.is_file() else []
        return first + super().log_sources(handle, rank)

    def cancel(self, handle: Handle) -> None:
        if self.status(handle).terminal:
            return
        # Recorded once Slurm took it: a refused scancel leaves the job's state as it is, and says why.
        proc = _run(["scancel", handle.job_id])
        if proc.returncode != 0:
            raise HarnessError(f"scancel {handle.job_id} failed, the job is not cancelled: "
                               f"{proc.stderr.strip() or f'exit code {proc.returncode}'}", 1)
        record_cancel(handle, state=JobState.CANCELLED.value)

