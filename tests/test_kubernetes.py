"""The Kubernetes backend: rendered PyTorchJobs and TrainJobs against their CRD schemas, and their life on a
FAKE API server (with a fake kubelet that runs the results pod here)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import kubeflow.training
import kubeflow_trainer_api.models as tj
import pytest
import yaml
from kubeflow.training import models as kf
from kubernetes import client as k8s

from harness import profiles
from harness.agent import EXIT_FOLDER_TAKEN, claim_run_folder
from harness.errors import HarnessError
from harness.launchers import JobState, follow, get_launcher
from harness.launchers.base import Handle
from harness.launchers.kubernetes_collect import RemoteFile, merge_run_folder, parse_manifest, plan_chunks
from harness.results import load
from harness.spec import JobSpec
from tests.conftest import REPO, SHARED, harness, training_job
from tests.fake_kube_api import LOG_ROTATE_BYTES, FakeKubeAPI, served_log

CRD = SHARED / "kubeflow" / "kubeflow.org_pytorchjobs.v1.9.0.yaml"
TRAINJOB_CRD = SHARED / "kubeflow" / "trainer.kubeflow.org_trainjobs.v2.3.yaml"
needs_crd = pytest.mark.skipif(not CRD.is_file(), reason=f"PyTorchJob CRD not found at {CRD} (../shared is absent)")
needs_trainjob_crd = pytest.mark.skipif(not TRAINJOB_CRD.is_file(),
                                        reason=f"TrainJob CRD not found at {TRAINJOB_CRD} (../shared is absent)")
RFC_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
BASELINE_LOG = REPO / "results" / "baselines" / "resnet-tiny" / "result_0.txt"


def crd_schema(path, version: str) -> dict:
    crd = yaml.safe_load(path.read_text())
    [found] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return found["schema"]["openAPIV3Schema"]


def pytorchjob_schema() -> dict:
    return crd_schema(CRD, "v1")


def rendered(*args: str) -> str:
    result = harness("run", "resnet", "--backend", "k8s", "--dry-run", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


# NVIDIA+CoreWeave's v3.0 ResNet: 448 nodes x 8 GPUs x 16 = 57,344, a global batch the LARS table covers (the tiny
# preset's 32 a GPU, 114,688, is refused when the job is rendered, as its workers would refuse it).
AT_448 = ("--profile", "coreweave-h100", "--nodes", "448", "--gpus-per-node", "8", "--preset", "full", "--synthetic",
          "--batch-size", "16")


@needs_crd
def test_448_h100_nodes_render_one_valid_pytorchjob(tmp_path):
    args = (*AT_448, "--runs", "5", "--out", str(tmp_path / "o"))
    text = rendered(*args)
    assert rendered(*args) == text  # deterministic
    documents = [doc for doc in yaml.safe_load_all(text) if doc]
    rbac = [doc for doc in documents if doc["apiVersion"].startswith("rbac.") or doc["kind"] == "ServiceAccount"]
    assert {doc["metadata"]["namespace"] for doc in rbac if "namespace" in doc["metadata"]} == {"default"}
    assert documents[:len(rbac)] == rbac  # the RBAC first, then what the run creates
    health, job, *others = documents[len(rbac):]  # preflight is on for full multi-node runs
    assert health["metadata"]["name"].endswith("-preflight") and job == training_job(text)
    # A closed campaign of 5 runs: each a job of its own (the profile flushes), each with its watcher pod.
    assert [doc["kind"] for doc in others] == ["Pod"] + ["PyTorchJob", "Pod"] * 4
    assert [doc["metadata"]["name"].rsplit("-", 1)[1] for doc in [job, *others]] == [
        "run0", "watch", *[part for run in range(1, 5) for part in (f"run{run}", "watch")]]
    # 448 nodes and the profile's 3% spares: the health job checks 462, the healthiest 448 train.
    assert sum(r["replicas"] for r in health["spec"]["pytorchReplicaSpecs"].values()) == 462
    jsonschema.validate(job, pytorchjob_schema())
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 448
    assert job["spec"]["nprocPerNode"] == "8" and RFC_1123_LABEL.match(job["metadata"]["name"])
    policy = job["spec"]["runPolicy"]["schedulingPolicy"]
    assert policy == {"minAvailable": 448, "queue": "mlperf", "priorityClass": "high"}
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "mlperf"
    for replica in replicas.values():
        pod = replica["template"]["spec"]
        [container] = pod["containers"]
        # CPU and memory: coreweave-h100's node shape less the reserve, requests = limits (Guaranteed pods)
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "rdma/ib": "1", "cpu": "115",
                                                    "memory": "1843Gi"}
        assert container["resources"]["requests"] == container["resources"]["limits"]
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        assert env["NCCL_COLLNET_ENABLE"] == "1" and "NCCL_IB_HCA" in env and "NCCL_SOCKET_IFNAME" in env
        # The node agent knows itself by its pod's name, which a recreated pod keeps.
        assert env["HARNESS_NODE"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert pod["automountServiceAccountToken"] is False  # training pods get no API token
        # The job's own folder on the volume, claimed with its token; the same arguments render the same token.
        out = container["args"][container["args"].index("--out") + 1]
        token = container["args"][container["args"].index("--job-token") + 1]
        assert out == f"/results/o-{token}" and re.fullmatch(r"[0-9a-f]{8}", token)
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "128Gi"}} in pod["volumes"]
        assert {"mountPath": "/dev/shm", "name": "dshm"} in container["volumeMounts"]
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False,
                                                "capabilities": {"add": ["IPC_LOCK"]}}
        assert "--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)" in container["args"]
        assert "--nnodes=448" in container["args"]
    # The SDK's own models read it back to the same object.
    model = kubeflow.training.ApiClient().deserialize(SimpleNamespace(data=json.dumps(job)),
                                                      "KubeflowOrgV1PyTorchJob")
    assert isinstance(model, kf.KubeflowOrgV1PyTorchJob)
    assert k8s.ApiClient().sanitize_for_serialization(model) == job


@needs_crd
def test_without_rdma_no_capability_is_added(tmp_path):
    job = training_job(rendered("--set", "image=python:3.11", "--nodes", "2", "--out", str(tmp_path),
                                  "--max-restarts", "3"))
    jsonschema.validate(job, pytorchjob_schema())
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False}
    assert "resources" not in container  # a CPU profile asks for no GPUs or RDMA devices
    assert job["spec"]["runPolicy"]["backoffLimit"] == 3
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] == "ExitCode"


def pod_folder(fake_api: FakeKubeAPI, volume: Path, name: str, namespace: str = "default") -> Path:
    """Where the job's pods write, on the local folder standing for the results volume."""
    args = fake_api.jobs[(namespace, name)]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]["args"]
    out = args[args.index("--out") + 1]
    assert out.startswith("/results/")
    return volume / out[len("/results/"):]


@pytest.fixture
def fake_api(tmp_path, monkeypatch):
    with FakeKubeAPI() as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        yield api


def submitted(tmp_path, name: str = "rn50", api: str = "pytorchjob"):
    profile = profiles.apply_overrides(profiles.load("h100-ib"), ["kubernetes.namespace=mlperf",
                                                                  f"kubernetes.api={api}"])
    spec = JobSpec("resnet", nodes=2, name=name, out_dir=tmp_path / "run", profile=profile).resolved()
    launcher = get_launcher("k8s")
    return launcher, launcher.submit(launcher.render(spec))


def test_pod_logs_tail_follow_and_one_rank(fake_api, tmp_path):
    """A pod is a node: --tail shows each pod's last lines, --follow what each pod's log gains until the job ends
    (driven a poll at a time); --rank shows the rank's own log once collected into the run folder, is refused in
    one line saying so before, and refused naming the ranks there are for one the job does not have."""
    launcher, handle = submitted(tmp_path)
    run = str(handle.out_dir)
    fake_api.add_pod("mlperf", "rn50", "rn50-master-0", "Running", "agent up\nrank 0 step 1\n")
    fake_api.add_pod("mlperf", "rn50", "rn50-worker-0", "Running", "agent up\n")
    fake_api.set_condition("mlperf", "rn50", "Running")
    tail = harness("logs", run, "--tail", "1")
    assert tail.stdout == "==> rn50-master-0 (Running) <==\nrank 0 step 1\n==> rn50-worker-0 (Running) <==\nagent up\n"
    chunks = follow(launcher, handle, poll_s=0)
    assert next(chunks) == "==> rn50-master-0 (Running) <==\nagent up\nrank 0 step 1\n"
    assert next(chunks) == "\n==> rn50-worker-0 (Running) <==\nagent up\n"
    with fake_api.lock:
        master = fake_api.pods[("mlperf", "rn50-master-0")]
        master["log"] += "rank 0 step 2\nrank 0 done"
        master["status"]["phase"] = "Succeeded"
    fake_api.set_condition("mlperf", "rn50", "Succeeded")
    assert list(chunks) == ["\n==> rn50-master-0 (Succeeded) <==\nrank 0 step 2\nrank 0 done"]
    uncollected = harness("logs", run, "--rank", "3")
    assert uncollected.returncode == 2 and uncollected.stderr == (
        "harness: error: --rank 3: on Kubernetes a rank's own log (logs/rank_3.log) is on the results volume until "
        f"`harness collect {run}` copies it here (`harness run` does when the job ends); without --rank, each pod's "
        "log holds its node's ranks' console\n")
    (handle.out_dir / "logs" / "rank_3.log").write_text("rank 3 started\nrank 3 done\n")
    assert harness("logs", run, "--rank", "3", "--tail", "1").stdout == "==> rank_3.log <==\nrank 3 done\n"
    assert harness("logs", run, "--rank", "16").stderr == "harness: error: --rank 16: job mlperf/rn50 has ranks 0-15\n"


def test_following_from_the_submit_waits_out_starting_and_deleted_pods(fake_api, tmp_path):
    """Right after the submit a pod's container is still starting (the API server answers its log with 400), and a
    restarted job's old pod can be gone between the listing and the read (404): neither ends `--follow`."""
    launcher, handle = submitted(tmp_path)
    fake_api.add_pod("mlperf", "rn50", "rn50-master-0", "Pending", "")
    fake_api.set_condition("mlperf", "rn50", "Created")
    assert harness("logs", str(handle.out_dir)).stdout == "==> rn50-master-0 (Pending) <==\n"
    chunks = follow(launcher, handle, poll_s=0)
    with fake_api.lock:
        fake_api.pods[("mlperf", "rn50-master-0")].update(status={"phase": "Running"}, log="agent up\n")
    fake_api.set_condition("mlperf", "rn50", "Running")
    assert next(chunks) == "==> rn50-master-0 (Running) <==\nagent up\n"
    [source] = launcher.log_sources(handle)
    with fake_api.lock:
        del fake_api.pods[("mlperf", "rn50-master-0")]
    assert source.read(0) == ("", 0)  # listed, then deleted: no log left, no error
    fake_api.set_condition("mlperf", "rn50", "Succeeded")
    assert list(chunks) == []


def test_submit_then_created_running_succeeded(fake_api, tmp_path):
    launcher, handle = submitted(tmp_path)
    assert handle.job_id == "mlperf/rn50" and ("mlperf", "rn50") in fake_api.jobs
    assert fake_api.jobs[("mlperf", "rn50")]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    seen = [launcher.status(handle)]
    for condition in ("Created", "Running", "Succeeded"):
        fake_api.set_condition("mlperf", "rn50", condition)
        seen.append(launcher.status(handle))
    assert seen == [JobState.PENDING, JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED]
    assert [e["reason"] for e in fake_api.events] == ["HarnessRunning", "HarnessSucceeded"]
    assert all(e["involvedObject"]["name"] == "rn50" and e["involvedObject"]["kind"] == "PyTorchJob"
               for e in fake_api.events)
    assert handle.record()["state"] == "SUCCEEDED"


def test_failed_after_restarts(fake_api, tmp_path):
    launcher, handle = submitted(tmp_path)
    for condition in ("Created", "Running", "Restarting", "Running"):
        fake_api.set_condition("mlperf", "rn50", condition)
        assert launcher.status(handle) in (JobState.PENDING, JobState.RUNNING)
    fake_api.set_condition("mlperf", "rn50", "Failed", "rn50-worker-0 exited with code 1 after 3 restarts")
    states = list(launcher.watch(handle, poll_s=0.01))
    assert states == [JobState.FAILED]
    assert fake_api.events[-1]["type"] == "Warning" and "after 3 restarts" in fake_api.events[-1]["message"]


def test_logs_and_cancel(fake_api, tmp_path):
    launcher, handle = submitted(tmp_path)
    fake_api.add_pod("mlperf", "rn50", "rn50-master-0", "Running", "rank 0/16 on rn50-master-0\n")
    fake_api.add_pod("mlperf", "rn50", "rn50-worker-0", "Running", "rank 8/16 on rn50-worker-0\n")
    fake_api.add_pod("mlperf", "other", "other-master-0", "Running", "not ours\n")
    logs = harness("logs", str(handle.out_dir), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert logs.returncode == 0, logs.stderr
    assert "rn50-master-0 (Running)" in logs.stdout and "rank 8/16" in logs.stdout and "not ours" not in logs.stdout
    cancelled = harness("cancel", str(handle.out_dir), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert cancelled.returncode == 0, cancelled.stderr
    assert ("mlperf", "rn50") not in fake_api.jobs and ("DELETE", "/apis/kubeflow.org/v1/namespaces/mlperf/"
                                                         "pytorchjobs/rn50") in fake_api.requests
    assert fake_api.events[-1]["reason"] == "HarnessCancelled"
    assert launcher.status(handle) is JobState.CANCELLED
    again = harness("cancel", str(handle.out_dir), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert again.returncode == 0 and "has already ended (CANCELLED); nothing to cancel" in again.stdout, again.stdout


def test_api_errors_are_one_line(fake_api, tmp_path):
    submitted(tmp_path)
    result = harness("run", "resnet", "--backend", "k8s", "--profile", "h100-ib", "--set", "kubernetes.namespace=mlperf",
                     "--name", "rn50", "--out", str(tmp_path / "again"), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert result.returncode == 1 and "409" in result.stderr and "already exists" in result.stderr
    assert "pick another --name" in result.stderr
    assert "Traceback" not in result.stderr


def test_harness_run_streams_the_job_states_and_collects_the_results(fake_api, tmp_path):
    """`harness run --backend k8s` end to end: submit, Created -> Running -> Succeeded as the operator says,
    then the result files come back from the results volume and the time-to-train is reported."""
    volume = tmp_path / "pvc"
    fake_api.claims["mlperf-results"] = volume

    def operator():
        deadline = time.monotonic() + 120
        while ("default", "rn") not in fake_api.jobs and time.monotonic() < deadline:
            time.sleep(0.1)
        for condition in ("Created", "Running", "Succeeded"):
            if condition == "Succeeded":  # rank 0 wrote its log and rank files on the volume
                folder = pod_folder(fake_api, volume, "rn")
                (folder / "logs").mkdir(parents=True)
                shutil.copy(BASELINE_LOG, folder / "result_0.txt")
                (folder / "logs" / "rank_0.log").write_text("rank 0 log\n")
                (folder / "checkpoints").mkdir()
                (folder / "checkpoints" / "big.bin").write_bytes(b"x" * 1000)
            if condition == "Succeeded":  # the watch's last read
                fake_api.set_condition("default", "rn", condition)
            else:  # the watch saw this state before the next comes, however slowly it polls
                fake_api.set_condition_seen("default", "rn", condition)

    thread = threading.Thread(target=operator)
    thread.start()
    result = harness("run", "resnet", "--backend", "k8s", "--profile", "h100-ib", "--name", "rn", "--nodes", "2",
                     "--out", str(tmp_path / "run"), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    thread.join()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "job default/rn PENDING" in result.stdout and "job default/rn RUNNING" in result.stdout
    assert "job default/rn SUCCEEDED" in result.stdout and "fetched 2 file(s)" in result.stdout
    run = tmp_path / "run"
    assert (run / "result_0.txt").read_bytes() == BASELINE_LOG.read_bytes()
    assert (run / "logs" / "rank_0.log").read_text() == "rank 0 log\n"
    assert not (run / "checkpoints").exists()  # checkpoints stay on the volume
    (fetched,) = load([BASELINE_LOG]).records
    assert "time-to-train (min)" in result.stdout and f"{fetched.time_to_train_min:.4f}" in result.stdout
    assert [e["reason"] for e in fake_api.events] == ["HarnessRunning", "HarnessSucceeded"]
    collector = [p for (_, name), p in fake_api.pods.items() if "-collect-" in name]
    assert not collector  # the results pod is deleted after use


def test_tolerations_as_in_a_pod_spec_or_refused(tmp_path):
    job = training_job(rendered("--profile", "coreweave-h100", "--out", str(tmp_path), "--set",
                                  "kubernetes.tolerations=[{key: a, operator: Exists, tolerationSeconds: 30}]"))
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "a", "operator": "Exists", "tolerationSeconds": 30}]
    result = harness("run", "resnet", "--backend", "k8s", "--profile", "coreweave-h100", "--dry-run",
                     "--set", "kubernetes.tolerations=[{bogus: 1}]", "--out", str(tmp_path))
    assert result.returncode == 2 and "unknown field(s) bogus" in result.stderr and "Traceback" not in result.stderr


@needs_trainjob_crd
def test_448_h100_nodes_render_one_valid_trainjob(tmp_path):
    args = (*AT_448, "--api", "trainjob", "--out", str(tmp_path / "o"))
    result = harness("run", "resnet", "--backend", "k8s", "--dry-run", *args)
    assert result.returncode == 0, result.stderr
    assert harness("run", "resnet", "--backend", "k8s", "--dry-run", *args).stdout == result.stdout
    # What a TrainJob cannot carry is said, not dropped silently.
    assert "takes priority_class, --max-restarts from its ClusterTrainingRuntime 'torch-distributed'" in result.stderr
    job = training_job(result.stdout)
    jsonschema.validate(job, crd_schema(TRAINJOB_CRD, "v1alpha1"))
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and job["kind"] == "TrainJob"
    trainer = job["spec"]["trainer"]
    assert trainer["numNodes"] == 448 and trainer["numProcPerNode"] == 8
    assert trainer["resourcesPerNode"]["limits"] == {"nvidia.com/gpu": "8", "rdma/ib": "1", "cpu": "115",
                                                     "memory": "1843Gi"}
    assert "--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)" in trainer["args"]
    assert {e["name"]: e.get("value") for e in trainer["env"]}["NCCL_COLLNET_ENABLE"] == "1"
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": "torch-distributed"}
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "mlperf"
    [patch] = job["spec"]["runtimePatches"]
    [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    assert node["name"] == "node" and pod["containers"][0]["name"] == "node"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "128Gi"}} in pod["volumes"]
    assert {"name": "results", "persistentVolumeClaim": {"claimName": "mlperf-results"}} in pod["volumes"]
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"]}
    assert pod["containers"][0]["securityContext"]["privileged"] is False
    # Its runtime patch cannot say it (the CRD has no such field there), so the runtime must; that is said.
    assert "automountServiceAccountToken" not in pod
    assert "set automountServiceAccountToken: false in the pod template of ClusterTrainingRuntime " \
        "'torch-distributed'" in result.stderr
    # The Trainer SDK's models read it back to the same object.
    assert tj.TrainerV1alpha1TrainJob.from_dict(job).to_dict() == job


@needs_trainjob_crd
def test_trainjob_pods_name_their_kubernetes_node_as_pytorchjob_pods_do(tmp_path):
    """A failure is blamed on the Kubernetes node under the pod (HARNESS_HOST, spec.nodeName), and each pod's
    attempts are keyed by a name that survives its recreation (HARNESS_NODE): a TrainJob's pod is recreated
    under a new metadata.name, so its key is the Job's name and the pod's completion index (the pod's hostname
    without hostNetwork, and still the pod's own under it), from the downward API."""
    from harness.agent import HOST_ENV, NODE_ENV

    job = training_job(rendered("--profile", "h100-ib", "--nodes", "2", "--api", "trainjob",
                                  "--out", str(tmp_path / "o")))
    jsonschema.validate(job, crd_schema(TRAINJOB_CRD, "v1alpha1"))
    env = job["spec"]["trainer"]["env"]
    names = [e["name"] for e in env]
    by_name = {e["name"]: e for e in env}
    assert by_name[HOST_ENV] == {"name": HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    # $(VAR) in a value expands only variables listed before it
    parts = re.findall(r"\$\((\w+)\)", by_name[NODE_ENV]["value"])
    assert parts and all(names.index(part) < names.index(NODE_ENV) for part in parts)
    fields = {by_name[part]["valueFrom"]["fieldRef"]["fieldPath"] for part in parts}
    assert fields == {"metadata.labels['batch.kubernetes.io/job-name']",
                      "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    assert tj.TrainerV1alpha1TrainJob.from_dict(job).to_dict() == job


def test_trainjob_life_on_the_fake_api(fake_api, tmp_path):
    launcher, handle = submitted(tmp_path, name="tj", api="trainjob")
    assert ("POST", "/apis/trainer.kubeflow.org/v1alpha1/namespaces/mlperf/trainjobs") in fake_api.requests
    seen = [launcher.status(handle)]
    fake_api.set_jobs_status("mlperf", "tj", active=2)
    seen.append(launcher.status(handle))
    fake_api.set_condition("mlperf", "tj", "Complete", "TrainJob is completed")
    seen.append(launcher.status(handle))
    assert seen == [JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED]
    assert [e["involvedObject"]["kind"] for e in fake_api.events] == ["TrainJob", "TrainJob"]
    fake_api.add_pod("mlperf", "tj", "tj-node-0-0-abcde", "Succeeded", "rank 0 of tj\n",
                     label="jobset.sigs.k8s.io/jobset-name")
    assert "rank 0 of tj" in launcher.logs(handle)


def test_trainjob_failed_and_cancelled(fake_api, tmp_path):
    launcher, handle = submitted(tmp_path, name="tj", api="trainjob")
    fake_api.set_condition("mlperf", "tj", "Failed", "jobset failed: node-0 backoff limit exceeded")
    assert list(launcher.watch(handle, poll_s=0.01)) == [JobState.FAILED]
    assert "backoff limit" in fake_api.events[-1]["message"]
    launcher, handle = submitted(tmp_path / "second", name="tj2", api="trainjob")
    launcher.cancel(handle)
    assert ("DELETE", "/apis/trainer.kubeflow.org/v1alpha1/namespaces/mlperf/trainjobs/tj2") in fake_api.requests


def test_a_delete_the_api_refuses_is_said_and_records_no_cancel(fake_api, tmp_path, monkeypatch):
    """The job is recorded CANCELLED only once the API took the delete: a refused one says why in one line and
    leaves the record as it was, so that the job still running is still watched and can be cancelled again."""
    launcher, handle = submitted(tmp_path)
    fake_api.set_condition("mlperf", "rn50", "Running")
    assert launcher.status(handle) is JobState.RUNNING

    def forbidden(*args, **kwargs):
        raise k8s.ApiException(status=403, reason="Forbidden")

    monkeypatch.setattr(k8s.CustomObjectsApi, "delete_namespaced_custom_object", forbidden)
    with pytest.raises(HarnessError, match="refused to delete the PyTorchJob rn50: 403 Forbidden") as refused:
        launcher.cancel(handle)
    assert "\n" not in str(refused.value)
    assert handle.record()["state"] == "RUNNING" and ("mlperf", "rn50") in fake_api.jobs
    assert not handle.record()["cancel_requested"]  # a job deleted later by someone else is no cancel of ours
    assert launcher.status(handle) is JobState.RUNNING
    assert all(event["reason"] != "HarnessCancelled" for event in fake_api.events)


def test_a_cancel_whose_record_cannot_be_written_still_deletes_the_job(fake_api, tmp_path, monkeypatch, capsys):
    """An operator cancels a teammate's run: its folder is not theirs to write. The job is deleted all the same,
    and the record that could not be written is said in one line, no traceback."""
    from harness.launchers import base

    launcher, handle = submitted(tmp_path)
    fake_api.set_condition("mlperf", "rn50", "Running")

    def not_ours(path, text):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(base, "replace_whole", not_ours)
    capsys.readouterr()
    launcher.cancel(handle)
    assert ("mlperf", "rn50") not in fake_api.jobs
    warnings = capsys.readouterr().err.splitlines()
    assert warnings and all(w.startswith("harness: warning: cannot record in") and "Permission denied" in w
                            for w in warnings), warnings


def test_a_cancel_after_the_job_succeeded_keeps_its_outcome(fake_api, tmp_path):
    """The job succeeded since the last poll: the cancel reads its live state, records SUCCEEDED and deletes
    nothing, rather than calling a finished job cancelled."""
    launcher, handle = submitted(tmp_path)
    fake_api.set_condition("mlperf", "rn50", "Running")
    assert launcher.status(handle) is JobState.RUNNING
    fake_api.set_condition("mlperf", "rn50", "Succeeded")
    launcher.cancel(handle)
    assert handle.record()["state"] == "SUCCEEDED" and ("mlperf", "rn50") in fake_api.jobs
    assert not any(method == "DELETE" for method, _ in fake_api.requests)
    assert launcher.status(handle) is JobState.SUCCEEDED
    del fake_api.jobs[("mlperf", "rn50")]  # collected and deleted since: a cancel now has nothing to ask or do
    launcher.cancel(handle)
    assert handle.record()["state"] == "SUCCEEDED"


def test_a_poll_that_crosses_a_cancel_answers_the_recorded_cancel(fake_api, tmp_path, monkeypatch):
    """`harness cancel` in another shell records CANCELLED while `harness run`'s poll reads the job that failed of
    it: the poll answers what is recorded (CANCELLED), and sends no Failed Event on top of the cancel's."""
    launcher, handle = submitted(tmp_path)
    fake_api.set_condition("mlperf", "rn50", "Failed", "rn50-worker-0 exited with code 143")
    real_get = k8s.CustomObjectsApi.get_namespaced_custom_object

    def read_as_the_cancel_lands(self, *args, **kwargs):
        handle.update(state=JobState.CANCELLED.value)
        return real_get(self, *args, **kwargs)

    monkeypatch.setattr(k8s.CustomObjectsApi, "get_namespaced_custom_object", read_as_the_cancel_lands)
    events = len(fake_api.events)
    assert launcher.status(handle) is JobState.CANCELLED
    assert handle.record()["state"] == "CANCELLED" and len(fake_api.events) == events


def test_a_poll_between_a_cancels_delete_and_its_record_answers_cancelled(fake_api, tmp_path, monkeypatch):
    """`harness cancel` deletes the job, then records CANCELLED: `harness run`'s poll from another shell in between
    finds the job gone, and reads that as the cancel it was asked for, not as an error. A job deleted outside the
    harness is one line."""
    launcher, handle = submitted(tmp_path)
    fake_api.set_condition("mlperf", "rn50", "Running")
    assert launcher.status(handle) is JobState.RUNNING
    real_delete = type(launcher).delete

    def delete_then_poll(self, handle):
        real_delete(self, handle)
        assert launcher.status(Handle.load(handle.out_dir)) is JobState.CANCELLED

    monkeypatch.setattr(type(launcher), "delete", delete_then_poll)
    launcher.cancel(handle)
    assert handle.record()["state"] == "CANCELLED"
    other, gone = submitted(tmp_path / "other")
    fake_api.jobs.clear()
    with pytest.raises(HarnessError, match="rn50 is gone from namespace mlperf") as error:
        other.status(gone)
    assert "\n" not in str(error.value)


def test_submit_without_a_results_volume_is_refused(fake_api, tmp_path):
    result = harness("run", "resnet", "--backend", "k8s", "--profile", "h100-ib", "--set", "kubernetes.results_pvc=",
                     "--out", str(tmp_path / "run"), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert result.returncode == 2 and "kubernetes.results_pvc" in result.stderr and not fake_api.jobs


@pytest.mark.parametrize("name", ["../escape.txt", "/etc/escape.txt", "logs/../../escape.txt"])
def test_collected_names_cannot_point_outside_the_run_folder(name):
    with pytest.raises(HarnessError, match="manifest is unreadable"):
        parse_manifest(json.dumps([[name, 1, "0" * 64]]))
    with pytest.raises(HarnessError, match="manifest is unreadable"):
        parse_manifest("not json")


def test_chunks_hold_at_most_the_limit_and_cover_every_byte():
    files = [RemoteFile("a", 5, ""), RemoteFile("empty", 0, ""), RemoteFile("b", 12, ""), RemoteFile("c", 3, "")]
    chunks = plan_chunks(files, limit=4)
    assert all(sum(length for _, _, length in chunk) <= 4 for chunk in chunks)
    covered = {}
    for chunk in chunks:
        for name, offset, length in chunk:
            assert covered.get(name, 0) == offset  # in order, no gap, no overlap
            covered[name] = offset + length
    assert covered == {"a": 5, "empty": 0, "b": 12, "c": 3} and len(chunks) == 5
    many = [RemoteFile(f"logs/rank_{i}.log", 10, "") for i in range(3584)]  # one chunk's bytes, too many names
    chunks = plan_chunks(many)
    assert len(chunks) > 1 and all(len(json.dumps(chunk)) < 64 * 2**10 for chunk in chunks)
    assert sum(len(chunk) for chunk in chunks) == len(many)


def test_collecting_keeps_local_files_that_differ(tmp_path):
    run, staging = tmp_path / "run", tmp_path / "staging"
    run.mkdir()
    staging.mkdir()
    (run / "result_0.txt").write_text("local\n")
    (staging / "result_0.txt").write_text("remote\n")
    (staging / "result_1.txt").write_text("new\n")
    files = [RemoteFile(f.name, f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest())
             for f in sorted(staging.iterdir())]
    fetched, kept = merge_run_folder(staging, files, run)
    assert fetched == [run / "result_1.txt"] and kept == ["result_0.txt"]
    assert (run / "result_0.txt").read_text() == "local\n" and (run / "result_1.txt").read_text() == "new\n"
    (staging / "result_0.txt").write_text("changed meanwhile\n")
    with pytest.raises(HarnessError, match="changed on the results volume"):
        merge_run_folder(staging, files[:1], run)


def test_harness_collect_fetches_the_run_folder_again(fake_api, tmp_path):
    volume = tmp_path / "pvc"
    fake_api.claims["mlperf-results"] = volume
    _, handle = submitted(tmp_path)
    folder = pod_folder(fake_api, volume, "rn50", namespace="mlperf")
    folder.mkdir(parents=True)
    shutil.copy(BASELINE_LOG, folder / "result_0.txt")
    result = harness("collect", str(handle.out_dir), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert result.returncode == 0, result.stderr
    assert "fetched 1 file(s)" in result.stdout and (handle.out_dir / "result_0.txt").is_file()
    fake_api.claims["mlperf-results"] = tmp_path / "empty"  # a volume without the run folder
    result = harness("collect", str(handle.out_dir), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert result.returncode == 1 and f"could not read /results/{folder.name}" in result.stderr
    assert (handle.out_dir / "result_0.txt").read_bytes() == BASELINE_LOG.read_bytes()


def test_a_collection_waits_out_an_api_server_outage_while_its_pods_run(fake_api, tmp_path, monkeypatch, capsys):
    """The results pods are read in a loop: an outage there (urllib3's MaxRetryError, not an OSError) is waited
    out with backoff, said once with the server's address, and the files come back; counted in requests."""
    from harness.launchers import kubernetes_api
    from harness.launchers.kubernetes_collect import collect

    waits = []
    monkeypatch.setattr(kubernetes_api, "BACKOFF", kubernetes_api.Backoff(sleep=waits.append))
    volume = tmp_path / "pvc"
    fake_api.claims["mlperf-results"] = volume
    _, handle = submitted(tmp_path)
    folder = pod_folder(fake_api, volume, "rn50", namespace="mlperf")
    folder.mkdir(parents=True)
    shutil.copy(BASELINE_LOG, folder / "result_0.txt")
    fake_api.outage_after, fake_api.unreachable = 2, 9  # the job's pods listed, the manifest pod created
    fetched = collect(handle, poll_s=0)
    assert [f.name for f in fetched] == ["result_0.txt"] and fake_api.dropped == 9 and len(waits) == 2
    err = capsys.readouterr().err.splitlines()
    assert len([line for line in err if f"cannot reach the Kubernetes API server at {fake_api.url} to read a "
                "results pod" in line]) == 1, err
    assert len([line for line in err if "answers again" in line]) == 1, err


def test_a_failed_job_that_wrote_nothing_says_so(fake_api, tmp_path):
    fake_api.claims["mlperf-results"] = tmp_path / "empty-pvc"

    def operator():
        deadline = time.monotonic() + 120
        while ("default", "rn") not in fake_api.jobs and time.monotonic() < deadline:
            time.sleep(0.1)
        fake_api.set_condition("default", "rn", "Failed", "rn-master-0 OOMKilled")

    thread = threading.Thread(target=operator)
    thread.start()
    result = harness("run", "resnet", "--backend", "k8s", "--profile", "h100-ib", "--name", "rn",
                     "--out", str(tmp_path / "run"), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    thread.join()
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "could not read /results/run-" in result.stderr and "the job failed" in result.stderr


def job_token(fake_api: FakeKubeAPI, name: str, namespace: str = "mlperf") -> str:
    args = fake_api.jobs[(namespace, name)]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "containers"][0]["args"]
    return args[args.index("--job-token") + 1]


def test_a_second_job_with_the_same_folder_name_cannot_reuse_the_first_jobs_folder(fake_api, tmp_path):
    """The first job's finished run stays its own: a second job with the same --out name (and job name, once
    the first job is deleted) gets another folder on the volume, collects only from it, and its pods, were
    they ever given the first job's folder, refuse it with one line and a code the operator never retries."""
    volume = tmp_path / "pvc"
    fake_api.claims["mlperf-results"] = volume
    fake_api.operator = True
    launcher, first = submitted(tmp_path / "a")
    first_folder, first_token = pod_folder(fake_api, volume, "rn50", "mlperf"), job_token(fake_api, "rn50")
    assert claim_run_folder(first_folder, first_token) is None  # what its node agents did first
    shutil.copy(BASELINE_LOG, first_folder / "result_0.txt")  # what its rank 0 wrote
    launcher.cancel(first)  # the user deletes the first job and submits the same again
    _, second = submitted(tmp_path / "b")
    second_folder = pod_folder(fake_api, volume, "rn50", "mlperf")
    assert first.out_dir.name == second.out_dir.name == "run"
    assert second_folder != first_folder and second.record()["pvc_folder"] == f"/results/{second_folder.name}"
    with pytest.raises(HarnessError, match=f"could not read /results/{second_folder.name}"):
        launcher.collect(second)  # nothing of the first job's
    assert not (second.out_dir / "result_0.txt").exists()
    shutil.copytree(first_folder, second_folder)  # a folder name reused by hand, or by an older harness
    assert fake_api.run_pod("mlperf", "rn50-master-0") == EXIT_FOLDER_TAKEN  # the real node agent, in the pod
    log = fake_api.pods[("mlperf", "rn50-master-0")]["log"]
    assert f"holds the results of job {first_token}, not of this job" in log and "Traceback" not in log
    assert log.count("\n") == 1 and sorted(p.name for p in second_folder.iterdir()) == ["job-token", "result_0.txt"]
    assert launcher.status(second) is JobState.FAILED  # 6 is in 1-127: the operator fails the job, no restart


def test_a_collection_far_over_10_mib_comes_back_byte_identical(fake_api, tmp_path):
    volume = tmp_path / "pvc"
    fake_api.claims["mlperf-results"] = volume
    launcher, handle = submitted(tmp_path)
    folder = pod_folder(fake_api, volume, "rn50", "mlperf")
    (folder / "logs").mkdir(parents=True)
    big = os.urandom(25 * 2**20)  # incompressible: 33 MiB of base64
    (folder / "logs" / "rank_0.log").write_bytes(big)
    shutil.copy(BASELINE_LOG, folder / "result_0.txt")
    (folder / "empty.txt").touch()
    # The fake log API keeps what the kubelet keeps after rotating at 10 MiB: one pod could not carry this.
    assert served_log("x" * (LOG_ROTATE_BYTES + 5)) == "xxxxx"
    fetched = launcher.collect(handle)
    assert sorted(p.relative_to(handle.out_dir).as_posix() for p in fetched) == \
        ["empty.txt", "logs/rank_0.log", "result_0.txt"]
    assert (handle.out_dir / "logs" / "rank_0.log").read_bytes() == big
    assert (handle.out_dir / "result_0.txt").read_bytes() == BASELINE_LOG.read_bytes()
    started = [path for method, path in fake_api.requests if method == "POST" and path.endswith("/pods")]
    assert len(started) == 1 + 7  # the manifest, then 25 MiB and change in chunks of 4 MiB
    assert not fake_api.pods  # every results pod deleted
    assert not [p for p in handle.out_dir.iterdir() if p.name.startswith(".collect-")]


@needs_crd
def test_the_opt_in_page_cache_flush_is_a_privileged_init_container(tmp_path):
    """kubernetes.flush_page_cache: each pod first runs a privileged init container that flushes its node's page
    cache and records it in the run folder on the results volume; the training container stays unprivileged.
    Without the opt-in there is none, and without a results volume the opt-in is refused in one line."""
    from workloads.common.page_cache import HOST_FLUSH_COMMAND, host_flush_script

    args = ("--profile", "coreweave-h100", "--nodes", "2", "--preset", "full", "--synthetic",
            "--out", str(tmp_path / "run"))
    job = training_job(rendered(*args, "--set", "kubernetes.flush_page_cache=true"))
    jsonschema.validate(job, pytorchjob_schema())
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        [init] = pod["initContainers"]
        [main] = pod["containers"]
        assert init["securityContext"] == {"privileged": True} and main["securityContext"]["privileged"] is False
        assert init["image"] == main["image"] and init["volumeMounts"] == main["volumeMounts"]
        folder = next(arg for arg in main["args"] if arg.startswith("/results/run-"))
        assert init["command"] == ["bash", "-c", host_flush_script(folder, HOST_FLUSH_COMMAND)]
    plain = training_job(rendered(*args, "--set", "kubernetes.flush_page_cache=false"))
    assert all("initContainers" not in r["template"]["spec"] for r in plain["spec"]["pytorchReplicaSpecs"].values())
    refused = harness("run", "resnet", "--backend", "k8s", "--dry-run", *args, "--set", "kubernetes.flush_page_cache=true",
                      "--set", "kubernetes.results_pvc=")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "kubernetes.flush_page_cache needs kubernetes.results_pvc" in refused.stderr



def _flush_spec(tmp_path, *overrides: str, **fields) -> JobSpec:
    profile = profiles.apply_overrides(profiles.load("coreweave-h100"), ["kubernetes.flush_page_cache=true", *overrides])
    return JobSpec("resnet", nodes=2, out_dir=tmp_path / "run", profile=profile, **fields).resolved()


def test_a_closed_campaign_without_the_flush_is_refused_before_anything_is_submitted(fake_api, tmp_path):
    """Without kubernetes.flush_page_cache an unprivileged pod cannot drop its node's page cache, and a closed run
    stops before init_start: `harness run` refuses it up front, in one line naming the fixes, and the cluster sees no
    request; a dry run prints the request and lists the problem, exiting 1 only under --strict. An open campaign,
    or the user's acceptance of unflushed runs, goes ahead."""
    args = ("run", "resnet", "--backend", "k8s", "--profile", "coreweave-h100", "--nodes", "2", "--preset", "full",
            "--synthetic", "--runs", "5", "--no-preflight", "--set", "kubernetes.flush_page_cache=false",
            "--out", str(tmp_path / "run"))
    refused = harness(*args, timeout=60)  # a job it submitted would be watched until then
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert "a closed run stops before init_start" in line and "--set kubernetes.flush_page_cache=true" in line
    assert "--allow-unflushed-cache" in line and "pod-security.kubernetes.io/enforce=privileged" in line
    assert not fake_api.requests and not (tmp_path / "run").exists()
    shown = harness(*args, "--dry-run")
    assert shown.returncode == 0 and training_job(shown.stdout)["kind"] == "PyTorchJob"
    assert f"harness: problem: {line.removeprefix('harness: error: ')}" in shown.stderr
    gated = harness(*args, "--dry-run", "--strict")
    assert gated.returncode == 1 and gated.stdout == shown.stdout
    launcher = get_launcher("k8s")
    for fine in ({"runs": 5}, {"preset": "full", "synthetic": True, "allow_unflushed_cache": True}):
        spec = _flush_spec(tmp_path, "kubernetes.flush_page_cache=false", **fine)
        assert launcher.problems(spec) == [], fine


def test_a_campaign_of_jobs_stops_at_a_failed_run_or_a_cancel_between_two_runs(cluster_api, tmp_path):
    """A closed campaign's job per run: when run 2's job fails, run 3's is never submitted, what runs 1 and 2 wrote
    comes back, and `harness run` fails; a `harness cancel` that finds the current run's job ended (between two
    runs) stops the campaign before its next job, where before it said "nothing to cancel" and the next 64-node job
    went in."""
    volume, ended = tmp_path / "pvc", {}

    def rank0(job: dict, folder: Path):
        run = int(job["metadata"]["name"].rsplit("run", 1)[1])
        shutil.copy(BASELINE_LOG, folder / f"result_{run}.txt")
        return ended.get(run)

    args = ("run", "resnet", "--backend", "k8s", "--profile", "coreweave-h100", "--nodes", "2", "--preset", "full",
            "--synthetic", "--runs", "3", "--no-preflight", "--max-restarts", "0")
    env = {"KUBECONFIG": str(tmp_path / "kubeconfig")}
    ended[1] = "Failed"
    with FakeCluster(cluster_api, volume, rank0=rank0) as cluster:
        failed = harness(*args, "--out", str(tmp_path / "failed"), env=env)
    assert failed.returncode == 1 and "the job failed" in failed.stderr, failed.stdout + failed.stderr
    assert [name.rsplit("-", 1)[1] for name in cluster.done] == ["run0", "run1"]
    assert sorted(p.name for p in (tmp_path / "failed").glob("result_*.txt")) == ["result_0.txt", "result_1.txt"]
    record = json.loads((tmp_path / "failed" / "job.json").read_text())
    assert record["launch"] == 1 and record["state"] == "FAILED" and record["earlier_jobs"][0]["state"] == "SUCCEEDED"

    ended.clear()
    out = tmp_path / "cancelled"

    def cancel_after_run0(job: dict, folder: Path):
        if job["metadata"]["name"].endswith("-run0"):  # what `harness cancel` records once run 0's job has ended
            Handle.load(out).update(campaign_cancelled=True)
        return rank0(job, folder)

    with FakeCluster(cluster_api, volume, rank0=cancel_after_run0) as cluster:
        cancelled = harness(*args, "--out", str(out), env=env)
    assert cancelled.returncode == 1 and "the campaign was cancelled after run 1" in cancelled.stderr
    assert [name.rsplit("-", 1)[1] for name in cluster.done] == ["run0"]
    said = harness("cancel", str(out), env=env)  # its job ended and later runs remain: the campaign's cancel
    assert said.returncode == 0 and "the campaign's later runs will not be submitted" in said.stdout
    assert json.loads((out / "job.json").read_text())["campaign_cancelled"] is True


NVIDIA_LLAMA = SHARED / "mlperf-results" / "training_v5.1" / "NVIDIA" / "results" / "theia_ngpu512_ngc25.09_nemo" / \
    "llama31_8b"


@pytest.mark.skipif(not NVIDIA_LLAMA.is_dir(), reason=f"NVIDIA's v5.1 llama31_8b logs not found at {NVIDIA_LLAMA}")
def test_a_closed_ten_run_campaign_is_ten_flushed_jobs_in_one_run_folder_and_one_package(cluster_api, tmp_path):
    """A closed llama31_8b campaign on Kubernetes, as a cluster operator runs it: `harness run` with no --runs runs
    the rules' 10; preflight checks the nodes once; then each run is a job of its own, in order, each after the one
    before succeeded and was collected, so that each run's pods flush their nodes' page cache as they start (the
    privileged init container, the job's only privileged part). The jobs share one run folder on the volume (the
    campaign's token, which the node agents' claim accepts), and each does its own run (--last-run, --launch).
    Rank 0 of run i writes what NVIDIA's v5.1 run i wrote; the ten come back into one local folder and
    `harness export` makes one package of them that MLCommons' package checker passes (against their round,
    5.1.0: 6.1.0, the harness's llama31_8b ruleset, added keys they lack, which `harness run`'s summary says)."""
    from workloads.common.page_cache import FLUSHED, HOST_FLUSH_COMMAND, RECORDS

    volume = tmp_path / "pvc"
    seen = []  # per job: (its run, the flush records its init containers left)

    def rank0(job: dict, folder: Path) -> None:
        pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        run = int(args[args.index("--last-run") + 1])
        assert args[args.index("--launch") + 1] == str(run) and job["metadata"]["name"].endswith(f"-run{run}")
        [init] = pod["initContainers"]
        assert init["securityContext"] == {"privileged": True}
        # The init container's own script, as its pod runs it (here without root: `true` stands for the flush).
        script = init["command"][2].replace(HOST_FLUSH_COMMAND, "true").replace("/results/", f"{volume}/")
        subprocess.run(["bash", "-c", script], check=True)
        records = sorted(folder.joinpath(RECORDS).iterdir())
        seen.append((run, [r.read_text().strip() for r in records]))
        for record in records:  # each run's worker takes its node's record (page_cache.take_host_record)
            record.unlink()
        shutil.copy(NVIDIA_LLAMA / f"result_{run}.txt", folder / f"result_{run}.txt")

    out = tmp_path / "campaign"
    with FakeCluster(cluster_api, volume, rank0=rank0) as cluster:
        result = harness("run", "llama31_8b", "--backend", "k8s", "--profile", "coreweave-h100", "--nodes", "2",
                         "--spare-nodes", "1", "--preflight", "--max-restarts", "1", "--data", "/data/c4",
                         "--out", str(out), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    said = result.stdout + result.stderr
    assert "closed llama31_8b runs 10 times, the count MLPerf's rules require" in result.stderr
    assert "10 run(s), one job each" in result.stdout, said
    assert [run for run, _ in seen] == list(range(10)) and all(records == [FLUSHED] for _, records in seen), seen
    health = [name for name in cluster.done if name.endswith("-preflight")]
    training = [name for name in cluster.done if name not in health]
    assert len(health) == 1 and cluster.done[0] == health[0]  # preflight once, first
    token = training[0].split("-")[-2]
    assert training == [f"llama31-8b-full-{token}-run{i}" for i in range(10)]
    assert said.count("fetched ") == 10  # collected as it goes
    for i in range(10):
        assert (out / f"result_{i}.txt").read_bytes() == (NVIDIA_LLAMA / f"result_{i}.txt").read_bytes()
    record = json.loads((out / "job.json").read_text())
    assert record["launch"] == 9 and [job["launch"] for job in record["earlier_jobs"]] == list(range(9))
    assert all(job["state"] == "SUCCEEDED" for job in record["earlier_jobs"])
    assert result.returncode == 1 and "10 left out by the compliance checker" in result.stderr, said

    desc = tmp_path / "desc.json"
    from tests.test_export import BY_HAND
    desc.write_text(json.dumps({**BY_HAND, **{key: "x" for key in (
        "number_of_nodes", "host_processors_per_node", "host_processor_model_name", "host_processor_core_count",
        "host_processor_vcpu_count", "host_memory_capacity", "accelerators_per_node", "accelerator_model_name",
        "accelerator_memory_capacity", "framework", "other_software_stack", "operating_system")}}))
    package = tmp_path / "package"
    exported = harness("export", str(out), "--submitter", "NVIDIA", "--system", "theia", "--ruleset", "5.1.0",
                       "--system-desc", str(desc), "--out", str(package), cwd=tmp_path)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "package checker: no errors" in exported.stdout
    assert sorted(p.name for p in (package / "results" / "theia" / "llama31_8b").glob("result_*.txt")) == \
        [f"result_{i}.txt" for i in range(10)]


@needs_trainjob_crd
def test_a_trainjob_patches_the_runtimes_privileged_flush_init_container(tmp_path):
    """A TrainJob's runtime patch can give an init container only its env, volume mounts and security context (the
    CRD), so the flush goes there: privileged, with the results volume and the flush script in an env variable that
    the runtime's init container runs (the note says what the ClusterTrainingRuntime must hold). The kubelet reads
    $$ as $ in env values, so the script reaches bash as the PyTorchJob's init container runs it."""
    from harness.cache_flush import FLUSH_SCRIPT_ENV, INIT_CONTAINER
    from workloads.common.page_cache import host_flush_script

    launcher = get_launcher("k8s")
    request = launcher.render(_flush_spec(tmp_path, "kubernetes.api=trainjob"))
    job = training_job(request.text)
    jsonschema.validate(job, crd_schema(TRAINJOB_CRD, "v1alpha1"))
    assert tj.TrainerV1alpha1TrainJob.from_dict(job).to_dict() == job
    [patch] = job["spec"]["runtimePatches"]
    [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    [init], [main] = pod["initContainers"], pod["containers"]
    assert init["name"] == INIT_CONTAINER and init["securityContext"] == {"privileged": True}
    assert main["securityContext"]["privileged"] is False and init["volumeMounts"] == main["volumeMounts"]
    [env] = init["env"]
    folder = next(arg for arg in job["spec"]["trainer"]["args"] if arg.startswith("/results/run-"))
    assert env["name"] == FLUSH_SCRIPT_ENV and env["value"].replace("$$", "$") == host_flush_script(folder)
    assert any(f"must hold an init container named {INIT_CONTAINER!r} with the harness image and command "
               f"[bash, -c, $({FLUSH_SCRIPT_ENV})]" in note for note in request.notes)
    plain = launcher.render(_flush_spec(tmp_path, "kubernetes.api=trainjob", "kubernetes.flush_page_cache=false"))
    assert "initContainers" not in plain.text and not any(INIT_CONTAINER in note for note in plain.notes)

class FakeCluster:
    """What the nodes and the operator do with each job `harness run` submits to the fake API (operator on): a
    health job's pods write their nodes' reports (but the nodes in `silent`) and it succeeds; a training job's
    rank 0 writes the baseline result and it succeeds (unless `train` is False). Runs in a thread until stopped."""

    def __init__(self, api: FakeKubeAPI, volume: Path, namespace: str = "default", silent: tuple[str, ...] = (),
                 train: bool = True, rank0=None):
        from tests.test_preflight import _report

        self.api, self.volume, self.namespace, self.silent, self.report = api, volume, namespace, silent, _report
        self.train = train  # False: training jobs are left to the test
        # What a training job's pods do on the volume, given the job and its run folder there: by default rank 0
        # writes the baseline result. It may return the job's end ("Failed"); None: it succeeds.
        self.rank0 = rank0 or (lambda job, folder: shutil.copy(BASELINE_LOG, folder / "result_0.txt") and None)
        self.done: list[str] = []  # the jobs it finished, in order
        self.reads_when_running: dict[str, int] = {}  # each job's reads when it was first found Running
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "FakeCluster":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _seen_running(self, namespace: str, name: str, job: dict) -> bool:
        """Whether the job is Running and has been read twice since (a read under way may have served the state
        before): a job ends only after the watch has seen it run, however slowly the watch polls."""
        true = [c["type"] for c in job.get("status", {}).get("conditions", []) if c["status"] == "True"]
        if not true or true[-1] != "Running":
            return False
        reads = self.api.job_reads(namespace, name)
        return reads >= self.reads_when_running.setdefault(name, reads) + 2

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            with self.api.lock:  # a job and all its pods, or neither (fake_kube_api's notes)
                for (namespace, name), job in list(self.api.jobs.items()):
                    if name in self.done or namespace != self.namespace or not (
                            self.train or name.endswith("-preflight")) or not self._seen_running(namespace, name, job):
                        continue
                    folder, end = pod_folder(self.api, self.volume, name, namespace), None
                    if name.endswith("-preflight"):
                        for pod in self.api.job_pods(namespace, name).values():
                            if pod["spec"]["nodeName"] not in self.silent:
                                self.report(folder, pod["spec"]["nodeName"], 470)
                    else:
                        folder.mkdir(parents=True, exist_ok=True)
                        end = self.rank0(job, folder)
                    self.done.append(name)
                    self.api.set_condition(namespace, name, end or "Succeeded")


@pytest.fixture
def cluster_api(fake_api, tmp_path):
    """The fake API with the operator on, three Nodes and the results volume."""
    fake_api.operator = True
    fake_api.claims["mlperf-results"] = tmp_path / "pvc"
    for node in ("gpu-a", "gpu-b", "gpu-c"):
        fake_api.add_node(node, taints=[])
    return fake_api


def test_two_runs_in_a_row_in_one_namespace_each_get_jobs_of_their_own(cluster_api, tmp_path):
    """Default job names are unique per run, and the health job (with its pods) is deleted once its reports are
    read: the second run's creates meet no name the first run's jobs hold (the API answers 409 to a duplicate)."""
    args = ("run", "resnet", "--backend", "k8s", "--profile", "h100-ib", "--nodes", "2", "--spare-nodes", "1",
            "--preflight")
    env = {"KUBECONFIG": str(tmp_path / "kubeconfig")}
    results_pods = []
    cluster_api.before_pod_run = results_pods.append  # returns None: each runs as usual
    with FakeCluster(cluster_api, tmp_path / "pvc") as cluster:
        runs = [harness(*args, "--out", str(tmp_path / f"run{i}"), env=env) for i in (1, 2)]
    for run in runs:
        assert run.returncode == 0, run.stdout + run.stderr
    health = [name for name in cluster.done if name.endswith("-preflight")]
    training = [name for name in cluster.done if name not in health]
    assert len(health) == len(set(health)) == 2 and len(training) == len(set(training)) == 2
    assert all(re.fullmatch(r"resnet-tiny-[0-9a-f]{8}", name) for name in training)
    # The health jobs and their pods are gone; the training jobs stay (their pods hold the logs).
    assert sorted(name for _, name in cluster_api.jobs) == sorted(training)
    assert not [pod for (_, pod) in cluster_api.pods if "-preflight-" in pod]
    deletes = [path for method, path in cluster_api.requests if method == "DELETE" and "/pytorchjobs/" in path]
    assert sorted(path.rpartition("/")[2] for path in deletes) == sorted(health)
    # The results pods prefer the Nodes the job ran on (its image is there): the health job's three, training's two.
    preferred = sorted(tuple(pod["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][
        0]["preference"]["matchFields"][0]["values"]) for pod in results_pods)
    assert set(preferred) == {("gpu-a", "gpu-b", "gpu-c"), ("gpu-a", "gpu-b")}
    # A name given with --name is kept as it is.
    named = harness(*args, "--name", "rn", "--out", str(tmp_path / "named"), "--dry-run")
    assert training_job(named.stdout)["metadata"]["name"] == "rn"


def test_each_harness_preflight_gets_a_health_job_name_of_its_own(tmp_path, capsys):
    """`harness preflight` alone names its health job as `harness run` does, with a per-run token: before, every
    one was `preflight-preflight`, so a second one in the namespace was refused (409) while the first's job
    stayed."""
    from harness.cli import main

    names = []
    for i in range(2):
        assert main(["preflight", "--backend", "k8s", "--profile", "h100-ib", "--nodes", "2", "--out",
                     str(tmp_path / f"p{i}"), "--dry-run"]) == 0
        names.append(yaml.safe_load(capsys.readouterr().out)["metadata"]["name"])
    assert all(re.fullmatch(r"preflight-[0-9a-f]{8}-preflight", name) for name in names) and len(set(names)) == 2


def test_a_node_that_ran_the_health_job_but_wrote_no_report_fails_preflight(cluster_api, tmp_path, monkeypatch):
    """A node whose health pod was bound to it but wrote nothing (hung, killed at the deadline) is judged, and
    fails with the reason, as on Slurm; it is not left out of the allocation unseen. The submitting machine is
    slow to read the job after creating it, as a busy one is: the job still ends only after the watch has seen it
    run (FakeCluster), so preflight's time is measured from then."""
    from harness import remediation

    spec = JobSpec("resnet", nodes=2, spare_nodes=1, preflight=True, out_dir=tmp_path / "run",
                   profile=profiles.load("h100-ib")).resolved()
    launcher = get_launcher("k8s")
    submit = type(launcher).submit

    def slow_to_read(self, request):
        handle = submit(self, request)
        time.sleep(1.0)
        return handle

    monkeypatch.setattr(type(launcher), "submit", slow_to_read)
    began = time.monotonic()
    with FakeCluster(cluster_api, tmp_path / "pvc", silent=("gpu-c",)):
        record = remediation.run_health_job(launcher, spec)
    # The whole on the submitting machine's own clock, from when the job was seen running (preflight.decide).
    assert 0 < record["seconds"] <= time.monotonic() - began
    assert record["allocated"] == ["gpu-a", "gpu-b", "gpu-c"] and record["kept"] == ["gpu-a", "gpu-b"]
    assert record["excluded"] == {"gpu-c": ["health_report missing, expected written by the node: the node did not "
                                            "run or finish the checks"]}
    assert not cluster_api.jobs and not cluster_api.pods  # the health job, its pods and the results pods: gone


def test_a_lost_watch_cancels_the_kubernetes_health_job(cluster_api, tmp_path, monkeypatch):
    """Whatever ends the watch of a health job (Ctrl-C here, at a poll) deletes it with its pods: no one will
    read its verdict, and on 448 nodes it would hold them until its deadline."""
    from harness import remediation

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(remediation.PreflightWatcher, "__call__", interrupted)
    spec = JobSpec("resnet", nodes=2, preflight=True, out_dir=tmp_path / "run",
                   profile=profiles.load("h100-ib")).resolved()
    with pytest.raises(KeyboardInterrupt):
        remediation.run_health_job(get_launcher("k8s"), spec)
    assert not cluster_api.jobs and not cluster_api.pods
    assert json.loads((tmp_path / "run" / "job.json").read_text())["state"] == "CANCELLED"


def test_preflight_time_leaves_out_the_health_jobs_time_in_the_queue(cluster_api, tmp_path, monkeypatch):
    """448 nodes may wait hours for Kueue's admission and the scheduler; no node is held meanwhile, so preflight's
    time (its badput) starts when the job is seen running. The queue is an hour on a clock the test moves."""
    from harness import remediation

    spec = JobSpec("resnet", nodes=2, preflight=True, out_dir=tmp_path / "run",
                   profile=profiles.load("h100-ib")).resolved()
    launcher = get_launcher("k8s")
    queued = {"s": 0.0}
    real_clock, real_watch = time.monotonic, launcher.watch
    monkeypatch.setattr(remediation.time, "monotonic", lambda: real_clock() + queued["s"])

    def watch(handle, **kwargs):
        yield JobState.PENDING
        queued["s"] += 3600
        yield from real_watch(handle, **kwargs)

    monkeypatch.setattr(launcher, "watch", watch)
    with FakeCluster(cluster_api, tmp_path / "pvc"):
        record = remediation.run_health_job(launcher, spec)
    assert record["passed"] and 0 < record["seconds"] < 3600


def test_the_fake_cluster_sees_a_health_job_with_all_its_pods_however_slowly_the_operator_makes_them(
        cluster_api, tmp_path, monkeypatch):
    """The fake API answers on threads of its own, and FakeCluster scans every 50 ms from another: a scan between
    the health job's create and its last pod would report only the nodes it saw, and the others would fail
    preflight as silent. Here the operator takes 0.1 s a pod; every node still reports."""
    from harness import remediation

    create_pod = FakeKubeAPI._create_pod

    def slowly(api, *args):
        create_pod(api, *args)
        time.sleep(0.1)  # widens the window the lock closes; nothing here counts on its length

    monkeypatch.setattr(FakeKubeAPI, "_create_pod", slowly)
    spec = JobSpec("resnet", nodes=2, spare_nodes=1, preflight=True, out_dir=tmp_path / "run",
                   profile=profiles.load("h100-ib")).resolved()
    with FakeCluster(cluster_api, tmp_path / "pvc"):
        record = remediation.run_health_job(get_launcher("k8s"), spec)
    assert record["allocated"] == ["gpu-a", "gpu-b", "gpu-c"] and not record["excluded"], record


def test_the_submitters_rbac_grants_exactly_what_harness_run_calls(cluster_api, tmp_path):
    """`harness run --backend k8s --preflight --taint-bad-nodes` in namespace mlperf runs through all it calls: the
    health job (created, read, its pods listed, deleted), a node that fails it (conditioned, tainted, told), the
    training job with its watcher pod, and the collection (results pods created, read, their logs, deleted);
    then a TrainJob is submitted, read and cancelled. The fake API records what RBAC would check for each
    request: that set, the submitter's table (kubernetes_rbac.SUBMITTER_RULES) and the Role and ClusterRole
    rendered from it are the same, nothing more, nothing less; nothing is asked outside the job's namespace but
    the Nodes (preflight's Events on a Node go in the job's namespace)."""
    from harness.launchers.kubernetes_nodes import TAINT
    from harness.launchers.kubernetes_rbac import SUBMITTER, SUBMITTER_RULES, rbac
    from tests.fake_kube_api import granted

    with FakeCluster(cluster_api, tmp_path / "pvc", namespace="mlperf", silent=("gpu-c",)):
        run = harness("run", "resnet", "--backend", "k8s", "--profile", "h100-ib", "--set",
                      "kubernetes.namespace=mlperf", "--nodes", "2", "--spare-nodes", "1", "--preflight",
                      "--taint-bad-nodes", "--out", str(tmp_path / "run"),
                      env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert run.returncode == 0, run.stdout + run.stderr
    assert [t["key"] for t in cluster_api.nodes["gpu-c"]["spec"]["taints"]] == [TAINT.key]
    assert any(e["involvedObject"]["kind"] == "Node" for e in cluster_api.events)
    launcher, handle = submitted(tmp_path / "tj", name="tj", api="trainjob")
    launcher.cancel(handle)
    used = set(cluster_api.authorized)
    assert {namespace for *_, namespace in used} == {"mlperf", ""}
    calls = {("namespace" if namespace else "cluster", group, resource, verb)
             for group, resource, verb, namespace in used}
    table = {(scope, group, resource, verb) for (scope, group, resource), verbs in SUBMITTER_RULES.items()
             for verb in verbs}
    assert calls == table
    rendered = [doc for doc in rbac("mlperf")
                if doc["metadata"]["name"] in (SUBMITTER, f"{SUBMITTER}-preflight-mlperf")]
    assert [doc["kind"] for doc in rendered] == ["ServiceAccount", "Role", "RoleBinding", "ClusterRole",
                                                 "ClusterRoleBinding"]
    assert granted(rendered) == table
    for doc in rendered:
        if doc["kind"].endswith("Binding"):
            assert doc["subjects"] == [{"kind": "ServiceAccount", "name": SUBMITTER, "namespace": "mlperf"}]


def test_the_shipped_rbac_is_what_the_harness_renders_for_the_default_namespace():
    """manifests/rbac/*.yaml hold every document kubernetes_rbac.rbac renders for "default", and nothing else; for
    another namespace every cluster-scoped name carries it, so that applying one namespace's RBAC never rebinds
    another's, and every binding binds a role rendered beside it."""
    from harness.launchers.kubernetes_rbac import rbac

    shipped = [doc for path in sorted((REPO / "manifests" / "rbac").glob("*.yaml"))
               for doc in yaml.safe_load_all(path.read_text()) if doc]

    def key(doc: dict) -> tuple[str, str]:
        return doc["kind"], doc["metadata"]["name"]

    assert sorted(shipped, key=key) == sorted(rbac("default"), key=key)
    elsewhere = rbac("mlperf")
    assert len({key(doc) for doc in elsewhere}) == len(elsewhere)
    for doc in elsewhere:
        if doc["kind"].startswith("Cluster"):
            assert doc["metadata"]["name"].endswith("-mlperf") and "namespace" not in doc["metadata"]
        else:
            assert doc["metadata"]["namespace"] == "mlperf"
        if doc["kind"].endswith("Binding"):
            assert (doc["roleRef"]["kind"], doc["roleRef"]["name"]) in {key(d) for d in elsewhere}


def test_a_collection_that_fails_for_one_pod_leaves_a_successful_run_at_0_and_says_what_failed(fake_api, tmp_path):
    """The chunk pods run side by side (two of them meet at a barrier: one after the other, they never would), and
    one that fails costs only its files: the run's exit code stays the job's, the failure is said on the terminal
    and recorded in job.json, and the other files come back."""
    volume = tmp_path / "pvc"
    fake_api.claims["mlperf-results"] = volume
    together = threading.Barrier(2, timeout=60)

    def kubelet(pod: dict) -> str | None:
        name = pod["metadata"]["name"]
        if name.endswith("-0") or name.endswith("-2"):  # chunks 0 and 2 run at the same time, or neither goes on
            together.wait()
        return "OSError: [Errno 5] Input/output error" if name.endswith("-1") else None

    fake_api.before_pod_run = kubelet

    def operator():
        deadline = time.monotonic() + 120
        while ("default", "rn") not in fake_api.jobs and time.monotonic() < deadline:
            time.sleep(0.1)
        folder = pod_folder(fake_api, volume, "rn")
        (folder / "logs").mkdir(parents=True)
        shutil.copy(BASELINE_LOG, folder / "result_0.txt")
        (folder / "logs" / "rank_0.log").write_bytes(b"r" * (9 * 2**20))  # three chunks of 4 MiB
        fake_api.set_condition("default", "rn", "Succeeded")

    thread = threading.Thread(target=operator)
    thread.start()
    result = harness("run", "resnet", "--backend", "k8s", "--profile", "h100-ib", "--name", "rn",
                     "--out", str(tmp_path / "run"), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    thread.join()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 of 2 file(s) did not come back from the results volume (logs/rank_0.log)" in result.stderr
    assert "-collect-" in result.stderr and "Input/output error" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "run" / "result_0.txt").read_bytes() == BASELINE_LOG.read_bytes()
    assert not (tmp_path / "run" / "logs" / "rank_0.log").exists()  # no torn copy
    assert "logs/rank_0.log" in json.loads((tmp_path / "run" / "job.json").read_text())["collect_error"]
    assert "time-to-train (min)" in result.stdout


@needs_crd
def test_the_pods_the_harness_starts_itself_match_the_pod_schema_and_ask_for_no_privilege():
    """The results pods and the watcher pod, against the Pod schema the PyTorchJob CRD carries for its templates,
    and read back by the client's own models; neither can run privileged, escalate or keep a capability."""
    from harness.launchers.kubernetes_collect import MANIFEST_SCRIPT, collector_pod
    from harness.launchers.kubernetes_render import to_dict, watcher_pod

    profile = profiles.apply_overrides(profiles.load("coreweave-h100"), ["kubernetes.collect_image=python:3.12-slim"])
    spec = JobSpec("resnet", nodes=2, preflight=True, max_restarts=2, taint_bad_nodes=True, profile=profile,
                   out_dir=Path("/x/run")).resolved()
    job = {"metadata": {"name": "rn", "namespace": "default", "uid": "1234"}}
    template = pytorchjob_schema()["properties"]["spec"]["properties"]["pytorchReplicaSpecs"][
        "additionalProperties"]["properties"]["template"]
    collector = to_dict(collector_pod(spec, "rn-collect-abc-m", MANIFEST_SCRIPT, ["/results/run-1"]))
    watcher = watcher_pod(spec, job, "/results/run-1")
    for pod in (collector, watcher):
        jsonschema.validate({"metadata": pod["metadata"], "spec": pod["spec"]}, template)
        model = k8s.ApiClient().deserialize(SimpleNamespace(data=json.dumps(pod)), "V1Pod")
        assert k8s.ApiClient().sanitize_for_serialization(model) == pod
        [container] = pod["spec"]["containers"]
        security = container["securityContext"]
        assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]} and security["readOnlyRootFilesystem"] is True
        assert all(mount["readOnly"] for mount in container["volumeMounts"])
    assert collector["spec"]["containers"][0]["image"] == "python:3.12-slim"  # a small image, where named
    assert collector["spec"]["automountServiceAccountToken"] is False
    assert watcher["spec"]["containers"][0]["image"] == profile.image  # the harness image: it runs the harness
    assert watcher["spec"]["securityContext"]["runAsNonRoot"] is True
