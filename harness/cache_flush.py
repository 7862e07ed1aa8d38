"""The page-cache flush before each run, where each backend can do it (workloads.common.page_cache says why).

Slurm: a host-side step, one task per node and outside the container, before the training step, as NVIDIA's
run.sub does it (`srun --ntasks="${SLURM_JOB_NUM_NODES}" bash -c "... sync && ${DROPCACHE_CMD}"`); the command
is the profile's `slurm.flush_page_cache`. Kubernetes: where the profile opts in (`kubernetes.flush_page_cache`),
a privileged init container in each pod, the only part of the job that asks for privilege. Either leaves its
node's record in the run folder, which the node's first run takes; a run whose flush failed says why, and a
closed one stops unless the user accepts it (--allow-unflushed-cache).
"""

from __future__ import annotations

import shlex

from kubernetes import client as k8s

from harness.errors import HarnessError
from harness.spec import JobSpec
from workloads.common.page_cache import HOST_FLUSH_COMMAND, host_flush_script

INIT_CONTAINER = "flush-page-cache"


def slurm_flush_lines(spec: JobSpec, nodelist: str | None) -> list[str]:
    """The sbatch lines of the host-side flush step on the training nodes (none if the profile turns it off).
    A failed step does not stop the job: each run then reads why in its node's record, or finds none."""
    command = spec.profile.slurm.flush_page_cache
    if not command:
        return []
    srun = ["srun", f"--nodes={spec.nodes}", f"--ntasks={spec.nodes}", "--ntasks-per-node=1"]
    where = [nodelist] if nodelist else []
    script = shlex.quote(host_flush_script(str(spec.out_dir), command))
    return ["# Flush each node's page cache on the host, outside the container, before the run (MLPerf's rules).",
            f"{' '.join([*map(shlex.quote, srun), *where])} bash -c {script} || true"]


def kubernetes_flush_init(spec: JobSpec, out_dir: str, mounts: list[k8s.V1VolumeMount]
                          ) -> list[k8s.V1Container] | None:
    """The privileged init container that flushes the pod's node before the run, if the profile opts in."""
    kube = spec.profile.kubernetes
    if not kube.flush_page_cache:
        return None
    if not kube.results_pvc:
        raise HarnessError("kubernetes.flush_page_cache needs kubernetes.results_pvc: the init step leaves its "
                           "record in the run folder on that volume, where the run reads it")
    return [k8s.V1Container(name=INIT_CONTAINER, image=spec.profile.image,
                            command=["bash", "-c", host_flush_script(out_dir, HOST_FLUSH_COMMAND)],
                            volume_mounts=mounts, security_context=k8s.V1SecurityContext(privileged=True))]
