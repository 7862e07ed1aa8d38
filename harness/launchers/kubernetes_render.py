"""Kubernetes rendering: the job a spec asks for, as the plain dict the API server receives, built with the
SDKs' models. No API calls: a dry run prints exactly this.

PyTorchJob (the default): a Master pod and `nodes - 1` Worker pods. TrainJob
(`--api trainjob`): `numNodes` nodes of the profile's ClusterTrainingRuntime, with
our pod settings as a runtime patch. Either way each pod runs one elastic agent
with one process per GPU, and the agents meet at a c10d rendezvous on the
PET_MASTER_ADDR/PORT the operator gives every pod. Pods ask for the profile's
GPUs and RDMA devices, and CPU and memory with requests equal to limits where the
profile gives them (kubernetes_resources: Guaranteed pods), get a memory-backed
/dev/shm, add IPC_LOCK only when RDMA is requested, never run privileged, and mount
no service-account token. Rank 0 writes the MLPerf logs to the job's own folder on
the results volume (a PVC), named with a token drawn at submit (see
kubernetes.KubernetesLauncher.submit). The profile fits the pods to the cluster
(pull secrets, scheduler, affinity, labels and annotations, and a pod patch:
kubernetes_patch) on every pod the harness creates, the watcher's and the
collector's included.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import PurePosixPath

from kubeflow.training import models as kf
from kubernetes import client as k8s

from harness import preflight
from harness.agent import HOST_ENV, NODE_ENV
from harness.cache_flush import RUNTIME_INIT, kubernetes_flush_init, trainjob_flush_patch
from harness.errors import HarnessError
from harness.launchers import kubernetes_nodes, kubernetes_patch, kubernetes_resources
from harness.launchers.base import agent_command, cluster_procs_per_node
from harness.launchers.kubernetes_api import APIS, PYTORCHJOB, TRAINJOB, to_dict
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
    limits.update(kubernetes_resources.training(profile, nproc))
    # Pinned memory for RDMA needs IPC_LOCK; nothing else does, and nothing needs privileged mode.
    capabilities = k8s.V1Capabilities(add=["IPC_LOCK"]) if profile.rdma_resource else None
    volumes = [k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory",
                                                                             size_limit=kube.shm_size))]
    mounts = [k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm")]
    if kube.results_pvc:
        volumes.append(results_volume(kube.results_pvc))
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
                            rdzv_id=spec.name, job_token=token,
                            launch=None if spec.launch is None else str(spec.launch))
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


def results_volume(claim: str) -> k8s.V1Volume:
    return k8s.V1Volume(name="results", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
        claim_name=claim))


def _pod_template(spec: JobSpec, nproc: int, token: str) -> dict:
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
    init = kubernetes_flush_init(spec, pvc_folder(spec, token), parts.mounts)
    figures = {name: value for name, value in kubernetes_resources.INIT_CONTAINER.items()
               if parts.resources and name in parts.resources.limits}
    for step in init or []:  # a Guaranteed pod's init containers ask for equal requests and limits too
        step.resources = k8s.V1ResourceRequirements(requests=figures, limits=figures) if figures else None
    template = to_dict(k8s.V1PodTemplateSpec(
        metadata=_pod_metadata(spec),
        spec=k8s.V1PodSpec(
            init_containers=init, containers=[container], volumes=parts.volumes,
            host_network=profile.host_network or None,
            dns_policy="ClusterFirstWithHostNet" if profile.host_network else None,
            node_selector=kube.node_selector or None,
            tolerations=tolerations(kube), affinity=affinity(kube), image_pull_secrets=pull_secrets(kube),
            scheduler_name=kube.scheduler_name,
            priority_class_name=kube.priority_class, service_account_name=kube.service_account,
            automount_service_account_token=False)))  # training needs no access to the API
    template = _patched(spec, template, PYTORCHJOB.container, "V1PodTemplateSpec")
    if {"cpu", "memory"} <= set(parts.resources.limits if parts.resources else {}):
        kubernetes_resources.check_guaranteed(template["spec"])
    return template


def _pod_metadata(spec: JobSpec) -> k8s.V1ObjectMeta:
    """The training and health pods' labels and annotations: the harness's labels and the profile's pod_labels
    and pod_annotations (Kueue's topology annotations among them); a pod label the harness sets is refused."""
    kube, own = spec.profile.kubernetes, _labels(spec, job=False)
    taken = sorted(set(kube.pod_labels) & set(own))
    if taken:
        raise HarnessError(f"kubernetes.pod_labels sets {', '.join(taken)}, which the harness sets on its pods (it "
                           "selects them by it): choose other label names")
    return k8s.V1ObjectMeta(labels={**kube.pod_labels, **own}, annotations=dict(kube.pod_annotations) or None)


def _patched(spec: JobSpec, pod: dict, container: str, model: str, sidecars: bool = True) -> dict:
    """`pod` (a pod, or a pod template) with the profile's pod patch, its fields checked against the Pod API."""
    kube = spec.profile.kubernetes
    if not kube.pod_patch:
        return pod
    target = kubernetes_patch.Target(container, kube.results_mount if kube.results_pvc else None, sidecars)
    return kubernetes_patch.check_pod_fields(kubernetes_patch.apply(pod, kube.pod_patch, target), model)


def pull_secrets(kube) -> list[k8s.V1LocalObjectReference] | None:
    return [k8s.V1LocalObjectReference(name=name) for name in kube.image_pull_secrets] or None


def affinity(kube) -> dict | None:
    """The profile's affinity, as in a pod spec, checked against the client's V1Affinity model."""
    if not kube.affinity:
        return None
    read = kubernetes_patch.read_back(kube.affinity, "V1Affinity", "kubernetes.affinity")
    where = kubernetes_patch.first_difference(kube.affinity, read)
    if where:
        raise HarnessError(f"kubernetes.affinity: {where} is not a field of that name and type of a pod's affinity "
                           "(nodeAffinity, podAffinity, podAntiAffinity, as in a pod spec)")
    return copy.deepcopy(kube.affinity)


def tolerations(kube) -> list[k8s.V1Toleration] | None:
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
                        tolerations=tolerations(kube), affinity=affinity(kube), image_pull_secrets=pull_secrets(kube),
                        service_account_name=kube.service_account)
    pod_patch = to_dict(pod)
    pod_patch["containers"] = [{"name": TRAINJOB.container, "volumeMounts": to_dict(parts.mounts),
                                "securityContext": to_dict(parts.security)}]
    flush = trainjob_flush_patch(spec, pvc_folder(spec, token), to_dict(parts.mounts))
    if flush:
        pod_patch["initContainers"] = flush
    template = _trainjob_fields(_patched(spec, {"metadata": to_dict(_pod_metadata(spec)), "spec": pod_patch},
                                         TRAINJOB.container, "V1PodTemplateSpec"), kube.trainjob_runtime)
    patch = tj.TrainerV1alpha1RuntimePatch(
        manager=MANAGER,
        training_runtime_spec=tj.TrainerV1alpha1TrainingRuntimeSpecPatch.from_dict({"template": {"spec": {
            "replicatedJobs": [{"name": "node", "template": {"spec": {"template": template}}}]}}}))
    job = tj.TrainerV1alpha1TrainJob(
        api_version=TRAINJOB.api_version, kind=TRAINJOB.kind,
        metadata=tj.IoK8sApimachineryPkgApisMetaV1ObjectMeta(name=spec.name, namespace=kube.namespace,
                                                             labels=_labels(spec)),
        spec=tj.TrainerV1alpha1TrainJobSpec(
            runtime_ref=tj.TrainerV1alpha1RuntimeRef(name=kube.trainjob_runtime, kind="ClusterTrainingRuntime",
                                                     api_group=TRAINJOB.group),
            trainer=tj.TrainerV1alpha1Trainer(
                image=spec.profile.image, command=parts.command[:1], args=parts.command[1:],
                env=[tj.IoK8sApiCoreV1EnvVar.from_dict(to_dict(e)) for e in [*parts.env, *_trainjob_identity()]],
                num_nodes=spec.nodes, num_proc_per_node=nproc,
                resources_per_node=tj.IoK8sApiCoreV1ResourceRequirements.from_dict(to_dict(parts.resources))
                if parts.resources else None),
            runtime_patches=[patch]))
    return job.to_dict()


def _trainjob_fields(template: dict, runtime: str) -> dict:
    """The runtime patch's pod template, refused in one line where it holds a field that a TrainJob's runtime patch
    cannot carry (Trainer v2.3's CRD: the API server would drop it): the pod patch's, most likely."""
    import kubeflow_trainer_api.models as tj
    from pydantic import ValidationError

    try:
        read = tj.TrainerV1alpha1PodTemplatePatch.from_dict(template).to_dict()
    except ValidationError as exc:
        error = exc.errors()[0]
        raise HarnessError(f"{kubernetes_patch.SETTING}: not valid in a TrainJob's runtime patch: "
                           f"{'.'.join(map(str, error['loc']))}: {error['msg']}") from None
    where = kubernetes_patch.first_difference(template, read)
    if where:
        fields = ", ".join(f.alias or name for name, f in tj.TrainerV1alpha1PodSpecPatch.model_fields.items())
        raise HarnessError(f"{kubernetes_patch.SETTING}: a TrainJob's runtime patch cannot carry {where} (its pod "
                           f"fields, in Trainer v2.3's CRD: {fields}; a container's: env, name, securityContext, "
                           f"volumeMounts): set it in ClusterTrainingRuntime {runtime!r}, or use --api pytorchjob")
    return template


def _field(name: str, path: str) -> k8s.V1EnvVar:
    return k8s.V1EnvVar(name=name, value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(field_path=path)))


JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # the Job (one per JobSet replicated job) that made the pod
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # the pod's index in its Indexed Job


def _trainjob_identity() -> list[k8s.V1EnvVar]:
    """What a PyTorchJob's pods get in _pod_template, for a TrainJob's: the Kubernetes node under the pod
    (HOST_ENV, what a failure is blamed on), and a name for the pod that outlives its recreation (NODE_ENV, what
    the node agent keys its attempts by). A TrainJob's pod is recreated under a new metadata.name (its Job's
    name, its completion index and a random suffix), so the key is the first two: the pod's hostname without
    hostNetwork, and the pod's own under it, where the hostname is the node's. The kubelet expands $(VAR) in a
    value from the variables listed before it."""
    job, index = "HARNESS_POD_JOB", "HARNESS_POD_INDEX"
    return [_field(job, f"metadata.labels['{JOB_NAME_LABEL}']"),
            _field(index, f"metadata.annotations['{COMPLETION_INDEX}']"),
            k8s.V1EnvVar(name=NODE_ENV, value=f"$({job})-$({index})"),
            _field(HOST_ENV, "spec.nodeName")]


def pod_monitor(spec: JobSpec) -> dict:
    """A Prometheus Operator PodMonitor (monitoring.coreos.com/v1) that scrapes the job's pods' `metrics` port;
    the pod's Kubernetes node becomes the `host` label (the metrics' own `node` is the pod's name).
    With --name it selects that job's pods; without, every run of the benchmark in the namespace, since
    each run's job gets a name of its own (kubernetes.KubernetesLauncher)."""
    api = APIS[spec.profile.kubernetes.api]
    if not spec.metrics():
        raise HarnessError("--pod-monitor needs metrics: the profile's metrics_port or --metrics-port is 0")
    selector = _labels(spec, job=False) if spec.name == spec.default_name() else {api.pod_label: spec.name}
    return {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": {"name": f"{spec.name}-metrics", "namespace": spec.profile.kubernetes.namespace,
                     "labels": _labels(spec, job=False)},
        "spec": {"selector": {"matchLabels": selector},
                 "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s",
                                          "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_node_name"],
                                                           "targetLabel": "host"}]}]}}


PLACEHOLDER_REGISTRY = "registry.example.com/"  # the shipped profiles' image, until one is built and pushed


def privileged_reasons(profile) -> list[str]:
    """What in a profile's training pods Pod Security's baseline level refuses, so that their namespace must enforce
    the privileged level: a privileged container (the page-cache flush), a capability outside baseline's short list
    (IPC_LOCK, which RDMA's pinned memory needs), host networking (the Pod Security Standards,
    kubernetes.io/docs/concepts/security/pod-security-standards). `harness doctor` checks the namespace for it."""
    return [reason for reason, present in (
        ("the page-cache flush init container is privileged", profile.kubernetes.flush_page_cache),
        ("RDMA adds the IPC_LOCK capability", bool(profile.rdma_resource)),
        ("host_network uses the host's network namespace", profile.host_network)) if present] \
        + [f"kubernetes.pod_patch {reason}" for reason in _baseline_refuses(profile.kubernetes.pod_patch or {})]


# The capabilities Pod Security's baseline level lets a container add (the Pod Security Standards' list).
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}


def _baseline_refuses(patch) -> list[str]:
    """What in a pod patch (or any part of it) baseline refuses: a privileged container, a host namespace, a
    hostPath volume, a capability outside BASELINE_CAPABILITIES."""
    found = []
    if isinstance(patch, list):
        for item in patch:
            found += _baseline_refuses(item)
        return found
    if not isinstance(patch, dict):
        return found
    for key, value in patch.items():
        if key == "privileged" and value is True:
            found.append("makes a container privileged")
        elif key in ("hostNetwork", "hostPID", "hostIPC") and value is True:
            found.append(f"sets {key}")
        elif key == "hostPath":
            found.append("mounts a hostPath volume")
        elif key == "capabilities" and isinstance(value, dict):
            extra = sorted(set(value.get("add") or []) - BASELINE_CAPABILITIES)
            found += [f"adds the {', '.join(extra)} capability"] if extra else []
        else:
            found += _baseline_refuses(value)
    return found


def prerequisites(spec: JobSpec) -> list[str]:
    """What must exist in the cluster before the request is applied, one line each (the dry run's header);
    `harness doctor` checks them."""
    kube, profile = spec.profile.kubernetes, spec.profile
    api = APIS[kube.api]
    nodes = spec.nodes + spec.spare_nodes if spec.preflight else spec.nodes
    devices = [f"{spec.gpus()} {profile.gpu_resource}"] if spec.gpus() else []
    devices += [f"{profile.rdma_count} {profile.rdma_resource}"] if profile.rdma_resource else []
    privileged = privileged_reasons(profile)
    lines = [f"Must exist first (`harness doctor --profile {profile.name}` checks each):",
             f"- the {api.kind} CRD ({api.plural}.{api.group})"
             + (f" and the ClusterTrainingRuntime {kube.trainjob_runtime}" if api is TRAINJOB else ""),
             f"- namespace {kube.namespace}, Pod Security "
             + ("pod-security.kubernetes.io/enforce=privileged: " + "; ".join(privileged) if privileged
                else "baseline or privileged")]
    if kube.results_pvc:
        lines.append(f"- PersistentVolumeClaim {kube.results_pvc}, ReadWriteMany, Bound (rank 0 writes the logs; "
                     "the collection pods read them)")
    lines += [f"- PersistentVolumeClaim {claim_mount(entry).source}, Bound, readable from every node"
              for entry in kube.mounts]
    if kube.priority_class:
        lines.append(f"- PriorityClass {kube.priority_class}")
    if kube.queue:
        lines.append(f"- queue {kube.queue}: a Kueue LocalQueue in {kube.namespace} or a Volcano Queue")
    if kube.service_account:
        lines.append(f"- ServiceAccount {kube.service_account} in {kube.namespace}")
    lines.append(f"- the RBAC below, for {kube.namespace}: the submitter's Role"
                 + (" and its ClusterRole for the node marks" if spec.preflight else "")
                 + (f", the watcher's ServiceAccount {kube.watcher_service_account} and its Roles"
                    if watches_failures(spec) else "")
                 + f" (`harness doctor --profile {profile.name} --rbac` prints it alone)")
    lines.append(f"- {nodes} Node(s)" + (f" with {' and '.join(devices)} allocatable" if devices else "")
                 + (f", labelled {', '.join(f'{k}={v}' for k, v in kube.node_selector.items())}"
                    if kube.node_selector else ""))
    image = profile.image or "(none)"
    lines.append(f"- image {image}, pullable by the nodes"
                 + (" (a placeholder: build manifests/image/Containerfile, push it, set `image`)"
                    if image.startswith(PLACEHOLDER_REGISTRY) else ""))
    return lines


def trainjob_notes(spec: JobSpec) -> list[str]:
    """Settings a TrainJob cannot carry: said aloud rather than dropped silently."""
    kube, runtime = spec.profile.kubernetes, spec.profile.kubernetes.trainjob_runtime
    unsaid = [name for name, value in (("priority_class", kube.priority_class),
                                       ("scheduler_name", kube.scheduler_name),
                                       ("host_network", spec.profile.host_network),
                                       ("--max-restarts", spec.max_restarts)) if value]
    # The runtime patch's pod spec has no automountServiceAccountToken (trainer v2.3's CRD), so the
    # training pods' token is the runtime's to turn off, as a PyTorchJob's pods have it turned off.
    notes = [f"note: a TrainJob cannot keep the service-account token out of its pods: set "
             f"automountServiceAccountToken: false in the pod template of ClusterTrainingRuntime {runtime!r}"]
    if unsaid:
        notes.append(f"note: a TrainJob takes {', '.join(unsaid)} from its ClusterTrainingRuntime {runtime!r} "
                     "(podGroupPolicy, pod template, JobSet failurePolicy); set them there")
    if kube.flush_page_cache:  # a TrainJob's patch cannot add an init container, only patch the runtime's
        notes.append(f"note: kubernetes.flush_page_cache on a TrainJob patches the init container of its "
                     f"ClusterTrainingRuntime {runtime!r}, which must hold {RUNTIME_INIT}, with cpu and memory "
                     "requests equal to its limits (the runtime patch cannot carry them) for Guaranteed pods")
    return notes


def excluding(body: dict, nodes: list[str]) -> dict:
    """The job's pod spec(s) with the node affinity that keeps them off `nodes` (preflight's exclusions)."""
    if body.get("kind") == TRAINJOB.kind:
        pods = [job["template"]["spec"]["template"]["spec"] for patch in body["spec"].get("runtimePatches", [])
                for job in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]]
    else:
        pods = [replica["template"]["spec"] for replica in body["spec"]["pytorchReplicaSpecs"].values()]
    for pod in pods:
        kubernetes_nodes.with_exclusions(pod, nodes)
    return body


BUILDERS = {PYTORCHJOB.kind: pytorch_job, TRAINJOB.kind: train_job}


def build(spec: JobSpec, token: str) -> dict:
    """The job the profile's API (kubernetes.api) asks for, without the nodes spec.exclude_nodes keeps out."""
    return excluding(BUILDERS[APIS[spec.profile.kubernetes.api].kind](spec, token), spec.exclude_nodes)


WATCHER_MODULE = "harness.launchers.kubernetes_blame"
WATCHER_UID = 65534  # nobody: the watcher writes nothing, and reads the run folder, which is world-readable


def watches_failures(spec: JobSpec) -> bool:
    """Whether a job gets the watcher pod: with preflight (it keeps out what preflight would) and restarts, on a
    PyTorchJob. A TrainJob's restarts are its runtime's (JobSet failurePolicy), outside --max-restarts."""
    return bool(spec.preflight and spec.max_restarts and APIS[spec.profile.kubernetes.api] is PYTORCHJOB)


def watcher_pod(spec: JobSpec, job: dict, folder: str) -> dict:
    """The pod that keeps a failed attempt's nodes out of the next attempt (kubernetes_blame), beside `job` (as
    the API server returned it: its uid makes the job the pod's owner, so the pod goes when the job goes). It runs
    as nobody, read-only, with no capability and no way to gain one; it mounts the results volume read-only and
    the token of its own ServiceAccount (kubernetes.watcher_service_account), granted exactly what the watcher
    calls (kubernetes_blame.WATCHER_RULES, manifests/rbac/watcher.yaml)."""
    kube, meta = spec.profile.kubernetes, job["metadata"]
    command = ["python", "-m", WATCHER_MODULE, "--namespace", meta["namespace"], "--job", meta["name"],
               "--folder", folder, "--max-marked-share", str(spec.profile.preflight.max_marked_share)] + \
        (["--taint"] if spec.taint_bad_nodes else []) + (["--launch", str(spec.launch)] if spec.launch is not None else [])
    container = k8s.V1Container(
        name="watch", image=spec.profile.image, command=command[:1], args=command[1:],
        env=[k8s.V1EnvVar(name="PYTHONDONTWRITEBYTECODE", value="1")],
        volume_mounts=[k8s.V1VolumeMount(name="results", mount_path=kube.results_mount, read_only=True)],
        resources=kubernetes_resources.SMALL_POD,
        security_context=k8s.V1SecurityContext(privileged=False, allow_privilege_escalation=False,
                                               read_only_root_filesystem=True,
                                               capabilities=k8s.V1Capabilities(drop=["ALL"])))
    owner = k8s.V1OwnerReference(api_version=PYTORCHJOB.api_version, kind=PYTORCHJOB.kind, name=meta["name"],
                                 uid=meta["uid"])
    pod = k8s.V1Pod(
        api_version="v1", kind="Pod",
        metadata=k8s.V1ObjectMeta(name=f"{meta['name']}-watch", namespace=meta["namespace"], owner_references=[owner],
                                  labels={**_labels(spec, job=False), kubernetes_nodes.ROLE_LABEL: "watch"}),
        spec=k8s.V1PodSpec(
            containers=[container], volumes=[results_volume(kube.results_pvc)],
            # A crash restarts it in place; what it decided is on the job, where it reads it back.
            restart_policy="OnFailure", service_account_name=kube.watcher_service_account,
            automount_service_account_token=True, tolerations=tolerations(kube), image_pull_secrets=pull_secrets(kube),
            security_context=k8s.V1PodSecurityContext(run_as_non_root=True, run_as_user=WATCHER_UID,
                                                      run_as_group=WATCHER_UID,
                                                      seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"))))
    return own_pod(spec, to_dict(pod))


def own_pod(spec: JobSpec, pod: dict) -> dict:
    """One of the harness's own small pods (the watcher, a collector) with the profile's pod patch: its one
    container stays the harness's (kubernetes_patch: no sidecar joins it)."""
    [container] = pod["spec"]["containers"]
    return _patched(spec, pod, container["name"], "V1Pod", sidecars=False)
