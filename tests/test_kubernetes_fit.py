"""Fitting the pods to a cluster from the profile (docs/backends.md, "Fit the pods to your cluster"): Guaranteed CPU
and memory, pull secrets, scheduler, affinity ANDed with preflight's exclusions, labels and annotations, and the pod
patch on every pod the harness creates (training, health, watcher, collector), validated against the CRD schemas;
what the harness manages stays its own."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from kubernetes.utils import parse_quantity

from harness import profiles
from harness.errors import HarnessError
from harness.launchers import get_launcher
from harness.launchers.kubernetes_blame import excluded_nodes
from harness.launchers.kubernetes_collect import MANIFEST_SCRIPT, collector_pod
from harness.launchers.kubernetes_nodes import with_exclusions
from harness.launchers.kubernetes_patch import merge
from harness.launchers.kubernetes_render import watcher_pod
from harness.spec import JobSpec
from tests.conftest import harness
from tests.test_kubernetes import (AT_448, CRD, TRAINJOB_CRD, FakeCluster, cluster_api, crd_schema,  # noqa: F401
                                   fake_api, needs_crd, needs_trainjob_crd, pytorchjob_schema)
from tests.test_kubernetes_restarts import operator  # noqa: F401

# A patch of every kind the module's notes name: a pod field, a label, an env variable of the training container by
# name, and a volume with its mount there. hostIPC is PyTorchJob's alone (a TrainJob's runtime patch lacks it).
PATCH = {"metadata": {"labels": {"team": "mlperf"}},
         "spec": {"volumes": [{"name": "scratch", "emptyDir": {}}],
                  "containers": [{"name": "pytorch", "env": [{"name": "EXTRA", "value": "1"}],
                                  "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}]}}
POD_FIELD = {"spec": {"hostIPC": False}}


def _spec(profile_name: str = "h100-ib", *overrides: str, **fields) -> JobSpec:
    profile = profiles.apply_overrides(profiles.load(profile_name), list(overrides))
    fields = {"nodes": 2, "out_dir": Path("/x/run"), **fields}
    return JobSpec("resnet", profile=profile, **fields).resolved()


def _with_patch(patch: dict) -> str:
    return f"kubernetes.pod_patch={json.dumps(patch)}"


def _training_pods(job: dict) -> list[dict]:
    """The pod templates of a PyTorchJob, or the runtime patch's pod template of a TrainJob."""
    if job["kind"] == "TrainJob":
        return [rj["template"]["spec"]["template"] for patch in job["spec"]["runtimePatches"]
                for rj in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]]
    return [replica["template"] for replica in job["spec"]["pytorchReplicaSpecs"].values()]


def _container(pod: dict, name: str) -> dict:
    [container] = [c for c in pod["spec"]["containers"] if c["name"] == name]
    return container


def test_strategic_merge_follows_kubernetes_merge_keys_and_directives():
    base = {"spec": {"containers": [{"name": "a", "image": "i", "env": [{"name": "X", "value": "1"}],
                                     "ports": [{"containerPort": 80, "name": "web"}],
                                     "volumeMounts": [{"name": "v", "mountPath": "/v"}]}],
                     "tolerations": [{"key": "t1", "operator": "Exists"}], "volumes": [{"name": "v", "emptyDir": {}}],
                     "nodeSelector": {"a": "1", "b": "2"}}}
    patched = merge(base, {"spec": {
        "containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}, {"name": "X", "value": "3"}],
                        "ports": [{"containerPort": 80, "protocol": "TCP"}],
                        "volumeMounts": [{"mountPath": "/v", "readOnly": True}]},
                       {"name": "b", "image": "j"}],
        "tolerations": [{"key": "t2", "operator": "Exists"}],  # no merge key: replaced whole
        "volumes": [{"name": "v", "$patch": "delete"}, {"name": "w", "emptyDir": {}}],
        "nodeSelector": {"a": None, "c": "3"}}})
    a, b = patched["spec"]["containers"]
    assert a["env"] == [{"name": "X", "value": "3"}, {"name": "Y", "value": "2"}] and a["image"] == "i"
    assert a["ports"] == [{"containerPort": 80, "name": "web", "protocol": "TCP"}]
    assert a["volumeMounts"] == [{"name": "v", "mountPath": "/v", "readOnly": True}]
    assert b == {"name": "b", "image": "j"}
    assert patched["spec"]["tolerations"] == [{"key": "t2", "operator": "Exists"}]
    assert patched["spec"]["volumes"] == [{"name": "w", "emptyDir": {}}]
    assert patched["spec"]["nodeSelector"] == {"b": "2", "c": "3"}
    assert base["spec"]["containers"][0]["env"] == [{"name": "X", "value": "1"}]  # the base is left as it was
    replaced = merge(base, {"spec": {"volumes": [{"$patch": "replace"}, {"name": "z", "emptyDir": {}}],
                                     "nodeSelector": {"$patch": "replace", "d": "4"}}})
    assert replaced["spec"]["volumes"] == [{"name": "z", "emptyDir": {}}]
    assert replaced["spec"]["nodeSelector"] == {"d": "4"}
    with pytest.raises(HarnessError, match="each item of env needs its name"):
        merge(base, {"spec": {"containers": [{"name": "a", "env": [{"value": "1"}]}]}})


def test_the_settings_come_back_whole_from_the_pairs_that_reproduce_a_job():
    """The `--set` pairs a job's reproducing command carries (profiles.overrides): one line each, and the mappings
    whole, since their keys hold dots (kueue.x-k8s.io/...) and nest freely."""
    topology = {"kueue.x-k8s.io/podset-required-topology": "cloud.provider.com/topology-rack"}
    profile = profiles.apply_overrides(profiles.load("h100-ib"), [
        _with_patch(PATCH), f"kubernetes.pod_annotations={json.dumps(topology)}", "kubernetes.cpu=190",
        "kubernetes.image_pull_secrets=[registry-a]"])
    pairs = profiles.overrides(profile)
    assert all("\n" not in pair for pair in pairs) and len(pairs) == 4
    assert profiles.apply_overrides(profiles.load("h100-ib"), pairs) == profile
    with pytest.raises(HarnessError, match=r"kubernetes.pod_patch.spec.x must be text, a number"):
        profiles.apply_overrides(profile, ["kubernetes.pod_patch={spec: {x: 2024-01-01}}"])  # YAML's date


@needs_crd
@needs_trainjob_crd
@pytest.mark.parametrize("api", ["pytorchjob", "trainjob"])
def test_the_pod_patch_reaches_the_training_health_watcher_and_collector_pods(api):
    extra = POD_FIELD if api == "pytorchjob" else {}
    spec = _spec("h100-ib", f"kubernetes.api={api}", _with_patch(merge(PATCH, extra)), preflight=True, max_restarts=2)
    launcher = get_launcher("k8s")
    job = launcher.render(spec).payload["body"]
    jsonschema.validate(job, pytorchjob_schema() if api == "pytorchjob" else crd_schema(TRAINJOB_CRD, "v1alpha1"))
    health = launcher.render_preflight(spec).payload["body"]
    jsonschema.validate(health, pytorchjob_schema())
    template_schema = pytorchjob_schema()["properties"]["spec"]["properties"]["pytorchReplicaSpecs"][
        "additionalProperties"]["properties"]["template"]
    own = [watcher_pod(spec, {"metadata": {"name": "rn", "namespace": "default", "uid": "1"}}, "/results/run-1"),
           collector_pod(spec, "rn-collect-abc-m", MANIFEST_SCRIPT, ["/results/run-1"])]
    training = "node" if api == "trainjob" else "pytorch"
    for pod in [*_training_pods(job), *_training_pods(health), *own]:
        jsonschema.validate({"metadata": pod["metadata"], "spec": pod["spec"]}, template_schema)
        assert pod["metadata"]["labels"]["team"] == "mlperf"
        assert {"name": "scratch", "emptyDir": {}} in pod["spec"]["volumes"]
        assert pod["spec"].get("hostIPC") is (False if extra else None)  # a pod field: every pod's
    for pod, name in [*((p, training) for p in _training_pods(job)), *((p, "pytorch") for p in _training_pods(health))]:
        container = _container(pod, name)  # the training container, by the name it has in that API
        assert {"name": "EXTRA", "value": "1"} in container["env"]
        assert {"name": "scratch", "mountPath": "/scratch"} in container["volumeMounts"]
        assert {"name": "results", "mountPath": "/results"} in container["volumeMounts"]  # what the harness mounts
    for pod in own:  # the harness's own container stays its own: no env or mount meant for the training container
        [container] = pod["spec"]["containers"]
        assert "EXTRA" not in str(container) and "/scratch" not in str(container)


@pytest.mark.parametrize("profile", ["coreweave-h100", "h100-ib"])
def test_every_container_of_a_training_pod_at_448_nodes_is_guaranteed(profile, tmp_path):
    """Requests equal limits for cpu and memory in every container and init container (the page-cache flush's
    included), so the pods are Guaranteed, and the memory holds the memory-backed /dev/shm."""
    args = list(AT_448)
    args[args.index("--profile") + 1] = profile
    result = harness("run", "resnet", "--backend", "k8s", "--dry-run", *args, "--out", str(tmp_path / "o"),
                     "--set", "kubernetes.flush_page_cache=true", "--runs", "5")
    assert result.returncode == 0, result.stderr
    jobs = [doc for doc in yaml.safe_load_all(result.stdout) if doc and doc["kind"] == "PyTorchJob"
            and not doc["metadata"]["name"].endswith("-preflight")]
    assert len(jobs) == 5  # a closed campaign of 5 runs, a job each (the flush)
    for template in [pod for job in jobs for pod in _training_pods(job)]:
        pod = template["spec"]
        assert pod["initContainers"]
        for container in [*pod["initContainers"], *pod["containers"]]:
            resources = container["resources"]
            for name in ("cpu", "memory"):
                assert parse_quantity(resources["requests"][name]) == parse_quantity(resources["limits"][name]) > 0
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
        memory = _container(template, "pytorch")["resources"]["limits"]["memory"]
        assert parse_quantity(shm) < parse_quantity(memory)
    assert "gives no node shape" not in result.stderr


def test_cpu_and_memory_are_the_profiles_where_set_and_said_missing_where_unknown(tmp_path):
    job = get_launcher("k8s").render(_spec("h100-ib", "kubernetes.cpu=190", "kubernetes.memory=1500Gi")).payload["body"]
    resources = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"] == "190"
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "1500Gi"
    request = get_launcher("k8s").render(_spec("local-cpu", "image=python:3.11"))  # no node shape: as before
    assert "resources" not in request.payload["body"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]
    assert any("gives no node shape for cpu or memory" in note for note in request.notes)
    bad = harness("run", "resnet", "--backend", "k8s", "--dry-run", "--profile", "h100-ib", "--out", str(tmp_path),
                  "--set", "kubernetes.cpu=lots")
    assert bad.returncode == 2 and "kubernetes.cpu 'lots' is not a Kubernetes quantity" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("setting", ["kubernetes.memory=100Gi", "memory_gib_per_node=64"])
def test_a_shm_larger_than_the_memory_limit_is_refused_in_one_line(setting, tmp_path):
    result = harness("run", "resnet", "--backend", "k8s", "--dry-run", "--profile", "coreweave-h100", "--nodes", "2",
                     "--out", str(tmp_path), "--set", setting)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "kubernetes.shm_size 128Gi does not fit in" in line and "counts against the pod's memory limit" in line


def _admitted(pod_spec: dict, node: str, labels: dict[str, str]) -> bool:
    """Whether the scheduler may bind the pod to `node` (its name and labels): any required term, all of its
    requirements (In/NotIn on labels or on the node's name)."""
    terms = pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]

    def holds(requirement: dict, value: str | None) -> bool:
        return (value in requirement["values"]) == (requirement["operator"] == "In")

    return any(all(holds(r, labels.get(r["key"])) for r in term.get("matchExpressions", [])) and
               all(holds(r, node) for r in term.get("matchFields", [])) for term in terms)


def test_the_profiles_affinity_is_anded_with_the_nodes_kept_out_under_every_term():
    """Required node selector terms are ORed: the exclusion goes into each, so an excluded node is admitted by no
    term, a node a term admits is still admitted, and the profile's preferences and pod anti-affinity stay. A later
    exclusion (the watcher's) adds to the earlier ones."""
    zones = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}],
         "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n9"]}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {"matchExpressions": [
            {"key": "rack", "operator": "In", "values": ["r1"]}]}}]}
    anti = {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "podAffinityTerm": {
        "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"x": "y"}}}}]}
    affinity = {"nodeAffinity": zones, "podAntiAffinity": anti}
    spec = _spec("h100-ib", f"kubernetes.affinity={json.dumps(affinity)}", exclude_nodes=["n1", "n2"])
    job = get_launcher("k8s").render(spec).payload["body"]
    nodes = {"n1": "a", "n2": "b", "n3": "a", "n4": "b", "n5": "c", "n9": "b"}
    for template in _training_pods(job):
        pod = template["spec"]
        admitted = {node for node, zone in nodes.items() if _admitted(pod, node, {"zone": zone})}
        assert admitted == {"n3", "n4"}  # n1, n2 kept out under both terms; n5 in no zone; n9 the profile's own
        assert pod["affinity"]["podAntiAffinity"] == anti
        assert pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == zones[
            "preferredDuringSchedulingIgnoredDuringExecution"]
    assert excluded_nodes(job) == {"n1", "n2"}
    later = copy.deepcopy(job)
    for template in _training_pods(later):
        with_exclusions(template["spec"], ["n3"])
        assert {node for node, zone in nodes.items() if _admitted(template["spec"], node, {"zone": zone})} == {"n4"}
    assert excluded_nodes(later) == {"n1", "n2", "n3"}
    refused = dataclasses.replace(spec.profile.kubernetes, affinity={"nodeAffinity": {"required": {}}})
    with pytest.raises(HarnessError, match="kubernetes.affinity: nodeAffinity.required is not a field"):
        get_launcher("k8s").render(dataclasses.replace(spec, profile=dataclasses.replace(spec.profile,
                                                                                        kubernetes=refused)))


@needs_crd
def test_pull_secrets_on_every_pod_and_the_scheduler_on_training_and_health_pods():
    topology = {"kueue.x-k8s.io/podset-required-topology": "cloud.provider.com/topology-rack"}
    spec = _spec("coreweave-h100", "kubernetes.image_pull_secrets=[registry-a, registry-b]",
                 "kubernetes.scheduler_name=volcano", f"kubernetes.pod_annotations={json.dumps(topology)}",
                 "kubernetes.pod_labels={cost-center: ml}", preflight=True, max_restarts=2)
    launcher = get_launcher("k8s")
    job, health = launcher.render(spec).payload["body"], launcher.render_preflight(spec).payload["body"]
    for body in (job, health):
        jsonschema.validate(body, pytorchjob_schema())
    secrets = [{"name": "registry-a"}, {"name": "registry-b"}]
    own = [watcher_pod(spec, {"metadata": {"name": "rn", "namespace": "default", "uid": "1"}}, "/results/run-1"),
           collector_pod(spec, "rn-collect-abc-m", MANIFEST_SCRIPT, ["/results/run-1"])]
    for template in [*_training_pods(job), *_training_pods(health)]:
        assert template["spec"]["imagePullSecrets"] == secrets and template["spec"]["schedulerName"] == "volcano"
        assert template["metadata"]["annotations"] == topology and template["metadata"]["labels"]["cost-center"] == "ml"
    for pod in own:
        assert pod["spec"]["imagePullSecrets"] == secrets and "schedulerName" not in pod["spec"]
    trainjob = launcher.render(_spec("coreweave-h100", "kubernetes.api=trainjob", "kubernetes.scheduler_name=volcano",
                                     "kubernetes.image_pull_secrets=[registry-a]"))
    [template] = _training_pods(trainjob.payload["body"])
    assert template["spec"]["imagePullSecrets"] == [{"name": "registry-a"}]
    assert any("takes priority_class, scheduler_name" in note for note in trainjob.notes)  # said, not dropped


@pytest.mark.parametrize("patch, field", [
    ({"spec": {"containers": [{"name": "pytorch", "command": ["sh"]}]}}, "spec.containers[pytorch].command"),
    ({"spec": {"containers": [{"name": "pytorch", "args": ["-c", "true"]}]}}, "spec.containers[pytorch].args"),
    ({"spec": {"restartPolicy": "Always"}}, "spec.restartPolicy"),
    ({"spec": {"containers": [{"name": "pytorch", "volumeMounts": [{"mountPath": "/results", "name": "scratch"}]}]}},
     "spec.containers[pytorch].volumeMounts[/results]"),
    ({"spec": {"containers": [{"$patch": "replace"}, {"name": "other", "image": "busybox"}]}},
     "spec.containers[pytorch]"),
    ({"metadata": {"labels": {"app.kubernetes.io/name": "mine"}}}, "metadata.labels[app.kubernetes.io/name]"),
])
def test_a_patch_of_what_the_harness_manages_is_refused_in_one_line(patch, field, tmp_path):
    result = harness("run", "resnet", "--backend", "k8s", "--dry-run", "--profile", "h100-ib", "--out", str(tmp_path),
                     "--set", _with_patch(patch))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert f"kubernetes.pod_patch would change {field}, which the harness manages" in line


@pytest.mark.parametrize("patch, api, words", [
    ({"spec": {"hostIpc": True}}, "pytorchjob", "spec.hostIpc is not a pod field of that name and type"),
    ({"spec": {"hostIPC": "yes"}}, "pytorchjob", "spec.hostIPC is not a pod field of that name and type"),
    ({"spec": {"containers": [{"name": "pytroch", "env": []}]}}, "pytorchjob", "names 'pytroch', which the training"),
    ({"spec": {"hostIPC": False}}, "trainjob", "a TrainJob's runtime patch cannot carry spec.hostIPC"),
    ({"spec": {"containers": [{"name": "log", "image": "busybox"}]}}, "trainjob",
     "cannot carry spec.containers[1].image"),
    ({"status": {}}, "pytorchjob", "unknown key(s) status; valid: metadata, spec"),
    ({"spec": {"containers": [{"name": "log", "image": "busybox"}]}}, "pytorchjob",
     "containers 'log' needs a cpu limit and a request equal to it"),
])
def test_a_patch_the_pods_cannot_carry_is_refused_in_one_line(patch, api, words):
    with pytest.raises(HarnessError) as refused:
        get_launcher("k8s").render(_spec("h100-ib", f"kubernetes.api={api}", _with_patch(patch)))
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_a_sidecar_with_equal_requests_and_limits_joins_the_training_and_health_pods_only():
    sidecar = {"name": "log", "image": "busybox", "resources": {"limits": {"cpu": "100m", "memory": "64Mi"}}}
    spec = _spec("h100-ib", _with_patch({"spec": {"containers": [sidecar]}}), preflight=True, max_restarts=2)
    launcher = get_launcher("k8s")
    health = launcher.render_preflight(spec).payload["body"]
    for template in [*_training_pods(launcher.render(spec).payload["body"]), *_training_pods(health)]:
        assert [c["name"] for c in template["spec"]["containers"]] == ["pytorch", "log"]
    assert "harness.health" in str(_container(_training_pods(health)[0], "pytorch")["args"])
    watcher = watcher_pod(spec, {"metadata": {"name": "rn", "namespace": "default", "uid": "1"}}, "/results/run-1")
    assert [c["name"] for c in watcher["spec"]["containers"]] == ["watch"]


def test_harness_run_with_preflight_on_the_fake_api_carries_the_patch_to_every_pod(cluster_api, tmp_path,
                                                                                  monkeypatch):
    """`harness run --backend k8s --preflight` end to end with a pod patch: preflight passes, the job trains and its
    results come back, and the job, its pods, the health job's pods, the watcher pod and the results pods the fake
    API stored all carry the patch."""
    from tests.fake_kube_api import FakeKubeAPI

    created, collectors = [], []
    create_pod = FakeKubeAPI._create_pod

    def recording(api, namespace, job, pod_name, *args):
        create_pod(api, namespace, job, pod_name, *args)
        created.append(copy.deepcopy(api.pods[(namespace, pod_name)]))

    monkeypatch.setattr(FakeKubeAPI, "_create_pod", recording)
    cluster_api.before_pod_run = lambda pod: collectors.append(copy.deepcopy(pod))  # None: each runs as usual
    with FakeCluster(cluster_api, tmp_path / "pvc"):
        result = harness("run", "resnet", "--backend", "k8s", "--profile", "h100-ib", "--nodes", "2", "--preflight",
                         "--name", "rn", "--set", _with_patch(merge(PATCH, POD_FIELD)), "--out", str(tmp_path / "run"),
                         env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "run" / "result_0.txt").is_file() and "time-to-train (min)" in result.stdout
    job = cluster_api.jobs[("default", "rn")]
    watcher = cluster_api.pods[("default", "rn-watch")]
    health = [pod for pod in created if "-preflight-" in pod["metadata"]["name"]]
    training = [pod for pod in created if pod["metadata"]["name"].startswith("rn-") and pod not in health]
    assert len(health) == 2 and len(training) == 2 and collectors
    for pod in [*_training_pods(job), *health, *training, watcher, *collectors]:
        assert pod["metadata"]["labels"]["team"] == "mlperf"
        assert {"name": "scratch", "emptyDir": {}} in pod["spec"]["volumes"]
    for pod in [*_training_pods(job), *health, *training]:
        assert pod["spec"]["hostIPC"] is False
        assert {"name": "EXTRA", "value": "1"} in _container(pod, "pytorch")["env"]


def test_the_watcher_keeps_a_blamed_node_out_under_every_term_of_the_profiles_affinity(operator, tmp_path):
    """The watcher's patch of the job's templates (a JSON merge patch, whose lists are replaced whole) carries the
    profile's terms with the exclusion in each: the recreated pod lands on the node the other term admits, never
    back on the blamed one, and the profile's terms still hold."""
    from harness import preflight
    from harness.agent import INFRASTRUCTURE, Failure
    from harness.launchers.kubernetes_blame import BlamedNodeWatcher
    from tests.test_kubernetes_restarts import BUDGET, JOB, NS, NodeAgent, pod_arg
    from tests.test_preflight import _report

    for node in ("gpu-a", "gpu-b", "gpu-c"):
        operator.add_node(node, taints=[])
        _report(tmp_path / JOB, node, 470)
    preflight.decide(tmp_path / JOB, ["gpu-a", "gpu-b", "gpu-c"], 2)
    terms = [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": hosts}]}
             for hosts in (["gpu-a", "gpu-b"], ["gpu-b", "gpu-c"])]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}
    profile = profiles.apply_overrides(profiles.load("h100-ib"), [f"kubernetes.namespace={NS}",
                                                                  f"kubernetes.affinity={json.dumps(affinity)}"])
    spec = JobSpec("resnet", nodes=2, name=JOB, out_dir=tmp_path / JOB, profile=profile, max_restarts=BUDGET,
                   preflight=True, spare_nodes=1).resolved()
    launcher = get_launcher("k8s")
    launcher.submit(launcher.render(spec))
    host = {pod: operator.pods[(NS, pod)]["spec"]["nodeName"] for pod in ("rn-master-0", "rn-worker-0")}
    assert host == {"rn-master-0": "gpu-a", "rn-worker-0": "gpu-b"}
    out = tmp_path / "pvc" / Path(pod_arg(operator, "--out")).name
    watch = BlamedNodeWatcher(NS, JOB, out, taint=False)
    agents = {pod: NodeAgent(out, pod_arg(operator, "--job-token"), pod, host[pod]) for pod in host}
    assert [agent.start() for agent in agents.values()] == [0, 0]
    operator.exit_pod(NS, "rn-worker-0", agents["rn-worker-0"].end(Failure(INFRASTRUCTURE, "rank 1 killed", 1, -9,
                                                                           "SIGKILL")))
    operator.exit_pod(NS, "rn-master-0", agents["rn-master-0"].end(Failure(INFRASTRUCTURE, "rank 0 stopped", 0,
                                                                           -15, "SIGTERM")))
    watch()
    assert operator.pods[(NS, "rn-worker-0")]["spec"]["nodeName"] == "gpu-c"
    exclusion = {"key": "metadata.name", "operator": "NotIn", "values": ["gpu-b"]}
    for replica in operator.jobs[(NS, JOB)]["spec"]["pytorchReplicaSpecs"].values():
        held = replica["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert held["nodeSelectorTerms"] == [{**term, "matchFields": [exclusion]} for term in terms]
