"""Kubernetes: one Kubeflow PyTorchJob (kubeflow.org/v1), built with the kubeflow-training SDK's models.

A Master pod and `nodes - 1` Worker pods, each running one elastic agent with one
process per GPU. The training operator gives every pod PET_MASTER_ADDR and
PET_MASTER_PORT; the agents meet at a c10d rendezvous there (the kubelet expands
`$(VAR)` in container arguments). Pods ask for the profile's GPUs and RDMA
devices, get a memory-backed /dev/shm, add IPC_LOCK only when RDMA is requested,
and never run privileged. The cluster is the system of record: each state change
the harness sees is also recorded as a Kubernetes Event on the job.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import datetime, timezone
from pathlib import PurePosixPath

import yaml
from kubeflow.training import models as kf
from kubernetes import client as k8s

from harness.errors import HarnessError
from harness.launchers.base import Handle, JobState, Launcher, Request, agent_command, cluster_procs_per_node
from harness.spec import JobSpec

GROUP, VERSION, PLURAL, KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
CONTAINER = "pytorch"  # the container name the training operator looks for
JOB_LABEL = "training.kubeflow.org/job-name"
KUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def _pod_template(spec: JobSpec, nproc: int, out_dir: str) -> k8s.V1PodTemplateSpec:
    profile, kube = spec.profile, spec.profile.kubernetes
    if not profile.image:
        raise HarnessError(f"the k8s backend runs a container image, and profile {profile.name} names none: "
                           "set `image` in the profile or --set image=REGISTRY/IMAGE:TAG")
    limits = {}
    if profile.gpus_per_node:
        limits[profile.gpu_resource] = str(spec.procs_per_node or profile.gpus_per_node)
    if profile.rdma_resource:
        limits[profile.rdma_resource] = str(profile.rdma_count)
    # Pinned memory for RDMA needs IPC_LOCK; nothing else does, and nothing needs privileged mode.
    capabilities = k8s.V1Capabilities(add=["IPC_LOCK"]) if profile.rdma_resource else None
    volumes = [k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory",
                                                                             size_limit=kube.shm_size))]
    mounts = [k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm")]
    if kube.results_pvc:
        volumes.append(k8s.V1Volume(name="results", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
            claim_name=kube.results_pvc)))
        mounts.append(k8s.V1VolumeMount(name="results", mount_path=kube.results_mount))
    env = {**profile.env, **spec.env}
    in_pod = dataclasses.replace(spec, out_dir=PurePosixPath(out_dir))
    command = agent_command(in_pod, "python", nproc, rendezvous="$(PET_MASTER_ADDR):$(PET_MASTER_PORT)",
                            rdzv_id=spec.name)
    container = k8s.V1Container(
        name=CONTAINER, image=profile.image, command=command[:1], args=command[1:],
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in sorted(env.items())],
        resources=k8s.V1ResourceRequirements(limits=limits, requests=limits) if limits else None,
        volume_mounts=mounts,
        security_context=k8s.V1SecurityContext(privileged=False, allow_privilege_escalation=False,
                                               capabilities=capabilities))
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(labels=_labels(spec)),
        spec=k8s.V1PodSpec(
            containers=[container], volumes=volumes, host_network=profile.host_network or None,
            dns_policy="ClusterFirstWithHostNet" if profile.host_network else None,
            node_selector=kube.node_selector or None,
            tolerations=[_toleration(t) for t in kube.tolerations] or None,
            priority_class_name=kube.priority_class, service_account_name=kube.service_account))


def _toleration(fields: dict) -> k8s.V1Toleration:
    """A profile's toleration, written as in a pod spec (tolerationSeconds) or in the client's snake_case."""
    names = {wire: attr for attr, wire in k8s.V1Toleration.attribute_map.items()}
    unknown = sorted(set(fields) - set(names) - set(names.values()))
    if unknown:
        raise HarnessError(f"toleration {fields}: unknown field(s) {', '.join(unknown)}; valid: {', '.join(names)}")
    return k8s.V1Toleration(**{names.get(key, key): value for key, value in fields.items()})


def _labels(spec: JobSpec) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "mlperf-harness", "mlperf-harness/benchmark": spec.benchmark}
    if spec.profile.kubernetes.queue:
        labels[KUEUE_LABEL] = spec.profile.kubernetes.queue
    return labels


def _pod_out_dir(spec: JobSpec) -> str:
    """The run folder inside the pods: on the shared results volume."""
    return f"{spec.profile.kubernetes.results_mount}/{spec.out_dir.name}"


def pytorch_job(spec: JobSpec) -> kf.KubeflowOrgV1PyTorchJob:
    """The PyTorchJob for a resolved spec: `nodes` pods in all, gang-scheduled."""
    kube = spec.profile.kubernetes
    nproc = cluster_procs_per_node(spec)
    template = _pod_template(spec, nproc, _pod_out_dir(spec))
    restart = "OnFailure" if spec.max_restarts else "Never"
    replicas = {"Master": kf.KubeflowOrgV1ReplicaSpec(replicas=1, restart_policy=restart, template=template)}
    if spec.nodes > 1:
        replicas["Worker"] = kf.KubeflowOrgV1ReplicaSpec(replicas=spec.nodes - 1, restart_policy=restart,
                                                         template=template)
    return kf.KubeflowOrgV1PyTorchJob(
        api_version=f"{GROUP}/{VERSION}", kind=KIND,
        metadata=k8s.V1ObjectMeta(name=spec.name, namespace=kube.namespace, labels=_labels(spec)),
        spec=kf.KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=str(nproc), pytorch_replica_specs=replicas,
            run_policy=kf.KubeflowOrgV1RunPolicy(
                backoff_limit=spec.max_restarts, clean_pod_policy="None",  # keep pods for `harness logs`
                scheduling_policy=kf.KubeflowOrgV1SchedulingPolicy(
                    min_available=spec.nodes, queue=kube.queue, priority_class=kube.priority_class))))


def to_dict(obj) -> dict:
    """An SDK model as the plain dict the API server receives (None fields dropped)."""
    return k8s.ApiClient().sanitize_for_serialization(obj)


# PyTorchJob conditions (the last one whose status is "True" wins) -> ours.
CONDITIONS = {"Created": JobState.PENDING, "Running": JobState.RUNNING, "Restarting": JobState.RUNNING,
              "Succeeded": JobState.SUCCEEDED, "Failed": JobState.FAILED, "Suspended": JobState.PENDING}


def job_state(job: dict) -> tuple[JobState, str]:
    """Our state and the operator's reason, from a PyTorchJob's status conditions."""
    conditions = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    if not conditions:
        return JobState.PENDING, "no conditions yet"
    last = conditions[-1]
    return CONDITIONS.get(last.get("type"), JobState.UNKNOWN), last.get("message") or last.get("type", "")


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


class KubernetesLauncher(Launcher):
    name = "k8s"

    def results_elsewhere(self, spec: JobSpec) -> str | None:
        kube = spec.profile.kubernetes  # rank 0 writes them to the profile's results volume
        return f"the results volume ({kube.results_pvc or 'none in the profile'}) under {_pod_out_dir(spec)}"

    def render(self, spec: JobSpec) -> Request:
        body = to_dict(pytorch_job(spec))
        text = yaml.safe_dump(body, sort_keys=True, default_flow_style=False)
        return Request(backend=self.name, spec=spec, text=text, payload={"body": body})

    def submit(self, request: Request) -> Handle:
        spec = request.spec
        (spec.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        jobs, _ = _api()
        namespace = spec.profile.kubernetes.namespace
        created = _call("create the PyTorchJob", jobs.create_namespaced_custom_object, GROUP, VERSION, namespace,
                        PLURAL, request.payload["body"])
        handle = Handle(backend=self.name, job_id=f"{namespace}/{created['metadata']['name']}", out_dir=spec.out_dir)
        handle.save(request, state=JobState.PENDING.value, uid=created["metadata"].get("uid"))
        return handle

    @staticmethod
    def _names(handle: Handle) -> tuple[str, str]:
        namespace, _, name = handle.job_id.partition("/")
        return namespace, name

    def status(self, handle: Handle) -> JobState:
        recorded = JobState(handle.record().get("state", JobState.UNKNOWN.value))
        if recorded is JobState.CANCELLED:
            return recorded
        namespace, name = self._names(handle)
        jobs, core = _api()
        job = _call("read the PyTorchJob", jobs.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                    name)
        state, reason = job_state(job)
        if state.value != recorded.value:
            handle.update(state=state.value, reason=reason)
            self._record_event(core, job, state, reason)
        return state

    @staticmethod
    def _record_event(core, job: dict, state: JobState, reason: str) -> None:
        """A Kubernetes Event on the job, so the cluster's own tools show what the harness saw."""
        meta = job["metadata"]
        now = datetime.now(timezone.utc)
        event = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(generate_name=f"{meta['name']}-", namespace=meta["namespace"]),
            involved_object=k8s.V1ObjectReference(api_version=f"{GROUP}/{VERSION}", kind=KIND, name=meta["name"],
                                                  namespace=meta["namespace"], uid=meta.get("uid")),
            reason=f"Harness{state.value.title()}", message=f"mlperf-harness: job {state.value}: {reason}",
            type="Warning" if state is JobState.FAILED else "Normal", first_timestamp=now, last_timestamp=now,
            count=1, source=k8s.V1EventSource(component="mlperf-harness"))
        _call("record an event", core.create_namespaced_event, meta["namespace"], event)

    def logs(self, handle: Handle) -> str:
        namespace, name = self._names(handle)
        _, core = _api()
        pods = _call("list the job's pods", core.list_namespaced_pod, namespace, label_selector=f"{JOB_LABEL}={name}")
        parts = []
        for pod in sorted(pods.items, key=lambda p: p.metadata.name):
            text = _call("read pod logs", core.read_namespaced_pod_log, pod.metadata.name, namespace,
                         container=CONTAINER)
            parts.append(f"==> {pod.metadata.name} ({pod.status.phase}) <==\n{text}")
        return "".join(parts)

    def cancel(self, handle: Handle) -> None:
        if JobState(handle.record().get("state", "UNKNOWN")).terminal:
            return
        namespace, name = self._names(handle)
        jobs, core = _api()
        handle.update(state=JobState.CANCELLED.value)
        job = _call("read the PyTorchJob", jobs.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                    name)
        self._record_event(core, job, JobState.CANCELLED, "cancelled by the user")
        _call("delete the PyTorchJob", jobs.delete_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
              name, propagation_policy="Background")
