"""Kubernetes: a node that a failed training attempt points at is kept out of the next attempt.

On Slurm the job goes back into the queue and its preflight step judges the nodes again, the failure's node
included (harness.preflight.blamed_nodes). A PyTorchJob instead goes on: the training operator deletes a pod
that failed with a retryable code and creates it again from the replica's pod template as the job holds it
at that moment (createNewPod copies spec.Template at each pass), so the exclusion has to reach that template
(the operator's webhook checks an update as it checks a create, only runPolicy being held to the old one).
While `harness run` watches, at every poll it lists the job's pods; a pod the operator recreated (a new uid
under a known name) means an attempt failed. The harness then reads the attempt records from the results
volume (a results pod, as `collect` does), waits until every node is done with that attempt, and for each
machine the failure points at:
- patches every replica's pod template with the node affinity `metadata.name NotIn [...]`;
- conditions the Node (MLPerfPreflight=True), taints it with --taint-bad-nodes, and records Events on the Node
  and on the job, as preflight does (kubernetes_nodes.remediate);
- deletes the job's pods already bound to it: the operator creates them again from the patched template, on
  another node (a free node of the cluster, the spares that preflight checked among them).
A pod the operator recreated on the blamed node before the patch, whose agent had already begun the next
attempt, leaves that attempt short of a node: it counts against --max-restarts like any failed attempt.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from kubernetes import client as k8s

from harness import preflight
from harness.errors import HarnessError
from harness.launchers import kubernetes_nodes
from harness.launchers.kubernetes_api import PYTORCHJOB, call, clients
from harness.launchers.kubernetes_collect import fetch
from harness.launchers.base import Handle
from harness.spec import JobSpec
from workloads.common.run_record import ATTEMPTS_DIR, read_attempts


READ_AGAIN_S = 10.0


class BlamedNodeWatcher:
    """A `watch` tick for one PyTorchJob (see the module's notes)."""

    def __init__(self, spec: JobSpec, handle: Handle):
        self.spec, self.handle = spec, handle
        self.namespace, _, self.name = handle.job_id.partition("/")
        self.excluded = set(spec.exclude_nodes)  # what the job's templates keep out now
        self.uids: dict[str, str] = {}  # pod name -> the uid last seen under it
        self.pending = False  # a pod was recreated and its failed attempt is not judged yet
        self.judged: set[int] = set()
        # Between two reads of an attempt still running somewhere: each read is a pod, and a lost node's
        # replacement can wait long for a free node.
        self.reread_s, self.next_read = READ_AGAIN_S, 0.0

    def _pods(self, core) -> list:
        return call("list the job's pods", core.list_namespaced_pod, self.namespace,
                     label_selector=f"{PYTORCHJOB.pod_label}={self.name}").items

    def __call__(self) -> None:
        """One poll. An API error (a transient 500, a refused patch) is printed and the watch goes on: the
        job keeps running either way, and `harness run` must keep watching and collecting it."""
        try:
            self._poll()
        except HarnessError as exc:
            print(f"harness: keeping failed nodes out of {self.name}: {exc} (tried again at the next poll)",
                  flush=True)

    def _poll(self) -> None:
        jobs, core = clients()
        seen = {p.metadata.name: p.metadata.uid for p in self._pods(core)}
        self.pending |= any(self.uids.get(name, uid) != uid for name, uid in seen.items())
        self.uids.update(seen)
        if not self.pending or time.monotonic() < self.next_read:
            return
        with tempfile.TemporaryDirectory(dir=self.handle.out_dir, prefix=".attempts-") as staging:
            try:
                fetch(self.handle, ATTEMPTS_DIR, Path(staging, ATTEMPTS_DIR))  # a file not whole: read later
            except HarnessError as exc:  # the job goes on; the next recreated pod tries again
                self.pending = False
                print(f"harness: could not read the attempt records to keep a failed node out: {exc}", flush=True)
                return
            records = read_attempts(Path(staging))
            if not preflight.settled(records):
                self.next_read = time.monotonic() + self.reread_s
                return  # a node still runs the failed attempt: judged at a later poll
            attempt = preflight.newest_ended(records)
            self.pending = False
            if attempt in self.judged:
                return
            self.judged.add(attempt)
            blamed = {node: cause for node, cause in preflight.blamed_nodes(Path(staging), attempt).items()
                      if node not in self.excluded}
        if blamed:
            self._keep_out(jobs, core, blamed)

    def _keep_out(self, jobs, core, blamed: dict[str, str]) -> None:
        self.excluded |= set(blamed)
        affinity = kubernetes_nodes.with_exclusions({}, sorted(self.excluded))["affinity"]
        job = call("read the PyTorchJob", jobs.get_namespaced_custom_object, PYTORCHJOB.group, PYTORCHJOB.version,
                    self.namespace, PYTORCHJOB.plural, self.name)
        patch = {"spec": {"pytorchReplicaSpecs": {replica: {"template": {"spec": {"affinity": affinity}}}
                                                  for replica in job["spec"]["pytorchReplicaSpecs"]}}}
        call("keep the failed node out of the PyTorchJob's pods", jobs.patch_namespaced_custom_object,
              PYTORCHJOB.group, PYTORCHJOB.version, self.namespace, PYTORCHJOB.plural, self.name, patch)
        checks = {node: preflight.blame_check(cause) for node, cause in blamed.items()}
        reasons = {node: [preflight.reason(check)] for node, check in checks.items()}
        record = {"nodes": {node: {"ok": False} for node in blamed}, "excluded": reasons}
        reference = k8s.V1ObjectReference(api_version=PYTORCHJOB.api_version, kind=PYTORCHJOB.kind, name=self.name,
                                          namespace=self.namespace, uid=job["metadata"].get("uid"))
        lines = [f"{node}: kept out of the job's next attempt ({reasons[node][0]})" for node in blamed]
        lines += kubernetes_nodes.remediate(core, call, self.spec, record, job=reference)
        # Listed after the patch: every pod not in this list is created from the patched template.
        for pod in self._pods(core):
            if pod.spec.node_name in blamed:
                call("move a pod off the failed node", core.delete_namespaced_pod, pod.metadata.name, self.namespace)
                self.uids.pop(pod.metadata.name, None)  # its successor is ours, not a new failure
                lines.append(f"{pod.spec.node_name}: pod {pod.metadata.name} deleted, to be created elsewhere")
        preflight.record_blame(self.spec.out_dir, checks, lines)
        for line in lines:
            print(f"harness: {line}", flush=True)
