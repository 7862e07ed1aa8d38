"""CPU and memory for the pods the harness creates.

Training pods ask for CPU and memory with requests equal to limits in every container, init containers included,
so that their QoS class is Guaranteed (Kubernetes, "Pod Quality of Service Classes"): under memory pressure the
kubelet evicts BestEffort pods first and Guaranteed ones last, and a training pod holds a memory-backed /dev/shm of up
to kubernetes.shm_size, which counts against the pod's memory limit (an emptyDir of medium Memory is charged to the
pod's memory), so the limit must hold it and the processes besides. The figures are the profile's kubernetes.cpu and
kubernetes.memory where set, else the node's shape (cpus_per_node, memory_gib_per_node) less NODE_RESERVE_SHARE for
the kubelet, the system and the DaemonSets every GPU node runs (the GPU and network operators, the DCGM exporter,
node-problem-detector, log agents): a share, since what they take grows with the node. Where neither is known the
pods ask for none, as before, and a note says so. The health job's pods are built from the training pod template
and ask for the same: they run the same GPU and NCCL checks with the same /dev/shm, and a node that holds one holds a
training pod. The watcher and collector pods are small and short of work: SMALL_POD.
"""

from __future__ import annotations

import math
from decimal import Decimal

from kubernetes import client as k8s
from kubernetes.utils import parse_quantity

from harness.errors import HarnessError

NODE_RESERVE_SHARE = 0.10  # of the node's CPUs and memory, left to the kubelet, the system and the DaemonSets
GIB = 2**30
GIB_PER_PROCESS = 8  # the least memory each training process needs beside /dev/shm (torch, CUDA, data loading)
INIT_CONTAINER = {"cpu": "1", "memory": "1Gi"}  # the page-cache flush: sync and a write to /proc
SMALL_POD = k8s.V1ResourceRequirements(requests={"cpu": "100m", "memory": "256Mi"},
                                       limits={"cpu": "1", "memory": "1Gi"})


def quantity(value: str, setting: str) -> Decimal:
    """A Kubernetes quantity ("128Gi", "500m", "2"), or one line naming the setting."""
    try:
        return parse_quantity(value)
    except ValueError:
        raise HarnessError(f"{setting} {value!r} is not a Kubernetes quantity (e.g. 1800Gi, 64, 500m)") from None


def training(profile, procs: int) -> dict[str, str]:
    """The training container's cpu and memory (requests and limits both), each that is known: the profile's
    kubernetes.cpu and kubernetes.memory, else the node shape less the reserve. Refused in one line where the memory
    cannot hold /dev/shm and `procs` processes beside it."""
    kube, figures = profile.kubernetes, {}
    if kube.cpu:
        quantity(kube.cpu, "kubernetes.cpu")
        figures["cpu"] = kube.cpu
    elif profile.cpus_per_node:
        figures["cpu"] = str(max(1, math.floor(profile.cpus_per_node * (1 - NODE_RESERVE_SHARE))))
    if kube.memory:
        limit = quantity(kube.memory, "kubernetes.memory")
        figures["memory"], where = kube.memory, f"kubernetes.memory {kube.memory}"
    elif profile.memory_gib_per_node:
        gib = max(1, math.floor(profile.memory_gib_per_node * (1 - NODE_RESERVE_SHARE)))
        limit, figures["memory"] = Decimal(gib * GIB), f"{gib}Gi"
        where = f"the memory derived from memory_gib_per_node {profile.memory_gib_per_node} ({gib}Gi)"
    else:
        return figures
    shm = quantity(kube.shm_size, "kubernetes.shm_size")
    if shm + procs * GIB_PER_PROCESS * GIB > limit:
        raise HarnessError(f"kubernetes.shm_size {kube.shm_size} does not fit in {where} with {GIB_PER_PROCESS}Gi for "
                           f"each of the {procs} process(es) beside it: a memory-backed /dev/shm counts against the "
                           "pod's memory limit; lower kubernetes.shm_size or raise kubernetes.memory")
    return figures


def notes(profile, procs: int) -> list[str]:
    """What the training pods ask for no figure of, said rather than left silent."""
    missing = [name for name in ("cpu", "memory") if name not in training(profile, procs)]
    if not missing:
        return []
    return [f"note: profile {profile.name} gives no node shape for {' or '.join(missing)} (cpus_per_node, "
            f"memory_gib_per_node) and no kubernetes.{' or kubernetes.'.join(missing)}, so the training pods ask for "
            "none and are not Guaranteed: the kubelet evicts them first under memory pressure"]


def check_guaranteed(pod_spec: dict) -> None:
    """Every container and init container of a training pod with equal cpu and memory requests and limits (the
    harness sets its own; a patch's sidecar must too), or one line naming the container."""
    for field in ("initContainers", "containers"):
        for container in pod_spec.get(field) or []:
            resources = container.get("resources") or {}
            requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
            for name in ("cpu", "memory"):
                if name not in limits or parse_quantity(str(requests.get(name, limits[name]))) != \
                        parse_quantity(str(limits[name])):
                    raise HarnessError(f"kubernetes.pod_patch: {field} {container.get('name')!r} needs a {name} limit "
                                       f"and a request equal to it, as every container of a Guaranteed training pod "
                                       f"has (resources.requests and resources.limits)")
