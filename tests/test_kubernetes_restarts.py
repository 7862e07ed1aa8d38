"""Restarts of a PyTorchJob under restartPolicy ExitCode, as the training operator makes them (the fake API's
`reconcile`), against one restart budget kept by the node agents in the shared attempts record.

The node agents here are harness.agent's own functions, step by step as its main() runs them, on the
folder standing for the results volume; no torch processes start, except where a pod's real command
runs to a refusal before torch (the fake kubelet runs it)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
from kubernetes import client as k8s

from harness import profiles
from harness.agent import (EXIT_BUDGET_SPENT, EXIT_RETRY, INFRASTRUCTURE, Failure, NewerAttemptWatch,
                           _append, attempt_argv, claim_run_folder, decide, newer_attempt, next_attempt,
                           read_records)
from harness.launchers import JobState, get_launcher
from harness.spec import JobSpec
from tests.fake_kube_api import FakeKubeAPI

NS, JOB, BUDGET = "mlperf", "rn", 2
PODS = ["rn-master-0", "rn-worker-0", "rn-worker-1"]


@pytest.fixture
def operator(tmp_path, monkeypatch):
    with FakeKubeAPI() as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        api.claims["mlperf-results"] = tmp_path / "pvc"
        api.operator = True
        yield api


def submit(tmp_path: Path, nodes: int = 3, max_restarts: int = BUDGET, name: str = JOB):
    profile = profiles.apply_overrides(profiles.load("h100-ib"), [f"kubernetes.namespace={NS}"])
    spec = JobSpec("resnet", nodes=nodes, name=name, out_dir=tmp_path / name, profile=profile,
                   max_restarts=max_restarts).resolved()
    launcher = get_launcher("k8s")
    return launcher, launcher.submit(launcher.render(spec))


def pod_arg(api: FakeKubeAPI, flag: str) -> str:
    args = api.jobs[(NS, JOB)]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index(flag) + 1]


class NodeAgent:
    """harness.agent.main on one pod, in its steps: claim the folder, take the attempt number from the
    record, refuse one past the budget, record the start; at the end, record it and decide."""

    def __init__(self, out: Path, token: str, pod: str, host: str | None = None):
        self.out, self.token, self.pod = out, token, pod
        self.host = host  # the Kubernetes node under the pod, as the agent records it from HARNESS_HOST
        self.attempt: int | None = None

    def _names(self) -> dict:
        return {"node": self.pod, **({"host": self.host} if self.host else {})}

    def start(self) -> int | None:
        assert claim_run_folder(self.out, self.token) is None
        attempt = next_attempt(read_records(self.out), self.pod)
        if attempt > BUDGET:
            return None
        _append(self.out, self.pod, {"event": "start", "attempt": attempt, **self._names(), "time": time.time()})
        self.attempt = attempt
        return attempt

    def rendezvous(self) -> str:
        [rdzv] = attempt_argv([f"--rdzv-id={JOB}"], self.attempt)
        return rdzv

    def end(self, failure: Failure) -> int:
        _append(self.out, self.pod, {"event": "end", "attempt": self.attempt, **self._names(), "time": time.time(),
                                     "ok": False, "kind": failure.kind, "cause": failure.cause,
                                     "signal": failure.signal, "run": 0, "step": None})
        return decide(read_records(self.out), self.attempt, BUDGET).exit_code


def lose(api: FakeKubeAPI, agents: dict[str, NodeAgent], lost: str) -> list[str]:
    """One node is lost in the middle of an attempt: the sequence the operator and the node agents go through.
    Returns the rendezvous ids the nodes meet at afterwards."""
    attempt = agents[lost].attempt
    survivors = [pod for pod in PODS if pod != lost]
    before = len(api.operations)
    api.exit_pod(NS, lost, 137)  # SIGKILL: no end record
    assert api.operations[before:] == [("delete", lost), ("create", lost)]  # same name, others untouched
    assert agents[lost].start() == attempt + 1  # its own unfinished start tells it
    assert agents[lost].rendezvous() == f"--rdzv-id={JOB}-{attempt + 1}"  # not the survivors' rendezvous
    for pod in survivors:  # still running, until their watch sees the newer attempt in the record
        assert api.pods[(NS, pod)]["status"]["phase"] == "Running"
        stopped = threading.Event()
        with NewerAttemptWatch(agents[pod].out, attempt, poll_s=0.01, stop=stopped.set) as watch:
            assert stopped.wait(5)
        assert watch.newer["node"] == lost
        code = agents[pod].end(watch.failure())
        assert code == (EXIT_RETRY if attempt < BUDGET else EXIT_BUDGET_SPENT)
        api.exit_pod(NS, pod, code)
        if code == EXIT_RETRY:
            assert api.operations[-2:] == [("delete", pod), ("create", pod)]
            assert agents[pod].start() == attempt + 1
    return sorted({agent.rendezvous() for agent in agents.values()})


def test_every_restart_counts_and_every_pod_knows_the_attempt(operator, tmp_path):
    launcher, handle = submit(tmp_path)
    job = operator.jobs[(NS, JOB)]
    assert job["spec"]["runPolicy"]["backoffLimit"] == BUDGET
    assert {r["restartPolicy"] for r in job["spec"]["pytorchReplicaSpecs"].values()} == {"ExitCode"}
    assert operator.operations == [("create", pod) for pod in PODS]
    out = tmp_path / "pvc" / Path(pod_arg(operator, "--out")).name
    agents = {pod: NodeAgent(out, pod_arg(operator, "--job-token"), pod) for pod in PODS}
    assert [agent.start() for agent in agents.values()] == [0, 0, 0]
    assert launcher.status(handle) is JobState.RUNNING

    assert lose(operator, agents, "rn-worker-0") == [f"--rdzv-id={JOB}-1"]  # all three meet again, in attempt 1
    assert launcher.status(handle) is JobState.RUNNING
    assert lose(operator, agents, "rn-master-0") == [f"--rdzv-id={JOB}-2"]
    # Six pods recreated, and the operator's backoffLimit (2) counted none of them.
    assert operator.operations.count(("delete", "rn-worker-0")) == 2 and launcher.status(handle) is JobState.RUNNING

    # Attempt 2 is the last the budget allows: the next lost node's pod is recreated, and its real node agent
    # (run by the fake kubelet, with the rendered command) refuses attempt 3 with a code the operator won't retry.
    operator.exit_pod(NS, "rn-worker-1", 137)
    assert operator.operations[-2:] == [("delete", "rn-worker-1"), ("create", "rn-worker-1")]
    assert operator.run_pod(NS, "rn-worker-1") == EXIT_BUDGET_SPENT
    log = operator.pods[(NS, "rn-worker-1")]["log"]
    assert "attempt 3 refused: the restart budget (2) is spent" in log and "Traceback" not in log
    assert launcher.status(handle) is JobState.FAILED
    # cleanPodPolicy Running: the survivors still in attempt 2 are stopped; the ended pod stays for its log.
    assert set(operator.job_pods(NS, JOB)) == {"rn-worker-1"}
    starts = [(r["node"], r["attempt"]) for r in read_records(out) if r["event"] == "start"]
    assert sorted(a for _, a in starts) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # three attempts, every pod in each


def last_message(api: FakeKubeAPI, name: str) -> str:
    return api.jobs[(NS, name)]["status"]["conditions"][-1]["message"]


def test_backoff_limit_as_the_operator_counts_it(operator, tmp_path):
    """backoffLimit under ExitCode: 0 fails the job at the first retryable failure; any other value never
    fails it, however many pods are recreated. 1-127 under ExitCode, and any failure under Never, fail it."""
    launcher, handle = submit(tmp_path, nodes=2)
    for _ in range(5):
        operator.exit_pod(NS, "rn-worker-0", 137)
    assert launcher.status(handle) is JobState.RUNNING and operator.operations.count(("create", "rn-worker-0")) == 6
    operator.exit_pod(NS, "rn-worker-0", 3)
    assert launcher.status(handle) is JobState.FAILED
    assert "failing because Worker replica(s) failed" in last_message(operator, "rn")

    launcher, handle = submit(tmp_path, nodes=2, name="zero")
    operator.jobs[(NS, "zero")]["spec"]["runPolicy"]["backoffLimit"] = 0
    operator.exit_pod(NS, "zero-worker-0", EXIT_RETRY)
    assert launcher.status(handle) is JobState.FAILED
    assert "reached the specified backoff limit" in last_message(operator, "zero")
    assert not operator.job_pods(NS, "zero")  # the operator deletes every pod before failing the job

    launcher, handle = submit(tmp_path, nodes=2, max_restarts=0, name="never")
    assert operator.jobs[(NS, "never")]["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "Never"
    operator.exit_pod(NS, "never-worker-0", EXIT_RETRY)
    assert launcher.status(handle) is JobState.FAILED


def test_the_master_succeeding_is_the_jobs_success(operator, tmp_path):
    launcher, handle = submit(tmp_path, nodes=2)
    operator.exit_pod(NS, "rn-worker-0", 0)
    assert launcher.status(handle) is JobState.RUNNING
    operator.exit_pod(NS, "rn-master-0", 0)
    assert launcher.status(handle) is JobState.SUCCEEDED


def test_attempt_numbers_and_rendezvous(tmp_path):
    records = [{"event": "start", "attempt": 0, "node": "a"}, {"event": "start", "attempt": 0, "node": "b"}]
    assert next_attempt(records, "a") == 1  # a restarted node that never ended its attempt
    assert next_attempt(records, "c") == 0 and newer_attempt(records, 0) is None
    records.append({"event": "start", "attempt": 1, "node": "a"})
    assert next_attempt(records, "b") == 1 and newer_attempt(records, 0)["node"] == "a"
    argv = ["--nnodes=2", "--rdzv-id=job", "-m", "workloads", "resnet", "--rdzv-id=the-programs-own"]
    assert attempt_argv(argv, 3) == ["--nnodes=2", "--rdzv-id=job-3", *argv[2:]]
    assert attempt_argv(["--standalone", "-m", "workloads"], 1) == ["--standalone", "-m", "workloads"]


def test_a_closed_campaigns_job_per_run_numbers_its_attempts_on_from_the_runs_before(tmp_path):
    """Each run of a closed Kubernetes campaign is a job of its own with new pods (--launch). Run 0 ended its attempts
    by succeeding: run 1's first pods must not read those ends as a failure to restart after (one past them would
    spend the budget on success and make the markers of attempt 1 stop run 1's other pods); they go on at the
    campaign's newest attempt, so a restart spent in run 0 stays spent. A pod of run 1 recreated after its own
    failure goes one past. The watcher of run 1's job judges run 1's attempts alone."""
    from harness.launchers.kubernetes_blame import judge
    from workloads.common.run_record import of_launch

    run0 = [{"event": "start", "attempt": 0, "node": "r0-m", "launch": 0},
            {"event": "end", "attempt": 0, "node": "r0-m", "launch": 0, "exit_code": 138},
            {"event": "start", "attempt": 1, "node": "r0-m", "launch": 0},
            {"event": "end", "attempt": 1, "node": "r0-m", "launch": 0, "exit_code": 0}]
    assert next_attempt(run0, "r1-m", launch=1) == 1 and next_attempt(run0, "r1-w", launch=1) == 1
    assert next_attempt(run0[:2] + [{"event": "start", "attempt": 0, "node": "x", "launch": 0}], "r1-m", launch=1) == 0
    run1 = [*run0, {"event": "start", "attempt": 1, "node": "r1-m", "launch": 1},
            {"event": "end", "attempt": 1, "node": "r1-m", "launch": 1, "exit_code": 138}]
    assert next_attempt(run1, "r1-m", launch=1) == 2 and next_attempt(run1, "r1-w", launch=1) == 2
    assert next_attempt(run1, "r1-m") == 2  # without --launch, as before: one past the newest end anywhere
    # Run 1's watcher, polling before run 1 ended anything: run 0's settled attempt 1 is not its to judge (judged,
    # it would leave run 1's own attempt 1, when it fails, marked judged already, and never acted on).
    job = {"metadata": {"name": JOB}, "spec": {"pytorchReplicaSpecs": {}}}
    assert judge(job, run0, lambda attempt: {}) is not None and judge(job, of_launch(run0, 1), lambda a: {}) is None
    verdict = judge(job, of_launch(run1, 1), lambda attempt: {"gpu-b": "lost"} if attempt == 1 else {})
    assert verdict.attempt == 1 and verdict.blamed == {"gpu-b": "lost"}
    from harness import profiles
    from harness.launchers.kubernetes_render import watcher_pod
    from harness.spec import JobSpec

    spec = JobSpec("resnet", preset="full", nodes=2, runs=5, launch=3, preflight=True, out_dir=tmp_path,
                   profile=profiles.load("coreweave-h100")).resolved()
    args = watcher_pod(spec, {"metadata": {"name": "j-run3", "namespace": NS, "uid": "u"}}, "/f")["spec"][
        "containers"][0]["args"]
    assert args[args.index("--launch") + 1] == "3"  # the pod's watcher filters by its run (BlamedNodeWatcher)


def test_a_survivor_stops_when_another_node_begins_a_newer_attempt(tmp_path):
    stopped = threading.Event()
    _append(tmp_path, "a", {"event": "start", "attempt": 0, "node": "a", "time": 0})
    with NewerAttemptWatch(tmp_path, 0, poll_s=0.05, stop=stopped.set) as watch:
        assert not stopped.wait(0.3)
        _append(tmp_path, "b", {"event": "start", "attempt": 1, "node": "b", "time": 0})
        assert stopped.wait(5)
    assert watch.newer["node"] == "b" and watch.failure().kind == INFRASTRUCTURE
    assert "b began attempt 1" in watch.failure().cause


def test_the_run_folder_is_claimed_once(tmp_path):
    results = []
    threads = [threading.Thread(target=lambda t=t: results.append(claim_run_folder(tmp_path / "run", t)))
               for t in ("aaaa", "bbbb", "aaaa", "bbbb")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winner = (tmp_path / "run" / "job-token").read_text().strip()
    assert sorted(r is None for r in results) == [False, False, True, True]  # the winner's two nodes
    assert claim_run_folder(tmp_path / "run", winner) is None  # a restarted pod of the same job
    old = tmp_path / "old"
    old.mkdir()
    (old / "result_0.txt").write_text("an older harness's run\n")
    assert "no job claimed" in claim_run_folder(old, "aaaa") and not (old / "job-token").exists()


def test_a_node_waits_for_the_token_of_a_claim_not_yet_written(tmp_path, monkeypatch):
    """The first node creates job-token, then writes its token, which on a shared file system under hundreds of
    starting nodes can show seconds later: the other nodes wait for it (on a clock faked here) instead of refusing
    their own job's folder, which would fail the job for good. A claim whose token never comes (its node died in
    between) is refused at the deadline."""
    from types import SimpleNamespace

    from harness import agent

    def claim(folder: Path, token_at_s: float | None) -> tuple[str | None, float]:
        folder.mkdir()
        (folder / agent.CLAIM_FILE).touch()  # created by the first node, its token not written yet
        clock = [0.0]

        def sleep(seconds: float) -> None:
            clock[0] += seconds
            if token_at_s is not None and clock[0] >= token_at_s:
                (folder / agent.CLAIM_FILE).write_text("aaaa\n")

        monkeypatch.setattr(agent, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep))
        return agent.claim_run_folder(folder, "aaaa"), clock[0]

    assert claim(tmp_path / "slow", token_at_s=30.0) == (None, pytest.approx(30.0))
    refused, waited = claim(tmp_path / "dead", token_at_s=None)
    assert "holds the results of job (unnamed)" in refused and waited >= agent.CLAIM_WAIT_S


def test_the_node_a_failed_attempt_points_at_is_kept_out_of_the_next(operator, tmp_path, capsys):
    """A rank killed on gpu-b: the operator recreates its pod from the same template, on gpu-b again; the
    watcher (here one poll at a time, in this process) patches the template (NotIn gpu-b), marks the node, and
    moves the pod, which lands on the spare gpu-c; `harness run`'s side only reads what it decided. The
    operator's pods are created from the template as the job holds it (fake_kube_api)."""
    from harness import preflight
    from harness.launchers.kubernetes_blame import BLAME_ANNOTATION, BlamedNodeWatcher
    from harness.launchers.kubernetes_nodes import CONDITION, TAINT
    from tests.test_preflight import _report

    for node in ("gpu-a", "gpu-b", "gpu-c"):
        operator.add_node(node, taints=[])
        _report(tmp_path / JOB, node, 470)
    preflight.decide(tmp_path / JOB, ["gpu-a", "gpu-b", "gpu-c"], 2)  # as the health job left it
    profile = profiles.apply_overrides(profiles.load("h100-ib"), [f"kubernetes.namespace={NS}"])
    spec = JobSpec("resnet", nodes=2, name=JOB, out_dir=tmp_path / JOB, profile=profile, max_restarts=BUDGET,
                   preflight=True, spare_nodes=1, taint_bad_nodes=True).resolved()
    launcher = get_launcher("k8s")
    handle = launcher.submit(launcher.render(spec))
    reader = launcher.restart_watcher(spec, handle)
    for without in ({"max_restarts": 0}, {"preflight": False, "spare_nodes": 0}):
        assert launcher.restart_watcher(dataclasses.replace(spec, **without), handle) is None
    trainjob = profiles.apply_overrides(profile, ["kubernetes.api=trainjob"])
    assert launcher.restart_watcher(dataclasses.replace(spec, profile=trainjob), handle) is None
    host = {pod: operator.pods[(NS, pod)]["spec"]["nodeName"] for pod in ("rn-master-0", "rn-worker-0")}
    assert host == {"rn-master-0": "gpu-a", "rn-worker-0": "gpu-b"}
    out = tmp_path / "pvc" / Path(pod_arg(operator, "--out")).name
    watch = BlamedNodeWatcher(NS, JOB, out, taint=True)
    assert watch() is JobState.RUNNING
    agents = {pod: NodeAgent(out, pod_arg(operator, "--job-token"), pod, host[pod]) for pod in host}
    assert [agent.start() for agent in agents.values()] == [0, 0]

    code = agents["rn-worker-0"].end(Failure(INFRASTRUCTURE, "rank 1 killed by SIGKILL", 1, -9, "SIGKILL"))
    operator.exit_pod(NS, "rn-worker-0", code)
    assert operator.pods[(NS, "rn-worker-0")]["spec"]["nodeName"] == "gpu-b"  # the same template, the same node
    watch()  # the master still runs attempt 0: not judged yet
    assert ("gpu-b" not in str(operator.jobs[(NS, JOB)]["spec"]) and
            operator.pods[(NS, "rn-worker-0")]["spec"]["nodeName"] == "gpu-b")
    code = agents["rn-master-0"].end(Failure(INFRASTRUCTURE, "rank 0 stopped by SIGTERM", 0, -15, "SIGTERM"))
    operator.exit_pod(NS, "rn-master-0", code)
    watch()

    assert {pod: operator.pods[(NS, pod)]["spec"]["nodeName"] for pod in host} == {
        "rn-master-0": "gpu-a", "rn-worker-0": "gpu-c"}
    for replica in operator.jobs[(NS, JOB)]["spec"]["pytorchReplicaSpecs"].values():
        [term] = replica["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert term == {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-b"]}]}
    why = "training_failure rank 1 killed by SIGKILL, expected no failure in the last attempt"
    condition = {c["type"]: c for c in operator.nodes["gpu-b"]["status"]["conditions"]}[CONDITION]
    assert (condition["status"], condition["message"]) == ("True", f"harness preflight: {why}")
    assert [t["key"] for t in operator.nodes["gpu-b"]["spec"]["taints"]] == [TAINT.key]
    told = {(e["involvedObject"]["kind"], e["involvedObject"]["name"]) for e in operator.events
            if e["reason"] == "PreflightFailed"}
    assert told == {("Node", "gpu-b"), ("PyTorchJob", JOB)}
    decided = json.loads(operator.jobs[(NS, JOB)]["metadata"]["annotations"][BLAME_ANNOTATION])
    assert decided["judged"] == [0] and list(decided["blamed"]) == ["gpu-b"]
    assert "gpu-b" not in preflight.read(tmp_path / JOB)["excluded"]  # the submitting side decided nothing

    reader()  # `harness run`'s poll: it reads what the watcher decided
    record = preflight.read(tmp_path / JOB)
    assert record["excluded"] == {"gpu-b": [why]} and "gpu-b" not in record["kept"]
    assert "harness: gpu-b: kept out of the job's next attempt" in capsys.readouterr().out
    reader()
    assert preflight.read(tmp_path / JOB)["excluded"] == {"gpu-b": [why]}  # once

    agents["rn-worker-0"].host = "gpu-c"
    assert [agent.start() for agent in agents.values()] == [1, 1]
    patches = len(operator.patches)
    watch()  # nothing new has ended: nothing patched
    assert len(operator.patches) == patches and "rn-worker-0" in operator.job_pods(NS, JOB)


def test_an_agent_in_a_pod_records_the_machine_under_it(tmp_path, monkeypatch):
    """What a failure is blamed on is the Kubernetes node (HARNESS_HOST), not the pod the record is named by."""
    import argparse

    from harness import agent

    monkeypatch.setenv(agent.HOST_ENV, "gpu-b")
    monkeypatch.setattr(agent, "_stop_on_sigterm", lambda: None)
    monkeypatch.setattr(agent, "run_attempt", lambda argv: (False, None))
    args = argparse.Namespace(out=tmp_path, torchrun=[], max_restarts=0, restart_here=False)
    assert agent._attempts(args, "rn-worker-0") == 0
    assert [(r["event"], r["node"], r["host"]) for r in read_records(tmp_path)] == [
        ("start", "rn-worker-0", "gpu-b"), ("end", "rn-worker-0", "gpu-b")]


def test_an_api_error_in_the_blame_watch_is_printed_and_the_watch_goes_on(tmp_path, monkeypatch, capsys):
    """A transient API error must not end the watcher: the job would run on, unwatched."""
    from types import SimpleNamespace

    from harness.launchers import kubernetes_blame

    def refuse(*args, **kwargs):
        raise k8s.ApiException(status=500, reason="Internal Server Error")

    monkeypatch.setattr(kubernetes_blame, "clients", lambda: (SimpleNamespace(get_namespaced_custom_object=refuse),
                                                              SimpleNamespace()))
    watch = kubernetes_blame.BlamedNodeWatcher("default", JOB, tmp_path, taint=False)
    assert watch() is JobState.UNKNOWN and watch() is JobState.UNKNOWN
    out = capsys.readouterr().out
    assert out.count("refused to read the PyTorchJob: 500 Internal Server Error") == 2


def test_the_watcher_pod_keeps_the_culprit_out_after_the_submitter_is_gone(operator, tmp_path):
    """`harness run --preflight --max-restarts` creates, with the PyTorchJob, a watcher pod the job owns; the
    submitting process is then killed (a closed laptop), and the watcher, run as its own process against the
    fake API as the kubelet would run it, keeps the node of the next failure out of the job: nothing of it
    depends on the submitter. It ends when the job ends, and goes when the job is deleted."""
    import subprocess
    import sys

    import jsonschema

    from harness.launchers.base import Handle
    from harness.launchers.kubernetes_nodes import TAINT
    from tests.conftest import REPO
    from tests.test_kubernetes import CRD, FakeCluster, pytorchjob_schema

    for node in ("gpu-a", "gpu-b", "gpu-c"):
        operator.add_node(node, taints=[])
    watcher_pod = (NS, f"{JOB}-watch")
    with FakeCluster(operator, tmp_path / "pvc", namespace=NS, train=False):
        submitter = subprocess.Popen(
            [sys.executable, "-m", "harness", "run", "resnet", "--backend", "k8s", "--profile", "h100-ib", "--set",
             f"kubernetes.namespace={NS}", "--name", JOB, "--nodes", "2", "--spare-nodes", "1", "--preflight",
             "--max-restarts", str(BUDGET), "--taint-bad-nodes", "--out", str(tmp_path / JOB)],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while watcher_pod not in operator.pods and submitter.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    submitter.kill()  # SIGKILL: no cancel, no clean-up; the job runs on
    assert submitter.wait() == -9 and watcher_pod in operator.pods

    job, pod = operator.jobs[(NS, JOB)], operator.pods[watcher_pod]
    assert pod["metadata"]["ownerReferences"] == [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                                                   "name": JOB, "uid": job["metadata"]["uid"]}]
    assert pod["spec"]["serviceAccountName"] == "mlperf-harness-watcher" and pod["spec"]["restartPolicy"] == "OnFailure"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True and pod["spec"]["securityContext"]["runAsUser"] > 0
    [container] = pod["spec"]["containers"]
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                            "privileged": False, "readOnlyRootFilesystem": True}
    assert container["volumeMounts"] == [{"mountPath": "/results", "name": "results", "readOnly": True}]
    assert container["args"][:2] == ["-m", "harness.launchers.kubernetes_blame"] and "--taint" in container["args"]
    if CRD.is_file():  # the pod spec against the Pod schema the PyTorchJob CRD carries for its templates
        template = pytorchjob_schema()["properties"]["spec"]["properties"]["pytorchReplicaSpecs"][
            "additionalProperties"]["properties"]["template"]
        jsonschema.validate({"metadata": pod["metadata"], "spec": pod["spec"]}, template)

    watcher = operator.start_pod(NS, f"{JOB}-watch", "--poll-s", "0.05")
    try:
        host = {name: operator.pods[(NS, name)]["spec"]["nodeName"] for name in ("rn-master-0", "rn-worker-0")}
        assert host == {"rn-master-0": "gpu-a", "rn-worker-0": "gpu-b"}
        out = tmp_path / "pvc" / Path(pod_arg(operator, "--out")).name
        agents = {name: NodeAgent(out, pod_arg(operator, "--job-token"), name, host[name]) for name in host}
        assert [agent.start() for agent in agents.values()] == [0, 0]
        code = agents["rn-worker-0"].end(Failure(INFRASTRUCTURE, "rank 1 killed by SIGKILL", 1, -9, "SIGKILL"))
        operator.exit_pod(NS, "rn-worker-0", code)
        code = agents["rn-master-0"].end(Failure(INFRASTRUCTURE, "rank 0 stopped by SIGTERM", 0, -15, "SIGTERM"))
        operator.exit_pod(NS, "rn-master-0", code)
        deadline = time.monotonic() + 120
        # The pod is moved first, the Node tainted after (kubernetes_blame): wait for both.
        while (operator.pods[(NS, "rn-worker-0")]["spec"].get("nodeName") != "gpu-c"
               or not operator.nodes["gpu-b"]["spec"]["taints"]) and watcher.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert operator.pods[(NS, "rn-worker-0")]["spec"]["nodeName"] == "gpu-c"
        [term] = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert term == {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-b"]}]}
        assert [t["key"] for t in operator.nodes["gpu-b"]["spec"]["taints"]] == [TAINT.key]
        operator.set_condition(NS, JOB, "Succeeded")  # the job ends: so does its watcher
        log, _ = watcher.communicate(timeout=120)
    finally:
        if watcher.poll() is None:
            watcher.kill()
    assert watcher.returncode == 0, log
    assert "gpu-b: kept out of the job's next attempt (training_failure rank 1 killed by SIGKILL" in log
    assert f"{JOB} SUCCEEDED; done" in log
    get_launcher("k8s").delete(Handle.load(tmp_path / JOB))
    assert watcher_pod not in operator.pods  # the garbage collector follows its ownerReference


def watched_spec(tmp_path: Path, nodes: int = 2, taint: bool = True) -> JobSpec:
    """A PyTorchJob that gets the watcher pod (--preflight and --max-restarts), with a spare node."""
    profile = profiles.apply_overrides(profiles.load("h100-ib"), [f"kubernetes.namespace={NS}"])
    return JobSpec("resnet", nodes=nodes, name=JOB, out_dir=tmp_path / JOB, profile=profile, max_restarts=BUDGET,
                   preflight=True, spare_nodes=1, taint_bad_nodes=taint).resolved()


def test_a_refused_watcher_pod_leaves_no_job_behind(operator, tmp_path):
    """Kubernetes refuses the watcher pod (no ServiceAccount, a PodSecurity admission, a quota) after the
    PyTorchJob exists: the job is deleted, with what else that submit made, the record says why, and the
    refusal is one line. Never a 64-node job running unwatched that no harness collects."""
    from harness.errors import HarnessError
    from harness.launchers.base import Handle

    operator.refuse[("", "pods", "create")] = 403
    launcher = get_launcher("k8s")
    with pytest.raises(HarnessError) as refused:
        launcher.submit(launcher.render(watched_spec(tmp_path)))
    message = str(refused.value)
    assert "\n" not in message and "watcher pod" in message and "403" in message
    assert f"deleted the PyTorchJob {JOB}" in message
    assert (NS, JOB) not in operator.jobs and not operator.job_pods(NS, JOB)
    record = Handle.load(tmp_path / JOB).record()
    assert record["state"] == JobState.FAILED.value and "watcher pod" in record["failure"]


def test_a_refused_watcher_pod_whose_job_cannot_be_deleted_says_what_is_left(operator, tmp_path):
    """Where the delete is refused too, the job is named as left behind, and how to remove it is said."""
    from harness.errors import HarnessError
    from harness.launchers.base import Handle

    operator.refuse[("", "pods", "create")] = 403
    operator.refuse[("kubeflow.org", "pytorchjobs", "delete")] = 403
    launcher = get_launcher("k8s")
    with pytest.raises(HarnessError) as refused:
        launcher.submit(launcher.render(watched_spec(tmp_path)))
    message = str(refused.value)
    assert "\n" not in message and f"{NS}/{JOB} is left" in message and "harness cancel" in message
    assert (NS, JOB) in operator.jobs
    record = Handle.load(tmp_path / JOB).record()
    assert record["state"] == JobState.PENDING.value and "harness cancel" in record["failure"]


def failed_on_gpu_b(operator: FakeKubeAPI, tmp_path: Path, taint: bool = True) -> tuple[Path, dict]:
    """A job of two nodes on gpu-a and gpu-b (gpu-c spare), submitted with its watcher pod, whose attempt 0
    failed: rank 1 killed on gpu-b, rank 0 stopped. Returns the run folder as the watcher reads it, and the
    node agents."""
    from harness import preflight
    from tests.test_preflight import _report

    for node in ("gpu-a", "gpu-b", "gpu-c"):
        operator.add_node(node, taints=[])
        _report(tmp_path / JOB, node, 470)
    preflight.decide(tmp_path / JOB, ["gpu-a", "gpu-b", "gpu-c"], 2)
    launcher = get_launcher("k8s")
    launcher.submit(launcher.render(watched_spec(tmp_path, taint=taint)))
    host = {pod: operator.pods[(NS, pod)]["spec"]["nodeName"] for pod in ("rn-master-0", "rn-worker-0")}
    assert host == {"rn-master-0": "gpu-a", "rn-worker-0": "gpu-b"}
    out = tmp_path / "pvc" / Path(pod_arg(operator, "--out")).name
    agents = {pod: NodeAgent(out, pod_arg(operator, "--job-token"), pod, host[pod]) for pod in host}
    assert [agent.start() for agent in agents.values()] == [0, 0]
    code = agents["rn-worker-0"].end(Failure(INFRASTRUCTURE, "rank 1 killed by SIGKILL", 1, -9, "SIGKILL"))
    operator.exit_pod(NS, "rn-worker-0", code)
    code = agents["rn-master-0"].end(Failure(INFRASTRUCTURE, "rank 0 stopped by SIGTERM", 0, -15, "SIGTERM"))
    operator.exit_pod(NS, "rn-master-0", code)
    return out, agents


def kept_out(operator: FakeKubeAPI) -> list[list[str]]:
    """The nodes each replica's template keeps out (the watcher's patch)."""
    found = []
    for replica in operator.jobs[(NS, JOB)]["spec"]["pytorchReplicaSpecs"].values():
        terms = (((replica["template"]["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
        found.append([node for term in terms for field in term["matchFields"] for node in field["values"]])
    return found


@pytest.mark.parametrize("refused", [("nodes/status", "patch"), ("nodes", "patch"), ("nodes", "get")])
def test_a_node_the_watcher_may_not_mark_is_still_kept_out_and_the_refusal_said_once(operator, tmp_path, capsys,
                                                                                      refused):
    """A 403 on the Node (cluster-scoped: a cluster that grants the namespace but not the Nodes) must not block
    the exclusion: the job's templates are patched first and the pod moved; the refused condition or taint is
    said once, not at every poll, and never tried again for that decision."""
    from harness.launchers.kubernetes_blame import BLAME_ANNOTATION, BlamedNodeWatcher

    operator.refuse[("", *refused)] = 403
    out, _ = failed_on_gpu_b(operator, tmp_path)
    watch = BlamedNodeWatcher(NS, JOB, out, taint=True)
    for _ in range(3):
        assert watch() is JobState.RUNNING
    assert kept_out(operator) == [["gpu-b"], ["gpu-b"]]
    assert operator.pods[(NS, "rn-worker-0")]["spec"]["nodeName"] == "gpu-c"
    said = capsys.readouterr().out
    [refusal] = [line for line in said.splitlines() if "403" in line]
    assert refusal.startswith("harness watcher: gpu-b: Kubernetes refused to ") and "kept out of the job" in refusal
    assert "gpu-b: kept out of the job's next attempt" in said
    decided = json.loads(operator.jobs[(NS, JOB)]["metadata"]["annotations"][BLAME_ANNOTATION])
    assert decided["judged"] == [0] and list(decided["blamed"]) == ["gpu-b"]
    tries = [a for a in operator.authorized if a[:3] == ("", *refused)]
    assert len(tries) == 1, tries


def test_one_watcher_verdict_marks_at_most_its_share_of_the_jobs_nodes(operator, tmp_path, capsys):
    """Both nodes of the job fail with GPU hardware errors in one attempt: both are kept out (the exclusion is not
    capped), but one verdict marks at most max_marked_share of the job's nodes (at least one; preflight.marking),
    as preflight's decision does: above it no Node is conditioned or tainted, and the failure is said to be
    systemic. Found by the fault simulator ("k8s n=8 s=2 | gpu_xid@1.a0.r0.s5; gpu_xid@2.a0.r0.s5")."""
    from harness import preflight
    from harness.launchers.kubernetes_blame import BlamedNodeWatcher
    from tests.test_preflight import _report

    for node in ("gpu-a", "gpu-b", "gpu-c", "gpu-d"):
        operator.add_node(node, taints=[])
        _report(tmp_path / JOB, node, 470)
    preflight.decide(tmp_path / JOB, ["gpu-a", "gpu-b", "gpu-c", "gpu-d"], 2)
    launcher = get_launcher("k8s")
    launcher.submit(launcher.render(watched_spec(tmp_path, taint=True)))
    host = {pod: operator.pods[(NS, pod)]["spec"]["nodeName"] for pod in ("rn-master-0", "rn-worker-0")}
    out = tmp_path / "pvc" / Path(pod_arg(operator, "--out")).name
    agents = {pod: NodeAgent(out, pod_arg(operator, "--job-token"), pod, host[pod]) for pod in host}
    assert [agent.start() for agent in agents.values()] == [0, 0]
    for rank, pod in enumerate(host):
        code = agents[pod].end(Failure(INFRASTRUCTURE, f"rank {rank}: CUDA error: unspecified launch failure", rank,
                                       1))
        operator.exit_pod(NS, pod, code)
    watch = BlamedNodeWatcher(NS, JOB, out, taint=True, max_marked_share=0.1)
    watch()
    assert kept_out(operator) == [["gpu-a", "gpu-b"], ["gpu-a", "gpu-b"]]
    assert not any(t.get("key") == "mlperf-harness/preflight" for node in ("gpu-a", "gpu-b")
                   for t in operator.nodes[node]["spec"].get("taints") or [])
    assert "systemic failure: 2 of 2 node(s)" in capsys.readouterr().out


class CountedBackoff:
    """The backoff's waits, recorded instead of slept: tests count tries, never seconds."""

    def __init__(self):
        from harness.launchers.kubernetes_api import Backoff

        self.waits: list[float] = []
        self.backoff = Backoff(sleep=self.waits.append)


@pytest.fixture
def backoff(monkeypatch):
    from harness.launchers import kubernetes_api

    counted = CountedBackoff()
    monkeypatch.setattr(kubernetes_api, "BACKOFF", counted.backoff)
    return counted


def test_harness_runs_watch_waits_out_an_api_server_outage_and_says_it_once(operator, tmp_path, capsys, backoff):
    """The client raises urllib3's errors (MaxRetryError, ProtocolError), not OSErrors: `harness run`'s watch
    (the job's status, and the reader of what the watcher decided) waits the outage out with backoff, says
    once which server it cannot reach and once that it answers again, and never loses the watch."""
    launcher = get_launcher("k8s")
    spec = watched_spec(tmp_path)
    handle = launcher.submit(launcher.render(spec))
    reader = launcher.restart_watcher(spec, handle)
    operator.set_condition(NS, JOB, "Succeeded")
    operator.unreachable = 16  # a GET is 4 requests (urllib3's own 3 retries): several unanswered calls
    assert list(launcher.watch(handle, poll_s=0.01, tick=reader)) == [JobState.SUCCEEDED]
    assert operator.unreachable == 0 and len(backoff.waits) >= 2
    assert backoff.waits == sorted(backoff.waits) and backoff.waits[1] > backoff.waits[0]
    said = capsys.readouterr()
    lines = (said.out + said.err).splitlines()
    down = [line for line in lines if "cannot reach the Kubernetes API server at " + operator.url in line]
    up = [line for line in lines if "answers again" in line]
    assert len(down) == 1 and len(up) == 1 and "Traceback" not in said.err, lines


@pytest.mark.parametrize("after", range(11))
def test_the_watcher_waits_out_an_api_server_outage_at_any_call_and_keeps_the_node_out(operator, tmp_path, capsys,
                                                                                        backoff, after):
    """An outage that begins at any of the watcher's calls (the job's read, its patch, the pods' list and
    delete, the Node's condition and taint, the Events, the last annotation) is waited out: the decision is
    carried through once the server answers, said once, and the watcher never dies of it."""
    from harness.launchers.kubernetes_blame import BlamedNodeWatcher
    from harness.launchers.kubernetes_nodes import CONDITION, TAINT

    out, _ = failed_on_gpu_b(operator, tmp_path)
    watch = BlamedNodeWatcher(NS, JOB, out, taint=True)
    operator.outage_after, operator.unreachable = after, 6
    for _ in range(5):
        assert watch() in (JobState.RUNNING, JobState.UNKNOWN)
    assert operator.dropped == 6
    assert kept_out(operator) == [["gpu-b"], ["gpu-b"]]
    assert operator.pods[(NS, "rn-worker-0")]["spec"]["nodeName"] == "gpu-c"
    assert [t["key"] for t in operator.nodes["gpu-b"]["spec"]["taints"]] == [TAINT.key]
    assert {c["type"]: c["status"] for c in operator.nodes["gpu-b"]["status"]["conditions"]}[CONDITION] == "True"
    said = capsys.readouterr().out.splitlines()
    assert len([line for line in said if "cannot reach the Kubernetes API server at " + operator.url in line]) == 1
    assert len([line for line in said if "answers again" in line]) == 1, said
    assert not [line for line in said if "tried again at the next poll" in line], said


def test_the_watchers_rbac_grants_exactly_what_its_code_calls(operator, tmp_path):
    """The watcher runs through all it can do (a failed attempt judged: the job read and patched, the pod on
    the node listed and deleted, the Node conditioned and tainted, Events; then the job gone) against the fake
    API, which records what RBAC would check for each request. That set, the table in the code
    (kubernetes_blame.WATCHER_RULES) and the RBAC the harness renders for the watcher (and ships as
    manifests/rbac/watcher.yaml) are the same: nothing more, nothing less, and only Nodes cluster-wide."""
    import yaml

    from harness.launchers.kubernetes_blame import WATCHER_RULES, BlamedNodeWatcher
    from harness.launchers.kubernetes_rbac import rbac
    from harness.profiles import KubernetesSettings
    from tests.conftest import REPO
    from tests.fake_kube_api import granted

    out, _ = failed_on_gpu_b(operator, tmp_path, taint=True)
    before = len(operator.authorized)
    watch = BlamedNodeWatcher(NS, JOB, out, taint=True)
    assert watch() is JobState.RUNNING and kept_out(operator) == [["gpu-b"], ["gpu-b"]]
    assert watch() is JobState.RUNNING  # judged: reads only
    with operator.lock:
        del operator.jobs[(NS, JOB)]
    assert watch() is None
    used = set(operator.authorized[before:])
    in_namespace = {(g, r, v) for g, r, v, ns in used if ns == NS}
    cluster_wide = {(g, r, v) for g, r, v, ns in used if ns == ""}
    assert in_namespace | cluster_wide == {(g, r, v) for g, r, v, _ in used}  # nothing in another namespace

    table = {(scope, group, resource, verb) for (scope, group, resource), verbs in WATCHER_RULES.items()
             for verb in verbs}
    assert table == {("namespace", *a) for a in in_namespace} | {("cluster", *a) for a in cluster_wide}

    account = KubernetesSettings().watcher_service_account

    def watcher_rbac(namespace: str) -> list[dict]:  # the watcher's own documents, of all the harness's
        return [doc for doc in rbac(namespace) if doc["metadata"]["name"] in (account, f"{account}-{namespace}")]

    rendered = watcher_rbac(NS)
    assert [doc["kind"] for doc in rendered] == ["ServiceAccount", "Role", "RoleBinding", "ClusterRole",
                                                 "ClusterRoleBinding"]
    assert granted(rendered) == table
    assert {r for _, _, r, _ in granted([d for d in rendered if d["kind"] == "ClusterRole"])} <= {"nodes",
                                                                                                   "nodes/status"}
    for doc in rendered:
        if doc["kind"].endswith("Binding"):
            assert doc["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NS}]
            assert any(d["kind"] == doc["roleRef"]["kind"] and d["metadata"]["name"] == doc["roleRef"]["name"]
                       for d in rendered)
    shipped = [d for d in yaml.safe_load_all((REPO / "manifests" / "rbac" / "watcher.yaml").read_text()) if d]
    assert shipped == watcher_rbac("default")
    # The harness's own Role is not the watcher's: its ServiceAccount is bound to nothing else.
    assert account != "mlperf-harness"
    for path in (REPO / "manifests" / "rbac").glob("*.yaml"):
        if path.name != "watcher.yaml":
            for doc in yaml.safe_load_all(path.read_text()):
                assert account not in str(doc.get("subjects", "")), path
