"""Kubernetes RBAC: what each identity of the harness calls, one table per identity, and the one renderer of
every RBAC document the harness needs in a namespace.

Why tables and a renderer rather than hand-written YAML: RBAC should grant exactly the verbs the code calls, in
the namespace the profile names. A table is what tests hold the code to (each is checked against the calls its
identity makes on the fake API server, both ways), and the renderer turns the same tables into the documents a
cluster operator applies for any namespace; manifests/rbac/*.yaml are its output for "default" (a test checks
that they still are). The identities:
- the submitter (SUBMITTER_RULES): whoever runs `harness run --backend k8s` (a user, or a CI ServiceAccount):
  its job resource, the watcher and results pods, their logs, Events; and, cluster-wide, the Nodes preflight
  conditions and taints (kubernetes_nodes). Its Role and its ClusterRole are apart, so that a cluster can grant
  job submission without the right to mark Nodes;
- `harness doctor` (DOCTOR_RULES), run by the same subject: read-only, what it reads to check the cluster;
- the watcher pod (kubernetes_blame.WATCHER_RULES, kept beside the code that makes those calls): a
  ServiceAccount of its own, bound to nothing else.
Each table maps (scope, apiGroup, resource) to verbs; scope "namespace" is the job's namespace (a Role),
"cluster" a cluster-scoped resource (a ClusterRole).
"""

from __future__ import annotations

from harness.launchers.kubernetes_blame import WATCHER_RULES
from harness.profiles import KubernetesSettings

Rules = dict[tuple[str, str, str], tuple[str, ...]]

# Every API call `harness run --backend k8s` makes (and `harness preflight`, `logs`, `cancel`, `collect`).
# tests/test_kubernetes.py runs it against the fake API and checks the calls it records are exactly these.
SUBMITTER_RULES: Rules = {
    # The job (either API, as the profile says): created, its state read, deleted by cancel and after preflight.
    ("namespace", "kubeflow.org", "pytorchjobs"): ("create", "get", "delete"),
    ("namespace", "trainer.kubeflow.org", "trainjobs"): ("create", "get", "delete"),
    # The watcher pod and the results pods: created, read until they end, deleted; the job's pods listed (logs,
    # the nodes the health job ran on, the nodes the results pods prefer).
    ("namespace", "", "pods"): ("create", "get", "list", "delete"),
    ("namespace", "", "pods/log"): ("get",),  # `harness logs`, and the run folder the results pods print
    # On the job at each state change; preflight's on the failed Nodes too (recorded in the job's namespace).
    ("namespace", "", "events"): ("create",),
    ("cluster", "", "nodes"): ("get", "patch"),  # preflight's taint (--taint-bad-nodes): read, then the whole list
    ("cluster", "", "nodes/status"): ("patch",),  # the MLPerfPreflight condition on every checked Node
}

# Every API call `harness doctor` makes: reads only (tests/test_doctor.py checks them both ways).
DOCTOR_RULES: Rules = {
    ("namespace", "", "namespaces"): ("get",),  # the namespace itself (RBAC counts it as in the namespace)
    ("namespace", "", "persistentvolumeclaims"): ("get",),
    ("namespace", "", "serviceaccounts"): ("get",),
    ("namespace", "kueue.x-k8s.io", "localqueues"): ("get",),
    ("namespace", "rbac.authorization.k8s.io", "rolebindings"): ("list",),  # the watcher's grants
    ("namespace", "rbac.authorization.k8s.io", "roles"): ("list",),
    ("cluster", "apiextensions.k8s.io", "customresourcedefinitions"): ("get",),
    ("cluster", "trainer.kubeflow.org", "clustertrainingruntimes"): ("get",),
    ("cluster", "scheduling.k8s.io", "priorityclasses"): ("get",),
    ("cluster", "scheduling.volcano.sh", "queues"): ("get",),
    ("cluster", "", "nodes"): ("list",),
    # Whether the submitter may do each of its verbs (every authenticated user may ask: system:basic-user).
    ("cluster", "authorization.k8s.io", "selfsubjectaccessreviews"): ("create",),
}

SUBMITTER = "mlperf-harness"  # the subject bound by default: a ServiceAccount of that name in the namespace
RBAC_API = "rbac.authorization.k8s.io"


def _rules(table: Rules, scope: str) -> list[dict]:
    """A table's rules of one scope, as a Role or ClusterRole lists them."""
    return [{"apiGroups": [group], "resources": [resource], "verbs": list(verbs)}
            for (where, group, resource), verbs in table.items() if where == scope]


def _granted(table: Rules, namespace: str, role: str, cluster_role: str, subject: dict) -> list[dict]:
    """A Role and its RoleBinding in `namespace`, and a ClusterRole and its ClusterRoleBinding, granting `table`
    to `subject` (each pair only where the table has rules of its scope)."""
    docs = []
    for scope, kind, name, meta in (("namespace", "Role", role, {"name": role, "namespace": namespace}),
                                    ("cluster", "ClusterRole", cluster_role, {"name": cluster_role})):
        if _rules(table, scope):
            docs += [{"apiVersion": f"{RBAC_API}/v1", "kind": kind, "metadata": dict(meta),
                      "rules": _rules(table, scope)},
                     {"apiVersion": f"{RBAC_API}/v1", "kind": f"{kind}Binding", "metadata": dict(meta),
                      "roleRef": {"apiGroup": RBAC_API, "kind": kind, "name": name}, "subjects": [dict(subject)]}]
    return docs


def rbac(namespace: str, account: str = SUBMITTER,
         watcher_account: str = KubernetesSettings.watcher_service_account) -> list[dict]:
    """Every RBAC document the harness needs in `namespace`: the submitter's ServiceAccount `account` with its
    Role (the job's namespace) and ClusterRole (the Nodes), the doctor's read-only Role and ClusterRole bound
    to the same account, and the watcher's ServiceAccount with its own Role and ClusterRole. Cluster-scoped
    names carry the namespace (but in "default"), so that each namespace's bindings are their own: applying
    one namespace's never rebinds another's. Bind another subject (a user, a group) by editing `subjects`."""

    def cluster(name: str) -> str:
        return f"{name}-{namespace}" if namespace != "default" else name

    def account_of(name: str) -> tuple[dict, dict]:
        return ({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}},
                {"kind": "ServiceAccount", "name": name, "namespace": namespace})

    submitter, subject = account_of(account)
    watcher, watcher_subject = account_of(watcher_account)
    doctor = f"{account}-doctor"
    return [submitter, *_granted(SUBMITTER_RULES, namespace, account, cluster(f"{account}-preflight"), subject),
            *_granted(DOCTOR_RULES, namespace, doctor, cluster(doctor), subject),
            watcher, *_granted(WATCHER_RULES, namespace, watcher_account, cluster(watcher_account),
                               watcher_subject)]


def rbac_documents(spec) -> list[dict]:
    """What a dry run prints for a spec (a JobSpec): rbac() for its profile's namespace and watcher
    ServiceAccount, with the submitter bound as the ServiceAccount SUBMITTER there. Every document, the
    watcher's included whether or not this job gets a watcher: a campaign's RBAC is applied once, before its
    first run, and its later runs (--preflight with --max-restarts) need the watcher's."""
    kube = spec.profile.kubernetes
    return rbac(kube.namespace, watcher_account=kube.watcher_service_account)
