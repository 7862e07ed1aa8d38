"""The Kubernetes backend: the rendered PyTorchJob against its CRD schema, and its life on a FAKE API server."""

from __future__ import annotations

import json
import re
import threading
import time
from types import SimpleNamespace

import jsonschema
import kubeflow.training
import pytest
import yaml
from kubeflow.training import models as kf
from kubernetes import client as k8s

from harness import profiles
from harness.launchers import JobState, get_launcher
from harness.spec import JobSpec
from tests.conftest import SHARED, harness
from tests.fake_kube_api import FakeKubeAPI

CRD = SHARED / "kubeflow" / "kubeflow.org_pytorchjobs.v1.9.0.yaml"
needs_crd = pytest.mark.skipif(not CRD.is_file(), reason=f"PyTorchJob CRD not found at {CRD} (../shared is absent)")
RFC_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")


def pytorchjob_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def rendered(*args: str) -> str:
    result = harness("run", "resnet", "--backend", "k8s", "--dry-run", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


@needs_crd
def test_448_h100_nodes_render_one_valid_pytorchjob(tmp_path):
    args = ("--profile", "coreweave-h100", "--nodes", "448", "--gpus-per-node", "8", "--out", str(tmp_path / "o"))
    text = rendered(*args)
    assert rendered(*args) == text  # deterministic
    job = yaml.safe_load(text)
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
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "rdma/ib": "1"}
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["NCCL_COLLNET_ENABLE"] == "1" and "NCCL_IB_HCA" in env and "NCCL_SOCKET_IFNAME" in env
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
    job = yaml.safe_load(rendered("--set", "image=python:3.11", "--nodes", "2", "--out", str(tmp_path),
                                  "--max-restarts", "3"))
    jsonschema.validate(job, pytorchjob_schema())
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "privileged": False}
    assert "resources" not in container  # a CPU profile asks for no GPUs or RDMA devices
    assert job["spec"]["runPolicy"]["backoffLimit"] == 3
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] == "OnFailure"


@pytest.fixture
def fake_api(tmp_path, monkeypatch):
    with FakeKubeAPI() as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        yield api


def submitted(tmp_path, name: str = "rn50"):
    profile = profiles.apply_overrides(profiles.load("h100-ib"), ["kubernetes.namespace=mlperf"])
    spec = JobSpec("resnet", nodes=2, name=name, out_dir=tmp_path / "run", profile=profile).resolved()
    launcher = get_launcher("k8s")
    return launcher, launcher.submit(launcher.render(spec))


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


def test_api_errors_are_one_line(fake_api, tmp_path):
    submitted(tmp_path)
    result = harness("run", "resnet", "--backend", "k8s", "--profile", "h100-ib", "--set", "kubernetes.namespace=mlperf",
                     "--name", "rn50", "--out", str(tmp_path / "again"), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    assert result.returncode == 1 and "409" in result.stderr and "already exists" in result.stderr
    assert "pick another --name" in result.stderr
    assert "Traceback" not in result.stderr


def test_harness_run_streams_the_job_states(fake_api, tmp_path):
    """`harness run --backend k8s` end to end: submit, then Created -> Running -> Succeeded as the operator says."""
    def operator():
        deadline = time.monotonic() + 60
        while ("default", "rn") not in fake_api.jobs and time.monotonic() < deadline:
            time.sleep(0.1)
        for condition in ("Created", "Running", "Succeeded"):
            fake_api.set_condition("default", "rn", condition)
            time.sleep(1.5)

    thread = threading.Thread(target=operator)
    thread.start()
    result = harness("run", "resnet", "--backend", "k8s", "--profile", "h100-ib", "--name", "rn", "--nodes", "2",
                     "--out", str(tmp_path / "run"), env={"KUBECONFIG": str(tmp_path / "kubeconfig")})
    thread.join()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "job default/rn PENDING" in result.stdout and "job default/rn RUNNING" in result.stdout
    assert "job default/rn SUCCEEDED" in result.stdout and "on the results volume" in result.stdout
    assert [e["reason"] for e in fake_api.events] == ["HarnessRunning", "HarnessSucceeded"]


def test_tolerations_as_in_a_pod_spec_or_refused(tmp_path):
    job = yaml.safe_load(rendered("--profile", "coreweave-h100", "--out", str(tmp_path), "--set",
                                  "kubernetes.tolerations=[{key: a, operator: Exists, tolerationSeconds: 30}]"))
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "a", "operator": "Exists", "tolerationSeconds": 30}]
    result = harness("run", "resnet", "--backend", "k8s", "--profile", "coreweave-h100", "--dry-run",
                     "--set", "kubernetes.tolerations=[{bogus: 1}]", "--out", str(tmp_path))
    assert result.returncode == 2 and "unknown field(s) bogus" in result.stderr and "Traceback" not in result.stderr
