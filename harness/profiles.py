"""Cluster profiles: what a cluster needs from a job that the benchmark does not decide.

A profile is a YAML file (`manifests/profiles/<name>.yaml`, or any path), loaded
with yaml.safe_load and checked field by field against the dataclasses below, so
a typo is an error naming the valid keys rather than a setting silently ignored.
`--set key=value` overrides one field (dotted for nested ones:
`--set slurm.partition=gpu`, `--set env.NCCL_DEBUG=INFO`); values are YAML, so
`--set gpus_per_node=4` is a number.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from harness.errors import HarnessError
from workloads.common.page_cache import HOST_FLUSH_COMMAND

PROFILES_DIR = Path(__file__).resolve().parent.parent / "manifests" / "profiles"
DEFAULT_PROFILE = "local-cpu"
KUBERNETES_APIS = ("pytorchjob", "trainjob")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass
class KubernetesSettings:
    api: str = "pytorchjob"  # pytorchjob (kubeflow.org/v1) or trainjob (Kubeflow Trainer v2); --api sets it
    trainjob_runtime: str = "torch-distributed"  # the ClusterTrainingRuntime a TrainJob runs on
    namespace: str = "default"
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict] = field(default_factory=list)  # as in a pod spec
    priority_class: str | None = None
    queue: str | None = None  # Volcano/scheduler-plugins queue and Kueue's queue-name label
    results_pvc: str | None = None  # a ReadWriteMany claim mounted where rank 0 writes the logs
    results_mount: str = "/results"
    shm_size: str = "16Gi"  # the memory-backed /dev/shm that NCCL and data loaders need
    service_account: str | None = None
    # A privileged init container per pod that flushes its node's page cache before the run (MLPerf's rules);
    # opt-in, since the pods ask for no privilege otherwise (harness.cache_flush).
    flush_page_cache: bool = False
    # The image of the pods that copy the run folder back (`harness collect`): they run a few lines of Python's
    # standard library, so any small Python image does; None: the training image.
    collect_image: str | None = None
    # The ServiceAccount of the watcher pod that keeps a failed attempt's nodes out of the next (with --preflight
    # and --max-restarts): its own, granted exactly what the watcher calls (manifests/rbac/watcher.yaml).
    watcher_service_account: str = "mlperf-harness-watcher"
    # More claims in every training pod, "CLAIM:/path[:ro]" (a dataset, reference checkpoints). --data and
    # --init-checkpoint must lie under one of these paths or under results_mount.
    mounts: list[str] = field(default_factory=list)
    # The training container's CPU and memory, requests equal to limits so that the training pods are Guaranteed
    # (last to be evicted, while they hold a memory-backed /dev/shm); None: derived from the node shape
    # (cpus_per_node, memory_gib_per_node) less a reserve for the node's own (harness.launchers.kubernetes_resources).
    cpu: str | None = None  # a Kubernetes quantity: "200", "199500m"
    memory: str | None = None  # a Kubernetes quantity, /dev/shm included: "1800Gi"
    image_pull_secrets: list[str] = field(default_factory=list)  # on every pod the harness creates: a private registry
    scheduler_name: str | None = None  # the training and health pods' scheduler (volcano, a Kueue-enabled one)
    # A node affinity, podAffinity or podAntiAffinity as in a pod spec, on the training and health pods; the nodes
    # preflight and the watcher keep out are ANDed into each of its required node selector terms.
    affinity: dict[str, typing.Any] = field(default_factory=dict)
    # On the training and health pods' metadata: Kueue's topology-aware scheduling reads
    # kueue.x-k8s.io/podset-required-topology (or -preferred-topology) from the pod template's annotations.
    pod_labels: dict[str, str] = field(default_factory=dict)
    pod_annotations: dict[str, str] = field(default_factory=dict)
    # A strategic-merge patch (metadata and spec, as in a pod template) applied to every pod the harness creates,
    # for what no setting above says; refused where it would change what the harness manages
    # (harness.launchers.kubernetes_patch).
    pod_patch: dict[str, typing.Any] = field(default_factory=dict)


@dataclass
class SlurmSettings:
    partition: str | None = None
    account: str | None = None
    constraint: str | None = None
    time: str | None = None  # --time; None: the campaign plan's (harness.campaign_plan.campaign_minutes)
    exclusive: bool = True
    requeue: bool = True
    use_gres: bool = False  # --gres=gpu:N instead of --gpus-per-node=N (older Slurm set-ups)
    # The host-side step per node before the run, outside the container (harness.cache_flush), as NVIDIA's
    # run.sub flushes the page cache; "" for none. NVIDIA's clusters: "sudo /sbin/sysctl vm.drop_caches=3".
    flush_page_cache: str = HOST_FLUSH_COMMAND
    # pyxis, with `image` below: "HOST[:CONTAINER[:FLAGS]]". --out, --data and --init-checkpoint reach the
    # container translated through these (see harness.mounts); the run folder is mounted as it is otherwise.
    container_mounts: list[str] = field(default_factory=list)
    results_dir: str | None = None  # where run folders go without --out (a shared file system), e.g. /mnt/results
    rendezvous_port: int = 29500


@dataclass
class RendezvousSettings:
    """How long the nodes wait for each other at the c10d rendezvous; None: scaled with the node count
    (harness.launchers.base.rendezvous_timeouts), since torch's defaults (600 s to join, 60 s per store read)
    are sized for tens of nodes, not for 448 nodes pulling a container image and sharing one store."""

    join_timeout_s: int | None = None
    store_timeout_s: int | None = None


@dataclass
class PreflightSettings:
    """Thresholds of the preflight checks (harness.health). None: the default for the node's GPU model
    (harness.health.thresholds, where each default says where it comes from); 0 GPUs: the CPU defaults."""

    gpu_model: str | None = None  # text the NVML name must contain, e.g. "H100"; None: any model
    min_matmul_tflops: float | None = None  # bf16 matmul, per GPU
    min_allreduce_busbw_gbps: float | None = None  # all-reduce bus bandwidth inside one node
    allreduce_mib: int | None = None  # all-reduce message size inside a node
    min_pair_busbw_gbps: float | None = None  # all-reduce bus bandwidth between two nodes (one rank each)
    pair_mib: int | None = None  # message size between nodes
    pair_rounds: int = 3  # rounds of node pairs: every node meets up to this many partners
    max_temperature_c: int | None = None
    min_pcie_gen: int | None = None
    min_pcie_width: int | None = None
    ib_rate_gbps: int | None = None  # every active InfiniBand port's rate; 0: any rate
    max_ib_link_errors: int | None = None  # link_downed + link_error_recovery per port
    min_free_gib: float | None = None  # free space in the shared results folder
    # The whole health phase's deadline on every backend (Slurm's step --time, Kubernetes' activeDeadlineSeconds):
    # a node whose check hangs (NVML and CUDA calls can, on a GPU after Xid 79) is then judged without the
    # report it never wrote, and the other nodes are not held until the job's wall-time limit.
    deadline_s: int = 1200
    # Each NVML or CUDA check's own deadline, in its child process (harness.health.isolate): a hung check fails
    # its node (`timed out after N s`) and the node's other checks still run, within deadline_s above.
    check_deadline_s: int = 120
    # Beyond deadline_s, what the scheduler's limit allows for the image pull and the nodes' start being spread
    # (activeDeadlineSeconds and Slurm's step --time count from before the pull): each node's own deadline_s counts
    # from when its health process starts, so a node that started late is not killed before it writes its report.
    start_allowance_s: int = 600
    # The most one decision marks on the cluster (drain, taint, failed condition), as a share of the allocation (at
    # least one node). Above it nothing is marked and the failure is reported as systemic (the image, the store,
    # the network), as NVSentinel's circuit breaker does.
    max_marked_share: float = 0.1
    # Spare nodes by default for a closed allocation of more than spare_above_nodes nodes: ceil(nodes x spare_share),
    # so that a node preflight keeps out is replaced rather than stopping the job (harness.campaign_plan.asked_spares).
    spare_share: float = 0.0
    spare_above_nodes: int = 16


@dataclass
class Profile:
    name: str
    description: str = ""
    gpus_per_node: int = 0  # 0: CPU nodes (gloo)
    procs_per_node: int | None = None  # processes per node when there are no GPUs; None: 1
    gpu_memory_gib: int = 80  # per GPU; workloads refuse configs whose estimate exceeds it
    # The node's shape (its CPUs, hyperthreads counted, and memory), from which the Kubernetes pods' CPU and memory
    # requests are derived (kubernetes.cpu, kubernetes.memory); None: unknown, and the pods ask for none.
    cpus_per_node: int | None = None
    memory_gib_per_node: int | None = None
    gpu_resource: str = "nvidia.com/gpu"
    rdma_resource: str | None = None  # e.g. rdma/ib, or an SR-IOV/hostdev resource name
    rdma_count: int = 0
    host_network: bool = False
    image: str | None = None  # container image (pods; pyxis on Slurm)
    env: dict[str, str] = field(default_factory=dict)  # NCCL and InfiniBand settings
    metrics_port: int = 9410  # each node agent's Prometheus endpoint (next to DCGM exporter's 9400); 0: off
    rendezvous: RendezvousSettings = field(default_factory=RendezvousSettings)
    kubernetes: KubernetesSettings = field(default_factory=KubernetesSettings)
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    preflight: PreflightSettings = field(default_factory=PreflightSettings)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def available() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def _check_value(value, kind, where: str):
    """`value` as `kind` (a type hint of the dataclasses above), or an error naming `where`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _check_value(value, next(a for a in args if a is not type(None)), where)
    if dataclasses.is_dataclass(kind):
        return _build(kind, value, where)
    if origin is dict and args[1] is typing.Any:
        return _mapping(value, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise HarnessError(f"{where} must be a mapping, got {value!r}")
        return {str(k): _text(v, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list) or not all(isinstance(v, args[0]) for v in value):
            raise HarnessError(f"{where} must be a list of {args[0].__name__}, got {value!r}")
        return [_text(v, f"{where}[{i}]") for i, v in enumerate(value)] if args[0] is str else value
    if kind is bool:
        if not isinstance(value, bool):
            raise HarnessError(f"{where} must be true or false, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise HarnessError(f"{where} must be a number, 0 or more, got {value!r}")
        return float(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise HarnessError(f"{where} must be a whole number, 0 or more, got {value!r}")
        return value
    return _text(value, where)


def _mapping(value, where: str) -> dict:
    """A free-form mapping (an affinity, a pod patch) as JSON would carry it to the API server: text keys, and
    values that are mappings, lists, text, numbers, booleans or null (not YAML's dates)."""
    def check(node, at: str):
        if isinstance(node, dict):
            for key, item in node.items():
                if not isinstance(key, str):
                    raise HarnessError(f"{at} has the key {key!r}; keys must be text")
                check(item, f"{at}.{key}")
        elif isinstance(node, list):
            for i, item in enumerate(node):
                check(item, f"{at}[{i}]")
        elif node is not None and not isinstance(node, (str, int, float, bool)):
            raise HarnessError(f"{at} must be text, a number, true/false, a list or a mapping, got {node!r}")

    if not isinstance(value, dict):
        raise HarnessError(f"{where} must be a mapping, got {value!r}")
    check(value, where)
    return value


def _text(value, where: str) -> str:
    if isinstance(value, (dict, list)) or value is None:
        raise HarnessError(f"{where} must be text, got {value!r}")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if any(ord(c) < 32 for c in text):
        raise HarnessError(f"{where} must not hold control characters such as newlines")
    return text


def _build(cls, data, where: str):
    if not isinstance(data, dict):
        raise HarnessError(f"{where} must be a mapping of settings, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise HarnessError(f"{where + ': ' if where else ''}unknown setting(s) {', '.join(map(str, unknown))}; "
                           f"valid: {', '.join(names)}")
    return cls(**{key: _check_value(value, hints[key], f"{where}.{key}" if where else key)
                  for key, value in data.items()})


def _validate(profile: Profile) -> Profile:
    for key in profile.env:
        if not _ENV_NAME.match(key):
            raise HarnessError(f"env name {key!r} must be letters, digits and _")
    if profile.kubernetes.api not in KUBERNETES_APIS:
        raise HarnessError(f"kubernetes.api {profile.kubernetes.api!r} is not one of: {', '.join(KUBERNETES_APIS)}")
    for label, value in (("join_timeout_s", profile.rendezvous.join_timeout_s),
                         ("store_timeout_s", profile.rendezvous.store_timeout_s)):
        if value is not None and value < 1:
            raise HarnessError(f"rendezvous.{label} must be at least 1 second, got {value}")
    if profile.rdma_resource and profile.rdma_count < 1:
        raise HarnessError(f"rdma_resource {profile.rdma_resource} needs rdma_count of 1 or more")
    return profile


def from_dict(data: dict, where: str = "profile") -> Profile:
    if not isinstance(data, dict) or not data.get("name"):
        raise HarnessError(f"{where} must be a mapping with a name")
    try:
        return _validate(_build(Profile, data, ""))
    except HarnessError as exc:
        raise HarnessError(f"{where}: {exc}") from None


def load(name_or_path: str) -> Profile:
    """A shipped profile by name, or a YAML file by path."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or "/" in name_or_path):
        if name_or_path not in available():
            raise HarnessError(f"unknown profile {name_or_path!r}; choose one of: {', '.join(available())}, "
                               "or give a YAML file's path")
        path = PROFILES_DIR / f"{name_or_path}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise HarnessError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise HarnessError(f"profile {path} is not valid YAML: {exc}") from None
    return from_dict(data, str(path))


# Mappings set whole by --set (`--set 'kubernetes.pod_patch={spec: {hostIPC: false}}'`): their keys hold dots
# (label names) or nest freely, so they are not dotted into --set keys.
_WHOLE = {"affinity", "pod_patch", "pod_labels", "pod_annotations"}


def _leaves(data: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in _WHOLE and (value or not prefix):
            flat.update(_leaves(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def overrides(profile: Profile) -> list[str]:
    """The `--set` pairs that turn the shipped profile of this name into `profile` (for reproducing a job)."""
    if profile.name not in available():
        return []
    base = _leaves(load(profile.name).to_dict())

    def text(value) -> str:  # one line (no wrap): a pair is one argument of the command that reproduces the job
        return yaml.safe_dump(value, default_flow_style=True, width=math.inf).strip().removesuffix('...').strip()

    return [f"{key}={text(value)}" for key, value in _leaves(profile.to_dict()).items()
            if base.get(key, object()) != value]


def apply_overrides(profile: Profile, pairs: list[str]) -> Profile:
    """`--set key=value` overrides, each checked like the file's own settings."""
    data = profile.to_dict()
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise HarnessError(f"--set {pair!r}: expected KEY=VALUE, e.g. slurm.partition=gpu")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        *parents, leaf = key.split(".")
        target = data
        for part in parents:
            if not isinstance(target.get(part), dict):
                raise HarnessError(f"--set {key}: {part!r} is not a group of settings; groups: env, kubernetes, "
                                   "slurm, rendezvous, preflight, kubernetes.node_selector")
            target = target[part]
        target[leaf] = value
    return from_dict(data, f"profile {profile.name} with --set")
