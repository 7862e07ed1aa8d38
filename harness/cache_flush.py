"""The page-cache flush before each run, where each backend can do it (workloads.common.page_cache says why).

Slurm: a host-side step, one task per node and outside the container, before each run's training step, as
NVIDIA's run.sub does it in its loop over the experiments (`srun --ntasks="${SLURM_JOB_NUM_NODES}" bash -c
"... sync && ${DROPCACHE_CMD}"`, then that run's srun); the command is the profile's `slurm.flush_page_cache`.
Kubernetes: where the profile opts in (`kubernetes.flush_page_cache`), a privileged init container in each pod,
the only part of the job that asks for privilege. It runs once, when the pods start, so a closed campaign of
several runs runs each run as a job of its own there (KubernetesLauncher.launches). Either leaves its node's record in
the run folder, which the node's next run takes; a run whose flush failed says why, and a closed one stops
unless the user accepts it (--allow-unflushed-cache).
"""

from __future__ import annotations

import shlex

from kubernetes import client as k8s
from mlperf_logging.mllog import constants as C

from harness.errors import HarnessError
from harness.spec import JobSpec
from workloads.common.mlperf import division
from workloads.common.page_cache import ALLOW_FLAG, HOST_FLUSH_COMMAND, RECORDS, host_flush_script

INIT_CONTAINER = "flush-page-cache"
FLUSH_SCRIPT_ENV = "HARNESS_FLUSH_SCRIPT"
# What a TrainJob's ClusterTrainingRuntime must hold for the flush: the kubelet expands $(VAR) in a container's
# command from its env, so that container runs the script the TrainJob's patch gives it, whatever the run folder.
RUNTIME_INIT = f"an init container named {INIT_CONTAINER!r} with the harness image and command " \
               f"[bash, -c, $({FLUSH_SCRIPT_ENV})]"


def slurm_flush_lines(spec: JobSpec, nodelist: str | None) -> list[str]:
    """The sbatch lines of the host-side flush step on the training nodes (none if the profile turns it off),
    which the batch script runs before each run's training step. A failed step does not stop the job: the run
    then reads why in its node's record, or finds none (a node's record left by an earlier step, which a run
    continuing after a requeue did not take, is removed first, so that it never passes for this step's)."""
    command = spec.profile.slurm.flush_page_cache
    if not command:
        return []
    srun = ["srun", f"--nodes={spec.nodes}", f"--ntasks={spec.nodes}", "--ntasks-per-node=1"]
    where = [nodelist] if nodelist else []
    script = shlex.quote(host_flush_script(str(spec.out_dir), command))
    return ["# Flush each node's page cache on the host, outside the container, before the run (MLPerf's rules).",
            f"rm -rf -- {shlex.quote(str(spec.out_dir / RECORDS))}",
            f"{' '.join([*map(shlex.quote, srun), *where])} bash -c {script} || true"]


def kubernetes_flush_init(spec: JobSpec, out_dir: str, mounts: list[k8s.V1VolumeMount]
                          ) -> list[k8s.V1Container] | None:
    """The privileged init container that flushes the pod's node before the run, if the profile opts in."""
    if not _flush_wanted(spec):
        return None
    return [k8s.V1Container(name=INIT_CONTAINER, image=spec.profile.image,
                            command=["bash", "-c", host_flush_script(out_dir, HOST_FLUSH_COMMAND)],
                            volume_mounts=mounts, security_context=k8s.V1SecurityContext(privileged=True))]


def trainjob_flush_patch(spec: JobSpec, out_dir: str, mounts: list[dict]) -> list[dict] | None:
    """The same init step on a TrainJob, if the profile opts in: the runtime patch of the init container
    INIT_CONTAINER, privileged, with the results volume and the flush script in FLUSH_SCRIPT_ENV. A TrainJob's
    patch of an init container carries only its env, volume mounts and security context (trainer v2.3's CRD),
    so the ClusterTrainingRuntime must hold the container itself: RUNTIME_INIT says what (trainjob_notes)."""
    if not _flush_wanted(spec):
        return None
    # The kubelet expands $(VAR) in env values too, and reads $$ as $: doubled, the script reaches bash unchanged.
    script = host_flush_script(out_dir).replace("$", "$$")
    return [{"name": INIT_CONTAINER, "env": [{"name": FLUSH_SCRIPT_ENV, "value": script}], "volumeMounts": mounts,
             "securityContext": {"privileged": True}}]


def _flush_wanted(spec: JobSpec) -> bool:
    """Whether the profile opts in to the init step; refused where the step cannot do what a run needs of it."""
    kube = spec.profile.kubernetes
    if not kube.flush_page_cache:
        return False
    if not kube.results_pvc:
        raise HarnessError("kubernetes.flush_page_cache needs kubernetes.results_pvc: the init step leaves its "
                           "record in the run folder on that volume, where the run reads it")
    return True


def kubernetes_flush_problem(spec: JobSpec) -> str | None:
    """Why a closed campaign on Kubernetes would stop unflushed, naming the fix; None where it will not. Without the
    init step an unprivileged pod cannot drop its node's page cache, and a closed run stops before init_start."""
    if spec.profile.kubernetes.flush_page_cache or division(spec.preset) != C.CLOSED or spec.allow_unflushed_cache:
        return None
    return (f"a closed run stops before init_start unless its nodes' page cache is flushed, which an unprivileged pod "
            f"cannot do: --set kubernetes.flush_page_cache=true (a privileged init container, each run a job of its "
            f"own; the namespace needs pod-security.kubernetes.io/enforce=privileged), or accept unflushed runs "
            f"with {ALLOW_FLAG}")


# The setting that makes the flush work, per backend: said once when a campaign's runs went unflushed.
FLUSH_FIXES = {
    "slurm": "set slurm.flush_page_cache to a command that has root on the nodes, as NVIDIA's clusters do: "
             "--set slurm.flush_page_cache='sudo /sbin/sysctl vm.drop_caches=3'",
    "k8s": "--set kubernetes.flush_page_cache=true (a privileged init container; the namespace needs "
           "pod-security.kubernetes.io/enforce=privileged)",
    "local": "run the harness as root on the machine, or accept it (open runs only log cache_clear false)",
}


def unflushed_note(out_dir, backend: str) -> str | None:
    """One line for a campaign whose runs went unflushed (their run records' cache_clear moment), with the first
    reason and the profile setting that fixes it; None when every run was flushed. The workers say it per node
    and run; this is what the user reads at the end."""
    from workloads.common.run_record import read_json_lines, run_records

    missed = [(run, moment) for run, path in run_records(out_dir).items() for moment in read_json_lines(path)
              if moment.get("kind") == "cache_clear" and not moment.get("cleared")]
    if not missed:
        return None
    run, first = missed[0]
    why = "; ".join(first.get("why_not") or []) or "no reason recorded"
    return (f"note: the page cache was not flushed before {len(missed)} run(s) (run {run + 1}: {why}); "
            f"{FLUSH_FIXES.get(backend, FLUSH_FIXES['local'])}")
