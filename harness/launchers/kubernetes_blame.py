"""Kubernetes: a node that a failed training attempt points at is kept out of the next attempt, by a watcher that
runs in the cluster beside the job, so that it goes on when the submitting machine is gone.

On Slurm the job goes back into the queue and its preflight step judges the nodes again, the failure's node
included (harness.preflight.blamed_nodes). A PyTorchJob instead goes on: the training operator deletes a pod
that failed with a retryable code and creates it again from the replica's pod template as the job holds it
at that moment (createNewPod copies spec.Template at each pass), so the exclusion has to reach that template
(the operator's webhook checks an update as it checks a create, only runPolicy being held to the old one).

With --preflight and --max-restarts, `harness run` creates, with the PyTorchJob, a small pod in the harness image
(kubernetes_render.watcher_pod: `python -m harness.launchers.kubernetes_blame`), owned by the job (the garbage
collector deletes it with the job) and run under a ServiceAccount of its own, granted exactly what it calls
(WATCHER_RULES: manifests/rbac/watcher.yaml). It mounts the results volume read-only and, every --poll-s seconds,
reads the job and its attempt records. Once every node is done with a failed attempt (preflight.settled), it judges it with the one
failure policy (preflight.blamed_nodes: harness.blame's culprits and the stragglers; `judge` is that decision,
free of API calls) and, for each machine the failure points at, in this order:
- patches every replica's pod template with the node affinity `metadata.name NotIn [...]`;
- deletes the job's pods already bound to it: the operator creates them again from the patched template, on
  another node (a free node of the cluster, the spares that preflight checked among them);
- conditions the Node (MLPerfPreflight=True), taints it with --taint-bad-nodes, and records Events on the Node
  and on the job, as preflight does (kubernetes_nodes.remediate). Last, since this only tells the cluster: a
  refusal (a 403 on the cluster-scoped Node) is said once and blocks nothing.
What it decided goes on the job as the annotation BLAME_ANNOTATION (the attempts it judged, the nodes it blamed
and why, what it did), in the same patch as the template: a watcher that restarts reads where it was, and
`harness run`, while it watches, only reads it (BlameReader) into preflight.json and onto the terminal.
It ends with the job (exit 0 once the job succeeded or failed, or is gone).
A pod the operator recreated on the blamed node before the patch, whose agent had already begun the next
attempt, leaves that attempt short of a node: it counts against --max-restarts like any failed attempt.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client as k8s

from harness import preflight
from harness.errors import HarnessError
from harness.launchers import kubernetes_nodes
from harness.launchers.base import Handle, JobState
from harness.launchers.kubernetes_api import PYTORCHJOB, Backoff, Outage, Unreachable, call, clients, retrying
from harness.spec import JobSpec
from workloads.common.run_record import of_launch, read_attempts

BLAME_ANNOTATION = "mlperf-harness/blame"
POLL_S = 10.0  # between two reads of the job and its attempt records

# Every API call the watcher makes, as RBAC grants it: (scope, apiGroup, resource) -> verbs; scope "namespace"
# is the job's (a Role), "cluster" the Nodes (a ClusterRole). Kept here, beside the calls; kubernetes_rbac renders
# it with the harness's other identities (manifests/rbac/watcher.yaml ships it), and a test runs the watcher
# against the fake API and checks the calls it records are exactly these.
WATCHER_RULES: dict[tuple[str, str, str], tuple[str, ...]] = {
    ("namespace", "kubeflow.org", "pytorchjobs"): ("get", "patch"),  # its state; the exclusion and the annotation
    ("namespace", "", "pods"): ("list", "delete"),  # the job's pods on a blamed node, moved
    ("namespace", "", "events"): ("create",),  # on the job, and on the Node (recorded in the job's namespace)
    ("cluster", "", "nodes"): ("get", "patch"),  # the taint (--taint-bad-nodes): read, then the whole list
    ("cluster", "", "nodes/status"): ("patch",),  # the MLPerfPreflight condition
}


def decision(job: dict) -> dict:
    """What the watcher decided so far, from the job's annotation: {"judged": [attempts], "blamed": {node: cause},
    "lines": [what it did]}."""
    text = ((job.get("metadata") or {}).get("annotations") or {}).get(BLAME_ANNOTATION)
    try:
        found = json.loads(text) if text else {}
    except ValueError:
        found = {}
    return {"judged": list(found.get("judged", [])), "blamed": dict(found.get("blamed", {})),
            "lines": list(found.get("lines", []))}


def excluded_nodes(job: dict) -> set[str]:
    """The nodes the job's pod templates keep out now (preflight's, and those blamed since): those every required
    node selector term of a template excludes (the terms are ORed: kubernetes_nodes.with_exclusions)."""
    kept_out = set()
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        terms = ((((replica["template"]["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or [])
        excluded = [{node for field in term.get("matchFields") or [] if kubernetes_nodes.is_exclusion(field)
                     for node in field.get("values") or []} for term in terms]
        kept_out |= set.intersection(*excluded) if excluded else set()
    return kept_out


@dataclass(frozen=True)
class Verdict:
    """What the watcher does about one failed attempt (judge): keep `blamed` ({node: cause}) out of the job's
    pods from now on, with `kept_out` (every node the templates keep out after it, preflight's included)."""

    attempt: int
    blamed: dict[str, str]
    kept_out: frozenset[str]


def judge(job: dict, records: list[dict], blamed_nodes) -> Verdict | None:
    """The watcher's decision after a failure, and nothing else (no API call, no clock): given the job as the API
    serves it (its templates' exclusions, the annotation of what was decided already), the attempt records of
    its run folder (read_attempts), and `blamed_nodes(attempt) -> {node: cause}` (preflight.blamed_nodes on
    the folder: the failure policy), the Verdict to act on, or None: nothing failed yet, that attempt judged
    already, or a node still runs it (preflight.settled)."""
    attempt = preflight.newest_ended(records)
    if attempt is None or attempt in decision(job)["judged"] or not preflight.settled(records):
        return None
    kept_out = excluded_nodes(job)
    blamed = {node: cause for node, cause in blamed_nodes(attempt).items() if node not in kept_out}
    return Verdict(attempt, blamed, frozenset(kept_out | set(blamed)))


class BlamedNodeWatcher:
    """One PyTorchJob, watched from inside the cluster (see the module's notes); each call is one poll."""

    def __init__(self, namespace: str, name: str, folder: Path, taint: bool, backoff: Backoff | None = None,
                 max_marked_share: float = preflight.MAX_MARKED_SHARE, launch: int | None = None):
        self.namespace, self.name, self.folder, self.taint = namespace, name, Path(folder), taint
        # A closed campaign's job per run (harness.agent --launch): the folder holds the runs before it too, whose
        # attempts (numbered on from theirs) are not this job's to judge.
        self.launch = launch
        # The most of the job's nodes one verdict marks (preflight.marking: the profile's preflight.max_marked_share,
        # at least one node); above it every blamed node is still kept out, and none is marked (systemic).
        self.max_marked_share = max_marked_share
        # An unreachable API server (urllib3's errors): said once per outage, waited out with `backoff`
        # (kubernetes_api.BACKOFF by default), and a decision begun is carried through once it answers.
        self.outage = Outage(lambda line: print(f"harness watcher: {line}", flush=True), backoff)

    def __call__(self) -> JobState | None:
        """One poll: the job's state (None: the job is gone). An API error (a transient 500, a refused patch) is
        printed and the watch goes on: the job keeps running either way; an outage is said once (UNKNOWN)."""
        try:
            state = self._poll()
            self.outage.answered()
            return state
        except Unreachable as exc:
            self.outage.failed(exc)
            return JobState.UNKNOWN
        except HarnessError as exc:
            print(f"harness watcher: keeping failed nodes out of {self.name}: {exc} (tried again at the next poll)",
                  flush=True)
            return JobState.UNKNOWN

    def _poll(self) -> JobState | None:
        jobs, core = clients()
        job = call("read the PyTorchJob", jobs.get_namespaced_custom_object, PYTORCHJOB.group, PYTORCHJOB.version,
                   self.namespace, PYTORCHJOB.plural, self.name, missing_ok=True)
        if job is None:
            return None
        state, _ = PYTORCHJOB.state(job)
        records = read_attempts(self.folder)
        if self.launch is not None:
            records = of_launch(records, self.launch)
        verdict = judge(job, records, lambda attempt: preflight.blamed_nodes(self.folder, attempt))
        if verdict is not None:
            self._keep_out(jobs, core, job, verdict)
        return state

    def _keep_out(self, jobs, core, job: dict, verdict: Verdict) -> None:
        """Act on a verdict, the exclusion first: the job's templates (and, in the same patch, the annotation
        that the attempt is judged), then the pods on the blamed nodes. The Nodes (cluster-scoped, which a
        cluster may not grant) come last and only tell the cluster: a refused condition, taint or Event is said
        once, in the lines, and blocks nothing; the attempt is judged, so no later poll tries it again. One verdict
        marks at most max_marked_share of the job's nodes (preflight.marking), as preflight's decision does."""
        done, blamed = decision(job), verdict.blamed
        reasons = {node: preflight.reason(preflight.blame_check(cause)) for node, cause in blamed.items()}
        lines = [f"{node}: kept out of the job's next attempt ({reasons[node]})" for node in blamed]
        patch: dict = {"spec": {"pytorchReplicaSpecs": {}}}
        if blamed:  # each template's own affinity with the exclusion in each of its terms (a merge patch's list is
            # replaced whole: the profile's terms are sent with it)
            patch["spec"]["pytorchReplicaSpecs"] = {replica: {"template": {"spec": {"affinity": (
                kubernetes_nodes.with_exclusions(copy.deepcopy(held["template"]["spec"]), sorted(verdict.kept_out))[
                    "affinity"])}}} for replica, held in job["spec"]["pytorchReplicaSpecs"].items()}
        decided = {"judged": sorted({*done["judged"], verdict.attempt}), "blamed": {**done["blamed"], **blamed},
                   "lines": done["lines"] + lines}
        patch["metadata"] = {"annotations": {BLAME_ANNOTATION: json.dumps(decided, sort_keys=True)}}
        retrying(self.outage, call, "keep the failed node out of the PyTorchJob's pods",
                 jobs.patch_namespaced_custom_object,
             PYTORCHJOB.group, PYTORCHJOB.version, self.namespace, PYTORCHJOB.plural, self.name, patch)
        for line in lines:
            print(f"harness watcher: {line}", flush=True)
        if not blamed:
            return
        # Listed after the patch: every pod not in this list is created from the patched template.
        pods = retrying(self.outage, call, "list the job's pods", core.list_namespaced_pod, self.namespace,
                        label_selector=f"{PYTORCHJOB.pod_label}={self.name}").items
        for pod in pods:
            if pod.spec.node_name in blamed:  # gone already: a delete that went through before an outage
                retrying(self.outage, call, "move a pod off the failed node", core.delete_namespaced_pod,
                         pod.metadata.name, self.namespace, missing_ok=True)
                print(f"harness watcher: {pod.spec.node_name}: pod {pod.metadata.name} deleted, to be created "
                      "elsewhere", flush=True)
        reference = k8s.V1ObjectReference(api_version=PYTORCHJOB.api_version, kind=PYTORCHJOB.kind,
                                          name=self.name, namespace=self.namespace, uid=job["metadata"].get("uid"))
        marks, systemic = preflight.marking(sorted(blamed), max(len(pods), len(blamed)), self.max_marked_share)
        record = {"nodes": {node: {"ok": False} for node in blamed},
                  "excluded": {node: [why] for node, why in reasons.items()}, "marked": marks, "systemic": systemic}
        marked = kubernetes_nodes.remediate(core, record, reference, self.taint, best_effort=True,
                                            attempt=lambda fn, *args: retrying(self.outage, fn, *args))
        for line in marked:
            print(f"harness watcher: {line}", flush=True)
        decided["lines"] += marked
        try:  # what it did to the Nodes, beside what it decided (the decision is recorded already)
            retrying(self.outage, call, "record what the watcher did on the PyTorchJob",
                     jobs.patch_namespaced_custom_object,
                 PYTORCHJOB.group, PYTORCHJOB.version, self.namespace, PYTORCHJOB.plural, self.name,
                 {"metadata": {"annotations": {BLAME_ANNOTATION: json.dumps(decided, sort_keys=True)}}})
        except HarnessError as exc:
            print(f"harness watcher: {exc}", flush=True)


class BlameReader:
    """`harness run`'s side, at every poll of its watch: what the watcher decided (the job's annotation), recorded
    in preflight.json (preflight.record_blame) and printed, once per node. It decides nothing itself."""

    def __init__(self, spec: JobSpec, handle: Handle):
        self.spec, self.handle = spec, handle
        self.namespace, _, self.name = handle.job_id.partition("/")
        self.recorded = set((preflight.read(spec.out_dir) or {}).get("excluded", {}))

    def __call__(self) -> None:
        jobs, _ = clients()
        try:
            job = call("read the PyTorchJob", jobs.get_namespaced_custom_object, PYTORCHJOB.group,
                       PYTORCHJOB.version, self.namespace, PYTORCHJOB.plural, self.name)
        except Unreachable:  # the watch's own status read says it, once, and waits the outage out
            return
        except HarnessError as exc:  # the watch's own status read says what is wrong, if it stays wrong
            print(f"harness: reading what the watcher decided: {exc}", flush=True)
            return
        new = {node: cause for node, cause in decision(job)["blamed"].items() if node not in self.recorded}
        if not new:
            return
        self.recorded |= set(new)
        lines = [line for line in decision(job)["lines"] if line.split(":", 1)[0] in new]
        preflight.record_blame(self.spec.out_dir, {node: preflight.blame_check(c) for node, c in new.items()}, lines)
        for line in lines:
            print(f"harness: {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.launchers.kubernetes_blame",
                                     description="Keep the nodes a failed attempt of a PyTorchJob points at out of "
                                                 "its next attempt; runs in the cluster beside the job.")
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--job", required=True, help="the PyTorchJob's name")
    parser.add_argument("--folder", required=True, type=Path, help="the job's run folder on the results volume")
    parser.add_argument("--taint", action="store_true", help="taint the blamed nodes (--taint-bad-nodes)")
    parser.add_argument("--poll-s", type=float, default=POLL_S)
    parser.add_argument("--max-marked-share", type=float, default=preflight.MAX_MARKED_SHARE,
                        help="the most of the job's nodes one verdict marks (the profile's preflight.max_marked_share)")
    parser.add_argument("--launch", type=int, help="the run this job does, where each run is a job of its own")
    args = parser.parse_args(argv)
    watcher = BlamedNodeWatcher(args.namespace, args.job, args.folder, args.taint,
                                max_marked_share=args.max_marked_share, launch=args.launch)
    print(f"harness watcher: watching {args.namespace}/{args.job} ({args.folder})", flush=True)
    while True:
        state = watcher()
        if state is None or state.terminal:
            print(f"harness watcher: {args.job} {'is gone' if state is None else state.value}; done", flush=True)
            return 0
        time.sleep(args.poll_s)


if __name__ == "__main__":
    sys.exit(main())
