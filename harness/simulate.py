"""`python -m harness.simulate SPEC`: a fault simulator that drives the real failure policy through a scenario.

A deterministic model (no processes, no sleeps, no network) of a job of N nodes x G ranks through its attempts,
on each backend's semantics:
- Slurm: a requeue per retried attempt (SLURM_RESTART_COUNT is the attempt), preflight judged again inside the
  allocation with --blame-failures, one srun step per run of the campaign (every step records the same attempt,
  and the run it was launched for: `launch`); a node agent that dies makes srun kill the step (SIGTERM to the
  others); --drain-bad-nodes drains, at most the cap per decision, and resumes a node the harness drained that
  passes again (against a model of scontrol's drains).
- Kubernetes (PyTorchJob, restartPolicy ExitCode): a pod that exits 128 or more is recreated from the job's
  template as it is then, begins the next attempt at once (harness.agent.next_attempt), and every pod still in
  the old one is stopped by NewerAttemptWatch; the watcher pod (kubernetes_blame.BlamedNodeWatcher, against an
  in-memory API: its own poll, kubernetes_blame.judge and _keep_out) judges each settled attempt, patches the
  template, deletes the pods on the blamed nodes, then marks them (a refused mark blocks nothing), waiting an API
  outage out with its backoff; `harness run`'s BlameReader reads what it decided. A later job's preflight (again=1)
  checks every node, the harness's tainted ones included, and untaints those that pass.
- local: one node, attempts restarted in the agent (--restart-here).

Each node writes the records the real agents write, with the real writers (harness.agent._append, end_record,
classify, signalled, NewerAttemptWatch.failure, workloads.common.run_record.RunRecord, the health report's
format), into a temporary folder, and the real code decides: harness.agent.decide (the restart budget),
harness.blame.culprits through harness.preflight.blamed_nodes (with the straggler judgement), preflight.decide/
judge (with the scenario's cap, max_marked_share), the watcher's decision, kubernetes_nodes.remediate and the
Slurm launcher's remediate. `check` then holds the outcome to the
invariants (INVARIANTS). A scenario is one line (Scenario.spec / parse), so a failing one replays:

    python -m harness.simulate "k8s n=4 s=1 budget=3 mark=1 | nic_flap@1.a0.r0.s5"

What it models of the health phase (harness.health.allreduce's pair phase, the deadlines of harness.health.__main__)
is written down in write_health, after the code it follows; the policy code it judges with is the real one.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from harness import agent, preflight
from harness.agent import (CONFIGURATION_REFUSAL, EXIT_RETRY, NewerAttemptWatch, attempt_failure, classify, decide,
                           end_record, newer_attempt, next_attempt, read_records, signalled)
from harness.health import FAIL, NODES_DIR, PASS, Check, equal
from harness.health.__main__ import phase_seconds
from harness.health.allreduce import pair_rounds
from harness.health.thresholds import resolve
from harness.launchers.kubernetes_api import Backoff
from harness.launchers.slurm import DRAIN_REASON as SLURM_DRAIN_REASON
from harness.profiles import PreflightSettings
from workloads.common.run_record import RunRecord, run_record_path

BACKENDS = ("slurm", "k8s", "local")
GPU = "NVIDIA H100 80GB HBM3"
STEPS = 30  # steps per run of the campaign
WINDOW = 5  # steps per straggler window
# Of the allocation: the most one decision may mark (issue 36, defect 10), at least one node: the profile's default
# (preflight.max_marked_share), which the scenario's `cap` overrides and preflight.decide is given.
CAP_SHARE = PreflightSettings().max_marked_share
MAX_POLLS = 4  # the watcher's polls of one settled attempt before the model calls its exclusion lost
HEALTHY_PAIR_GBPS, SLOW_SCORE = 46.0, 0.5
_THRESHOLDS = resolve({}, GPU)  # the health checks' thresholds for the model's GPU (the profile's defaults)
START_ALLOWANCE_S = PreflightSettings().start_allowance_s  # the scheduler's limit beyond deadline_s
LOCAL_CHECKS_S = 60  # a node's own checks, before its between-node phase
ROUND_S = 10  # one pair round (an all-reduce of pair_mib, a few seconds), or the whole-set all-reduce


@dataclass(frozen=True)
class FaultKind:
    name: str
    what: str  # the fault, in words
    node_fault: bool  # the node itself is at fault (the invariants may blame it)
    told: bool  # its node can be told within one attempt (lost, GPU hardware)
    program: bool  # the job's own error: blames no node
    blamed: str  # who the policy should blame
    next: str  # what should happen next


FAULTS = {f.name: f for f in [
    FaultKind("lost", "a node lost (its agent dies, no end record)", True, True, False,
              "the lost node", "retried without it (Kubernetes: its pod elsewhere; Slurm: requeued, kept out)"),
    FaultKind("gpu_xid", "a GPU hardware error under the program (Xid 13/31/48, a dead launch)", True, True, False,
              "that GPU's node", "retried without it; its marks are removed when it passes preflight again"),
    FaultKind("gpu_offbus", "a GPU fallen off the bus (Xid 79), which stays off", True, True, False,
              "that GPU's node", "retried without it; preflight fails it (gpu_count) until it is repaired"),
    FaultKind("nic_flap", "a NIC flap that times out NCCL on every peer", True, False, False,
              "no node (every rank ends as a victim)", "retried; the next preflight tests the links"),
    FaultKind("oom", "CUDA out of memory in a rank (at the same step every attempt)", False, False, True,
              "no node (the job's own)", "the job stops with the setting to lower"),
    FaultKind("workload", "an exception in the training code", False, False, True,
              "no node", "the job stops (a restart would repeat it)"),
    FaultKind("config", "a configuration error (the same on every node and attempt)", False, False, True,
              "no node", "the job stops at once"),
    FaultKind("slow", "a slow rank (steady, or from a step mid-run)", True, False, False,
              "its node, once slow 3 straggler windows in a row", "kept out of the next attempt if one fails"),
    FaultKind("stale_nfs", "a stale NFS handle (a file server failing over)", True, False, False,
              "no node (the first reader is not its cause)", "retried; the same failure 3 times stops the job"),
    FaultKind("api_down", "the Kubernetes API server unreachable for a while", False, False, False,
              "no node", "the watch and the watcher say what is unreachable and go on"),
    FaultKind("node_403", "a 403 on Nodes for the watcher (no cluster-wide node patch)", False, False, False,
              "no node", "the exclusion still reaches the job; the refused mark is said once"),
    FaultKind("health0_absent", "the rank-0 health node never starts (image pull, device plugin)", True, True, False,
              "that node only (health_report missing)",
              "the others, which could not reach its store (store_unreachable), are excused"),
    FaultKind("pair_absent", "a pair partner absent (its node never joins the pair phase)", True, True, False,
              "that node only", "its partners name it absent, leave it out of their medians, and pass"),
]}
RECURRING = {"oom", "workload", "config"}  # the job's own: at the same step of every attempt from the first
HEALTH = {"health0_absent", "pair_absent"}  # faults of a preflight pass (the one before attempt `attempt`)
CLUSTER = {"api_down", "node_403"}  # faults of the Kubernetes API, not of a node


@dataclass(frozen=True)
class Fault:
    kind: str
    node: int | None = None
    attempt: int = 0
    run: int = 0
    step: int = 5

    def spec(self) -> str:
        where = "" if self.node is None else f"@{self.node}"
        return f"{self.kind}{where}.a{self.attempt}.r{self.run}.s{self.step}"

    @classmethod
    def parse(cls, text: str) -> "Fault":
        head, *parts = text.strip().split(".")
        kind, _, node = head.partition("@")
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}: one of {', '.join(FAULTS)}")
        values = {{"a": "attempt", "r": "run", "s": "step"}[p[0]]: int(p[1:]) for p in parts}
        return cls(kind, int(node) if node else None, **values)


@dataclass(frozen=True)
class Scenario:
    backend: str = "k8s"
    nodes: int = 4  # training nodes
    spares: int = 1  # preflight's spare nodes (Kubernetes: free nodes of the cluster; Slurm: in the allocation)
    gpus: int = 2
    runs: int = 1
    budget: int = 3
    mark: bool = True  # --taint-bad-nodes / --drain-bad-nodes
    again: bool = False  # a second job's preflight on the same cluster after this one (a marked node checked again)
    cap_share: float = CAP_SHARE
    skew: tuple[int, ...] = ()  # each cluster node's clock offset in seconds (missing: 0)
    pull: tuple[int, ...] = ()  # Kubernetes: each node's image pull before its health process starts, seconds
    faults: tuple[Fault, ...] = ()

    def spec(self) -> str:
        words = [self.backend, f"n={self.nodes}", f"s={self.spares}", f"g={self.gpus}", f"runs={self.runs}",
                 f"budget={self.budget}", f"mark={int(self.mark)}", f"again={int(self.again)}"]
        if self.cap_share != CAP_SHARE:
            words.append(f"cap={self.cap_share:g}")
        if any(self.skew):
            words.append("skew=" + ",".join(map(str, self.skew)))
        if any(self.pull):
            words.append("pull=" + ",".join(map(str, self.pull)))
        return " ".join(words) + " | " + "; ".join(f.spec() for f in self.faults)

    @classmethod
    def parse(cls, text: str) -> "Scenario":
        head, _, tail = text.partition("|")
        backend, *words = head.split()
        keys = {"n": "nodes", "s": "spares", "g": "gpus", "runs": "runs", "budget": "budget", "mark": "mark",
                "again": "again", "cap": "cap_share", "skew": "skew", "pull": "pull"}
        values: dict = {}
        for word in words:
            key, _, value = word.partition("=")
            name = keys[key]
            if name in ("skew", "pull"):
                values[name] = tuple(int(v) for v in value.split(","))
            elif name in ("mark", "again"):
                values[name] = value not in ("0", "false", "")
            elif name == "cap_share":
                values[name] = float(value)
            else:
                values[name] = int(value)
        faults = tuple(Fault.parse(f) for f in tail.split(";") if f.strip())
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: one of {', '.join(BACKENDS)}")
        return cls(backend, faults=faults, **values)

    @property
    def cluster(self) -> list[str]:
        """Every node the job may land on: the local machine, or the allocation plus two free nodes."""
        return ["local"] if self.backend == "local" else [f"n{i}" for i in range(self.nodes + self.spares + 2)]

    @property
    def cap(self) -> int:
        return max(1, int(self.cap_share * (self.nodes + self.spares)))


@dataclass
class Outcome:
    exit_code: int | None = None
    attempts: int = 0  # attempts begun
    blamed: dict[int, dict[str, str]] = field(default_factory=dict)  # attempt -> {node: cause}, as decided
    excluded: dict[int, set[str]] = field(default_factory=dict)  # attempt -> nodes kept out of the next
    marks: list[set[str]] = field(default_factory=list)  # each decision's nodes drained / tainted / conditioned
    marked: set[str] = field(default_factory=set)  # marked at the end
    unchecked: set[str] = field(default_factory=set)  # marked nodes the second preflight could not check
    health: list[set[str]] = field(default_factory=list)  # each preflight pass's nodes kept out
    moved: dict[int, str] = field(default_factory=dict)  # attempt -> node whose pod the watcher moved in it
    fired: dict[int, set[str]] = field(default_factory=dict)  # attempt -> fault kinds that fired in it
    fired_faults: set = field(default_factory=set)  # the Faults that fired
    failed: set[int] = field(default_factory=set)  # attempts that failed
    traceback: str | None = None
    log: list[str] = field(default_factory=list)


class _Traceback(Exception):
    pass


def _real(outcome: Outcome, fn, *args, **kwargs):
    """Call the harness's own code; an exception from it ends the scenario as a traceback."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - that is what is being looked for
        outcome.traceback = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        raise _Traceback from exc


# --- the records --------------------------------------------------------------------------------------------------

class Records:
    """The run folder the agents share, written with the agents' own writers."""

    def __init__(self, scenario: Scenario, out: Path):
        self.scenario, self.out = scenario, out
        self.skew = {n: (scenario.skew[i] if i < len(scenario.skew) else 0) for i, n in enumerate(scenario.cluster)}
        self.written = lambda: None  # told after each record (simulate's cache of read_attempts)

    def time(self, host: str, attempt: int, run: int, step: float) -> float:
        return 1.0e9 + attempt * 10_000 + run * 1_000 + step + self.skew.get(host, 0)

    def identity(self, node: str, host: str | None, run: int) -> dict:
        """A start record's identity, as harness.agent._attempts writes it: the node, the host under a pod, and on
        Slurm the run its step was launched for (--launch: every run's step shares the attempt)."""
        return {"node": node, **({"host": host} if host else {}),
                **({"launch": run} if self.scenario.backend == "slurm" else {})}

    def start(self, node: str, host: str | None, attempt: int, run: int) -> None:
        agent._append(self.out, node, {"event": "start", "attempt": attempt, **self.identity(node, host, run),
                                       "time": self.time(host or node, attempt, run, 0)})
        self.written()

    def end(self, node: str, host: str | None, attempt: int, run: int, step: float, failure) -> None:
        """The agent's own end record (harness.agent.end_record): `stopped_by` where NewerAttemptWatch ended it."""
        agent._append(self.out, node, end_record(attempt, self.identity(node, host, run), failure,
                                                 run if failure else None, int(step) if failure else None,
                                                 now=self.time(host or node, attempt, run, step)))
        self.written()


def worker_failure(kind: str, rank: int, attempt: int, step: int):
    """What a rank's error file holds for a fault, classified as harness.agent classifies it."""
    if kind == "gpu_xid":
        return classify(rank, 1, None, "RuntimeError: CUDA error: unspecified launch failure", True)
    if kind == "gpu_offbus":
        return classify(rank, 1, None, "RuntimeError: CUDA error: GPU has fallen off the bus (Xid 79)", True)
    if kind == "nic_flap":  # NCCL's watchdog aborts the rank whose collective timed out
        return classify(rank, -6, "SIGABRT", "", False)
    if kind == "peer":  # a peer's collective timed out with it
        return classify(rank, 1, None, "torch.distributed.DistBackendError: NCCL communicator was aborted: "
                                       "Watchdog caught collective operation timeout", True)
    if kind == "oom":  # the free memory it quotes differs at every attempt
        return classify(rank, 1, None, f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                                       f"GPU 0 has a total capacity of 79.10 GiB of which {311 + 7 * attempt} MiB "
                                       "is free.", True)
    if kind == "workload":
        return classify(rank, 1, None, f"ValueError: the loss is nan at step {step}", True)
    if kind == "config":
        reason = "the preset 'full' needs its dataset under /data/imagenet"
        return classify(rank, 1, None, f"ConfigurationError: {reason}", True,
                        f"Traceback (most recent call last):\n  ...\n{CONFIGURATION_REFUSAL}{reason}")
    if kind == "stale_nfs":
        return classify(rank, 1, None, "OSError: [Errno 116] Stale file handle: '/data/shard-00017'", True)
    raise ValueError(kind)


def sigterm():
    return signalled(SimpleNamespace(sigval=signal.SIGTERM))


# --- the health phase ---------------------------------------------------------------------------------------------

def write_health(out: Path, scenario: Scenario, allocated: list[str], broken: set[str], preflight_pass: int) -> None:
    """Each allocated node's report as harness.health.__main__ leaves it with today's pair phase
    (harness.health.allreduce.between_nodes and pair_rank):
    - rank 0's health process never starting (health0_absent): it writes no report, and every other node, which
      cannot reach its store, reports `store_unreachable` with its `rank` and no pair (between_nodes);
    - a node that never joins the pair phase (pair_absent: its health process wrote its own checks, then never set
      its name in the store): no `pairs` in its report; each partner, after waiting for it, records the pair as
      `{"peer": "node #k", "absent": true, ...}` and goes on to its next round (pair_rank);
    - a GPU off the bus: its node joins, the pair rank of the missing GPU fails at once (`pair_failures`), and each
      partner's pair with it ends after the operation timeout (NCCL's non-blocking init, group_arguments) as a
      measured 0 with an error, in that partner's median (preflight.pair_checks); the whole-set all-reduce of every
      node misses a rank;
    - each node's between-node phase gets its own deadline from its start, capped by the scheduler's end
      (harness.health.__main__.phase_seconds; the scheduler's limit is deadline_s + start_allowance_s, counted
      from before the image pull), and the pairs it finished are in its report as they finish (progress)."""
    faults = [f for f in scenario.faults if f.kind in HEALTH and f.attempt == preflight_pass]
    absent = {allocated[0]} if any(f.kind == "health0_absent" for f in faults) else set()
    never_joined = {scenario.cluster[f.node] for f in faults if f.kind == "pair_absent" and f.node is not None}
    th = _THRESHOLDS
    nodes_dir = out / NODES_DIR
    nodes_dir.mkdir(parents=True, exist_ok=True)
    schedule = pair_rounds(len(allocated), th["pair_rounds"])
    pull = {n: (scenario.pull[i] if i < len(scenario.pull) else 0) for i, n in enumerate(scenario.cluster)}
    kill_at = th["deadline_s"] + START_ALLOWANCE_S  # the scheduler's end, from before the image pull
    for node in allocated:  # a pull past the scheduler's whole limit: the node never runs its checks
        if pull[node] + LOCAL_CHECKS_S >= kill_at:
            absent.add(node)
    joined = [n for n in allocated if n not in absent | never_joined]
    lost_rank = scenario.gpus - 1  # the GPU off the bus: CUDA renumbers the rest, the last ordinal is missing
    store_down = allocated[0] in absent
    for index, node in enumerate(allocated):
        if node in absent:
            continue
        count = scenario.gpus - (1 if node in broken else 0)
        record = {"node": node, "started": 1.0e9 + preflight_pass, "gpu": GPU, "thresholds": th,
                  "checks": [equal("gpu_count", count, scenario.gpus).to_dict(),
                             Check("xid_events", FAIL if node in broken else PASS, "79" if node in broken else "none",
                                   "none during the checks").to_dict()]}
        if len(allocated) > 1 and node not in never_joined:
            if store_down:  # between_nodes: the store could not be reached, said and not raised
                record.update(rank=index, pair_ranks=scenario.gpus, pairs=[], pair_failures={}, world_busbw_gbps=None,
                              store_unreachable="could not reach the pair phase's store at n0:29501 (rank 0's node): "
                                                "DistNetworkError: failed to connect")
            else:
                left = phase_seconds(th["deadline_s"], LOCAL_CHECKS_S, pull[node] + LOCAL_CHECKS_S, kill_at)
                done_rounds = max(0, int(left // ROUND_S))  # the rounds it finishes before its own deadline
                pairs, failures = [], {}
                for local in range(scenario.gpus):
                    if node in broken and local == lost_rank:
                        failures[str(local)] = "CUDA error: invalid device ordinal"
                        continue
                    for number, round_pairs in enumerate(schedule[:done_rounds]):
                        pair = next((p for p in round_pairs if index in p), None)
                        if pair is None:
                            continue
                        k = pair[1] if pair[0] == index else pair[0]
                        peer = allocated[k]
                        if peer not in joined:
                            pairs.append({"peer": f"node #{k}", "busbw_gbps": 0.0, "absent": True,
                                          "error": f"never joined the pair phase (rank {k})", "gpu": local})
                        elif peer in broken and local == lost_rank:
                            pairs.append({"peer": peer, "busbw_gbps": 0.0, "gpu": local,
                                          "error": "NCCL communicator initialization timed out"})
                        else:
                            pairs.append({"peer": peer, "busbw_gbps": HEALTHY_PAIR_GBPS, "gpu": local})
                whole = (len(joined) == len(allocated) and not broken & set(allocated)
                         and done_rounds > len(schedule))
                record.update(rank=index, pair_ranks=scenario.gpus, pairs=pairs, pair_failures=failures,
                              world_busbw_gbps=HEALTHY_PAIR_GBPS if whole else None)
        record["seconds"] = 60.0
        (nodes_dir / f"{node}.json").write_text(json.dumps(record) + "\n")


# --- the Kubernetes API the watcher talks to ----------------------------------------------------------------------

class FakeApi:
    """The API calls kubernetes_blame and kubernetes_nodes make, in memory. `down` polls: unreachable (urllib3's
    MaxRetryError, as the client raises it); `forbid_nodes`: 403 on Node patches (the watcher's ServiceAccount)."""

    def __init__(self, job: dict, pods: dict[str, str], nodes: dict[str, dict]):
        self.job, self.pods, self.nodes = job, pods, nodes
        self.down, self.forbid_nodes, self.deleted, self.events = 0, False, [], []

    def _reach(self):
        if self.down:  # each request dropped while the server is down brings its answer nearer
            self.down -= 1
            from urllib3.exceptions import MaxRetryError, NewConnectionError
            raise MaxRetryError(None, "/apis/kubeflow.org/v1", NewConnectionError(None, "Connection refused"))

    def _forbidden(self, what: str):
        from kubernetes import client as k8s
        if self.forbid_nodes:
            raise k8s.ApiException(status=403, reason=f"Forbidden: cannot {what} nodes")

    # CustomObjectsApi
    def get_namespaced_custom_object(self, *args):
        self._reach()
        return json.loads(json.dumps(self.job))

    def patch_namespaced_custom_object(self, *args):
        self._reach()
        patch = args[-1]
        meta = patch.get("metadata", {})
        self.job["metadata"].setdefault("annotations", {}).update(meta.get("annotations", {}))
        for replica, spec in patch.get("spec", {}).get("pytorchReplicaSpecs", {}).items():
            self.job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"].update(spec["template"]["spec"])

    # CoreV1Api
    def patch_node_status(self, node, body):
        self._reach()
        self._forbidden("patch the status of")
        conditions = self.nodes[node].setdefault("conditions", {})
        for c in body["status"]["conditions"]:
            conditions[c["type"]] = c["status"]

    def read_node(self, node):
        self._reach()
        self._forbidden("read")
        from kubernetes import client as k8s
        taints = [k8s.V1Taint(**t, local_vars_configuration=_k8s_configuration())
                  for t in self.nodes[node].get("taints", [])]
        return SimpleNamespace(spec=SimpleNamespace(taints=taints), metadata=SimpleNamespace(resource_version="1"))

    def patch_node(self, node, body):
        self._reach()
        self._forbidden("patch")
        self.nodes[node]["taints"] = [{k: v for k, v in t.items() if k in ("key", "value", "effect")}
                                      for t in body["spec"]["taints"]]

    def create_namespaced_event(self, namespace, event):
        self._reach()
        self.events.append(event)

    def list_namespaced_pod(self, namespace, label_selector=""):
        self._reach()
        return SimpleNamespace(items=[SimpleNamespace(spec=SimpleNamespace(node_name=host),
                                                      metadata=SimpleNamespace(name=pod))
                                      for pod, host in self.pods.items()])

    def delete_namespaced_pod(self, name, namespace):
        self._reach()
        self.deleted.append(name)


def _k8s_configuration():
    """One client Configuration for the models the fake API builds (each model makes its own otherwise)."""
    if not _CONFIGURATION:
        from kubernetes import client as k8s
        _CONFIGURATION.append(k8s.Configuration())
    return _CONFIGURATION[0]


_CONFIGURATION: list = []


def _marked(nodes: dict[str, dict]) -> set[str]:
    from harness.launchers.kubernetes_nodes import CONDITION, TAINT
    return {n for n, v in nodes.items() if v.get("conditions", {}).get(CONDITION) == "True"
            or any(t["key"] == TAINT.key for t in v.get("taints", []))}


_TOLERATED: list[bool] = []


def health_job_tolerates_taint() -> bool:
    """Whether the health job `harness run` renders (kubernetes launcher, real) tolerates the harness's own taint:
    a node it tainted can only pass again if the health job may land on it."""
    if not _TOLERATED:
        from harness import profiles
        from harness.launchers import get_launcher
        from harness.launchers.kubernetes_nodes import TAINT
        from harness.spec import JobSpec
        spec = JobSpec("resnet", nodes=2, name="sim", out_dir=Path(tempfile.gettempdir()) / "harness-sim",
                       profile=profiles.load("h100-ib"), max_restarts=1, preflight=True, spare_nodes=1,
                       taint_bad_nodes=True).resolved()
        body = get_launcher("k8s").render_preflight(spec).payload["body"]
        tolerations = [t for r in body["spec"]["pytorchReplicaSpecs"].values()
                       for t in r["template"]["spec"].get("tolerations") or []]
        _TOLERATED.append(any(t.get("key") == TAINT.key or t.get("operator") == "Exists" and not t.get("key")
                              for t in tolerations))
    return _TOLERATED[0]


# --- the backends -------------------------------------------------------------------------------------------------

class Job:
    """What every backend shares: the run folder, the faults, and where a fault fires."""

    def __init__(self, scenario: Scenario, out: Path):
        self.s, self.out, self.o = scenario, out, Outcome()
        self.rec = Records(scenario, out)
        self.lost_now: set[str] = set()  # nodes down at the moment (a lost node comes back after its attempt)
        self.offbus: set[str] = set()  # nodes with a GPU off the bus, for good
        self.finished_runs: set[int] = set()

    def first_faults(self, attempt: int, run: int, hosts: list[str]) -> list[Fault]:
        """The faults that end this run of this attempt first (those at the earliest step, together), on the nodes
        it runs on."""
        live = []
        for f in self.s.faults:
            if f.kind in HEALTH | CLUSTER or f.kind == "slow":
                continue
            if f.run != run or (f.attempt != attempt and not (f.kind in RECURRING and attempt >= f.attempt)):
                continue
            if f.kind not in RECURRING and self.s.cluster[f.node % len(self.s.cluster)] not in hosts:
                continue
            live.append(f)
        # A refused command never starts: its refusal comes before any step, and nothing else fires in that run.
        when = lambda f: -1 if f.kind == "config" else f.step  # noqa: E731
        first = min(map(when, live), default=None)
        return sorted((f for f in live if when(f) == first), key=Fault.spec)

    def host_of(self, f: Fault, hosts: list[str]) -> str:
        """The node a fault is on: its own, or (the job's own errors) the node holding that rank."""
        if f.kind in RECURRING:
            return hosts[(f.node or 0) % len(hosts)]
        return self.s.cluster[f.node % len(self.s.cluster)]

    def write_stragglers(self, attempt: int, run: int, names: list[str], upto: int) -> None:
        """Rank 0's straggler windows of this run up to step `upto` (RunRecord, scored as the workloads score)."""
        slow = [f for f in self.s.faults if f.kind == "slow" and f.attempt <= attempt]
        nodes = [self.s.cluster[f.node % len(self.s.cluster)] for f in slow]
        if not any(n in map(self.host, names) for n in nodes):
            return
        from workloads.common.stragglers import THRESHOLD, score
        record = RunRecord(run_record_path(self.out, run), attempt)
        ranks = [(name, g) for name in names for g in range(self.s.gpus)]
        for end in range(WINDOW, upto + 1, WINDOW):
            means = [1.0 / SLOW_SCORE if any(n == self.host(name) and (f.run < run or f.step <= end - WINDOW)
                                            and g == 0 for f, n in zip(slow, nodes)) else 1.0 for name, g in ranks]
            scores = score(means)
            t = self.rec.time(names[0], attempt, run, end)
            record.interval("stragglers", t, t, (end, end), {
                "scores": scores, "threshold": THRESHOLD,
                "stragglers": [{"rank": r, "node": ranks[r][0], "score": s} for r, s in enumerate(scores)
                               if s < THRESHOLD]})

    def host(self, name: str) -> str:
        return name

    @staticmethod
    def blamed_in(record: dict) -> dict[str, str]:
        """The nodes preflight kept out for the last attempt's failure (its training_failure check)."""
        return {n: c["measured"] for n, v in record["nodes"].items() for c in v["checks"]
                if c["name"] == "training_failure" and c["verdict"] == FAIL}

    def fire(self, attempt: int, fault: Fault) -> None:
        self.o.fired.setdefault(attempt, set()).add(fault.kind)
        self.o.fired_faults.add(fault)


class SlurmJob(Job):
    """One batch job: preflight in the allocation, a step per run, the decide step, a requeue per retry."""

    def play(self) -> None:
        from harness.launchers.slurm import SlurmLauncher
        spare = [n for n in self.s.cluster]
        drained: dict[str, str] = {}  # node -> its drain reason (scontrol's view)
        for attempt in range(self.s.budget + 1):
            allocated = [n for n in spare if n not in drained][:self.s.nodes + self.s.spares]  # Slurm skips drains
            write_health(self.out, self.s, allocated, self.offbus, attempt)
            record = _real(self.o, preflight.decide, self.out, allocated, self.s.nodes,
                           blame_failures=bool(self.s.budget) and attempt > 0, seconds=0.0,
                           max_marked_share=self.s.cap_share)
            self.o.health.append(set(record["excluded"]) - set(self.blamed_in(record)))
            if attempt > 0:
                self.o.excluded[attempt - 1] = set(record["excluded"])
                self.o.blamed[attempt - 1] = self.blamed_in(record)
            if self.s.mark:
                before = set(drained)
                with mock.patch("harness.launchers.slurm._run", self.scontrol(drained)):
                    _real(self.o, SlurmLauncher().remediate, SimpleNamespace(drain_bad_nodes=True), record)
                self.o.marks.append(set(drained) - before)
            self.o.marked = {n for n, why in drained.items() if why.startswith(SLURM_DRAIN_REASON)}
            if not record["passed"]:
                self.o.exit_code = preflight.EXIT_PREFLIGHT
                return
            kept = record["kept"]
            self.o.attempts = attempt + 1
            status = 0
            for run in range(self.s.runs):
                if run in self.finished_runs:
                    continue
                faults = self.first_faults(attempt, run, kept)
                for node in kept:
                    self.rec.start(node, None, attempt, run)
                self.write_stragglers(attempt, run, kept, faults[0].step if faults else STEPS)
                if not faults:
                    for node in kept:
                        self.rec.end(node, None, attempt, run, STEPS, None)
                    self.finished_runs.add(run)
                    continue
                culprits = {}
                for f in faults:
                    self.fire(attempt, f)
                    culprits.setdefault(self.host_of(f, kept), f)
                kinds, step = {f.kind for f in faults}, faults[0].step
                status = 1
                for node in kept:
                    rank = kept.index(node) * self.s.gpus
                    mine = culprits.get(node)
                    if mine and mine.kind == "lost":
                        continue  # its agent died with it: srun kills the step
                    if "config" in kinds:
                        failure = worker_failure("config", rank, attempt, 0)
                    elif mine:
                        failure = worker_failure(mine.kind, rank, attempt, step)
                    elif "nic_flap" in kinds:
                        failure = worker_failure("peer", rank, attempt, step)
                    else:
                        failure = sigterm()  # srun --kill-on-bad-exit ends the step's other tasks
                    later = 0 if mine or kinds & {"nic_flap", "config"} else 2
                    self.rec.end(node, None, attempt, run, step + later, failure)
                self.offbus |= {n for n, f in culprits.items() if f.kind == "gpu_offbus"}
                break
            records = read_records(self.out)
            decision = _real(self.o, decide, records, attempt, self.s.budget)
            if status:
                self.o.failed.add(attempt)
            if not decision.retry:
                self.o.exit_code = decision.exit_code or status
                if decision.exit_code == 0 and status:
                    self.o.exit_code = status
                return
        self.o.exit_code = agent.EXIT_BUDGET_SPENT

    @staticmethod
    def scontrol(drained: dict[str, str]):
        """slurm._run as the remediation calls it, against the cluster's drains: `scontrol show node` (State and
        Reason), `update ... State=DRAIN Reason=...` and `update ... State=RESUME`."""
        def run(argv: list[str]):
            if argv[1:3] == ["show", "node"]:
                node = argv[3]
                state = "IDLE+DRAIN" if node in drained else "IDLE"
                reason = f" Reason={drained[node]} [slurm@2026-01-01T00:00:00]" if node in drained else ""
                return SimpleNamespace(returncode=0, stdout=f"NodeName={node} State={state}\n  {reason}\n",
                                       stderr="")
            words = dict(w.split("=", 1) for w in argv[2:])
            if words.get("State") == "DRAIN":
                drained[words["NodeName"]] = words["Reason"]
            elif words.get("State") == "RESUME":
                drained.pop(words["NodeName"], None)
            return SimpleNamespace(returncode=0, stdout="", stderr="")
        return run


class KubernetesJob(Job):
    """A PyTorchJob (restartPolicy ExitCode), its pods, NewerAttemptWatch, and the watcher pod."""

    def play(self) -> None:
        from harness.launchers import kubernetes_blame, kubernetes_nodes
        nodes = {n: {} for n in self.s.cluster}
        self.nodes = nodes
        user = FakeApi({}, {}, nodes)  # `harness run`'s own credentials: Nodes may be patched
        ref = SimpleNamespace(namespace="mlperf", name="sim", api_version="kubeflow.org/v1", kind="PyTorchJob",
                              uid="u")
        free = [n for n in self.s.cluster][:self.s.nodes + self.s.spares]
        write_health(self.out, self.s, free, self.offbus, 0)
        record = _real(self.o, preflight.decide, self.out, free, self.s.nodes, seconds=0.0,
                       max_marked_share=self.s.cap_share)
        self.o.health.append(set(record["excluded"]))
        before = _marked(nodes)
        _real(self.o, kubernetes_nodes.remediate, user, record, ref, self.s.mark)
        self.o.marks.append(_marked(nodes) - before)
        if not record["passed"]:
            self.o.exit_code = preflight.EXIT_PREFLIGHT
            return self.second_preflight(user, ref)
        affinity = kubernetes_nodes.with_exclusions({}, sorted(record["excluded"])).get("affinity", {})
        job = {"metadata": {"name": "sim", "namespace": "mlperf", "uid": "u", "annotations": {}},
               "spec": {"pytorchReplicaSpecs": {
                   "Master": {"template": {"spec": {"affinity": json.loads(json.dumps(affinity))}}},
                   "Worker": {"template": {"spec": {"affinity": json.loads(json.dumps(affinity))}}}}},
               "status": {"conditions": [{"type": "Running", "status": "True"}]}}
        pods = {f"sim-pod-{i}": host for i, host in enumerate(record["kept"])}
        api = FakeApi(job, pods, nodes)
        api.forbid_nodes = any(f.kind == "node_403" for f in self.s.faults)
        watching = self.s.budget > 0
        spec = SimpleNamespace(out_dir=self.out)
        with mock.patch.object(kubernetes_blame, "clients", lambda: (api, api)), \
                contextlib.redirect_stdout(_Lines(self.o.log)):
            # An outage is waited out with the watcher's backoff; its waits pass no time here (the fake API counts
            # the requests it drops instead).
            watcher = kubernetes_blame.BlamedNodeWatcher("mlperf", "sim", self.out, taint=self.s.mark,
                                                         backoff=Backoff(sleep=lambda seconds: None),
                                                         max_marked_share=self.s.cap_share)
            reader = _real(self.o, kubernetes_blame.BlameReader, spec, SimpleNamespace(job_id="mlperf/sim")) \
                if watching else None
            self.train(api, pods, watcher if watching else None, reader)
        self.o.marked = _marked(nodes)
        self.second_preflight(user, ref)

    def schedulable(self, api: FakeApi, pods: dict[str, str]) -> list[str]:
        from harness.launchers.kubernetes_blame import excluded_nodes
        from harness.launchers.kubernetes_nodes import TAINT
        kept_out = excluded_nodes(api.job)
        return [n for n in self.s.cluster if n not in kept_out and n not in self.lost_now
                and n not in pods.values() and not any(t["key"] == TAINT.key for t in self.nodes[n].get("taints", []))]

    def train(self, api: FakeApi, pods: dict[str, str], watcher, reader) -> None:
        names = sorted(pods)
        for name in names:
            self.rec.start(name, pods[name], 0, 0)
        attempt, moved = 0, None
        while True:
            if attempt > self.s.budget:
                self.o.exit_code = agent.EXIT_BUDGET_SPENT
                return
            self.o.attempts = attempt + 1
            hosts = [pods[n] for n in names]
            faults: list[Fault] = []
            for run in range(self.s.runs):
                faults = self.first_faults(attempt, run, hosts)
                if moved is not None:  # the watcher deleted this pod: SIGTERM, 143, recreated from the template
                    faults = [Fault("moved", names.index(moved), attempt, run, 1)]
                self.write_stragglers_k8s(attempt, run, names, pods, faults[0].step if faults else STEPS)
                if faults:
                    break
            if not faults:
                for name in names:
                    self.rec.end(name, pods[name], attempt, self.s.runs - 1, STEPS, None)
                self.o.exit_code = 0
                return
            self.o.failed.add(attempt)
            culprits: dict[str, Fault] = {}
            for f in faults:
                if f.kind == "moved":
                    self.o.moved[attempt] = pods[moved]
                    culprits[moved] = f
                else:
                    self.fire(attempt, f)
                    culprits.setdefault(next(n for n in names if pods[n] == self.host_of(f, hosts)), f)
            self.offbus |= {pods[n] for n, f in culprits.items() if f.kind == "gpu_offbus"}
            codes = self.end_attempt(api, pods, names, culprits, attempt)
            moved = None
            stop = [c for c in codes.values() if c not in (EXIT_RETRY, 143)]
            if stop:
                self.o.exit_code = stop[0]
                self.judge(api, watcher, reader, attempt)
                return
            self.lost_now.clear()
            deleted = self.judge(api, watcher, reader, attempt)
            if self.o.traceback:
                return
            if deleted:
                moved = deleted[0]
            if any(pods[n] is None for n in names):
                self.o.log.append("a pod is Pending: no free node (the job waits)")
                return
            attempt += 1

    def end_attempt(self, api: FakeApi, pods: dict, names: list[str], culprits: dict[str, Fault],
                    attempt: int) -> dict[str, int]:
        """Every pod's end of a failed attempt, as its agent records it, and its exit code. The culprits' pods end
        first (a lost node's never does); a pod recreated for the next attempt stops the others' attempt
        (NewerAttemptWatch); a job that failed for good has its pods deleted (SIGTERM)."""
        codes: dict[str, int] = {}
        newer = False
        kinds = {f.kind for f in culprits.values()}
        first = next(iter(culprits.values()))
        run, step = first.run, first.step
        for name in list(culprits) + [n for n in names if n not in culprits]:
            rank, host, mine = names.index(name) * self.s.gpus, pods[name], culprits.get(name)
            cancelled = False
            if mine and mine.kind == "lost":
                self.lost_now.add(host)  # its node is down: the operator recreates the pod once it is evicted
                codes[name] = EXIT_RETRY
                continue
            if mine and mine.kind == "moved":
                failure, late, cancelled = sigterm(), 0, True
            elif "config" in kinds:
                failure, late = worker_failure("config", rank, attempt, 0), 0
            elif mine:
                failure, late = worker_failure(mine.kind, rank, attempt, step), 0
            elif newer:  # NewerAttemptWatch saw a recreated pod begin the next attempt
                watch = NewerAttemptWatch(self.out, attempt)
                watch.newer = newer_attempt(read_records(self.out), attempt)
                failure, late = watch.failure(), 5
            elif "lost" in kinds:  # NCCL gives up on the lost peer
                failure, late = worker_failure("peer", rank, attempt, step), 1
            else:  # the job failed for good (a workload or configuration error): the operator deletes the pods
                failure, late, cancelled = sigterm(), 3, True
            self.rec.end(name, host, attempt, run, step + late, failure)
            code = 143 if cancelled else _real(self.o, decide, read_records(self.out), attempt, self.s.budget).exit_code
            codes[name] = code
            if code == EXIT_RETRY or (mine and mine.kind == "moved"):
                began = self.recreate(api, pods, name, attempt + 1)
                if began is False:  # the recreated pod's agent refused the attempt: the job fails
                    codes[name] = agent.EXIT_BUDGET_SPENT
                newer = newer or bool(began)
        for name, f in culprits.items():
            if f.kind == "lost":
                self.recreate(api, pods, name, attempt + 1)
        return codes

    def recreate(self, api: FakeApi, pods: dict[str, str], name: str, attempt: int) -> bool | None:
        """The operator recreates a pod from the template as the job holds it now: on its node if still admitted,
        else on a free one; its agent begins `attempt` at once. Whether it began (False: refused, past the budget;
        None: Pending, no node for it)."""
        host = pods[name]
        pods[name] = None
        free = self.schedulable(api, pods)
        pods[name] = host if host in free else (free[0] if free else None)
        if pods[name] is None:
            return None
        begun = next_attempt(read_records(self.out), name)
        if begun != attempt:
            self.o.log.append(f"model: {name} would begin attempt {begun}, not {attempt}")
        if begun > self.s.budget:
            return False  # its agent refuses it: EXIT_BUDGET_SPENT
        self.rec.start(name, pods[name], begun, 0)
        return True

    def write_stragglers_k8s(self, attempt, run, names, pods, upto):
        self._pods = pods
        self.write_stragglers(attempt, run, names, upto)

    def host(self, name: str) -> str:
        return self._pods.get(name, name)

    def judge(self, api: FakeApi, watcher, reader, attempt: int) -> list[str]:
        """The watcher's polls of a settled attempt (and `harness run`'s reader); the pods it deleted."""
        if watcher is None:
            return []
        from harness.launchers.kubernetes_blame import decision
        downs = sum(1 for f in self.s.faults if f.kind == "api_down" and f.attempt == attempt)
        api.down = 2 * downs
        before, deleted = _marked(self.nodes), len(api.deleted)
        blamed_before = set(decision(api.job)["blamed"])
        for _ in range(MAX_POLLS + api.down):
            _real(self.o, watcher)
            _real(self.o, reader)
            if attempt in decision(api.job)["judged"]:
                break
        done = decision(api.job)
        if attempt in done["judged"]:
            self.o.blamed[attempt] = {n: c for n, c in done["blamed"].items() if n not in blamed_before}
        from harness.launchers.kubernetes_blame import excluded_nodes
        self.o.excluded[attempt] = excluded_nodes(api.job)
        self.o.marks.append(_marked(self.nodes) - before)
        return api.deleted[deleted:]

    def second_preflight(self, user: FakeApi, ref) -> None:
        """Another job's preflight on the same cluster: the faults of this one are over (but a GPU off the bus)."""
        if not self.s.again:
            return
        from harness.launchers import kubernetes_nodes
        from harness.launchers.kubernetes_nodes import TAINT
        tolerated = health_job_tolerates_taint()
        tainted = {n for n, v in self.nodes.items() if any(t["key"] == TAINT.key for t in v.get("taints", []))}
        marked = _marked(self.nodes)
        checked = [n for n in self.s.cluster if tolerated or n not in tainted]
        self.o.unchecked = marked - set(checked)
        folder = self.out / "again"
        folder.mkdir()
        write_health(folder, dataclasses.replace(self.s, faults=()), checked, self.offbus, 0)
        record = _real(self.o, preflight.decide, folder, checked, min(self.s.nodes, len(checked)), seconds=0.0,
                       max_marked_share=self.s.cap_share)
        _real(self.o, kubernetes_nodes.remediate, user, record, ref, self.s.mark)
        self.o.marked = _marked(self.nodes)


class LocalJob(Job):
    """One machine, attempts restarted by its agent (--restart-here)."""

    def play(self) -> None:
        attempt = 0
        while True:
            self.o.attempts = attempt + 1
            self.rec.start("local", None, attempt, 0)
            fault = None
            fault = None
            for run in range(self.s.runs):
                fault = next(iter(self.first_faults(attempt, run, ["local"])), None)
                if fault is not None:
                    break
            if fault is None:
                self.rec.end("local", None, attempt, self.s.runs - 1, STEPS, None)
                self.o.exit_code = 0
                return
            self.fire(attempt, fault)
            self.o.failed.add(attempt)
            ranks = range(self.s.gpus)
            failures = [worker_failure(fault.kind if r == 0 or fault.kind == "config" else "peer", r, attempt,
                                       fault.step) for r in ranks]
            self.rec.end("local", None, attempt, fault.run, fault.step, attempt_failure(failures))
            decision = _real(self.o, decide, read_records(self.out), attempt, self.s.budget)
            if not decision.retry:
                self.o.exit_code = decision.exit_code
                return
            attempt += 1


class _Lines:
    """stdout while the watcher runs: its lines go to the outcome's log."""

    def __init__(self, log: list[str]):
        self.log = log

    def write(self, text: str) -> None:
        self.log += [line for line in text.splitlines() if line]

    def flush(self) -> None:
        pass


def normalized(scenario: Scenario) -> Scenario:
    """The scenario the model plays: faults only where the backend has them."""
    keep = []
    for f in scenario.faults:
        if scenario.backend == "local" and (f.kind in HEALTH | CLUSTER or f.kind in ("lost", "nic_flap", "slow")):
            continue
        if scenario.backend == "slurm" and f.kind in CLUSTER:
            continue
        if f.run >= scenario.runs:
            continue
        if f.node is None and f.kind not in CLUSTER | {"health0_absent"}:
            f = dataclasses.replace(f, node=0)
        if f.kind in CLUSTER | {"health0_absent"}:
            f = dataclasses.replace(f, node=None)
        keep.append(f)
    pull = scenario.pull if scenario.backend == "k8s" else ()
    return dataclasses.replace(scenario, faults=tuple(keep), pull=pull)


class _CompactJson:
    """The json module as harness.preflight uses it, without the indent it writes preflight.json with (for people;
    every reader parses it): the same records, written several times per scenario, in a fraction of the time."""

    loads = staticmethod(json.loads)

    @staticmethod
    def dumps(obj, **kwargs) -> str:
        kwargs.pop("indent", None)
        return json.dumps(obj, **kwargs)


class _AttemptsCache:
    """read_attempts for the run folder, read once per change: every attempt record is written through Records
    (agent._append), which calls changed(); in between, the real code's many reads (each agent's decide, blame,
    the watcher's polls) get a copy of the same records instead of parsing every node's file again."""

    def __init__(self, read):
        self.read, self.cached = read, {}

    def changed(self) -> None:
        self.cached.clear()

    def __call__(self, out) -> list[dict]:
        key = str(out)
        if key not in self.cached:
            self.cached[key] = self.read(out)
        return [dict(r) for r in self.cached[key]]


_FOLDER: list[Path] = []  # one scratch folder per process, emptied between scenarios


def _scratch() -> Path:
    if not _FOLDER:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        _FOLDER.append(Path(tempfile.mkdtemp(prefix="harness-sim-", dir=shm)))
        atexit.register(shutil.rmtree, _FOLDER[0], True)
    folder = _FOLDER[0] / "run"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir()
    return folder


def simulate(scenario: Scenario) -> Outcome:
    """Play `scenario` through the real policy code; what happened."""
    from harness.launchers import kubernetes_blame
    from workloads.common import run_record

    scenario = normalized(scenario)
    folder = _scratch()
    attempts = _AttemptsCache(run_record.read_attempts)
    with mock.patch.dict(os.environ, {}, clear=False), mock.patch.object(preflight, "json", _CompactJson), \
            mock.patch.object(agent, "read_attempts", attempts), \
            mock.patch.object(preflight, "read_attempts", attempts), \
            mock.patch.object(kubernetes_blame, "read_attempts", attempts):
        for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
            os.environ.pop(name, None)
        job = {"slurm": SlurmJob, "k8s": KubernetesJob, "local": LocalJob}[scenario.backend](scenario, folder)
        job.rec.written = attempts.changed
        try:
            job.play()
        except _Traceback:
            pass
        return job.o


# --- the invariants -----------------------------------------------------------------------------------------------

INVARIANTS = {
    "innocent": "a node with no fault is never blamed, excluded, drained or tainted",
    "cap": "no decision marks more than the cap (a share of the allocation, at least one node)",
    "unmarked": "a node marked by the harness that passes again is unmarked",
    "told": "a faulty node whose fault can be told (lost, GPU hardware) is blamed and kept out within one attempt",
    "budget": "victims' ends never spend the restart budget twice for one fault",
    "program": "a workload or configuration error blames no node, and the same error three times stops the job",
    "traceback": "no scenario ends with a traceback from the policy code",
    "success": "a job that succeeds keeps exit 0",
}


def check(scenario: Scenario, o: Outcome) -> list[str]:
    """The invariants `scenario`'s outcome breaks, one line each ("<invariant>: what happened")."""
    s = normalized(scenario)
    node_of = lambda f: s.cluster[f.node % len(s.cluster)]  # noqa: E731
    faulty = {node_of(f) for f in s.faults if FAULTS[f.kind].node_fault and f.node is not None}
    if any(f.kind == "health0_absent" for f in s.faults):
        faulty.add(s.cluster[0])  # the first allocated node: rank 0 of the health job
    broken: list[str] = []
    if o.traceback:
        broken.append(f"traceback: {o.traceback}")
    innocent = set().union(*o.blamed.values(), *o.excluded.values(), *o.health, *o.marks) - faulty
    if innocent:
        broken.append(f"innocent: {', '.join(sorted(innocent))} blamed, excluded or marked with no fault")
    over = next((m for m in o.marks if len(m) > s.cap), None)
    if over:
        broken.append(f"cap: one decision marked {len(over)} node(s) ({', '.join(sorted(over))}), above the cap "
                      f"of {s.cap}")
    if o.unchecked:
        broken.append(f"unmarked: {', '.join(sorted(o.unchecked))} stays marked and is never checked again "
                      "(the health job does not tolerate the harness's taint)")
    recovered = o.marked - o.unchecked - {node_of(f) for f in s.faults if f.kind == "gpu_offbus"}
    if s.again and s.backend == "k8s" and recovered:
        broken.append(f"unmarked: {', '.join(sorted(recovered))} passed again and is still marked")
    # An attempt whose every node was lost left no end at all: nothing tells the nodes from a shared cause (the
    # network, the batch host), and blaming all of them would be over the cap; such a loss is not "told".
    lost = {a: {node_of(f) for f in o.fired_faults if f.kind == "lost" and f.attempt == a} for a in o.fired}
    for f in sorted(o.fired_faults, key=Fault.spec):  # told: kept out of the attempt after the one it failed
        if f.kind == "lost" and len(lost[f.attempt]) >= s.nodes:
            continue
        if f.attempt + 1 >= o.attempts:  # the job stopped after it: there is no next attempt to keep it out of
            continue
        if FAULTS[f.kind].told and f.attempt in o.excluded and node_of(f) not in o.excluded[f.attempt]:
            broken.append(f"told: {node_of(f)} ({f.kind} in attempt {f.attempt}) was not kept out of the next "
                          "attempt")
    spent = sorted(a for a in o.failed if not o.fired.get(a) and o.moved.get(a) not in faulty)
    if spent:
        broken.append(f"budget: attempt(s) {', '.join(map(str, spent))} failed with no fault of their own (a "
                      "victim's end, or a healthy node's pod moved, spent it)")
    program = {f.kind for f in s.faults if FAULTS[f.kind].program}
    for attempt, blamed in sorted(o.blamed.items()):
        kinds = o.fired.get(attempt, set())
        blamed = set(blamed) - faulty  # a node at fault itself (a straggler) is blamed for its own fault
        if kinds and kinds <= program and blamed:
            broken.append(f"program: attempt {attempt} failed with {', '.join(sorted(kinds))}, and "
                          f"{', '.join(sorted(blamed))} was blamed")
    repeats = max((sum(1 for kinds in o.fired.values() if kind in kinds) for kind in program), default=0)
    if repeats > 3:
        broken.append(f"program: the job's own error came back {repeats} times and the job went on")
    if not o.failed and o.exit_code not in (0, None, preflight.EXIT_PREFLIGHT) and not o.traceback:
        broken.append(f"success: no attempt failed, yet the job exited {o.exit_code}")
    if o.exit_code == 0 and o.failed and max(o.failed) + 1 >= o.attempts:
        broken.append("success: the last attempt failed, yet the job exited 0")
    return broken


# --- the table the docs show --------------------------------------------------------------------------------------

def fault_table() -> str:
    """docs/failures.md's table: each fault kind, who is blamed, what happens next (FAULTS)."""
    rows = ["| fault | spec | blamed | then |", "|---|---|---|---|"]
    rows += [f"| {f.what} | `{f.name}` | {f.blamed} | {f.next} |" for f in FAULTS.values()]
    return "\n".join(rows) + "\n"


def describe(scenario: Scenario, o: Outcome) -> str:
    lines = [f"scenario: {scenario.spec()}", f"exit code: {o.exit_code}; attempts begun: {o.attempts}"]
    for attempt in sorted(set(o.fired) | set(o.blamed) | o.failed):
        lines.append(f"attempt {attempt}: faults {sorted(o.fired.get(attempt, set())) or '-'}"
                     f"{' (moved by the watcher)' if attempt in o.moved else ''}; blamed "
                     f"{sorted(o.blamed.get(attempt, {})) or '-'}; kept out {sorted(o.excluded.get(attempt, set()))}")
    lines.append(f"marked per decision: {[sorted(m) for m in o.marks]}; marked at the end: {sorted(o.marked)}")
    lines += [f"  {line}" for line in o.log[-8:]]
    broken = check(scenario, o)
    lines += [f"BROKEN {b}" for b in broken] or ["every invariant holds"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.simulate", description=__doc__.split("\n")[0])
    parser.add_argument("spec", nargs="?", help='a scenario, e.g. "slurm n=4 runs=2 | lost@1.a0.r1.s5"')
    parser.add_argument("--table", action="store_true", help="print the fault table (docs/failures.md)")
    args = parser.parse_args(argv)
    if args.table or not args.spec:
        print(fault_table(), end="")
        return 0
    scenario = Scenario.parse(args.spec)
    outcome = simulate(scenario)
    print(describe(scenario, outcome))
    return 1 if check(scenario, outcome) else 0


if __name__ == "__main__":
    sys.exit(main())
