"""Kubernetes: a Kubeflow PyTorchJob (kubeflow.org/v1) or a Trainer v2 TrainJob, built with the SDKs' models.

PyTorchJob (the default): a Master pod and `nodes - 1` Worker pods. TrainJob
(`--api trainjob`): `numNodes` nodes of the profile's ClusterTrainingRuntime, with
our pod settings as a runtime patch. Either way each pod runs one elastic agent
with one process per GPU, and the agents meet at a c10d rendezvous on the
PET_MASTER_ADDR/PORT the operator gives every pod. Pods ask for the profile's
GPUs and RDMA devices, get a memory-backed /dev/shm, add IPC_LOCK only when RDMA
is requested, never run privileged, and mount no service-account token. Rank 0
writes the MLPerf logs to the job's own folder on the results volume (a PVC),
named with a token drawn at submit; when the job ends, short-lived read-only pods
bring the run folder back through their logs, a manifest then bounded chunks. The
cluster is the system of record: each state change the harness sees is also
recorded as a Kubernetes Event on the job.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import secrets
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Callable

import yaml
from kubeflow.training import models as kf
from kubernetes import client as k8s

from harness import preflight
from harness.agent import HOST_ENV, NODE_ENV
from harness.cache_flush import kubernetes_flush_init
from harness.errors import HarnessError
from harness.launchers import kubernetes_nodes
from harness.launchers.base import (Handle, JobState, Launcher, Request, agent_command,
                                    cluster_procs_per_node, health_command, workload_plan)
from harness.mounts import Mount, check_inside, claim_mount
from harness.spec import JobSpec
from workloads.common.requirements_check import IMAGE_ENV

KUEUE_LABEL = "kueue.x-k8s.io/queue-name"
MANAGER = "mlperf-harness"  # owner of the TrainJob's runtime patch


@dataclass(frozen=True)
class _PodParts:
    """What every training pod gets, whichever job API carries it."""

    command: list[str]
    env: list[k8s.V1EnvVar]
    resources: k8s.V1ResourceRequirements | None
    volumes: list[k8s.V1Volume]
    mounts: list[k8s.V1VolumeMount]
    security: k8s.V1SecurityContext


def _pod_parts(spec: JobSpec, nproc: int, token: str) -> _PodParts:
    profile, kube = spec.profile, spec.profile.kubernetes
    if not profile.image:
        raise HarnessError(f"the k8s backend runs a container image, and profile {profile.name} names none: "
                           "set `image` in the profile or --set image=REGISTRY/IMAGE:TAG")
    limits = {}
    if spec.gpus():
        limits[profile.gpu_resource] = str(spec.gpus())
    if profile.rdma_resource:
        limits[profile.rdma_resource] = str(profile.rdma_count)
    # Pinned memory for RDMA needs IPC_LOCK; nothing else does, and nothing needs privileged mode.
    capabilities = k8s.V1Capabilities(add=["IPC_LOCK"]) if profile.rdma_resource else None
    volumes = [k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory",
                                                                             size_limit=kube.shm_size))]
    mounts = [k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm")]
    if kube.results_pvc:
        volumes.append(_results_volume(kube.results_pvc))
        mounts.append(k8s.V1VolumeMount(name="results", mount_path=kube.results_mount))
    for index, extra in enumerate(_extra_mounts(spec)):
        read_only = extra.spec.endswith(":ro")
        volumes.append(k8s.V1Volume(name=f"mount-{index}", persistent_volume_claim=(
            k8s.V1PersistentVolumeClaimVolumeSource(claim_name=extra.source, read_only=read_only or None))))
        mounts.append(k8s.V1VolumeMount(name=f"mount-{index}", mount_path=str(extra.target),
                                        read_only=read_only or None))
    _check_paths(spec)
    env = {**profile.env, **spec.env, IMAGE_ENV: profile.image}
    if spec.node_verdicts:
        env[preflight.VERDICTS_ENV] = json.dumps(spec.node_verdicts, separators=(",", ":"), sort_keys=True)
    in_pod = dataclasses.replace(spec, out_dir=PurePosixPath(pvc_folder(spec, token)))
    # Both operators give every pod PET_MASTER_ADDR/PORT; the kubelet expands $(VAR) in arguments.
    command = agent_command(in_pod, "python", nproc, rendezvous="$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
                            rdzv_id=spec.name, job_token=token)
    return _PodParts(
        command=command, env=[k8s.V1EnvVar(name=k, value=v) for k, v in sorted(env.items())],
        resources=k8s.V1ResourceRequirements(limits=limits, requests=limits) if limits else None,
        volumes=volumes, mounts=mounts,
        security=k8s.V1SecurityContext(privileged=False, allow_privilege_escalation=False,
                                       capabilities=capabilities))


def _extra_mounts(spec: JobSpec) -> list[Mount]:
    return [claim_mount(entry) for entry in spec.profile.kubernetes.mounts]


def _check_paths(spec: JobSpec) -> None:
    """--data and --init-checkpoint name paths inside the pods: refused unless a volume the pods mount holds them."""
    kube = spec.profile.kubernetes
    volumes = _extra_mounts(spec)
    if kube.results_pvc:
        volumes.append(Mount(kube.results_pvc, PurePosixPath(kube.results_mount), f"{kube.results_pvc}:"
                             f"{kube.results_mount}"))
    for key, flag in (("data", "--data"), ("init_checkpoint", "--init-checkpoint")):
        if getattr(spec, key) is not None:
            check_inside(getattr(spec, key), volumes, flag)


def _results_volume(claim: str) -> k8s.V1Volume:
    return k8s.V1Volume(name="results", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
        claim_name=claim))


def _pod_template(spec: JobSpec, nproc: int, token: str) -> k8s.V1PodTemplateSpec:
    profile, kube = spec.profile, spec.profile.kubernetes
    parts = _pod_parts(spec, nproc, token)
    # The operator recreates a failed pod under the same name, while its hostname is the node's under
    # hostNetwork: the pod's name is what lets the node agent find its own unfinished attempt.
    node = k8s.V1EnvVar(name=NODE_ENV, value_from=k8s.V1EnvVarSource(
        field_ref=k8s.V1ObjectFieldSelector(field_path="metadata.name")))
    # The Kubernetes node the pod runs on: the metrics' `node` label, as the DCGM exporter names it.
    host = k8s.V1EnvVar(name=HOST_ENV, value_from=k8s.V1EnvVarSource(
        field_ref=k8s.V1ObjectFieldSelector(field_path="spec.nodeName")))
    container = k8s.V1Container(
        name=PYTORCHJOB.container, image=profile.image, command=parts.command[:1], args=parts.command[1:],
        env=[*parts.env, node, host], resources=parts.resources, volume_mounts=parts.mounts,
        security_context=parts.security,
        ports=[k8s.V1ContainerPort(name="metrics", container_port=spec.metrics())] if spec.metrics() else None)
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(labels=_labels(spec, job=False)),
        spec=k8s.V1PodSpec(
            init_containers=kubernetes_flush_init(spec, pvc_folder(spec, token), parts.mounts),
            containers=[container], volumes=parts.volumes, host_network=profile.host_network or None,
            dns_policy="ClusterFirstWithHostNet" if profile.host_network else None,
            node_selector=kube.node_selector or None,
            tolerations=_tolerations(kube),
            priority_class_name=kube.priority_class, service_account_name=kube.service_account,
            automount_service_account_token=False))  # training needs no access to the API


def _tolerations(kube) -> list[k8s.V1Toleration] | None:
    return [_toleration(t) for t in kube.tolerations] or None


def _toleration(fields: dict) -> k8s.V1Toleration:
    """A profile's toleration, written as in a pod spec (tolerationSeconds) or in the client's snake_case."""
    names = {wire: attr for attr, wire in k8s.V1Toleration.attribute_map.items()}
    unknown = sorted(set(fields) - set(names) - set(names.values()))
    if unknown:
        raise HarnessError(f"toleration {fields}: unknown field(s) {', '.join(unknown)}; valid: {', '.join(names)}")
    return k8s.V1Toleration(**{names.get(key, key): value for key, value in fields.items()})


def _labels(spec: JobSpec, job: bool = True) -> dict[str, str]:
    """The job's labels; its pods get the same without Kueue's, which belongs on the job alone."""
    labels = {"app.kubernetes.io/name": "mlperf-harness", "mlperf-harness/benchmark": spec.benchmark}
    if job and spec.profile.kubernetes.queue:
        labels[KUEUE_LABEL] = spec.profile.kubernetes.queue
    return labels


def pvc_folder(spec: JobSpec, token: str) -> str:
    """The job's own run folder inside the pods, on the shared results volume: the local folder's name and
    the job's token, so that two jobs with the same --out name never share one (see `render`)."""
    return f"{spec.profile.kubernetes.results_mount}/{spec.out_dir.name}-{token}"


TOKEN_HEX = 8


def render_token(spec: JobSpec) -> str:
    """The token a dry run shows: derived from the spec, so the same arguments print the same bytes.
    `submit` draws a fresh random one instead (KubernetesLauncher.submit)."""
    canonical = json.dumps(spec.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:TOKEN_HEX]


def pytorch_job(spec: JobSpec, token: str) -> dict:
    """The PyTorchJob for a resolved spec: `nodes` pods in all, gang-scheduled."""
    kube = spec.profile.kubernetes
    nproc = cluster_procs_per_node(spec)
    template = _pod_template(spec, nproc, token)
    # ExitCode: the operator deletes a pod whose agent exits with 128 or more (an infrastructure failure
    # with restarts left, harness.agent.EXIT_RETRY, or a signal) and creates it again under the same name,
    # and fails the job on 1 to 127. It counts none of this against backoffLimit (its PastBackoffLimit sums
    # container restarts, and these pods' containers never restart in place), so the harness's own record
    # is the budget: every recreated pod starts the next attempt, and one past the budget is refused.
    restart = "ExitCode" if spec.max_restarts else "Never"
    replicas = {"Master": kf.KubeflowOrgV1ReplicaSpec(replicas=1, restart_policy=restart, template=template)}
    if spec.nodes > 1:
        replicas["Worker"] = kf.KubeflowOrgV1ReplicaSpec(replicas=spec.nodes - 1, restart_policy=restart,
                                                         template=template)
    job = kf.KubeflowOrgV1PyTorchJob(
        api_version=PYTORCHJOB.api_version, kind=PYTORCHJOB.kind,
        metadata=k8s.V1ObjectMeta(name=spec.name, namespace=kube.namespace, labels=_labels(spec)),
        spec=kf.KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=str(nproc), pytorch_replica_specs=replicas,
            run_policy=kf.KubeflowOrgV1RunPolicy(
                # Running: a failed job's pods still waiting are deleted; the ended ones stay for `harness logs`
                backoff_limit=spec.max_restarts, clean_pod_policy="Running",
                scheduling_policy=kf.KubeflowOrgV1SchedulingPolicy(
                    min_available=spec.nodes, queue=kube.queue, priority_class=kube.priority_class))))
    return to_dict(job)


def train_job(spec: JobSpec, token: str) -> dict:
    """The Trainer v2 TrainJob for a resolved spec: the trainer step of the profile's ClusterTrainingRuntime.

    The runtime owns what a TrainJob cannot say (gang scheduling, priority, hostNetwork,
    the restart policy); the rest of the pod goes in as a runtime patch on its `node` job.
    """
    import kubeflow_trainer_api.models as tj  # 0.5 s of pydantic models, which only TrainJobs need

    kube = spec.profile.kubernetes
    nproc = cluster_procs_per_node(spec)
    parts = _pod_parts(spec, nproc, token)
    pod = k8s.V1PodSpec(containers=[], volumes=parts.volumes, node_selector=kube.node_selector or None,
                        tolerations=_tolerations(kube),
                        service_account_name=kube.service_account)
    pod_patch = to_dict(pod)
    pod_patch["containers"] = [{"name": TRAINJOB.container, "volumeMounts": to_dict(parts.mounts),
                                "securityContext": to_dict(parts.security)}]
    patch = tj.TrainerV1alpha1RuntimePatch(
        manager=MANAGER,
        training_runtime_spec=tj.TrainerV1alpha1TrainingRuntimeSpecPatch.from_dict({"template": {"spec": {
            "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {
                "metadata": {"labels": _labels(spec, job=False)}, "spec": pod_patch}}}}]}}}))
    job = tj.TrainerV1alpha1TrainJob(
        api_version=TRAINJOB.api_version, kind=TRAINJOB.kind,
        metadata=tj.IoK8sApimachineryPkgApisMetaV1ObjectMeta(name=spec.name, namespace=kube.namespace,
                                                             labels=_labels(spec)),
        spec=tj.TrainerV1alpha1TrainJobSpec(
            runtime_ref=tj.TrainerV1alpha1RuntimeRef(name=kube.trainjob_runtime, kind="ClusterTrainingRuntime",
                                                     api_group=TRAINJOB.group),
            trainer=tj.TrainerV1alpha1Trainer(
                image=spec.profile.image, command=parts.command[:1], args=parts.command[1:],
                env=[tj.IoK8sApiCoreV1EnvVar.from_dict(to_dict(e)) for e in parts.env] or None,
                num_nodes=spec.nodes, num_proc_per_node=nproc,
                resources_per_node=tj.IoK8sApiCoreV1ResourceRequirements.from_dict(to_dict(parts.resources))
                if parts.resources else None),
            runtime_patches=[patch]))
    return job.to_dict()


def pod_monitor(spec: JobSpec) -> dict:
    """A Prometheus Operator PodMonitor (monitoring.coreos.com/v1) that scrapes the job's pods' `metrics` port;
    the pod's Kubernetes node becomes the `host` label (the metrics' own `node` is the pod's name)."""
    api = APIS[spec.profile.kubernetes.api]
    if not spec.metrics():
        raise HarnessError("--pod-monitor needs metrics: the profile's metrics_port or --metrics-port is 0")
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": {"name": f"{spec.name}-metrics", "namespace": spec.profile.kubernetes.namespace,
                     "labels": _labels(spec, job=False)},
        "spec": {"selector": {"matchLabels": {api.pod_label: spec.name}},
                 "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s",
                                          "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_node_name"],
                                                           "targetLabel": "host"}]}]}}


def trainjob_notes(spec: JobSpec) -> list[str]:
    """Settings a TrainJob cannot carry: said aloud rather than dropped silently."""
    kube, runtime = spec.profile.kubernetes, spec.profile.kubernetes.trainjob_runtime
    unsaid = [name for name, value in (("priority_class", kube.priority_class),
                                       ("host_network", spec.profile.host_network),
                                       ("--max-restarts", spec.max_restarts)) if value]
    # The runtime patch's pod spec has no automountServiceAccountToken (trainer v2.3's CRD), so the
    # training pods' token is the runtime's to turn off, as a PyTorchJob's pods have it turned off.
    notes = [f"note: a TrainJob cannot keep the service-account token out of its pods: set "
             f"automountServiceAccountToken: false in the pod template of ClusterTrainingRuntime {runtime!r}"]
    if unsaid:
        notes.append(f"note: a TrainJob takes {', '.join(unsaid)} from its ClusterTrainingRuntime {runtime!r} "
                     "(podGroupPolicy, pod template, JobSet failurePolicy); set them there")
    return notes


def _excluding(body: dict, nodes: list[str]) -> dict:
    """The job's pod spec(s) with the node affinity that keeps them off `nodes` (preflight's exclusions)."""
    if body.get("kind") == TRAINJOB.kind:
        pods = [job["template"]["spec"]["template"]["spec"] for patch in body["spec"].get("runtimePatches", [])
                for job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]]
    else:
        pods = [replica["template"]["spec"] for replica in body["spec"]["pytorchReplicaSpecs"].values()]
    for pod in pods:
        kubernetes_nodes.with_exclusions(pod, nodes)
    return body


def to_dict(obj) -> dict:
    """A kubernetes-client model as the plain dict the API server receives (None fields dropped)."""
    return k8s.ApiClient().sanitize_for_serialization(obj)


def _last_true_condition(job: dict) -> dict | None:
    conditions = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    return conditions[-1] if conditions else None


# PyTorchJob conditions (the last one whose status is "True" wins) -> ours.
PYTORCHJOB_CONDITIONS = {"Created": JobState.PENDING, "Running": JobState.RUNNING, "Restarting": JobState.RUNNING,
                         "Succeeded": JobState.SUCCEEDED, "Failed": JobState.FAILED, "Suspended": JobState.PENDING}


def pytorchjob_state(job: dict) -> tuple[JobState, str]:
    """Our state and the operator's reason, from a PyTorchJob's status conditions."""
    last = _last_true_condition(job)
    if last is None:
        return JobState.PENDING, "no conditions yet"
    return PYTORCHJOB_CONDITIONS.get(last.get("type"), JobState.UNKNOWN), last.get("message") or last.get("type", "")


TRAINJOB_CONDITIONS = {"Complete": JobState.SUCCEEDED, "Failed": JobState.FAILED, "Suspended": JobState.PENDING}


def trainjob_state(job: dict) -> tuple[JobState, str]:
    """A TrainJob has conditions only at the ends (and when suspended); in between, its child Jobs say."""
    last = _last_true_condition(job)
    if last is not None and last.get("type") in TRAINJOB_CONDITIONS:
        return TRAINJOB_CONDITIONS[last["type"]], last.get("message") or last["type"]
    jobs = (job.get("status") or {}).get("jobsStatus") or []
    if any((j.get("active") or 0) + (j.get("ready") or 0) > 0 for j in jobs):
        return JobState.RUNNING, ", ".join(f"{j.get('name')}: {j.get('active') or 0} active" for j in jobs)
    return JobState.PENDING, last.get("type", "") if last else "no child jobs running yet"


@dataclass(frozen=True)
class JobApi:
    """One Kubeflow job resource: where it lives, how it is built, how its state reads, how its pods are found."""

    group: str
    version: str
    plural: str
    kind: str
    pod_label: str  # the label the operator puts on the job's pods, valued with the job's name
    container: str  # the training container's name, which the operator looks for
    build: Callable[[JobSpec, str], dict]  # (spec, token) -> the job
    state: Callable[[dict], tuple[JobState, str]]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


PYTORCHJOB = JobApi("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob", "training.kubeflow.org/job-name", "pytorch",
                    pytorch_job, pytorchjob_state)
TRAINJOB = JobApi("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob", "jobset.sigs.k8s.io/jobset-name",
                  "node", train_job, trainjob_state)
APIS = {"pytorchjob": PYTORCHJOB, "trainjob": TRAINJOB}


def _api():
    """The official client, configured from KUBECONFIG / ~/.kube/config, or in-cluster."""
    from kubernetes import config

    try:
        # Read KUBECONFIG now: the client reads it once, at import.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    except (config.ConfigException, OSError):  # no kubeconfig: maybe we run inside a pod
        try:
            config.load_incluster_config()
        except config.ConfigException:
            raise HarnessError("no Kubernetes configuration found: set KUBECONFIG or run inside the cluster") \
                from None
    api = k8s.ApiClient()
    return k8s.CustomObjectsApi(api), k8s.CoreV1Api(api)


def _call(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except k8s.ApiException as exc:
        hint = "; pick another --name or delete the old job" if exc.status == 409 else ""
        raise HarnessError(f"Kubernetes refused to {what}: {exc.status} {exc.reason}: {exc.body}{hint}", 1) from None
    except OSError as exc:  # urllib3's connection errors
        raise HarnessError(f"cannot reach the Kubernetes API to {what}: {exc}", 1) from None


# Collection runs in short-lived pods on the results volume, read-only, and reads back through the pod-log
# API: first a manifest of the run folder (every file but the checkpoints: name, size, sha256), then the
# files' bytes in chunks, one pod per chunk. The kubelet rotates a container's log at 10 MiB
# (containerLogMaxSize) and the log API serves only the newest part, so no pod prints more than
# CHUNK_BYTES (base64: 4/3 of that). Nothing but the client's pod and log calls is needed.
MANIFEST_SCRIPT = """\
import hashlib, json, os, sys
root = sys.argv[1]
if not os.path.isdir(root):
    sys.exit(f"no folder {root}")
files = []
for folder, subfolders, names in os.walk(root):
    subfolders[:] = sorted(d for d in subfolders if os.path.relpath(os.path.join(folder, d), root) != "checkpoints")
    for name in sorted(names):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not os.path.islink(path):
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(2**20), b""):
                    digest.update(block)
            files.append([os.path.relpath(path, root), os.path.getsize(path), digest.hexdigest()])
print(json.dumps(files))
"""
CHUNK_SCRIPT = """\
import base64, json, os, sys
root, pieces = sys.argv[1], json.loads(sys.argv[2])
out = bytearray()
for name, offset, length in pieces:
    with open(os.path.join(root, name), "rb") as f:
        f.seek(offset)
        out += f.read(length)
sys.stdout.write(base64.b64encode(bytes(out)).decode())
"""
CHUNK_BYTES = 4 * 2**20  # 5.3 MiB of base64 per pod log, well under the kubelet's 10 MiB rotation
ARG_BYTES = 64 * 2**10  # a chunk's pieces, as one argument: Linux takes at most 128 KiB in one
COLLECT_TIMEOUT_S = 300


@dataclass(frozen=True)
class RemoteFile:
    name: str  # relative to the run folder, POSIX
    size: int
    sha256: str


def parse_manifest(text: str) -> list[RemoteFile]:
    """The results pod's manifest; a name that tarfile's `data` filter would refuse or alter (absolute,
    '..', outside the folder) is refused, so nothing lands outside the local run folder."""
    try:
        files = [RemoteFile(str(name), int(size), str(digest)) for name, size, digest in json.loads(text)]
        for remote in files:
            member = tarfile.TarInfo(remote.name)
            member.size = remote.size
            if tarfile.data_filter(member, "/collect").name != remote.name or remote.size < 0:
                raise ValueError(f"{remote.name!r} is not a plain name inside the run folder")
        return files
    except (ValueError, TypeError, tarfile.FilterError) as exc:
        raise HarnessError(f"the results pod's manifest is unreadable: {exc}", 1) from None


def plan_chunks(files: list[RemoteFile], limit: int = CHUNK_BYTES,
                arg_limit: int = ARG_BYTES) -> list[list[tuple[str, int, int]]]:
    """(name, offset, length) pieces, grouped so that no chunk holds more than `limit` bytes, nor more
    pieces than fit in `arg_limit` bytes of arguments: small files share a chunk, a large one spans several."""
    chunks: list[list[tuple[str, int, int]]] = [[]]
    room = arg_room = 0

    def next_chunk() -> None:
        nonlocal room, arg_room
        if chunks[-1]:
            chunks.append([])
        room, arg_room = limit, arg_limit

    next_chunk()
    for remote in files:
        offset = 0
        while True:
            arg = len(json.dumps([remote.name, remote.size, remote.size])) + 2  # the piece's widest form
            if arg > arg_room:
                next_chunk()
            length = min(room, remote.size - offset)
            chunks[-1].append((remote.name, offset, length))
            offset, room, arg_room = offset + length, room - length, arg_room - arg
            if room == 0:
                next_chunk()
            if offset >= remote.size:
                break
    return [chunk for chunk in chunks if chunk]


def write_pieces(staging: Path, pieces: list[tuple[str, int, int]], log: str) -> None:
    """Write one chunk's bytes (its pod's log, base64) into the staged files at their offsets."""
    try:
        data = base64.b64decode(log.strip(), validate=True)
    except ValueError as exc:
        raise HarnessError(f"a results pod's chunk is unreadable: {exc}", 1) from None
    if len(data) != sum(length for _, _, length in pieces):
        raise HarnessError(f"a results pod's chunk holds {len(data)} bytes, not the "
                           f"{sum(length for _, _, length in pieces)} asked for; was its log cut?", 1)
    at = 0
    for name, offset, length in pieces:
        path = staging / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+b" if path.exists() else "wb") as f:
            f.seek(offset)
            f.write(data[at:at + length])
        at += length


def merge_run_folder(staging: Path, files: list[RemoteFile], out_dir: Path) -> tuple[list[Path], list[str]]:
    """Move the staged files into out_dir once each matches its manifest checksum: new files are added,
    identical ones skipped, and a local file that differs is kept as it is (and named), so nothing
    already written is lost."""
    for remote in files:
        path = staging / remote.name
        with open(path, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != remote.sha256:
                raise HarnessError(f"{remote.name} changed on the results volume while it was collected; "
                                   "run `harness collect` again", 1)
    fetched, kept = [], []
    for remote in files:
        source, target = staging / remote.name, out_dir / remote.name
        if target.exists() and target.read_bytes() == source.read_bytes():
            continue
        if target.exists():
            kept.append(remote.name)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)
        fetched.append(target)
    return fetched, kept


def collector_pod(spec: JobSpec, name: str, script: str, args: list[str]) -> k8s.V1Pod:
    """A one-shot pod that runs `script` on the results volume, read-only and unprivileged."""
    kube = spec.profile.kubernetes
    container = k8s.V1Container(
        name="collect", image=spec.profile.image, command=["python", "-c", script, *args],
        volume_mounts=[k8s.V1VolumeMount(name="results", mount_path=kube.results_mount, read_only=True)],
        resources=k8s.V1ResourceRequirements(requests={"cpu": "100m", "memory": "256Mi"}),
        security_context=k8s.V1SecurityContext(privileged=False, allow_privilege_escalation=False,
                                               read_only_root_filesystem=True))
    return k8s.V1Pod(
        api_version="v1", kind="Pod",
        metadata=k8s.V1ObjectMeta(name=name, namespace=kube.namespace,
                                  labels={"app.kubernetes.io/name": "mlperf-harness", "mlperf-harness/role": "collect"}),
        spec=k8s.V1PodSpec(containers=[container], volumes=[_results_volume(kube.results_pvc)],
                           restart_policy="Never", automount_service_account_token=False,
                           tolerations=_tolerations(kube)))


class KubernetesLauncher(Launcher):
    name = "k8s"
    paths_here = False  # --data and --init-checkpoint name paths inside the pods

    def render(self, spec: JobSpec) -> Request:
        """The job with the token derived from the spec (a dry run prints the same bytes for the same
        arguments); `submit` renders it again with a fresh random token."""
        return self._request(spec, render_token(spec))

    def _request(self, spec: JobSpec, token: str) -> Request:
        api = APIS[spec.profile.kubernetes.api]
        body = _excluding(api.build(spec, token), spec.exclude_nodes)
        text = yaml.safe_dump(body, sort_keys=True, default_flow_style=False)
        notes = workload_plan(spec, cluster_procs_per_node(spec), spec.profile.gpu_memory_gib if spec.gpus() else None)
        notes += tuple(trainjob_notes(spec)) if api is TRAINJOB else ()
        return Request(backend=self.name, spec=spec, text=text, payload={"body": body, "token": token},
                       notes=notes)

    def render_preflight(self, spec: JobSpec) -> Request:
        """The health job: a PyTorchJob with a pod on each of nodes + spare_nodes nodes (kubernetes_nodes)."""
        checked = kubernetes_nodes.health_spec(spec)
        token = secrets.token_hex(TOKEN_HEX // 2)  # a folder of its own: an earlier check's reports never count
        in_pod = dataclasses.replace(checked, out_dir=PurePosixPath(pvc_folder(checked, token)))
        body = kubernetes_nodes.health_job(_excluding(pytorch_job(checked, token), spec.exclude_nodes), spec,
                                           health_command(in_pod, "python"))
        return Request(backend=self.name, spec=checked, text=yaml.safe_dump(body, sort_keys=True),
                       payload={"body": body, "token": token, "health": True})

    def remediate(self, spec: JobSpec, preflight: dict) -> list[str]:
        _, core = _api()
        return kubernetes_nodes.remediate(core, _call, spec, preflight)

    def restart_watcher(self, spec: JobSpec, handle: Handle):
        """With preflight and restarts, on a PyTorchJob: harness.launchers.kubernetes_blame. A TrainJob's
        restarts are its runtime's (JobSet failurePolicy), outside --max-restarts."""
        if not (spec.preflight and spec.max_restarts and APIS[spec.profile.kubernetes.api] is PYTORCHJOB):
            return None
        from harness.launchers.kubernetes_blame import BlamedNodeWatcher

        return BlamedNodeWatcher(self, spec, handle)

    def submit(self, request: Request) -> Handle:
        spec = request.spec
        if not spec.profile.kubernetes.results_pvc:
            raise HarnessError(f"profile {spec.profile.name} names no results volume, so the MLPerf logs would "
                               "vanish with the pods: set kubernetes.results_pvc to a ReadWriteMany claim "
                               "(--set kubernetes.results_pvc=NAME)")
        # A token of its own, so that no earlier job's folder on the volume (same --out name, same
        # arguments) is taken for this one's; the node agents also refuse a folder another job claimed.
        if not request.payload.get("health"):  # the health job keeps its own (it trains nothing)
            request = self._request(spec, secrets.token_hex(TOKEN_HEX // 2))
        (spec.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        api = APIS[spec.profile.kubernetes.api]
        jobs, _ = _api()
        namespace = spec.profile.kubernetes.namespace
        created = _call(f"create the {api.kind}", jobs.create_namespaced_custom_object, api.group, api.version,
                        namespace, api.plural, request.payload["body"])
        handle = Handle(backend=self.name, job_id=f"{namespace}/{created['metadata']['name']}", out_dir=spec.out_dir)
        handle.save(request, state=JobState.PENDING.value, uid=created["metadata"].get("uid"),
                    pvc_folder=pvc_folder(spec, request.payload["token"]))
        return handle

    @staticmethod
    def _job(handle: Handle) -> tuple[JobSpec, JobApi, str, str]:
        spec = JobSpec.from_dict(handle.record()["spec"])
        namespace, _, name = handle.job_id.partition("/")
        return spec, APIS[spec.profile.kubernetes.api], namespace, name

    def status(self, handle: Handle) -> JobState:
        recorded = JobState(handle.record().get("state", JobState.UNKNOWN.value))
        if recorded is JobState.CANCELLED:
            return recorded
        _, api, namespace, name = self._job(handle)
        jobs, core = _api()
        job = _call(f"read the {api.kind}", jobs.get_namespaced_custom_object, api.group, api.version, namespace,
                    api.plural, name)
        state, reason = api.state(job)
        if state.value != recorded.value:
            handle.update(state=state.value, reason=reason)
            self._record_event(core, api, job, state, reason)
        return state

    @staticmethod
    def _record_event(core, api: JobApi, job: dict, state: JobState, reason: str) -> None:
        """A Kubernetes Event on the job, so the cluster's own tools show what the harness saw."""
        meta = job["metadata"]
        now = datetime.now(timezone.utc)
        event = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(generate_name=f"{meta['name']}-", namespace=meta["namespace"]),
            involved_object=k8s.V1ObjectReference(api_version=api.api_version, kind=api.kind, name=meta["name"],
                                                  namespace=meta["namespace"], uid=meta.get("uid")),
            reason=f"Harness{state.value.title()}", message=f"mlperf-harness: job {state.value}: {reason}",
            type="Warning" if state is JobState.FAILED else "Normal", first_timestamp=now, last_timestamp=now,
            count=1, source=k8s.V1EventSource(component="mlperf-harness"))
        _call("record an event", core.create_namespaced_event, meta["namespace"], event)

    def logs(self, handle: Handle) -> str:
        _, api, namespace, name = self._job(handle)
        _, core = _api()
        pods = _call("list the job's pods", core.list_namespaced_pod, namespace,
                     label_selector=f"{api.pod_label}={name}")
        parts = []
        for pod in sorted(pods.items, key=lambda p: p.metadata.name):
            text = _call("read pod logs", core.read_namespaced_pod_log, pod.metadata.name, namespace,
                         container=api.container)
            parts.append(f"==> {pod.metadata.name} ({pod.status.phase}) <==\n{text}")
        return "".join(parts)

    def cancel(self, handle: Handle) -> None:
        if JobState(handle.record().get("state", "UNKNOWN")).terminal:
            return
        _, api, namespace, name = self._job(handle)
        jobs, core = _api()
        handle.update(state=JobState.CANCELLED.value)
        job = _call(f"read the {api.kind}", jobs.get_namespaced_custom_object, api.group, api.version, namespace,
                    api.plural, name)
        self._record_event(core, api, job, JobState.CANCELLED, "cancelled by the user")
        _call(f"delete the {api.kind}", jobs.delete_namespaced_custom_object, api.group, api.version, namespace,
              api.plural, name, propagation_policy="Background")

    def collect(self, handle: Handle, poll_s: float = 1.0) -> list[Path]:
        """Copy the job's run folder from the results volume: a manifest, then the files in chunks, each
        through a one-shot pod and its log; checked against the manifest's checksums before use."""
        with tempfile.TemporaryDirectory(dir=handle.out_dir, prefix=".collect-") as staging:
            files = self.fetch(handle, "", Path(staging), poll_s)
            fetched, kept = merge_run_folder(Path(staging), files, handle.out_dir)
        if kept:
            print(f"harness: kept the local copies of {', '.join(kept)}, which differ from the results volume's",
                  file=sys.stderr)
        return fetched

    def fetch(self, handle: Handle, sub: str, into: Path, poll_s: float = 1.0) -> list[RemoteFile]:
        """Copy the folder `sub` of the job's run folder on the results volume ("": all of it) into `into`:
        a manifest, then the files in chunks, each through a one-shot pod and its log. Returns the manifest:
        `collect` checks every file against its checksum before use; the blame watch reads attempt records,
        whose reader skips a torn last line, so a torn copy at worst delays its judgement to a later poll."""
        spec, _, namespace, name = self._job(handle)
        folder = handle.record().get("pvc_folder")
        if not folder:
            raise HarnessError(f"{handle.out_dir}/job.json names no folder on the results volume (pvc_folder); "
                               "it was submitted by an older harness", 1)
        folder = str(PurePosixPath(folder, sub)) if sub else folder
        _, core = _api()
        nonce = secrets.token_hex(3)

        def run_pod(step: str, script: str, args: list[str]) -> str:
            return self._run_collector(core, spec, namespace, f"{name}-collect-{nonce}-{step}", script, args,
                                       folder, poll_s)

        files = parse_manifest(run_pod("m", MANIFEST_SCRIPT, [folder]))
        for index, pieces in enumerate(plan_chunks(files)):
            write_pieces(into, pieces, run_pod(str(index), CHUNK_SCRIPT, [folder, json.dumps(pieces)]))
        return files

    @staticmethod
    def _run_collector(core, spec: JobSpec, namespace: str, pod_name: str, script: str, args: list[str],
                       folder: str, poll_s: float) -> str:
        """Run one collector pod to its end and return its log; the pod is deleted either way."""
        _call("start a results pod", core.create_namespaced_pod, namespace,
              collector_pod(spec, pod_name, script, args))
        try:
            deadline = time.monotonic() + COLLECT_TIMEOUT_S
            while (phase := _call("read a results pod", core.read_namespaced_pod, pod_name,
                                  namespace).status.phase) not in ("Succeeded", "Failed"):
                if time.monotonic() > deadline:
                    raise HarnessError(f"the results pod {namespace}/{pod_name} is still {phase} after "
                                       f"{COLLECT_TIMEOUT_S} s; is the claim {spec.profile.kubernetes.results_pvc} "
                                       "mountable (ReadWriteMany)?", 1)
                time.sleep(poll_s)
            # Raw bytes: the client would parse a log that reads as JSON (the manifest) and hand back its repr.
            log = _call("read a results pod's log", core.read_namespaced_pod_log, pod_name, namespace,
                        _preload_content=False).data.decode(errors="replace")
            if phase == "Failed":
                raise HarnessError(f"the results pod could not read {folder} on "
                                   f"{spec.profile.kubernetes.results_pvc}: {log.strip()[-500:]}", 1)
            return log
        finally:
            _call("delete a results pod", core.delete_namespaced_pod, pod_name, namespace)
