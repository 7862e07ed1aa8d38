"""Kubernetes: a Kubeflow PyTorchJob (kubeflow.org/v1) or a Trainer v2 TrainJob, built with the SDKs' models.

PyTorchJob (the default): a Master pod and `nodes - 1` Worker pods. TrainJob
(`--api trainjob`): `numNodes` nodes of the profile's ClusterTrainingRuntime, with
our pod settings as a runtime patch. Either way each pod runs one elastic agent
with one process per GPU, and the agents meet at a c10d rendezvous on the
PET_MASTER_ADDR/PORT the operator gives every pod. Pods ask for the profile's
GPUs and RDMA devices, get a memory-backed /dev/shm, add IPC_LOCK only when RDMA
is requested, and never run privileged. Rank 0 writes the MLPerf logs to the
results volume (a PVC); when the job ends, a one-shot read-only pod streams the
run folder back through its log into the local run folder. The cluster is the
system of record: each state change the harness sees is also recorded as a
Kubernetes Event on the job.
"""

from __future__ import annotations

import base64
import dataclasses
import io
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

from harness.errors import HarnessError
from harness.launchers import kubernetes_nodes
from harness.launchers.base import (IMAGE_ENV, Handle, JobState, Launcher, Request, agent_command,
                                    cluster_procs_per_node, health_command, workload_plan)
from harness.mounts import Mount, check_inside, claim_mount
from harness.spec import JobSpec

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


def _pod_parts(spec: JobSpec, nproc: int) -> _PodParts:
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
    in_pod = dataclasses.replace(spec, out_dir=PurePosixPath(_pod_out_dir(spec)))
    # Both operators give every pod PET_MASTER_ADDR/PORT; the kubelet expands $(VAR) in arguments.
    command = agent_command(in_pod, "python", nproc, rendezvous="$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
                            rdzv_id=spec.name)
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


def _pod_template(spec: JobSpec, nproc: int) -> k8s.V1PodTemplateSpec:
    profile, kube = spec.profile, spec.profile.kubernetes
    parts = _pod_parts(spec, nproc)
    container = k8s.V1Container(
        name=PYTORCHJOB.container, image=profile.image, command=parts.command[:1], args=parts.command[1:],
        env=parts.env, resources=parts.resources, volume_mounts=parts.mounts, security_context=parts.security)
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(labels=_labels(spec, job=False)),
        spec=k8s.V1PodSpec(
            containers=[container], volumes=parts.volumes, host_network=profile.host_network or None,
            dns_policy="ClusterFirstWithHostNet" if profile.host_network else None,
            node_selector=kube.node_selector or None,
            tolerations=_tolerations(kube),
            priority_class_name=kube.priority_class, service_account_name=kube.service_account))


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


def _pod_out_dir(spec: JobSpec) -> str:
    """The run folder inside the pods: on the shared results volume."""
    return f"{spec.profile.kubernetes.results_mount}/{spec.out_dir.name}"


def pytorch_job(spec: JobSpec) -> dict:
    """The PyTorchJob for a resolved spec: `nodes` pods in all, gang-scheduled."""
    kube = spec.profile.kubernetes
    nproc = cluster_procs_per_node(spec)
    template = _pod_template(spec, nproc)
    # ExitCode: the operator restarts a pod whose agent exits with 128 or more (an infrastructure failure
    # with restarts left, harness.agent.EXIT_RETRY, or a signal) and fails the job on 1 to 127.
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
                backoff_limit=spec.max_restarts, clean_pod_policy="None",  # keep pods for `harness logs`
                scheduling_policy=kf.KubeflowOrgV1SchedulingPolicy(
                    min_available=spec.nodes, queue=kube.queue, priority_class=kube.priority_class))))
    return to_dict(job)


def train_job(spec: JobSpec) -> dict:
    """The Trainer v2 TrainJob for a resolved spec: the trainer step of the profile's ClusterTrainingRuntime.

    The runtime owns what a TrainJob cannot say (gang scheduling, priority, hostNetwork,
    the restart policy); the rest of the pod goes in as a runtime patch on its `node` job.
    """
    import kubeflow_trainer_api.models as tj  # 0.5 s of pydantic models, which only TrainJobs need

    kube = spec.profile.kubernetes
    nproc = cluster_procs_per_node(spec)
    parts = _pod_parts(spec, nproc)
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


def trainjob_notes(spec: JobSpec) -> list[str]:
    """Profile settings a TrainJob cannot carry: said aloud rather than dropped silently."""
    kube, runtime = spec.profile.kubernetes, spec.profile.kubernetes.trainjob_runtime
    unsaid = [name for name, value in (("priority_class", kube.priority_class),
                                       ("host_network", spec.profile.host_network),
                                       ("--max-restarts", spec.max_restarts)) if value]
    if not unsaid:
        return []
    return [f"note: a TrainJob takes {', '.join(unsaid)} from its ClusterTrainingRuntime {runtime!r} "
            "(podGroupPolicy, pod template, JobSet failurePolicy); set them there"]


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
    build: Callable[[JobSpec], dict]
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


# Runs in a small pod on the results volume: the run folder (not its checkpoints) as one base64 tar.gz on stdout,
# which the harness reads back through the pod-log API. Nothing but the client's own calls is needed.
COLLECT_SCRIPT = """\
import base64, io, sys, tarfile
buffer = io.BytesIO()
with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
    tar.add(sys.argv[1], arcname=".", filter=lambda m: None if m.name.startswith("./checkpoints") else m)
sys.stdout.write(base64.b64encode(buffer.getvalue()).decode())
"""
COLLECT_TIMEOUT_S = 300


def collector_pod(spec: JobSpec, name: str) -> k8s.V1Pod:
    """A one-shot pod that reads the run folder from the results volume, read-only and unprivileged."""
    kube = spec.profile.kubernetes
    container = k8s.V1Container(
        name="collect", image=spec.profile.image, command=["python", "-c", COLLECT_SCRIPT, _pod_out_dir(spec)],
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


def unpack_run_folder(archive_b64: str, out_dir: Path) -> tuple[list[Path], list[str]]:
    """Unpack the collector's archive into out_dir: new files are added, identical ones skipped, and a local
    file that differs is kept as it is (and named), so nothing already written is lost."""
    try:
        data = base64.b64decode(archive_b64.strip(), validate=True)
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".collect-") as staging, \
                tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            files = [m for m in tar.getmembers() if m.isfile()]
            tar.extractall(staging, members=files, filter="data")  # refuses absolute paths, '..' and links out
            fetched, kept = [], []
            for member in files:
                source, target = Path(staging, member.name), out_dir / member.name
                if target.exists() and target.read_bytes() == source.read_bytes():
                    continue
                if target.exists():
                    kept.append(member.name)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(source, target)
                fetched.append(target)
            return fetched, kept
    except (ValueError, tarfile.TarError, EOFError, OSError) as exc:
        raise HarnessError(f"the results pod's archive is unreadable: {exc}", 1) from None


class KubernetesLauncher(Launcher):
    name = "k8s"
    paths_here = False  # --data and --init-checkpoint name paths inside the pods

    def render(self, spec: JobSpec) -> Request:
        api = APIS[spec.profile.kubernetes.api]
        body = _excluding(api.build(spec), spec.exclude_nodes)
        text = yaml.safe_dump(body, sort_keys=True, default_flow_style=False)
        notes = workload_plan(spec, cluster_procs_per_node(spec), spec.profile.gpu_memory_gib if spec.gpus() else None)
        notes += tuple(trainjob_notes(spec)) if api is TRAINJOB else ()
        return Request(backend=self.name, spec=spec, text=text, payload={"body": body}, notes=notes)

    def render_preflight(self, spec: JobSpec) -> Request:
        """The health job: a PyTorchJob with a pod on each of nodes + spare_nodes nodes (kubernetes_nodes)."""
        checked = kubernetes_nodes.health_spec(spec)
        in_pod = dataclasses.replace(checked, out_dir=PurePosixPath(_pod_out_dir(checked)))
        body = kubernetes_nodes.health_job(_excluding(pytorch_job(checked), spec.exclude_nodes), spec,
                                           health_command(in_pod, "python"))
        return Request(backend=self.name, spec=checked, text=yaml.safe_dump(body, sort_keys=True),
                       payload={"body": body})

    def remediate(self, spec: JobSpec, preflight: dict) -> list[str]:
        _, core = _api()
        return kubernetes_nodes.remediate(core, _call, spec, preflight)

    def submit(self, request: Request) -> Handle:
        spec = request.spec
        if not spec.profile.kubernetes.results_pvc:
            raise HarnessError(f"profile {spec.profile.name} names no results volume, so the MLPerf logs would "
                               "vanish with the pods: set kubernetes.results_pvc to a ReadWriteMany claim "
                               "(--set kubernetes.results_pvc=NAME)")
        (spec.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        api = APIS[spec.profile.kubernetes.api]
        jobs, _ = _api()
        namespace = spec.profile.kubernetes.namespace
        created = _call(f"create the {api.kind}", jobs.create_namespaced_custom_object, api.group, api.version,
                        namespace, api.plural, request.payload["body"])
        handle = Handle(backend=self.name, job_id=f"{namespace}/{created['metadata']['name']}", out_dir=spec.out_dir)
        handle.save(request, state=JobState.PENDING.value, uid=created["metadata"].get("uid"))
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
        """Copy the run folder from the results volume through a one-shot pod and its log."""
        spec, _, namespace, name = self._job(handle)
        _, core = _api()
        pod_name = f"{name}-collect-{secrets.token_hex(3)}"
        _call("start the results pod", core.create_namespaced_pod, namespace, collector_pod(spec, pod_name))
        try:
            deadline = time.monotonic() + COLLECT_TIMEOUT_S
            while (phase := _call("read the results pod", core.read_namespaced_pod, pod_name,
                                  namespace).status.phase) not in ("Succeeded", "Failed"):
                if time.monotonic() > deadline:
                    raise HarnessError(f"the results pod {namespace}/{pod_name} is still {phase} after "
                                       f"{COLLECT_TIMEOUT_S} s; is the claim {spec.profile.kubernetes.results_pvc} "
                                       "mountable (ReadWriteMany)?", 1)
                time.sleep(poll_s)
            log = _call("read the results pod's log", core.read_namespaced_pod_log, pod_name, namespace)
            if phase == "Failed":
                raise HarnessError(f"the results pod could not read {_pod_out_dir(spec)} on "
                                   f"{spec.profile.kubernetes.results_pvc}: {log.strip()[-500:]}", 1)
        finally:
            _call("delete the results pod", core.delete_namespaced_pod, pod_name, namespace)
        fetched, kept = unpack_run_folder(log, handle.out_dir)
        if kept:
            print(f"harness: kept the local copies of {', '.join(kept)}, which differ from the results volume's",
                  file=sys.stderr)
        return fetched
