"""`harness doctor` against the FAKE API server (tests/fake_kube_api.py): a cluster prepared for the profile passes
every check; each prerequisite taken away in turn fails its own row, with its fix, and only that row; a read the
identity is refused names the permission; an unreachable API server is one line."""

from __future__ import annotations

import pytest

from harness import profiles
from harness.doctor import FAIL, PASS, SKIP, WARN, Doctor, render
from harness.launchers.kubernetes_rbac import DOCTOR_RULES, SUBMITTER_RULES, rbac
from tests.conftest import harness
from tests.fake_kube_api import FakeKubeAPI

NS = "mlperf"
WATCHER = "mlperf-harness-watcher"
# coreweave-h100 asks for every prerequisite doctor checks: a node selector and a toleration, 8 GPUs and an RDMA
# device per node, a priority class, a queue, a results claim and a read-only data claim.
SETTINGS = [f"kubernetes.namespace={NS}", "image=ghcr.io/acme/mlperf-harness:0.1.0",
            "kubernetes.service_account=mlperf-train"]
ARGS = ("--profile", "coreweave-h100", *[arg for s in SETTINGS for arg in ("--set", s)], "--nodes", "2")
CRDS = {"pytorchjobs.kubeflow.org": ("PyTorchJob", "v1", "Namespaced"),
        "trainjobs.trainer.kubeflow.org": ("TrainJob", "v1alpha1", "Namespaced"),
        "clustertrainingruntimes.trainer.kubeflow.org": ("ClusterTrainingRuntime", "v1alpha1", "Cluster"),
        "localqueues.kueue.x-k8s.io": ("LocalQueue", "v1beta1", "Namespaced"),
        "queues.scheduling.volcano.sh": ("Queue", "v1beta1", "Cluster")}
PSA = "pod-security.kubernetes.io/enforce"


def crd(name: str) -> dict:
    kind, version, scope = CRDS[name]
    plural, _, group = name.partition(".")
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": name},
            "spec": {"group": group, "names": {"plural": plural, "kind": kind}, "scope": scope,
                     "versions": [{"name": version, "served": True, "storage": True}]}}


def pvc(name: str, mode: str, size: str, phase: str = "Bound") -> dict:
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": NS},
             "spec": {"accessModes": [mode], "resources": {"requests": {"storage": size}}, "storageClassName": "nfs"},
             "status": {"phase": phase}}
    if phase == "Bound":
        claim["spec"]["volumeName"] = f"pvc-{name}"
        claim["status"].update(accessModes=[mode], capacity={"storage": size})
    return claim


def prepare(api: FakeKubeAPI, gpu_nodes: int = 2) -> None:
    """Everything coreweave-h100 (with SETTINGS) needs, as a cluster operator would have made it: the CRDs and
    the TrainJob runtime, the namespace (privileged: RDMA's IPC_LOCK), the claims, the priority class, Kueue's
    queue, the ServiceAccounts, the watcher's RBAC as kubernetes_rbac renders it, and GPU nodes (besides a CPU
    node the selector leaves out)."""
    api.crds.update({name: crd(name) for name in CRDS if name != "queues.scheduling.volcano.sh"})
    api.runtimes["torch-distributed"] = {"apiVersion": "trainer.kubeflow.org/v1alpha1",
                                         "kind": "ClusterTrainingRuntime", "metadata": {"name": "torch-distributed"}}
    api.namespaces[NS] = {"apiVersion": "v1", "kind": "Namespace", "status": {"phase": "Active"},
                          "metadata": {"name": NS, "labels": {"kubernetes.io/metadata.name": NS, PSA: "privileged"}}}
    api.pvcs[(NS, "mlperf-results")] = pvc("mlperf-results", "ReadWriteMany", "20Ti")
    api.pvcs[(NS, "mlperf-data")] = pvc("mlperf-data", "ReadOnlyMany", "50Ti")
    api.priority_classes["high"] = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                    "metadata": {"name": "high"}, "value": 1000000}
    api.local_queues[(NS, "mlperf")] = {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "LocalQueue",
                                        "metadata": {"name": "mlperf", "namespace": NS},
                                        "spec": {"clusterQueue": "h100"}}
    for account in ("mlperf-train", WATCHER):
        api.service_accounts[(NS, account)] = {"apiVersion": "v1", "kind": "ServiceAccount",
                                               "metadata": {"name": account, "namespace": NS}}
    for doc in rbac(NS):
        if doc["kind"] in ("Role", "RoleBinding"):
            held = api.roles if doc["kind"] == "Role" else api.role_bindings
            held[(NS, doc["metadata"]["name"])] = doc
    for i in range(gpu_nodes):
        api.add_node(f"gpu-{i}", taints=[{"key": "is_cpu_compute", "effect": "NoSchedule"}],
                     labels={"gpu.nvidia.com/class": "H100_NVLINK_80GB"},
                     allocatable={"nvidia.com/gpu": "8", "rdma/ib": "1", "cpu": "126", "memory": "2000Gi"})
    api.add_node("cpu-0", taints=[])


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    with FakeKubeAPI() as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        prepare(api)
        yield api


def checked(*settings: str, nodes: int = 2) -> list:
    profile = profiles.apply_overrides(profiles.load("coreweave-h100"), [*SETTINGS, *settings])
    return Doctor(profile, nodes).rows()


def test_a_prepared_cluster_passes_every_check_through_the_cli(cluster, tmp_path):
    result = harness("doctor", *ARGS, env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["CHECK", "RESULT", "FOUND"] and "fix:" not in result.stdout
    rows = {row.check: row for row in checked()}
    assert all(row.result == PASS for row in rows.values()), render(list(rows.values()))
    for check in rows:
        assert any(line.startswith(check) and " PASS " in line for line in lines), check
    assert set(rows) == {"CRD pytorchjobs.kubeflow.org", f"namespace {NS}", f"pod security of {NS}",
                         "results PVC mlperf-results", "PVC mlperf-data", "ServiceAccount mlperf-train",
                         f"ServiceAccount {WATCHER}", f"permissions in {NS}", "permissions on Nodes (--preflight)",
                         f"watcher {WATCHER}'s Role", "priority class high", "queue mlperf", "nodes (2 needed)",
                         "image"}
    assert rows["nodes (2 needed)"].found.startswith("2 of 2 Node(s) fit")  # the CPU node is not selected
    assert "20Ti" in rows["results PVC mlperf-results"].found
    assert lines[-1] == f"harness doctor: every check passed ({len(rows)})"


def test_a_failed_check_through_the_cli_names_its_fix_and_exits_1(cluster, tmp_path):
    del cluster.pvcs[(NS, "mlperf-results")]
    result = harness("doctor", *ARGS, env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert result.returncode == 1, result.stdout + result.stderr
    [failed] = [line for line in result.stdout.splitlines() if " FAIL " in line]
    assert failed.startswith("results PVC mlperf-results") and f"no PVC mlperf-results in namespace {NS}" in failed
    after = result.stdout.splitlines()[result.stdout.splitlines().index(failed) + 1]
    assert after.strip().startswith("fix: create it (ReadWriteMany)")
    assert result.stdout.splitlines()[-1].startswith("harness doctor: 1 of ")


def _label(level: str):
    return lambda api: api.namespaces[NS]["metadata"]["labels"].update({PSA: level})


def _drop(attribute: str, key):
    return lambda api: getattr(api, attribute).pop(key)


# (what is missing, how the cluster or the settings lose it, the row that fails, what it finds, its fix)
MISSING = [
    ("crd", _drop("crds", "pytorchjobs.kubeflow.org"), (), "CRD pytorchjobs.kubeflow.org",
     "no PyTorchJob CRD", "training-operator.git/manifests/overlays/standalone?ref=v1.9.0"),
    ("trainjob runtime", _drop("runtimes", "torch-distributed"), ("kubernetes.api=trainjob",),
     "runtime torch-distributed", "no ClusterTrainingRuntime torch-distributed", "kubernetes.trainjob_runtime"),
    ("namespace", _drop("namespaces", NS), (), f"namespace {NS}", "not there", f"kubectl create namespace {NS}"),
    ("restricted, flush on", _label("restricted"),
     ("kubernetes.flush_page_cache=true",), f"pod security of {NS}", "the page-cache flush init container is privileged",
     f"kubectl label --overwrite namespace {NS} {PSA}=privileged"),
    ("baseline, RDMA", _label("baseline"), (),
     f"pod security of {NS}", "RDMA adds the IPC_LOCK capability", f"{PSA}=privileged"),
    ("results PVC", _drop("pvcs", (NS, "mlperf-results")), (), "results PVC mlperf-results",
     "no PVC mlperf-results", "create it (ReadWriteMany)"),
    ("results PVC not RWX", lambda api: api.pvcs.update({(NS, "mlperf-results"): pvc("mlperf-results",
                                                                                    "ReadWriteOnce", "20Ti")}),
     (), "results PVC mlperf-results", "ReadWriteOnce: the pods of 2 node(s) write their logs there needs "
                                       "ReadWriteMany", "recreate it as ReadWriteMany"),
    ("results PVC Pending", lambda api: api.pvcs.update({(NS, "mlperf-results"): pvc("mlperf-results",
                                                                                    "ReadWriteMany", "20Ti",
                                                                                    "Pending")}),
     (), "results PVC mlperf-results", "Pending, not Bound", f"kubectl describe pvc mlperf-results -n {NS}"),
    ("data PVC", _drop("pvcs", (NS, "mlperf-data")), (), "PVC mlperf-data", "no PVC mlperf-data",
     "create it (ReadOnlyMany or ReadWriteMany)"),
    ("priority class", _drop("priority_classes", "high"), (), "priority class high", "no such PriorityClass",
     "kubectl create priorityclass high"),
    ("queue", _drop("local_queues", (NS, "mlperf")), (), "queue mlperf",
     f"neither a Kueue LocalQueue mlperf in {NS} nor a Volcano Queue mlperf", "--set kubernetes.queue=null"),
    ("pods' ServiceAccount", _drop("service_accounts", (NS, "mlperf-train")), (), "ServiceAccount mlperf-train",
     f"not in namespace {NS} (kubernetes.service_account", f"kubectl create serviceaccount mlperf-train -n {NS}"),
    ("watcher's ServiceAccount", _drop("service_accounts", (NS, WATCHER)), (), f"ServiceAccount {WATCHER}",
     f"not in namespace {NS} (kubernetes.watcher_service_account", f"kubectl create serviceaccount {WATCHER} -n {NS}"),
    ("watcher's Role", _drop("role_bindings", (NS, WATCHER)), (), f"watcher {WATCHER}'s Role",
     "not granted: create events, delete pods, list pods, get pytorchjobs.kubeflow.org", "--rbac | kubectl apply"),
    ("a denied verb", lambda api: api.denied.add(("", "pods/log", "get")), (), f"permissions in {NS}",
     "denied: get pods/log", "| kubectl apply -f -"),
    ("a denied Node verb", lambda api: api.denied.add(("", "nodes/status", "patch")), (),
     "permissions on Nodes (--preflight)", "denied: patch nodes/status", "kubectl apply -f -"),
    ("too few GPU nodes", lambda api: api.nodes["gpu-1"]["status"]["allocatable"].update({"nvidia.com/gpu": "4"}),
     (), "nodes (2 needed)", "1 of 2 Node(s) fit (labels gpu.nvidia.com/class=H100_NVLINK_80GB, nvidia.com/gpu "
                             ">= 8, rdma/ib >= 1, cpu >= 115, memory >= 1843Gi): gpu-1: nvidia.com/gpu 4 < 8",
     "--nodes 1 or fewer"),
    ("too little memory for the Guaranteed pods", lambda api: api.nodes["gpu-1"]["status"]["allocatable"].update(
        {"memory": "1500Gi"}), (), "nodes (2 needed)", "gpu-1: memory 1500Gi < 1843Gi", "kubernetes.cpu/memory"),
    ("an untolerated taint", lambda api: api.nodes["gpu-1"]["spec"]["taints"].append(
        {"key": "nvidia.com/gpu-fault", "value": "xid79", "effect": "NoExecute"}),
     (), "nodes (2 needed)", "gpu-1: taint nvidia.com/gpu-fault=xid79:NoExecute not tolerated", "tolerations"),
    ("placeholder image", lambda api: None, ("image=registry.example.com/mlperf/mlperf-harness:0.1.0",), "image",
     "the shipped profiles' placeholder", "--set image=REGISTRY/mlperf-harness:TAG"),
    ("a read the identity is refused",
     lambda api: api.refuse.update({("scheduling.k8s.io", "priorityclasses", "get"): 403}), (),
     "priority class high", "forbidden: this identity may not get priorityclasses.scheduling.k8s.io",
     "| kubectl apply -f -"),
]


@pytest.mark.parametrize("missing, change, settings, check, found, fix", MISSING, ids=[m[0] for m in MISSING])
def test_each_missing_prerequisite_fails_its_own_row_with_its_fix(cluster, capsys, missing, change, settings,
                                                                  check, found, fix):
    from harness.doctor import doctor

    change(cluster)
    profile = profiles.apply_overrides(profiles.load("coreweave-h100"), [*SETTINGS, *settings])
    assert doctor(profile, 2) == 1
    rows = Doctor(profile, 2).rows()
    [failed] = [row for row in rows if row.result == FAIL]
    assert failed.check == check and found in failed.found and fix in failed.fix, failed
    # Nothing else failed, and nothing else is merely advised: only what the namespace would hold goes unchecked.
    assert {row.result for row in rows if row is not failed} <= ({PASS, SKIP} if missing == "namespace" else {PASS})
    assert f"fix: {failed.fix}" in capsys.readouterr().out


def test_the_watchers_role_that_cannot_be_listed_is_advice_with_how_to_check(cluster):
    cluster.refuse[("rbac.authorization.k8s.io", "rolebindings", "list")] = 403
    rows = {row.check: row for row in checked()}
    row = rows[f"watcher {WATCHER}'s Role"]
    assert row.result == WARN and "may not list rolebindings.rbac.authorization.k8s.io" in row.found
    assert row.fix.startswith(f"check with: kubectl auth can-i patch pytorchjobs.kubeflow.org -n {NS} "
                              f"--as=system:serviceaccount:{NS}:{WATCHER}")
    assert all(r.result == PASS for r in rows.values() if r is not row)


def test_doctors_rbac_grants_exactly_what_it_reads_and_it_asks_for_every_submitter_verb(cluster):
    """Both APIs (the TrainJob's runtime read too), the queue found in Volcano once Kueue is not installed (both
    read): the calls the fake API records are doctor's table (kubernetes_rbac.DOCTOR_RULES), nothing more,
    nothing less; and the SelfSubjectAccessReviews it asks are the submitter's table, each verb once, in the
    namespace for the namespaced ones."""
    assert all(row.result == PASS for row in checked())
    reviews = list(cluster.reviews)
    del cluster.crds["localqueues.kueue.x-k8s.io"]  # no Kueue: its path is not served
    cluster.crds["queues.scheduling.volcano.sh"] = crd("queues.scheduling.volcano.sh")
    cluster.volcano_queues["mlperf"] = {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "Queue",
                                        "metadata": {"name": "mlperf"}, "spec": {"weight": 1}}
    trainjob = {row.check: row for row in checked("kubernetes.api=trainjob")}
    assert all(row.result == PASS for row in trainjob.values()) and trainjob["queue mlperf"].found == \
        "Volcano Queue mlperf"
    used = {("namespace" if ns else "cluster", group, resource, verb) for group, resource, verb, ns in
            cluster.authorized}
    assert {ns for *_, ns in cluster.authorized} == {NS, ""}
    assert used == {(scope, group, resource, verb) for (scope, group, resource), verbs in DOCTOR_RULES.items()
                    for verb in verbs}
    asked = {(r["group"] or "", r["resource"] + (f"/{r['subresource']}" if r.get("subresource") else ""),
              r["verb"], r.get("namespace")) for r in reviews}
    assert len(asked) == len(reviews)
    assert asked == {(group, resource, verb, NS if scope == "namespace" else None)
                     for (scope, group, resource), verbs in SUBMITTER_RULES.items() if resource != "trainjobs"
                     for verb in verbs}


def test_an_unreachable_api_server_is_one_line(cluster, tmp_path):
    cluster.unreachable = 10**6
    result = harness("doctor", *ARGS, env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert result.returncode == 1 and not result.stdout
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"cannot reach the Kubernetes API server at {cluster.url}" in result.stderr


def test_the_rbac_for_a_namespace_is_one_command_and_the_dry_run_prints_the_same(tmp_path):
    """`harness doctor --rbac` prints every identity's RBAC for the profile's namespace (the fix doctor names
    outside "default"); a Kubernetes dry run prints the same documents first, and its watcher pod runs as the
    ServiceAccount they bind, in the same namespace."""
    import yaml

    from harness.launchers.kubernetes_rbac import rbac

    shown = harness("doctor", "--profile", "coreweave-h100", "--set", "kubernetes.namespace=mlperf", "--rbac")
    assert shown.returncode == 0, shown.stderr
    documents = [doc for doc in yaml.safe_load_all(shown.stdout) if doc]
    assert documents == rbac("mlperf")
    assert {doc["metadata"]["namespace"] for doc in documents if "namespace" in doc["metadata"]} == {"mlperf"}
    assert all(doc["metadata"]["name"].endswith("-mlperf") for doc in documents if "namespace" not in doc["metadata"])
    run = harness("run", "resnet", "--backend", "k8s", "--profile", "coreweave-h100", "--set",
                  "kubernetes.namespace=mlperf", "--nodes", "2", "--preflight", "--max-restarts", "1", "--dry-run",
                  "--out", str(tmp_path / "o"))
    assert run.returncode == 0, run.stderr
    printed = [doc for doc in yaml.safe_load_all(run.stdout) if doc]
    assert printed[:len(documents)] == documents
    [watcher] = [doc for doc in printed if doc["kind"] == "Pod"]
    accounts = {doc["metadata"]["name"] for doc in documents if doc["kind"] == "ServiceAccount"}
    assert watcher["metadata"]["namespace"] == "mlperf" and watcher["spec"]["serviceAccountName"] in accounts
    assert [doc["kind"] for doc in printed[len(documents):]] == ["PyTorchJob", "PyTorchJob", "Pod"]  # health, job


def test_a_pod_patch_that_adds_privilege_needs_the_privileged_level_in_the_dry_run_and_in_doctor(cluster):
    """The Pod Security level is decided from what the pods will hold, the profile's pod patch included: a patch that
    makes a container privileged or adds a capability outside baseline's list needs the privileged level, which the
    dry run's header names and doctor checks (one decision: kubernetes_render.privileged_reasons)."""
    from harness.launchers.kubernetes_render import privileged_reasons

    plain = profiles.apply_overrides(profiles.load("h100-ib"), ["kubernetes.flush_page_cache=false",
                                                                "rdma_resource=null", "rdma_count=0"])
    assert privileged_reasons(plain) == []
    patched = profiles.apply_overrides(plain, [
        "kubernetes.pod_patch={spec: {hostIPC: true, containers: [{name: pytorch, securityContext: "
        "{capabilities: {add: [SYS_ADMIN, CHOWN]}}}]}}"])
    assert privileged_reasons(patched) == ["kubernetes.pod_patch sets hostIPC",
                                           "kubernetes.pod_patch adds the SYS_ADMIN capability"]
    cluster.namespaces[NS]["metadata"]["labels"][PSA] = "baseline"
    [row] = [row for row in Doctor(profiles.apply_overrides(patched, [f"kubernetes.namespace={NS}"]), 1).rows()
             if row.check == f"pod security of {NS}"]
    assert row.result == FAIL and "kubernetes.pod_patch sets hostIPC" in row.found
