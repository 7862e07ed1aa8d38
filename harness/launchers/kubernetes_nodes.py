"""Kubernetes and preflight: the health job, the verdicts written on each Node, and the training pods kept off
the excluded nodes.

- The health job is a PyTorchJob of `nodes + spare_nodes` pods, one per node (pod anti-affinity on the host),
  each running `python -m harness.health` with its node's name (NODE_NAME, from the downward API) and the
  operator's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT for the between-node all-reduces. Its reports land on the
  results volume and come back with the run folder.
- Each checked Node gets a condition of type MLPerfPreflight, in node-problem-detector's sense: status "True"
  when preflight found a problem (reason PreflightFailed, the failed checks as the message), "False" when it
  found none (reason PreflightPassed). With --taint-bad-nodes a failed Node also gets a NoSchedule taint
  (mlperf-harness/preflight=failed). An Event goes on each failed Node and on the health job.
- The training pods get a required node affinity `metadata.name NotIn [excluded nodes]` (matchFields: the
  Node's name exactly, which is what preflight and the attempt records name; the kubernetes.io/hostname label
  need not equal it, on some clouds it does not), ANDed into each of the profile's required node selector terms.
The RBAC this needs (nodes get/patch, nodes/status patch cluster-wide; events create in the job's namespace) is
in kubernetes_rbac's tables (manifests/rbac/).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

from kubernetes import client as k8s

from harness.errors import HarnessError
from harness.launchers.kubernetes_api import PYTORCHJOB, UNREACHABLE, call, unreachable
from harness.preflight import to_mark

CONDITION = "MLPerfPreflight"
TAINT = k8s.V1Taint(key="mlperf-harness/preflight", value="failed", effect="NoSchedule")
OWN_TOLERATION = {"key": TAINT.key, "operator": "Equal", "value": TAINT.value, "effect": TAINT.effect}
HOSTNAME = "kubernetes.io/hostname"  # the topology key of one health pod per host
NODE_NAME_FIELD = "metadata.name"  # a Node's name, exactly (node affinity's matchFields)
ROLE_LABEL = "mlperf-harness/role"
HEALTH_JOB_TTL_S = 3600  # the operator deletes an ended health job that no harness deleted (its submitter gone)
MESSAGE_LIMIT = 1000  # a condition message and an Event message stay readable in `kubectl describe`


def preflight_name(spec) -> str:
    return f"{spec.name}-preflight"


def health_job(job: dict, spec, command: list[str]) -> dict:
    """The training PyTorchJob (`job`, as built for `spec` with nodes + spare_nodes pods) turned into the health
    job: `command` in every pod, one pod per node, one process per pod, no restarts."""
    job["metadata"]["name"] = preflight_name(spec)
    job["spec"]["nprocPerNode"] = "1"  # WORLD_SIZE = pods, RANK = the pod's index: one rank per node
    job["spec"]["runPolicy"]["backoffLimit"] = 0
    # A hung check (a GPU after Xid 79) must not hold every node: the operator fails the job at the deadline,
    # and a node without a report is judged failed.
    # It counts from before the image pull: each node's own deadline_s counts from its start (harness.health), and
    # the allowance keeps a node that started late from being killed before it rewrites its report.
    job["spec"]["runPolicy"]["activeDeadlineSeconds"] = (spec.profile.preflight.deadline_s
                                                         + spec.profile.preflight.start_allowance_s)
    # Its pods stay when it ends, so that the harness reads which Nodes they ran on (a node that wrote no report
    # fails); the harness then deletes the job with its pods. Were the harness gone, the operator deletes it later.
    job["spec"]["runPolicy"]["cleanPodPolicy"] = "None"
    job["spec"]["runPolicy"]["ttlSecondsAfterFinished"] = HEALTH_JOB_TTL_S
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        # One pod per node: no two pods of this job on one host (the operator labels pods with the job's name).
        anti = {"requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {"matchLabels": {
            ROLE_LABEL: "preflight", "training.kubeflow.org/job-name": job["metadata"]["name"]}},
            "topologyKey": HOSTNAME}]}
        replica["restartPolicy"] = "Never"
        template = replica["template"]
        template["metadata"].setdefault("labels", {})[ROLE_LABEL] = "preflight"
        template["spec"].setdefault("affinity", {})["podAntiAffinity"] = anti
        # A node the harness tainted is checked again (and untainted when it passes): the harness's own taint only.
        tolerations = template["spec"].get("tolerations") or []
        template["spec"]["tolerations"] = tolerations + [dict(OWN_TOLERATION)]  # a copy: no YAML anchors
        # The training container (a profile's pod patch may add sidecars beside it).
        [container] = [c for c in template["spec"]["containers"] if c["name"] == PYTORCHJOB.container]
        container["command"], container["args"] = command[:1], command[1:]
        container.setdefault("env", []).append(
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
    return job


def _event(namespace: str, involved: k8s.V1ObjectReference, reason: str, message: str, warning: bool):
    now = datetime.now(timezone.utc)
    return k8s.CoreV1Event(
        metadata=k8s.V1ObjectMeta(generate_name=f"{involved.name}-", namespace=namespace), involved_object=involved,
        reason=reason, message=message[:MESSAGE_LIMIT], type="Warning" if warning else "Normal",
        first_timestamp=now, last_timestamp=now, count=1, source=k8s.V1EventSource(component="mlperf-harness"))


def health_job_reference(spec) -> k8s.V1ObjectReference:
    """The health job of `spec` (as the health job's own spec names it), for the Events about its verdicts."""
    return k8s.V1ObjectReference(api_version="kubeflow.org/v1", kind="PyTorchJob", name=preflight_name(spec),
                                 namespace=spec.profile.kubernetes.namespace)


def remediate(core: k8s.CoreV1Api, record: dict, job: k8s.V1ObjectReference, taint: bool,
              best_effort: bool = False, attempt=None) -> list[str]:
    """Condition every Node `record` (preflight.json's shape) judged, taint the failed ones (with `taint`:
    --taint-bad-nodes), and record Events on the failed Nodes and on `job` (the health job, or the training job
    a failed attempt blamed the node in). The one remediation code for both, whoever runs it: `harness run` after
    preflight, the watcher pod after a failed attempt (kubernetes_blame). With `best_effort` (the watcher, which
    has kept the node out of the job already) a refused step (a 403 on the Node) is a line of its own and the
    next step is tried; otherwise it raises. `attempt(fn, *args)` runs each step (the watcher's retries through
    an API server outage: kubernetes_api.retrying); by default, once. The Events on a Node go in the job's
    namespace, the one whoever runs this is granted (kubernetes_rbac: no right to write Events anywhere else is
    needed); `kubectl describe node` finds a Node's Events in any namespace."""
    namespace = job.namespace
    now = datetime.now(timezone.utc).isoformat()
    done = [record["systemic"]] if record.get("systemic") else []
    marked = to_mark(record)

    def step(node: str, fn, *args) -> bool:
        try:
            (attempt or (lambda f, *a: f(*a)))(fn, *args)
            return True
        except HarnessError as exc:
            if not best_effort:
                raise
            done.append(f"{node}: {exc} (kept out of the job all the same)")
            return False

    for node, verdict in record["nodes"].items():
        reasons = record["excluded"].get(node, [])
        failed = not verdict["ok"]
        if failed and node not in marked:  # a systemic failure: no node is marked for it
            continue
        message = ("harness preflight: " + "; ".join(reasons)) if failed else "harness preflight: every check passed"
        condition = {"type": CONDITION, "status": "True" if failed else "False",
                     "reason": "PreflightFailed" if failed else "PreflightPassed",
                     "message": message[:MESSAGE_LIMIT], "lastHeartbeatTime": now, "lastTransitionTime": now}
        conditioned = step(node, call, f"set the {CONDITION} condition on node {node}", core.patch_node_status,
                           node, {"status": {"conditions": [condition]}})
        if not failed:
            removed = []  # whether the harness's own taint was there to remove
            step(node, lambda: removed.append(_untaint(core, node)))
            if any(removed):
                done.append(f"{node}: untainted {TAINT.key}={TAINT.value}:{TAINT.effect} (passed again)")
            continue
        if conditioned:
            done.append(f"{node}: condition {CONDITION}=True ({message})")
        if taint and step(node, _taint, core, node):
            done.append(f"{node}: tainted {TAINT.key}={TAINT.value}:{TAINT.effect}")
        node_ref = k8s.V1ObjectReference(api_version="v1", kind="Node", name=node)
        for target in (node_ref, job):
            step(node, call, "record an event", core.create_namespaced_event, namespace,
                 _event(namespace, target, "PreflightFailed", message, warning=True))
    return done


def _taint(core: k8s.CoreV1Api, node: str, tries: int = 5) -> None:
    """Add TAINT to the node's taints. The list has no merge key, so a patch replaces it whole: the patch names
    the resourceVersion it was read at, and a taint another controller added meanwhile (the node lifecycle
    controller's `unreachable`, say) makes it a 409 Conflict, after which the list is read again."""
    for _ in range(tries):
        read = call(f"read node {node}", core.read_node, node)
        current = read.spec.taints or []
        if any(t.key == TAINT.key and t.effect == TAINT.effect for t in current):
            return
        taints = [k8s.ApiClient().sanitize_for_serialization(t) for t in [*current, TAINT]]
        try:
            core.patch_node(node, {"metadata": {"resourceVersion": read.metadata.resource_version},
                                   "spec": {"taints": taints}})
            return
        except k8s.ApiException as exc:
            if exc.status != 409:
                raise HarnessError(f"Kubernetes refused to taint node {node}: {exc.status} {exc.reason}: "
                                   f"{exc.body}", 1) from None
        except UNREACHABLE as exc:  # as `call` says it (an Unreachable, which the watcher waits out)
            raise unreachable(f"taint node {node}", core.patch_node, exc) from None
    raise HarnessError(f"could not taint node {node}: its taints changed under every one of {tries} tries", 1)


def _own(taint) -> bool:
    """Whether a Node's taint is the one the harness writes: key, value and effect, never only the key."""
    return (taint.key, taint.value, taint.effect) == (TAINT.key, TAINT.value, TAINT.effect)


def _untaint(core: k8s.CoreV1Api, node: str, tries: int = 5) -> bool:
    """Remove the harness's own taint from a node that passed again (as _taint adds it: the whole list, at the
    resourceVersion it was read at); every other taint stays. Whether there was one to remove."""
    for _ in range(tries):
        read = call(f"read node {node}", core.read_node, node)
        current = read.spec.taints or []
        if not any(_own(t) for t in current):
            return False
        taints = [k8s.ApiClient().sanitize_for_serialization(t) for t in current if not _own(t)]
        try:
            core.patch_node(node, {"metadata": {"resourceVersion": read.metadata.resource_version},
                                   "spec": {"taints": taints}})
            return True
        except k8s.ApiException as exc:
            if exc.status != 409:
                raise HarnessError(f"Kubernetes refused to untaint node {node}: {exc.status} {exc.reason}: "
                                   f"{exc.body}", 1) from None
    raise HarnessError(f"could not untaint node {node}: its taints changed under every one of {tries} tries", 1)


def with_exclusions(pod_spec: dict, nodes: list[str]) -> dict:
    """A pod spec (as a dict) with the node affinity that keeps it off `nodes` as well as the nodes it kept out
    already. Required node selector terms are ORed, so the exclusion is ANDed into each of the pod's own (a term
    without it would still admit an excluded node); the pod's preferences and pod (anti-)affinity stay as they are."""
    if not nodes:
        return pod_spec
    node_affinity = pod_spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    required["nodeSelectorTerms"] = [_excluding(term, nodes) for term in required.get("nodeSelectorTerms") or [{}]]
    return pod_spec


def is_exclusion(requirement: dict) -> bool:
    """Whether a node selector requirement is the harness's exclusion (a Node's name NotIn a list)."""
    return requirement.get("key") == NODE_NAME_FIELD and requirement.get("operator") == "NotIn"


def _excluding(term: dict, nodes: list[str]) -> dict:
    """One node selector term with one exclusion of `nodes` and of those it excluded already."""
    fields = term.get("matchFields") or []
    kept_out = sorted({*nodes, *(node for f in fields if is_exclusion(f) for node in f.get("values") or [])})
    return {**term, "matchFields": [*(f for f in fields if not is_exclusion(f)),
                                    {"key": NODE_NAME_FIELD, "operator": "NotIn", "values": kept_out}]}


def health_spec(spec):
    """The spec the health job is built from: every allocated node, PyTorchJob, no restarts."""
    profile = dataclasses.replace(spec.profile,
                                  kubernetes=dataclasses.replace(spec.profile.kubernetes, api="pytorchjob"))
    return dataclasses.replace(spec, nodes=spec.nodes + spec.spare_nodes, spare_nodes=0, max_restarts=0,
                               profile=profile)
