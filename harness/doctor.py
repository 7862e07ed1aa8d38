"""`harness doctor`: a cluster's prerequisites for a profile, checked read-only before the first run.

Why: what a first run on a new cluster fails on is seldom the benchmark and often the cluster around it: the
operator's CRD missing, a results claim still Pending or ReadWriteOnce, a namespace whose Pod Security level
refuses the pods, a misspelt priority class or queue, a verb the submitter was not granted, too few nodes
with the GPUs the profile asks for. Each is found only once the job is submitted, and, at 448 nodes, after
its wait in the queue; each is one read away. Doctor makes those reads through the official client
(kubernetes_api.call) and prints one row per check, with the fix of each that failed. It changes nothing in
the cluster (its reads are kubernetes_rbac.DOCTOR_RULES). A read the API server refuses (403) fails its
check, naming the permission; an unreachable API server ends it in one line (kubernetes_api.Unreachable).
"""

from __future__ import annotations

import shlex

from dataclasses import dataclass
from typing import Callable

from kubernetes import client as k8s
from kubernetes.utils import parse_quantity

from harness.launchers.kubernetes_api import APIS, PYTORCHJOB, TRAINJOB, Refused, apis, call
from harness.launchers.kubernetes_blame import WATCHER_RULES
from harness.launchers.kubernetes_rbac import RBAC_API, SUBMITTER_RULES
from harness.launchers.kubernetes_render import PLACEHOLDER_REGISTRY, privileged_reasons
from harness.launchers.kubernetes_resources import training
from harness.mounts import claim_mount
from harness.profiles import KubernetesSettings, Profile

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
PSA_LABEL = "pod-security.kubernetes.io/enforce"
RUNTIMES = ("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes")
LOCAL_QUEUES = ("kueue.x-k8s.io", "v1beta1", "localqueues")
VOLCANO_QUEUES = ("scheduling.volcano.sh", "v1beta1", "queues")
INSTALL = {
    PYTORCHJOB.kind: 'kubectl apply --server-side -k "github.com/kubeflow/training-operator.git/manifests/overlays/'
                     'standalone?ref=v1.9.0" (the Kubeflow Training Operator)',
    TRAINJOB.kind: 'kubectl apply --server-side -k "https://github.com/kubeflow/trainer.git/manifests/overlays/'
                   'manager?ref=v2.1.0" (Kubeflow Trainer v2)',
}
REPELLING_EFFECTS = ("NoSchedule", "NoExecute")  # the taints that keep a pod off a node (PreferNoSchedule does not)


@dataclass(frozen=True)
class Row:
    """One check's verdict: PASS, FAIL, WARN (advisory: exit 0) or SKIP (a check it depends on failed)."""

    check: str
    result: str
    found: str
    fix: str = ""


class _Forbidden(Exception):
    """A read the API server refused (403): the check fails, naming the permission that is missing."""

    def __init__(self, verb: str, group: str, resource: str):
        super().__init__(_permission(verb, group, resource))


def _permission(verb: str, group: str, resource: str) -> str:
    """A verb on a resource as kubectl names it: `get customresourcedefinitions.apiextensions.k8s.io`."""
    return f"{verb} {resource}{'.' + group if group else ''}"


def _read(permission: tuple[str, str, str], what: str, fn, *args, **kwargs):
    """fn(*args) through `call`: the object, or None where it is not there (404); a 403 raises _Forbidden with
    `permission` (verb, apiGroup, resource); an unreachable server raises Unreachable (one line, the end)."""
    try:
        return call(what, fn, *args, missing_ok=True, **kwargs)
    except Refused as exc:
        if exc.status == 403:
            raise _Forbidden(*permission) from None
        raise


class Doctor:
    """The checks of one profile against the cluster the kubeconfig (or the pod) names; `rows()` runs them."""

    def __init__(self, profile: Profile, nodes: int):
        self.profile, self.kube, self.nodes = profile, profile.kubernetes, nodes
        self.api = APIS[self.kube.api]
        self.namespace = self.kube.namespace
        (self.custom, self.core, self.extensions, self.scheduling, self.rbac_api,
         self.authorization) = apis(k8s.CustomObjectsApi, k8s.CoreV1Api, k8s.ApiextensionsV1Api, k8s.SchedulingV1Api,
                                    k8s.RbacAuthorizationV1Api, k8s.AuthorizationV1Api)

    def _checked(self, check: str, fn: Callable[[], list[Row]]) -> list[Row]:
        """fn's rows; a refused read fails the check instead (naming the permission, or with the API server's
        answer)."""
        try:
            return fn()
        except _Forbidden as exc:
            return [Row(check, FAIL, f"forbidden: this identity may not {exc}", self._apply("doctor.yaml"))]
        except Refused as exc:
            return [Row(check, FAIL, str(exc), "see the API server's answer")]

    def _apply(self, file: str) -> str:
        """The one-line fix that grants what manifests/rbac/`file` grants: that file, where the profile keeps the
        namespace and watcher of the shipped RBAC; else every identity's RBAC rendered for the profile's."""
        watcher = self.kube.watcher_service_account
        if self.namespace == "default" and watcher == KubernetesSettings.watcher_service_account:
            return f"kubectl apply -f manifests/rbac/{file}"
        return (f"harness doctor --profile {shlex.quote(self.profile.name)} (and its --set) --rbac | "
                "kubectl apply -f -")

    def rows(self) -> list[Row]:
        """Every check's rows, in the order of the module's notes. A namespace that is not there is one failed
        row: what would be in it is not checked (SKIP), rather than failed again for the same cause."""
        ns = self.namespace
        rows = self._checked(f"CRD {self.api.plural}.{self.api.group}", self._crd)
        rows += self._checked(f"namespace {ns}", self._namespace)
        if rows[-1].result == FAIL and rows[-1].check == f"namespace {ns}":
            rows.append(Row(f"in namespace {ns}", SKIP, "PVCs, ServiceAccounts, permissions, the watcher's Role: "
                                                        f"not checked, namespace {ns} is not there"))
        else:
            for check in (self._results_pvc, self._mounts, self._service_accounts,
                          lambda: self._permissions("namespace"), self._watcher):
                rows += check()
        rows += self._permissions("cluster")
        if self.kube.priority_class:
            rows += self._checked(f"priority class {self.kube.priority_class}", self._priority_class)
        if self.kube.queue:
            rows += self._checked(f"queue {self.kube.queue}", self._queue)
        rows += self._checked(f"nodes ({self.nodes} needed)", self._nodes)
        rows.append(self._image())
        return rows

    # 1. The job API's CRD, and a TrainJob's runtime.
    def _crd(self) -> list[Row]:
        name = f"{self.api.plural}.{self.api.group}"
        check = f"CRD {name}"
        crd = _read(("get", "apiextensions.k8s.io", "customresourcedefinitions"), f"read the CRD {name}",
                    self.extensions.read_custom_resource_definition, name)
        if crd is None:
            return [Row(check, FAIL, f"no {self.api.kind} CRD: its operator is not installed",
                        INSTALL[self.api.kind])]
        served = [v.name for v in crd.spec.versions if v.served]
        if self.api.version not in served:
            return [Row(check, FAIL, f"serves {', '.join(served)}, not {self.api.version}",
                        f"upgrade the operator: {INSTALL[self.api.kind]}")]
        rows = [Row(check, PASS, f"{self.api.kind} {self.api.api_version} served")]
        if self.api is TRAINJOB:
            rows += self._checked(f"runtime {self.kube.trainjob_runtime}", self._runtime)
        return rows

    def _runtime(self) -> list[Row]:
        name = self.kube.trainjob_runtime
        found = _read(("get", RUNTIMES[0], RUNTIMES[2]), f"read the ClusterTrainingRuntime {name}",
                      self.custom.get_cluster_custom_object, *RUNTIMES, name)
        if found is None:
            return [Row(f"runtime {name}", FAIL, f"no ClusterTrainingRuntime {name}",
                        'kubectl apply --server-side -k "https://github.com/kubeflow/trainer.git/manifests/overlays/'
                        'runtimes?ref=v2.1.0", or --set kubernetes.trainjob_runtime=NAME')]
        return [Row(f"runtime {name}", PASS, f"ClusterTrainingRuntime {name}")]

    # 2. The namespace, and the Pod Security level it enforces.
    def _namespace(self) -> list[Row]:
        ns = self.namespace
        found = _read(("get", "", "namespaces"), f"read namespace {ns}", self.core.read_namespace, ns)
        if found is None:
            return [Row(f"namespace {ns}", FAIL, "not there",
                        f"kubectl create namespace {ns}, or --set kubernetes.namespace=NAME")]
        level = (found.metadata.labels or {}).get(PSA_LABEL)
        needed, why = self._pod_security()
        rows = [Row(f"namespace {ns}", PASS, "there")]
        allowed = ("privileged",) if needed == "privileged" else ("baseline", "privileged")
        check = f"pod security of {ns}"
        if level is None:
            return rows + [Row(check, PASS, f"no {PSA_LABEL} label: the cluster's default level applies "
                                            f"(privileged unless its admission configuration says otherwise); "
                                            f"the pods need {needed} ({why})")]
        if level in allowed:
            return rows + [Row(check, PASS, f"enforces {level}; the pods need {needed} ({why})")]
        return rows + [Row(check, FAIL, f"enforces {level}; the pods need {needed} ({why})",
                           f"kubectl label --overwrite namespace {ns} {PSA_LABEL}={needed}")]

    def _pod_security(self) -> tuple[str, str]:
        """The Pod Security Standards level the training pods need, and why (kubernetes_render.privileged_reasons);
        restricted also wants runAsNonRoot, a seccomp profile and every capability dropped."""
        needs = privileged_reasons(self.profile)
        if needs:
            return "privileged", "; ".join(needs)
        return "baseline", ("restricted wants runAsNonRoot, a seccomp profile and every capability dropped, "
                            "which the training pods do not set")

    # 3. The volumes.
    def _claim(self, name: str) -> k8s.V1PersistentVolumeClaim | None:
        return _read(("get", "", "persistentvolumeclaims"), f"read the PVC {name}",
                     self.core.read_namespaced_persistent_volume_claim, name, self.namespace)

    def _results_pvc(self) -> list[Row]:
        name = self.kube.results_pvc
        if not name:
            return [Row("results PVC", FAIL, "the profile names none: the MLPerf logs would vanish with the pods",
                        "--set kubernetes.results_pvc=NAME (a ReadWriteMany claim)")]
        why = f"the pods of {self.nodes} node(s) write their logs there"
        return self._checked(f"results PVC {name}",
                             lambda: [self._volume(f"results PVC {name}", name, ("ReadWriteMany",), why)])

    def _mounts(self) -> list[Row]:
        rows = []
        for entry in self.kube.mounts:
            mount = claim_mount(entry)
            read_only = entry.endswith(":ro")
            modes = ("ReadOnlyMany", "ReadWriteMany") if read_only else ("ReadWriteMany",)
            if self.nodes == 1:
                modes += ("ReadWriteOnce", "ReadWriteOncePod")
            why = f"mounted {'read-only ' if read_only else ''}at {mount.target} on {self.nodes} node(s)"
            rows += self._checked(f"PVC {mount.source}",
                                  lambda m=mount, w=why, a=modes: [self._volume(f"PVC {m.source}", m.source, a, w)])
        return rows

    def _volume(self, check: str, name: str, modes: tuple[str, ...], why: str) -> Row:
        claim = self._claim(name)
        if claim is None:
            return Row(check, FAIL, f"no PVC {name} in namespace {self.namespace}",
                       f"create it ({' or '.join(modes)}), or name another in the profile")
        status = claim.status or k8s.V1PersistentVolumeClaimStatus()
        held = status.access_modes or (claim.spec.access_modes if claim.spec else None) or []
        size = (status.capacity or {}).get("storage", "no capacity yet")
        if status.phase != "Bound":
            return Row(check, FAIL, f"{status.phase or 'no phase'}, not Bound",
                       f"kubectl describe pvc {name} -n {self.namespace} (its StorageClass or volume)")
        if not set(held) & set(modes):
            return Row(check, FAIL, f"Bound, {size}, {', '.join(held) or 'no access mode'}: {why} needs "
                                    f"{' or '.join(modes)}",
                       f"recreate it as {modes[0]} on a StorageClass that offers it (NFS, CephFS, Lustre, ...)")
        return Row(check, PASS, f"Bound, {size}, {', '.join(held)}")

    # 6. The identities: their ServiceAccounts, the submitter's verbs, the watcher's grants.
    def _service_accounts(self) -> list[Row]:
        accounts = [(name, why) for name, why in (
            (self.kube.service_account, "kubernetes.service_account: the training pods run under it"),
            (self._watcher_account(), "kubernetes.watcher_service_account: the watcher pod runs under it")) if name]
        rows = []
        for name, why in accounts:
            def one(name=name, why=why) -> list[Row]:
                found = _read(("get", "", "serviceaccounts"), f"read the ServiceAccount {name}",
                              self.core.read_namespaced_service_account, name, self.namespace)
                if found is None:
                    return [Row(f"ServiceAccount {name}", FAIL, f"not in namespace {self.namespace} ({why})",
                                f"kubectl create serviceaccount {name} -n {self.namespace}")]
                return [Row(f"ServiceAccount {name}", PASS, f"there ({why})")]

            rows += self._checked(f"ServiceAccount {name}", one)
        return rows

    def _watcher_account(self) -> str | None:
        """The watcher's ServiceAccount: only a PyTorchJob gets a watcher (kubernetes_render.watches_failures)."""
        return self.kube.watcher_service_account if self.api is PYTORCHJOB else None

    def _permissions(self, scope: str) -> list[Row]:
        """Whether this identity may make each of `harness run`'s calls of `scope` (SUBMITTER_RULES), as the API
        server answers a SelfSubjectAccessReview; the other job API's verbs are left out. The Nodes' verbs
        ("cluster") are those of preflight's remediation."""
        check, file = ((f"permissions in {self.namespace}", "harness-role.yaml") if scope == "namespace"
                       else ("permissions on Nodes (--preflight)", "preflight-clusterrole.yaml"))
        other = {(a.group, a.plural) for a in APIS.values() if a is not self.api}
        asked = [(group, resource, verb) for (where, group, resource), verbs in SUBMITTER_RULES.items()
                 if where == scope and (group, resource) not in other for verb in verbs]
        namespace = self.namespace if scope == "namespace" else None

        def review() -> list[Row]:
            denied = [_permission(verb, group, resource) for group, resource, verb in asked
                      if not self._allowed(group, resource, verb, namespace)]
            if denied:
                return [Row(check, FAIL, f"denied: {', '.join(denied)}", self._apply(file))]
            return [Row(check, PASS, f"all {len(asked)} verbs allowed")]

        return self._checked(check, review)

    def _allowed(self, group: str, resource: str, verb: str, namespace: str | None) -> bool:
        """The API server's answer to a SelfSubjectAccessReview: may this identity do `verb` on `resource`
        ("pods/log": a subresource) in `namespace` (None: cluster-wide)?"""
        resource, _, subresource = resource.partition("/")
        review = k8s.V1SelfSubjectAccessReview(spec=k8s.V1SelfSubjectAccessReviewSpec(
            resource_attributes=k8s.V1ResourceAttributes(group=group, resource=resource, verb=verb,
                                                         subresource=subresource or None, namespace=namespace)))
        answer = _read(("create", "authorization.k8s.io", "selfsubjectaccessreviews"),
                       f"ask whether this identity may {verb} {resource}",
                       self.authorization.create_self_subject_access_review, review)
        return bool(answer and answer.status and answer.status.allowed)

    def _watcher(self) -> list[Row]:
        account = self._watcher_account()
        if account is None:
            return []
        check = f"watcher {account}'s Role"
        return self._checked(check, lambda: self._watcher_grants(account, check))

    def _watcher_grants(self, account: str, check: str) -> list[Row]:
        """The watcher's grants in the namespace (WATCHER_RULES'), which cannot be asked of the API server as
        itself: read from the RoleBindings that bind its ServiceAccount and the Roles they name. Where they
        cannot be listed, or a binding names a ClusterRole (not read), the row says how to check (WARN)."""
        needed = {(group, resource, verb) for (scope, group, resource), verbs in WATCHER_RULES.items()
                  if scope == "namespace" for verb in verbs}
        how = (f"kubectl auth can-i patch pytorchjobs.kubeflow.org -n {self.namespace} "
               f"--as=system:serviceaccount:{self.namespace}:{account}")
        try:
            bindings = _read(("list", RBAC_API, "rolebindings"), "list the RoleBindings",
                             self.rbac_api.list_namespaced_role_binding, self.namespace).items
            roles = _read(("list", RBAC_API, "roles"), "list the Roles", self.rbac_api.list_namespaced_role,
                          self.namespace).items
        except _Forbidden as exc:
            return [Row(check, WARN, f"cannot tell: this identity may not {exc} in {self.namespace}",
                        f"check with: {how}")]
        granted, via_cluster_roles = set(), []
        for binding in bindings:
            if not any(s.kind == "ServiceAccount" and s.name == account and (s.namespace or self.namespace)
                       == self.namespace for s in binding.subjects or []):
                continue
            if binding.role_ref.kind == "ClusterRole":
                via_cluster_roles.append(binding.role_ref.name)
                continue
            named = [role for role in roles if role.metadata.name == binding.role_ref.name]
            for rule in [rule for role in named for rule in role.rules or []]:
                granted |= {(g, r, v) for g, r, v in needed if _covers(rule, g, r, v)}
        missing = sorted(needed - granted)
        if not missing:
            return [Row(check, PASS, f"RoleBinding grants its {len(needed)} verbs in {self.namespace}")]
        words = ", ".join(_permission(v, g, r) for g, r, v in missing)
        if via_cluster_roles:
            return [Row(check, WARN, f"its Roles lack {words}; bound to ClusterRole(s) "
                                     f"{', '.join(via_cluster_roles)}, not read", f"check with: {how}")]
        return [Row(check, FAIL, f"not granted: {words}", self._apply("watcher.yaml"))]

    # 4. and 5. Scheduling: the priority class, the queue.
    def _priority_class(self) -> list[Row]:
        name = self.kube.priority_class
        found = _read(("get", "scheduling.k8s.io", "priorityclasses"), f"read the PriorityClass {name}",
                      self.scheduling.read_priority_class, name)
        if found is None:
            return [Row(f"priority class {name}", FAIL, "no such PriorityClass",
                        f"kubectl create priorityclass {name} --value=1000, or --set kubernetes.priority_class=null")]
        return [Row(f"priority class {name}", PASS, f"value {found.value}")]

    def _queue(self) -> list[Row]:
        """Kueue's LocalQueue in the namespace, or Volcano's Queue (cluster-wide): either one will do. A read
        refused (403) is named only where neither is found."""
        name, ns = self.kube.queue, self.namespace
        (kueue_group, kueue_version, kueue_plural), (volcano_group, volcano_version, volcano_plural) = \
            LOCAL_QUEUES, VOLCANO_QUEUES
        kueue = (f"Kueue LocalQueue {ns}/{name}", ("get", kueue_group, kueue_plural),
                 lambda: self.custom.get_namespaced_custom_object(kueue_group, kueue_version, ns, kueue_plural, name))
        volcano = (f"Volcano Queue {name}", ("get", volcano_group, volcano_plural),
                   lambda: self.custom.get_cluster_custom_object(volcano_group, volcano_version, volcano_plural, name))
        refused = []
        for kind, permission, read in (kueue, volcano):
            try:
                if _read(permission, f"read the {kind}", read) is not None:
                    return [Row(f"queue {name}", PASS, kind)]
            except _Forbidden as exc:
                refused.append(f"forbidden to {exc}")
        return [Row(f"queue {name}", FAIL, f"neither a Kueue LocalQueue {name} in {ns} nor a Volcano Queue {name}"
                                           + (f" ({'; '.join(refused)})" if refused else ""),
                    f"create one (Kueue: a LocalQueue {name} in {ns} on a ClusterQueue; Volcano: a Queue {name}), "
                    "or --set kubernetes.queue=null")]

    # 7. The nodes.
    def _nodes(self) -> list[Row]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(self.kube.node_selector.items()))
        found = _read(("list", "", "nodes"), "list the Nodes", self.core.list_node, label_selector=selector or None)
        wants = [(self.profile.gpu_resource, self.profile.gpus_per_node)] if self.profile.gpus_per_node else []
        wants += [(self.profile.rdma_resource, self.profile.rdma_count)] if self.profile.rdma_resource else []
        # The training container's Guaranteed cpu and memory (requests = limits), where the profile gives them.
        procs = self.profile.gpus_per_node or self.profile.procs_per_node or 1
        wants += [(resource, figure) for resource, figure in sorted(training(self.profile, procs).items())]
        fit, refused = [], []
        for node in sorted(found.items if found else [], key=lambda n: n.metadata.name):
            why = self._unfit(node, wants)
            (refused if why else fit).append(f"{node.metadata.name}: {why}" if why else node.metadata.name)
        asked = ", ".join([f"labels {selector}"] * bool(selector) + [f"{r} >= {n}" for r, n in wants]) or "any node"
        found_text = f"{len(fit)} of {len(fit) + len(refused)} Node(s) fit ({asked})"
        if len(fit) >= self.nodes:
            return [Row(f"nodes ({self.nodes} needed)", PASS, found_text)]
        shown = "; ".join(refused[:3]) + ("; ..." if len(refused) > 3 else "")
        return [Row(f"nodes ({self.nodes} needed)", FAIL, found_text + (f": {shown}" if shown else ""),
                    f"--nodes {len(fit)} or fewer, or a node_selector, tolerations, gpus_per_node, rdma_count or "
                    "kubernetes.cpu/memory that the Nodes meet" if fit else
                    "a node_selector, tolerations, gpus_per_node, rdma_count or kubernetes.cpu/memory that the Nodes "
                    "meet")]

    def _unfit(self, node: k8s.V1Node, wants: list[tuple[str, int]]) -> str:
        """Why a Node cannot take one of the training pods ("" where it can)."""
        allocatable = (node.status.allocatable if node.status else None) or {}
        short = [f"{resource} {allocatable.get(resource, 0)} < {count}" for resource, count in wants
                 if parse_quantity(allocatable.get(resource, "0")) < parse_quantity(count)]
        if short:
            return ", ".join(short)
        if node.spec and node.spec.unschedulable:
            return "cordoned"
        taints = [t for t in (node.spec.taints if node.spec else None) or [] if t.effect in REPELLING_EFFECTS]
        untolerated = [f"{t.key}{'=' + t.value if t.value else ''}:{t.effect}" for t in taints
                       if not any(_tolerates(toleration, t) for toleration in self.kube.tolerations)]
        return f"taint {', '.join(untolerated)} not tolerated" if untolerated else ""

    # 8. The image.
    def _image(self) -> Row:
        image = self.profile.image
        if not image:
            return Row("image", FAIL, "the profile names none", "--set image=REGISTRY/mlperf-harness:TAG")
        if image.startswith(PLACEHOLDER_REGISTRY):
            return Row("image", FAIL, f"{image} is the shipped profiles' placeholder",
                       "build manifests/image/Containerfile, push it, then --set image=REGISTRY/mlperf-harness:TAG")
        return Row("image", PASS, image)


def _covers(rule: k8s.V1PolicyRule, group: str, resource: str, verb: str) -> bool:
    """Whether one RBAC rule grants `verb` on `resource` in `group` ("*" matching any)."""
    return (("*" in (rule.api_groups or []) or group in (rule.api_groups or []))
            and ("*" in (rule.resources or []) or resource in (rule.resources or []))
            and ("*" in rule.verbs or verb in rule.verbs))


def _tolerates(toleration: dict, taint: k8s.V1Taint) -> bool:
    """As the scheduler matches them: the effect (empty: any), the key (empty, with Exists: any), and the value
    (operator Equal, the default) or none (Exists). A profile's toleration may use the client's snake_case."""
    effect, key = toleration.get("effect"), toleration.get("key")
    if (effect and effect != taint.effect) or (key and key != taint.key):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return True
    return bool(key) and toleration.get("value", "") == (taint.value or "")


def render(rows: list[Row]) -> str:
    """The table: one row per check, the fix after a failed or advisory one; then the count."""
    width = max(len(row.check) for row in rows)
    lines = [f"{'CHECK':<{width}}  RESULT  FOUND"]
    for row in rows:
        lines.append(f"{row.check:<{width}}  {row.result:<6}  {row.found}")
        if row.fix:
            lines.append(f"{'':<{width}}  {'':<6}  fix: {row.fix}")
    failed = sum(row.result == FAIL for row in rows)
    lines.append(f"harness doctor: {failed} of {len(rows)} check(s) failed" if failed
                 else f"harness doctor: every check passed ({len(rows)})")
    return "\n".join(lines)


def doctor(profile: Profile, nodes: int) -> int:
    """Check the cluster for `profile` and `nodes` nodes, print the table; 0 where nothing failed, else 1."""
    rows = Doctor(profile, nodes).rows()
    print(render(rows))
    return 1 if any(row.result == FAIL for row in rows) else 0
