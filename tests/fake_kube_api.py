"""FAKE Kubernetes API server, for tests only: no real API server can be installed offline.

It speaks just the endpoints the k8s launcher uses, through the official client:
PyTorchJob and TrainJob custom objects (create, get, patch, delete: a job's pods, and the pods whose
ownerReferences name it, go with it), pods (list by label, create, get, delete; a create under a name
already taken is refused with 409 AlreadyExists, as the API server refuses it), pod logs, events (create), and
Nodes (list, by label too, get, and strategic-merge patches of the node and of its status). For `harness doctor`,
reads only, of objects held in plain dicts the tests fill (each shaped as the API server serves it): Namespaces,
CustomResourceDefinitions, PersistentVolumeClaims, ServiceAccounts, Roles and RoleBindings (listed), PriorityClasses,
Kueue LocalQueues, Volcano Queues and Kubeflow Trainer ClusterTrainingRuntimes (each served only while `crds` holds
its CRD: otherwise the API server has no such path, and answers 404 in plain text), and SelfSubjectAccessReviews,
answered from `denied`. Tests move a job
through its life by editing `jobs` and `pods` directly, or, for PyTorchJobs, by
letting `reconcile` do what the training operator's controller does (below). A
pod created through the API (the harness's results pods), or a job's pod passed
to `run_pod`, is "run" as a fake kubelet would: its command runs here, with the
pod's environment, $(VAR) expanded in its arguments, each volume claim named in
`claims` standing for a local folder, and its output as its log; a long-running pod (restartPolicy
other than Never) is left Running, for the test to start as a process of its own (`start_pod`). The log API
serves what the kubelet would after rotating the container log at 10 MiB: only
the part written since the newest rotation.

The operator (kubeflow/training-operator, pkg/controller.v1/common job.go and
pod.go, pkg/core, the PyTorchJob reconciler), as far as restarts go:
- one pod per replica, named <job>-<master|worker>-<index>; a missing one is created;
- restartPolicy ExitCode: the pod's own restartPolicy is Never; a pod that failed with
  an exit code of 128 or more is deleted (condition Restarting) and, on the next
  pass, created again under the same name; 1 to 127 fails the job. Never: any
  failed pod fails the job;
- backoffLimit: PastBackoffLimit sums the container restartCounts of running pods,
  which stay 0 when pods are recreated rather than restarted in place, and the
  "new failure" check compares the work queue's requeue count, always 0 in the
  controller-runtime reconciler (FakeWorkQueue), with the limit: so only a limit of
  0 ever fails a job, on its first retryable failure;
- the Master's success is the job's; a finished job's pods are deleted as
  cleanPodPolicy says (Running: those still running or pending; None: none);
- a pod is created from the replica's template as the job holds it at that moment
  (createNewPod: spec.Template.DeepCopy()), so a template patched after submit shapes
  the pods created after it, recreated ones included, and no pod already there; a job's
  pod deleted through the API is created again at the next pass.

Where `nodes` holds Nodes, a fake scheduler binds each new job pod (spec.nodeName) to
the first Node that its required node affinity (metadata.name or kubernetes.io/hostname In / NotIn)
admits, whose NoSchedule and NoExecute taints it tolerates, and that holds no other pod
of the same job (one training pod fills a node's GPUs); with none left it stays Pending.

The server answers requests on threads of its own while tests act on the same state from theirs: every change,
and every read of more than one object, holds `lock`, so a job is never seen half made (the operator's pass
over a new PyTorchJob creates its pods within the create, and a reader that takes the lock sees both or
neither). A pod the fake kubelet runs runs outside it, so that pods run side by side, as on a cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

JOBS = re.compile(r"/apis/(kubeflow\.org/v1|trainer\.kubeflow\.org/v1alpha1)/namespaces/([^/]+)/"
                  r"(pytorchjobs|trainjobs)(?:/([^/]+))?$")
PODS = re.compile(r"/api/v1/namespaces/([^/]+)/pods$")
POD = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
POD_LOG = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$")
EVENTS = re.compile(r"/api/v1/namespaces/([^/]+)/events$")
LOG_ROTATE_BYTES = 10 * 2**20  # the kubelet's default containerLogMaxSize
JOB_LABEL, TYPE_LABEL, INDEX_LABEL = ("training.kubeflow.org/job-name", "training.kubeflow.org/replica-type",
                                      "training.kubeflow.org/replica-index")
MASTER_PORT = "23456"
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _container_status(pod: dict, state: dict) -> dict:
    """A pod's container status as the kubelet reports it; a container ends without restarting in place
    (restartCount 0: pods under ExitCode have restartPolicy Never)."""
    [container] = pod["spec"]["containers"]
    return {"name": container["name"], "image": container["image"], "imageID": "", "ready": "running" in state,
            "restartCount": 0, "state": state}


def served_log(log: str) -> str:
    """What the log API returns after the kubelet rotated the log every LOG_ROTATE_BYTES: the newest part."""
    data = log.encode()
    return data[len(data) - len(data) % LOG_ROTATE_BYTES:].decode(errors="replace") if len(data) > LOG_ROTATE_BYTES \
        else log
NODES = re.compile(r"/api/v1/nodes$")
# What `harness doctor` reads: (path, the FakeKubeAPI attribute that holds the objects, keyed by (namespace,
# name) where the path has a namespace, else by name; the CRD that serves them, None for a built-in kind; the
# List kind where the path lists them: the RBAC kinds alone).
READS = [
    (re.compile(r"/api/v1/namespaces/(?P<name>[^/]+)$"), "namespaces", None, None),
    (re.compile(r"/apis/apiextensions\.k8s\.io/v1/customresourcedefinitions/(?P<name>[^/]+)$"), "crds", None, None),
    (re.compile(r"/api/v1/namespaces/(?P<namespace>[^/]+)/persistentvolumeclaims/(?P<name>[^/]+)$"), "pvcs", None,
     None),
    (re.compile(r"/api/v1/namespaces/(?P<namespace>[^/]+)/serviceaccounts/(?P<name>[^/]+)$"), "service_accounts",
     None, None),
    (re.compile(r"/apis/rbac\.authorization\.k8s\.io/v1/namespaces/(?P<namespace>[^/]+)/roles$"), "roles", None,
     "RoleList"),
    (re.compile(r"/apis/rbac\.authorization\.k8s\.io/v1/namespaces/(?P<namespace>[^/]+)/rolebindings$"),
     "role_bindings", None, "RoleBindingList"),
    (re.compile(r"/apis/scheduling\.k8s\.io/v1/priorityclasses/(?P<name>[^/]+)$"), "priority_classes", None, None),
    (re.compile(r"/apis/kueue\.x-k8s\.io/v1beta1/namespaces/(?P<namespace>[^/]+)/localqueues/(?P<name>[^/]+)$"),
     "local_queues", "localqueues.kueue.x-k8s.io", None),
    (re.compile(r"/apis/scheduling\.volcano\.sh/v1beta1/queues/(?P<name>[^/]+)$"), "volcano_queues",
     "queues.scheduling.volcano.sh", None),
    (re.compile(r"/apis/trainer\.kubeflow\.org/v1alpha1/clustertrainingruntimes/(?P<name>[^/]+)$"), "runtimes",
     "clustertrainingruntimes.trainer.kubeflow.org", None),
]
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


def merge_patch(target: dict, patch: dict) -> None:
    """RFC 7386: objects merge key by key, null removes a key, anything else (lists too) replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_patch(target[key], value)
        else:
            target[key] = value
NODE = re.compile(r"/api/v1/nodes/([^/]+)(/status)?$")


def rbac_attributes(method: str, path: str) -> tuple[str, str, str, str]:
    """The request as RBAC authorizes it: (apiGroup, resource with its subresource, verb, namespace), the
    namespace "" for a cluster-scoped resource; the verb a GET of a collection is `list`, of one object `get`."""
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    namespace = ""
    if rest[:1] == ["namespaces"] and len(rest) > 1:  # a namespace itself counts as in it (RequestInfoFactory)
        namespace, rest = rest[1], rest[2:] if len(rest) > 2 else rest
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    one = len(rest) > 1
    verb = {"GET": "get" if one else "list", "POST": "create", "PATCH": "patch", "PUT": "update",
            "DELETE": "delete"}[method]
    return group, resource, verb, namespace


def granted(docs: list[dict]) -> set[tuple[str, str, str, str]]:
    """What RBAC documents grant, as (scope, apiGroup, resource, verb): a Role's rules "namespace" (its
    namespace's), a ClusterRole's "cluster"; the tables in harness.launchers.kubernetes_rbac read the same."""
    kinds = {"Role": "namespace", "ClusterRole": "cluster"}
    return {(kinds[doc["kind"]], group, resource, verb) for doc in docs if doc["kind"] in kinds
            for rule in doc["rules"] for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"]}


class FakeKubeAPI:
    def __init__(self):
        self.jobs: dict[tuple[str, str], dict] = {}  # (namespace, name) -> job, of either kind
        self.claims: dict[str, Path] = {}  # PersistentVolumeClaim name -> the local folder standing for it
        self.pods: dict[tuple[str, str], dict] = {}  # (namespace, name) -> pod, with "log" text beside
        self.events: list[dict] = []
        self.nodes: dict[str, dict] = {}  # name -> Node; add_node() adds one
        # What `harness doctor` reads (module notes): by name, or by (namespace, name) for a namespaced kind.
        self.namespaces: dict[str, dict] = {}
        self.crds: dict[str, dict] = {}  # by <plural>.<group>
        self.pvcs: dict[tuple[str, str], dict] = {}
        self.service_accounts: dict[tuple[str, str], dict] = {}
        self.roles: dict[tuple[str, str], dict] = {}
        self.role_bindings: dict[tuple[str, str], dict] = {}
        self.priority_classes: dict[str, dict] = {}
        self.local_queues: dict[tuple[str, str], dict] = {}  # Kueue's
        self.volcano_queues: dict[str, dict] = {}
        self.runtimes: dict[str, dict] = {}  # Kubeflow Trainer's ClusterTrainingRuntimes
        # (apiGroup, resource[/subresource], verb) that a SelfSubjectAccessReview answers as not allowed (any
        # namespace); `reviews` holds the resourceAttributes of each one asked.
        self.denied: set[tuple[str, str, str]] = set()
        self.reviews: list[dict] = []
        self.before_node_patch = None  # a callable(name), run before each node patch (a concurrent writer)
        # A callable(pod), run before the fake kubelet runs a pod created through the API: a string it returns
        # fails the pod, with that string as its log (a results pod that cannot read the volume).
        self.before_pod_run = None
        self.patches: list[tuple[str, str]] = []  # (path, Content-Type) of every PATCH
        self.requests: list[tuple[str, str]] = []
        # What RBAC would check for each request that reached the server: (apiGroup, resource, verb, namespace),
        # the namespace "" for a cluster-scoped object (rbac_attributes).
        self.authorized: list[tuple[str, str, str, str]] = []
        # (apiGroup, resource, verb) -> HTTP status: such a request is refused (403: what a Role without the verb
        # answers), before anything changes.
        self.refuse: dict[tuple[str, str, str], int] = {}
        # The next `unreachable` requests find no API server: the connection is closed without an answer (the
        # client raises urllib3's errors: ProtocolError, MaxRetryError once its own retries are spent). Counted in
        # requests, never in seconds.
        self.unreachable = 0
        self.dropped = 0  # requests dropped so far, for the outage
        self.outage_after = 0  # requests answered before the `unreachable` ones begin
        self.operations: list[tuple[str, str]] = []  # ("create" | "delete", pod name), as the operator did them
        self.operator = False  # True: PyTorchJobs get their pods from `reconcile`, as the operator would
        self.lock = threading.RLock()  # held by every change and every read of several objects (module notes)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, folder: Path) -> Path:
        path = folder / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))
        return path

    def __enter__(self) -> "FakeKubeAPI":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # What the operator and kubelet would do.
    def set_condition(self, namespace: str, name: str, kind: str, message: str = "") -> None:
        with self.lock:
            job = self.jobs[(namespace, name)]
            conditions = job.setdefault("status", {}).setdefault("conditions", [])
            for condition in conditions:
                condition["status"] = "False" if condition["type"] in ("Running", "Restarting") else condition["status"]
            conditions.append({"type": kind, "status": "True", "message": message or f"PyTorchJob {name} is {kind}"})

    def job_reads(self, namespace: str, name: str) -> int:
        """How many times the job has been read (GET), by `harness run`'s watch or anyone."""
        path = re.compile(rf"/namespaces/{re.escape(namespace)}/(pytorchjobs|trainjobs)/{re.escape(name)}$")
        return sum(1 for method, url in list(self.requests) if method == "GET" and path.search(url))

    def set_condition_seen(self, namespace: str, name: str, kind: str, timeout: float = 120) -> None:
        """set_condition, then wait until the job has been read twice since (a read already under way may have
        served the state before), so a watcher that polls it has seen this condition however slow it runs."""
        before = self.job_reads(namespace, name)
        self.set_condition(namespace, name, kind)
        deadline = time.monotonic() + timeout
        while self.job_reads(namespace, name) < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)

    def set_jobs_status(self, namespace: str, name: str, active: int) -> None:
        """What the TrainJob controller reports while its child jobs run."""
        self.jobs[(namespace, name)].setdefault("status", {})["jobsStatus"] = [
            {"name": "node", "active": active, "ready": active, "succeeded": 0, "failed": 0, "suspended": 0}]

    def add_pod(self, namespace: str, job: str, name: str, phase: str, log: str,
                label: str = "training.kubeflow.org/job-name") -> None:
        self.pods[(namespace, name)] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {label: job}},
            "status": {"phase": phase}, "log": log}

    def add_node(self, name: str, taints: list[dict] | None = None, labels: dict[str, str] | None = None,
                 allocatable: dict[str, str] | None = None) -> None:
        """A Node, labelled with its hostname (and `labels`), with `allocatable` beside its CPUs and memory."""
        taints = [{"key": "example.com/other", "effect": "NoExecute"}] if taints is None else taints
        self.nodes[name] = {"apiVersion": "v1", "kind": "Node",
                            "metadata": {"name": name, "resourceVersion": "1",
                                         "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
                            "spec": {"taints": taints},
                            "status": {"conditions": [{"type": "Ready", "status": "True"}],
                                       "allocatable": {"cpu": "64", "memory": "515000Mi", **(allocatable or {})}}}

    def _schedule(self, pod: dict, job: str) -> str | None:
        """The fake scheduler (see the module's notes): the node the pod is bound to, or None (Pending)."""
        spec = pod["spec"]
        terms = (((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
        taken = {p["spec"].get("nodeName") for p in self.job_pods(pod["metadata"]["namespace"], job).values()}

        def admits(term: dict, node: str) -> bool:
            # Every node here has kubernetes.io/hostname equal to its name; matchFields reads the name itself.
            for key, expressions in (("kubernetes.io/hostname", term.get("matchExpressions", [])),
                                     ("metadata.name", term.get("matchFields", []))):
                for expression in expressions:
                    assert expression["key"] == key, expression
                    if (node in expression["values"]) != (expression["operator"] == "In"):
                        return False
            return True

        def tolerated(taint: dict) -> bool:
            return taint.get("effect") not in ("NoSchedule", "NoExecute") or any(
                t.get("key") == taint["key"] and (t.get("operator") == "Exists" or t.get("value") == taint.get("value"))
                for t in spec.get("tolerations") or [])

        for name, node in self.nodes.items():
            if name not in taken and (not terms or any(admits(t, name) for t in terms)) \
                    and all(tolerated(t) for t in node["spec"].get("taints") or []):
                return name
        return None

    def _patch_node(self, name: str, patch: dict, status: bool) -> dict | None:
        """A strategic merge patch as the API server applies it to a Node: status conditions merge by type;
        spec.taints (no merge key) is replaced whole. A patch naming a resourceVersion other than the node's
        is refused (None: 409 Conflict), as the API server's optimistic concurrency refuses it; every change
        moves the version on. `before_node_patch(name)`, when set, runs first (another controller's write)."""
        if self.before_node_patch:
            self.before_node_patch(name)
        node = self.nodes[name]
        asked = patch.get("metadata", {}).get("resourceVersion")
        if asked is not None and asked != node["metadata"]["resourceVersion"]:
            return None
        node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
        if status:
            conditions = node["status"]["conditions"]
            for condition in patch.get("status", {}).get("conditions", []):
                conditions[:] = [c for c in conditions if c["type"] != condition["type"]] + [condition]
        else:
            node["spec"].update(patch.get("spec", {}))
        return node

    def _run_pod(self, pod: dict) -> dict:
        """The fake kubelet: run the pod's one container here, claims mapped to local folders. Only a one-shot
        pod (restartPolicy Never) runs to its end; any other is left Running, for a test to start as its own
        process (start_pod)."""
        if pod["spec"].get("restartPolicy", "Always") != "Never":
            pod["status"] = {"phase": "Running", "containerStatuses": [_container_status(pod, {"running": {}})]}
            return pod
        if self.before_pod_run and (refused := self.before_pod_run(pod)) is not None:
            self._ended(pod, 1, refused)
            return pod
        command, env = self._command(pod)
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
        self._ended(pod, done.returncode, done.stdout + done.stderr)
        return pod

    def start_pod(self, namespace: str, name: str, *extra_args: str) -> subprocess.Popen:
        """Start a long-running pod (one the fake kubelet left Running) as a process of its own, as the kubelet
        would: its command, environment and volumes as in _run_pod, `extra_args` after its arguments."""
        command, env = self._command(self.pods[(namespace, name)])
        return subprocess.Popen([*command, *extra_args], env={**os.environ, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def _command(self, pod: dict) -> tuple[list[str], dict[str, str]]:
        """A pod's command line and environment here: $(VAR) expanded, `python` this Python, each mount of a
        claim in `claims` its local folder."""
        spec = pod["spec"]
        [container] = spec["containers"]
        claims = {v["name"]: self.claims[v["persistentVolumeClaim"]["claimName"]] for v in spec.get("volumes", [])
                  if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] in self.claims}
        mounts = {m["mountPath"]: claims[m["name"]] for m in container.get("volumeMounts", []) if m["name"] in claims}
        env = {e["name"]: e["value"] if "value" in e else pod["metadata"]["name"]  # fieldRef: metadata.name
               for e in container.get("env", [])}
        command = [VAR.sub(lambda m: env.get(m.group(1), m.group(0)), part)
                   for part in container["command"] + container.get("args", [])]
        command = [sys.executable if part == "python" else part for part in command]
        for mount, folder in mounts.items():
            command = [str(folder) + part[len(mount):] if part.startswith(mount) else part for part in command]
        return command, env

    @staticmethod
    def _ended(pod: dict, exit_code: int, log: str = "") -> None:
        pod["status"] = {"phase": "Succeeded" if exit_code == 0 else "Failed",
                         "containerStatuses": [_container_status(pod, {"terminated": {"exitCode": exit_code}})]}
        pod["log"] = pod.get("log", "") + log

    # The training operator, for PyTorchJobs.
    def job_pods(self, namespace: str, name: str) -> dict[str, dict]:
        with self.lock:
            return {key[1]: pod for key, pod in self.pods.items()
                    if key[0] == namespace and pod["metadata"]["labels"].get(JOB_LABEL) == name}

    def run_pod(self, namespace: str, name: str) -> int:
        """The kubelet runs a job's pod to its end; then the operator reconciles. Returns its exit code."""
        pod = self.pods[(namespace, name)]
        self._run_pod(pod)
        self.reconcile(namespace, pod["metadata"]["labels"][JOB_LABEL])
        return pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"]

    def exit_pod(self, namespace: str, name: str, exit_code: int) -> None:
        """A job's pod ends with `exit_code` (137: killed), without running anything; then the operator
        reconciles."""
        with self.lock:
            pod = self.pods[(namespace, name)]
            self._ended(pod, exit_code)
            self.reconcile(namespace, pod["metadata"]["labels"][JOB_LABEL])

    def reconcile(self, namespace: str, name: str) -> None:
        """The operator's passes over one PyTorchJob until nothing more changes (see the module's notes)."""
        with self.lock:
            while self._reconcile_once(namespace, name):
                pass

    def _reconcile_once(self, namespace: str, name: str) -> bool:
        job = self.jobs[(namespace, name)]
        status = job.setdefault("status", {})
        pods = self.job_pods(namespace, name)
        if self._finished(job):
            policy = job["spec"]["runPolicy"].get("cleanPodPolicy", "None")
            doomed = [n for n, pod in pods.items() if policy == "All" or (
                policy == "Running" and pod["status"]["phase"] in ("Running", "Pending"))]
            for pod_name in doomed:
                self._delete_pod(namespace, pod_name)
            return False
        replicas = job["spec"]["pytorchReplicaSpecs"]
        failed = sum(pod["status"]["phase"] == "Failed" for pod in pods.values())
        active = sum(pod["status"]["phase"] in ("Running", "Pending") for pod in pods.values())
        limit = job["spec"]["runPolicy"].get("backoffLimit")
        if limit is not None:
            previously_failed = sum(r.get("failed", 0) for r in status.get("replicaStatuses", {}).values())
            new_failure = failed > previously_failed and active != sum(r["replicas"] for r in replicas.values())
            restarts = sum(c.get("restartCount", 0) for pod in pods.values() if pod["status"]["phase"] == "Running"
                           for c in pod["status"].get("containerStatuses", []))
            if (new_failure and 0 + 1 > limit) or (restarts > 0 if limit == 0 else restarts >= limit):
                for pod_name in pods:
                    self._delete_pod(namespace, pod_name)
                self.set_condition(namespace, name, "Failed", f"Job {name} has failed because it has reached "
                                                              "the specified backoff limit")
                return False
        changed = False
        counts = {}
        for rtype, spec in replicas.items():
            count = counts[rtype] = {"active": 0, "succeeded": 0, "failed": 0}
            for index in range(spec["replicas"]):
                pod_name = f"{name}-{rtype.lower()}-{index}"
                pod = pods.get(pod_name)
                if pod is None:
                    self._create_pod(namespace, name, pod_name, rtype, index, spec["template"])
                    count["active"] += 1
                    changed = True
                    continue
                phase = pod["status"]["phase"]
                if phase == "Failed":
                    code = pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"]
                    if spec["restartPolicy"] == "ExitCode" and code >= 128:
                        self._delete_pod(namespace, pod_name)
                        self.set_condition(namespace, name, "Restarting",
                                           f"PyTorchJob {name} is restarting because {rtype} replica(s) failed.")
                        changed = True
                        continue
                    self.set_condition(namespace, name, "Failed",
                                       f"PyTorchJob {name} is failing because {rtype} replica(s) failed.")
                    changed = True
                count[{"Running": "active", "Pending": "active"}.get(phase, phase.lower())] += 1
        status["replicaStatuses"] = counts
        if not self._finished(job) and counts.get("Master", {}).get("succeeded"):
            self.set_condition(namespace, name, "Succeeded", f"PyTorchJob {name} is successfully completed.")
            changed = True
        elif not self._finished(job) and counts.get("Master", {}).get("active") and not changed \
                and self._last_condition(job) != "Running":
            self.set_condition(namespace, name, "Running", f"PyTorchJob {name} is running.")
        return changed

    @staticmethod
    def _last_condition(job: dict) -> str | None:
        true = [c["type"] for c in job.get("status", {}).get("conditions", []) if c["status"] == "True"]
        return true[-1] if true else None

    def _finished(self, job: dict) -> bool:
        return any(c["type"] in ("Succeeded", "Failed") and c["status"] == "True"
                   for c in job.get("status", {}).get("conditions", []))

    def _create_pod(self, namespace: str, job: str, pod_name: str, rtype: str, index: int, template: dict) -> None:
        pod_spec = json.loads(json.dumps(template["spec"]))
        pod_spec["restartPolicy"] = "Never"  # core.SetRestartPolicy: ExitCode is the operator's, not the kubelet's
        replicas = self.jobs[(namespace, job)]["spec"]["pytorchReplicaSpecs"]
        rank = index + (1 if rtype == "Worker" and "Master" in replicas else 0)
        operator_env = {"PET_MASTER_ADDR": f"{job}-master-0", "PET_MASTER_PORT": MASTER_PORT,
                        "PET_NNODES": str(sum(r["replicas"] for r in replicas.values())), "PET_NODE_RANK": str(rank)}
        for container in pod_spec["containers"]:
            container["env"] = container.get("env", []) + [{"name": k, "value": v} for k, v in operator_env.items()]
        labels = {**template.get("metadata", {}).get("labels", {}), JOB_LABEL: job, TYPE_LABEL: rtype.lower(),
                  INDEX_LABEL: str(index)}
        self.pods[(namespace, pod_name)] = {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod_name, "namespace": namespace, "labels": labels,
                                                            "uid": str(uuid.uuid4())},
            "spec": pod_spec, "log": ""}
        pod = self.pods[(namespace, pod_name)]
        pod["status"] = {"phase": "Running", "containerStatuses": [_container_status(pod, {"running": {}})]}
        if self.nodes:
            node = self._schedule(pod, job)
            if node is None:
                pod["status"] = {"phase": "Pending"}
            else:
                pod_spec["nodeName"] = node
        self.operations.append(("create", pod_name))

    def _delete_pod(self, namespace: str, pod_name: str) -> None:
        self.pods.pop((namespace, pod_name))
        self.operations.append(("delete", pod_name))

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, code: int, body) -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict:
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

            def _route(self, method: str) -> None:
                url = urlparse(self.path)
                with fake.lock:
                    down = fake.unreachable > 0 and fake.outage_after <= 0
                    fake.outage_after -= 1
                    if down:
                        fake.unreachable -= 1
                        fake.dropped += 1
                if down:  # no answer at all: the client sees the connection closed
                    self.rfile.read(int(self.headers.get("Content-Length", 0)))
                    self.close_connection = True
                    return
                fake.requests.append((method, url.path))
                group, resource, verb, namespace = rbac_attributes(method, url.path)
                fake.authorized.append((group, resource, verb, namespace))
                if (code := fake.refuse.get((group, resource, verb))) is not None:
                    self.rfile.read(int(self.headers.get("Content-Length", 0)))
                    return self._send(code, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                             "status": "Failure", "code": code,
                                             "reason": "Forbidden" if code == 403 else "Refused",
                                             "message": f"{resource} is forbidden: cannot {verb} {resource} "
                                                        f"(the fake's refuse)"})
                if (m := PODS.match(url.path)) and method == "POST":
                    return self._create_pod(m.group(1))
                with fake.lock:  # the rest changes or reads the state at once (the module's notes)
                    self._locked_route(method, url)

            def _create_pod(self, namespace: str) -> None:
                pod = self._body()
                with fake.lock:
                    if (namespace, pod["metadata"]["name"]) in fake.pods:  # as the API server refuses it
                        return self._send(409, {"kind": "Status", "status": "Failure", "reason": "AlreadyExists",
                                                "code": 409, "message": f"pods {pod['metadata']['name']!r} already "
                                                                        "exists"})
                pod = fake._run_pod(pod)  # outside the lock: pods run side by side
                with fake.lock:
                    fake.pods[(namespace, pod["metadata"]["name"])] = pod
                self._send(201, {k: v for k, v in pod.items() if k != "log"})

            def _locked_route(self, method: str, url) -> None:
                if m := JOBS.match(url.path):
                    return self._jobs(method, m.group(3), m.group(2), m.group(4))
                if m := POD.match(url.path):
                    pod = fake.pods.get((m.group(1), m.group(2)))
                    if pod is None:
                        return self._not_found("pods", m.group(2))
                    if method == "DELETE":
                        fake.pods.pop((m.group(1), m.group(2)))
                        job = pod["metadata"]["labels"].get(JOB_LABEL)
                        if fake.operator and (m.group(1), job) in fake.jobs:  # the operator sees a pod missing
                            fake.operations.append(("delete", m.group(2)))
                            fake.reconcile(m.group(1), job)
                    return self._send(200, {k: v for k, v in pod.items() if k != "log"})
                if (m := PODS.match(url.path)) and method == "GET":
                    selector = parse_qs(url.query).get("labelSelector", [""])[0]
                    key, _, value = selector.partition("=")
                    items = [{k: v for k, v in pod.items() if k != "log"} for (ns, _), pod in fake.pods.items()
                             if ns == m.group(1) and pod["metadata"]["labels"].get(key) == value]
                    return self._send(200, {"apiVersion": "v1", "kind": "PodList", "items": items})
                if (m := POD_LOG.match(url.path)) and method == "GET":
                    pod = fake.pods.get((m.group(1), m.group(2)))
                    if pod is None:
                        return self._not_found("pods", m.group(2))
                    if pod["status"]["phase"] == "Pending":  # as the API server answers while the image is pulled
                        return self._send(400, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                "reason": "BadRequest", "code": 400,
                                                "message": f"container \"harness\" in pod \"{m.group(2)}\" is "
                                                           "waiting to start: ContainerCreating"})
                    return self._send(200, served_log(pod["log"]))
                if (m := EVENTS.match(url.path)) and method == "POST":
                    event = self._body()
                    event["metadata"]["name"] = event["metadata"].get("generateName", "") + uuid.uuid4().hex[:5]
                    fake.events.append(event)
                    return self._send(201, event)
                if (m := NODE.match(url.path)) and method in ("GET", "PATCH"):
                    if m.group(1) not in fake.nodes:
                        return self._not_found("nodes", m.group(1))
                    if method == "GET":
                        return self._send(200, fake.nodes[m.group(1)])
                    fake.patches.append((url.path, self.headers.get("Content-Type", "")))
                    patched = fake._patch_node(m.group(1), self._body(), bool(m.group(2)))
                    if patched is None:
                        return self._send(409, {"kind": "Status", "status": "Failure", "reason": "Conflict",
                                                "code": 409, "message": "the object has been modified"})
                    return self._send(200, patched)
                if NODES.match(url.path) and method == "GET":  # equality selectors only: k=v,k2=v2
                    selector = parse_qs(url.query).get("labelSelector", [""])[0]
                    wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
                    items = [node for node in fake.nodes.values()
                             if all(node["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())]
                    return self._send(200, {"apiVersion": "v1", "kind": "NodeList", "items": items})
                if url.path == ACCESS_REVIEWS and method == "POST":
                    return self._review(self._body())
                if method == "GET":
                    for pattern, attribute, crd, list_kind in READS:
                        if m := pattern.match(url.path):
                            return self._read(getattr(fake, attribute), m.groupdict(), crd, list_kind)
                self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})

            def _read(self, held: dict, found: dict, crd: str | None, list_kind: str | None) -> None:
                """One object of `held` (or, with `list_kind`, the namespace's), as the API server serves it."""
                if crd is not None and crd not in fake.crds:  # no such path on this server
                    return self._send(404, "404 page not found\n")
                namespace = found.get("namespace")
                if list_kind is not None:
                    items = [obj for (ns, _), obj in held.items() if ns == namespace]
                    return self._send(200, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": list_kind,
                                            "metadata": {"resourceVersion": "1"}, "items": items})
                key = (namespace, found["name"]) if namespace is not None else found["name"]
                if key not in held:
                    return self._not_found(self.path.split("?")[0].split("/")[-2], found["name"])
                return self._send(200, held[key])

            def _review(self, review: dict) -> None:
                """A SelfSubjectAccessReview, answered from `denied` (201 Created, as the API server answers)."""
                asked = (review.get("spec") or {}).get("resourceAttributes") or {}
                fake.reviews.append(asked)
                resource = asked.get("resource", "") + (f"/{asked['subresource']}" if asked.get("subresource") else "")
                allowed = (asked.get("group", ""), resource, asked.get("verb", "")) not in fake.denied
                review.update(apiVersion="authorization.k8s.io/v1", kind="SelfSubjectAccessReview",
                              metadata={"creationTimestamp": None}, status={"allowed": allowed})
                return self._send(201, review)

            def _not_found(self, kind: str, name: str) -> None:
                self._send(404, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                 "message": f"{kind} {name!r} not found", "reason": "NotFound",
                                 "details": {"name": name, "kind": kind}, "code": 404})

            def _jobs(self, method: str, plural: str, namespace: str, name: str | None) -> None:
                if method == "POST" and name is None:
                    job = self._body()
                    key = (namespace, job["metadata"]["name"])
                    if key in fake.jobs:
                        return self._send(409, {"kind": "Status", "status": "Failure", "reason": "AlreadyExists",
                                                "code": 409, "message": f"{plural} {key[1]!r} already exists"})
                    job["metadata"]["uid"] = str(uuid.uuid4())
                    fake.jobs[key] = job
                    if fake.operator and plural == "pytorchjobs":
                        fake.set_condition(namespace, key[1], "Created")
                        fake.reconcile(namespace, key[1])
                    return self._send(201, job)
                if name is None or (namespace, name) not in fake.jobs:
                    return self._not_found(plural, name or "")
                if method == "GET":
                    return self._send(200, fake.jobs[(namespace, name)])
                if method == "PATCH":  # a JSON merge patch (RFC 7386), as the client sends a dict for a custom object
                    fake.patches.append((self.path, self.headers.get("Content-Type", "")))
                    merge_patch(fake.jobs[(namespace, name)], self._body())
                    return self._send(200, fake.jobs[(namespace, name)])
                if method == "DELETE":  # its pods go too (the garbage collector follows their ownerReferences)
                    job = fake.jobs.pop((namespace, name))
                    owned = [key[1] for key, pod in fake.pods.items() if key[0] == namespace and any(
                        ref.get("uid") == job["metadata"]["uid"] for ref in pod["metadata"].get("ownerReferences", []))]
                    for pod_name in {*fake.job_pods(namespace, name), *owned}:
                        fake._delete_pod(namespace, pod_name)
                    return self._send(200, {"kind": "Status", "status": "Success"})
                self._send(405, {"kind": "Status", "status": "Failure", "code": 405})

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def do_DELETE(self):
                self._route("DELETE")

            def do_PATCH(self):
                self._route("PATCH")

        return Handler
