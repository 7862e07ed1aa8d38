"""Kubernetes: a Kubeflow PyTorchJob (kubeflow.org/v1) or a Trainer v2 TrainJob, behind the Launcher interface.

The backend is a few small modules, each with one job, imported one way (no cycle, tests/test_kubernetes.py):
- kubernetes_api: the client and every call through it; the job resources and how their state reads;
- kubernetes_render: the job a spec asks for (what a dry run prints);
- kubernetes_nodes: the health job, and the verdicts written on the Nodes (condition, taint, Events);
- kubernetes_collect: the run folder brought back from the results volume through short-lived pods;
- kubernetes_blame: the watcher pod that keeps a failed attempt's node out of the next one, in the
  cluster beside the job, and the reader of what it decided;
- kubernetes_rbac: what each identity calls (the submitter, `harness doctor`, the watcher), and the RBAC
  rendered from it for a namespace (manifests/rbac/ is namespace default's);
- this module: the launcher, which puts them together. The cluster is the system of record: each state
  change the harness sees is also recorded as a Kubernetes Event on the job.
"""

from __future__ import annotations

import dataclasses
import secrets
import sys
from pathlib import Path, PurePosixPath

import yaml
from mlperf_logging.mllog import constants as C

from harness.cache_flush import kubernetes_flush_problem
from harness.errors import HarnessError
from harness.launchers import kubernetes_collect, kubernetes_nodes, kubernetes_resources
from harness.launchers.base import (Handle, JobState, Launcher, LogSource, Request, TextLog, cluster_procs_per_node,
                                    health_command, record_cancel, record_state, workload_plan)
from harness.launchers.kubernetes_api import (APIS, TRAINJOB, Outage, Refused, call, clients, handle_job,
                                              record_event, retrying)
from harness.launchers.kubernetes_blame import BlameReader
from harness.launchers.kubernetes_rbac import rbac_documents
from harness.launchers.kubernetes_render import (TOKEN_HEX, build, excluding, prerequisites, pvc_folder,
                                                 pytorch_job, render_token, trainjob_notes, watcher_pod,
                                                 watches_failures)
from harness.spec import JobSpec
from workloads.common.mlperf import division


def _named(spec: JobSpec, token: str) -> JobSpec:
    """The spec with its job's name on the cluster: --name as given, else the default name and the job's token,
    so that each run's jobs (and health jobs) have names of their own in the namespace: the next run's create
    is never refused (409) for a name an earlier run's job still holds. A campaign's job per run adds the run."""
    name = spec.name if spec.name != spec.default_name() else f"{spec.name}-{token}"
    return dataclasses.replace(spec, name=name if spec.launch is None else f"{name}-run{spec.launch}")


def per_run_jobs(spec: JobSpec) -> bool:
    """Whether each run of the campaign is a job of its own: a closed campaign of several runs whose pods flush their
    nodes' page cache (kubernetes.flush_page_cache), which the init container does once, as the pods start. Jobs in
    sequence, rather than one job whose pods flush between runs, since only a privileged container can flush and the
    training container stays unprivileged; the jobs share the run folder (the campaign's token), its run numbering
    and its restart budget, and preflight runs once before the first."""
    return bool(spec.launch is None and spec.runs > 1 and spec.profile.kubernetes.flush_page_cache
                and division(spec.preset) == C.CLOSED)


class KubernetesLauncher(Launcher):
    name = "k8s"
    paths_here = False  # --data and --init-checkpoint name paths inside the pods

    def launches(self, spec: JobSpec) -> list[JobSpec]:
        return [dataclasses.replace(spec, launch=run) for run in range(spec.runs)] if per_run_jobs(spec) else [spec]

    def problems(self, spec: JobSpec) -> list[str]:
        flush = kubernetes_flush_problem(spec)
        return [flush] if flush else []

    def render(self, spec: JobSpec) -> Request:
        """Every object the campaign creates, in order, as YAML documents under the list of what must exist first
        and the RBAC for the profile's namespace: the health job (with --preflight), then each job (one, or one per
        run) and its watcher pod. Tokens are derived from the spec (a dry run prints the same bytes for the same
        arguments); `submit` renders the job again with a fresh random token. The request's payload is the (first)
        training job's."""
        token = render_token(spec)
        requests = [self._request(launch, token) for launch in self.launches(spec)]
        documents = [self._health_body(spec, render_token(dataclasses.replace(spec, health_only=True)))[1]] \
            if spec.preflight else []
        for request in requests:
            documents.append(request.payload["body"])
            if watches_failures(request.spec):  # its owner's uid exists only once the API server made the job
                job = {"metadata": {**request.payload["body"]["metadata"], "uid": "<the job's uid, at submit>"}}
                documents.append(watcher_pod(request.spec, job, pvc_folder(request.spec, token)))
        header = "".join(f"# {line}\n" for line in prerequisites(spec))
        if len(requests) > 1:
            header += (f"# The {len(requests)} jobs run one after another, each once the one before succeeded and was "
                       "collected: `harness run` applies them in order (applied at once, they would run at once)\n")
        text = (header + "# The RBAC, for the profile's namespace (applied once, as manifests/rbac is for default):\n"
                + yaml.safe_dump_all(rbac_documents(spec), sort_keys=True, default_flow_style=False)
                + "---\n# What the run creates, in order:\n"
                + yaml.safe_dump_all(documents, sort_keys=True, default_flow_style=False))
        return dataclasses.replace(requests[0], text=text,
                                   payload={**requests[0].payload, "launches": len(requests)})

    def _request(self, spec: JobSpec, token: str) -> Request:
        """`spec` as given (its name the default, or --name); the request's spec carries the job's own name."""
        api = APIS[spec.profile.kubernetes.api]
        named = _named(spec, token)
        body = build(named, token)
        text = yaml.safe_dump(body, sort_keys=True, default_flow_style=False)
        notes = workload_plan(spec, cluster_procs_per_node(spec), spec.profile.gpu_memory_gib if spec.gpus() else None)
        notes += tuple(trainjob_notes(spec)) if api is TRAINJOB else ()
        notes += tuple(kubernetes_resources.notes(spec.profile, cluster_procs_per_node(spec)))
        if watches_failures(spec):
            notes += (f"note: with the job, a watcher pod in the same image keeps the nodes a failed attempt points "
                      f"at out of the next one (ServiceAccount {spec.profile.kubernetes.watcher_service_account}, "
                      "manifests/rbac/watcher.yaml)",)
        return Request(backend=self.name, spec=named, text=text, payload={"body": body, "token": token, "spec": spec},
                       notes=notes)

    def render_preflight(self, spec: JobSpec) -> Request:
        """The health job: a PyTorchJob with a pod on each of nodes + spare_nodes nodes (kubernetes_nodes)."""
        token = secrets.token_hex(TOKEN_HEX // 2)  # a folder of its own: an earlier check's reports never count
        checked, body = self._health_body(spec, token)
        return Request(backend=self.name, spec=checked, text=yaml.safe_dump(body, sort_keys=True),
                       payload={"body": body, "token": token, "health": True})

    @staticmethod
    def _health_body(spec: JobSpec, token: str) -> tuple[JobSpec, dict]:
        checked = kubernetes_nodes.health_spec(_named(dataclasses.replace(spec, launch=None), token))
        in_pod = dataclasses.replace(checked, out_dir=PurePosixPath(pvc_folder(checked, token)))
        return checked, kubernetes_nodes.health_job(excluding(pytorch_job(checked, token), spec.exclude_nodes),
                                                    checked, health_command(in_pod, "python"))

    def remediate(self, spec: JobSpec, preflight: dict) -> list[str]:
        _, core = clients()
        return kubernetes_nodes.remediate(core, preflight, kubernetes_nodes.health_job_reference(spec),
                                          spec.taint_bad_nodes)

    def restart_watcher(self, spec: JobSpec, handle: Handle):
        """Where the job has a watcher pod (kubernetes_render.watches_failures): the reader of what it decided."""
        return BlameReader(spec, handle) if watches_failures(spec) else None

    def submit(self, request: Request) -> Handle:
        spec = request.spec
        if not spec.profile.kubernetes.results_pvc:
            raise HarnessError(f"profile {spec.profile.name} names no results volume, so the MLPerf logs would "
                               "vanish with the pods: set kubernetes.results_pvc to a ReadWriteMany claim "
                               "(--set kubernetes.results_pvc=NAME)")
        if request.payload.get("launches", 1) > 1:
            raise HarnessError(f"this campaign is {request.payload['launches']} jobs, one per run: submit each of "
                               "launcher.launches(spec) in turn (as `harness run` does)")
        # A token of its own, so that no earlier job's folder on the volume (same --out name, same
        # arguments) is taken for this one's; the node agents also refuse a folder another job claimed.
        # A campaign's later runs go on in its first run's folder, with its token (per_run_jobs).
        earlier: list[dict] = []
        if not request.payload.get("health"):  # the health job keeps its own (it trains nothing)
            token = secrets.token_hex(TOKEN_HEX // 2)
            if request.payload["spec"].launch:
                previous = Handle.load(request.spec.out_dir).record()
                token = previous["token"]
                earlier = [*previous.get("earlier_jobs", []),
                           {key: previous.get(key) for key in ("job_id", "launch", "state")}]
            request = self._request(request.payload["spec"], token)
            spec = request.spec
        (spec.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        api = APIS[spec.profile.kubernetes.api]
        jobs, _ = clients()
        namespace = spec.profile.kubernetes.namespace
        create = (call, f"create the {api.kind}", jobs.create_namespaced_custom_object, api.group, api.version,
                  namespace, api.plural, request.payload["body"])
        # A campaign's later runs are submitted unattended, hours in: an API server outage then is waited out (said
        # once), as the watch waits it out, rather than ending the campaign between two runs.
        created = retrying(Outage(lambda line: print(f"harness: {line}", file=sys.stderr, flush=True)), *create) \
            if spec.launch else create[0](*create[1:])
        handle = Handle(backend=self.name, job_id=f"{namespace}/{created['metadata']['name']}", out_dir=spec.out_dir)
        folder = pvc_folder(spec, request.payload["token"])
        handle.save(request, state=JobState.PENDING.value, uid=created["metadata"].get("uid"), pvc_folder=folder,
                    token=request.payload["token"], launch=spec.launch, earlier_jobs=earlier)
        if watches_failures(spec):  # the job's own, in the cluster: it goes on without this process
            _, core = clients()
            try:
                call("start the job's watcher pod", core.create_namespaced_pod, namespace,
                     watcher_pod(spec, created, folder))
            except HarnessError as exc:
                self._withdraw(handle, api, exc)
        return handle

    def _withdraw(self, handle: Handle, api, refused: HarnessError) -> None:
        """The watcher pod was refused after the job was created: delete the job (and, through their
        ownerReferences, its pods: all this submit made), record why, and raise one line.

        Deleted rather than run on with the refusal said: the watcher is what --preflight and --max-restarts
        ask for on Kubernetes, and without it each restart may land on the node that failed the last attempt,
        spending the budget on it while the run looks protected; a refusal is a setting to fix (the
        ServiceAccount, its RBAC, an admission policy, a quota) before a 64-node job is worth running, and a job
        deleted before it trained has cost nothing. Where the delete fails too, the job is named as left behind
        in the record and the line, with how to remove it: never a job running unrecorded."""
        namespace, _, name = handle.job_id.partition("/")
        why = f"{refused} (the watcher pod keeps a failed attempt's node out of the next: a restart without it " \
              "could land on the same node)"
        try:
            self.delete(handle)
        except HarnessError as exc:
            failure = (f"{why}; the {api.kind} {namespace}/{name} is left in the cluster, unwatched, since its "
                       f"delete failed too ({exc}): remove it with `harness cancel {handle.out_dir}`")
            handle.update(failure=failure)
            raise HarnessError(failure, 1) from None
        failure = f"{why}; deleted the {api.kind} {name} before it trained"
        handle.update(state=JobState.FAILED.value, failure=failure)
        raise HarnessError(failure, 1) from None

    def watched_status(self):
        """Launcher.watch's poll, through API server outages: an unreachable server (urllib3's errors, which the
        client raises) is said once, with its address, and waited out with backoff (kubernetes_api.BACKOFF),
        with no deadline: the job runs on in the cluster either way, and the watch must not be lost. A refusal
        still ends it in one line."""
        outage = Outage(lambda line: print(f"harness: {line}", file=sys.stderr, flush=True))
        return lambda handle: retrying(outage, self.status, handle)

    def status(self, handle: Handle) -> JobState:
        recorded = JobState(handle.record().get("state", JobState.UNKNOWN.value))
        if recorded is JobState.CANCELLED:
            return recorded
        _, api, namespace, name = handle_job(handle)
        jobs, core = clients()
        job = call(f"read the {api.kind}", jobs.get_namespaced_custom_object, api.group, api.version, namespace,
                   api.plural, name, missing_ok=True)
        if job is None:
            if handle.record().get("cancel_requested"):  # deleted by a `harness cancel` that records it next
                return record_state(handle, JobState.CANCELLED)
            raise HarnessError(f"the {api.kind} {name} is gone from namespace {namespace} (deleted outside the "
                               f"harness?); `harness collect {handle.out_dir}` copies what it wrote from the results "
                               "volume", 1)
        state, reason = api.state(job)
        if state.value == recorded.value:
            return state
        now = record_state(handle, state, reason=reason)
        if now is state:  # not a cancel recorded since the read above: that one has its own Event
            record_event(core, api, job, state, reason)
        return now

    def log_sources(self, handle: Handle, rank: int | None = None) -> list[LogSource]:
        """Each pod's log, by pod name: a pod is a node, its log the console of the node agent and its ranks (rank 0
        alone shows progress). Which ranks a pod runs is decided at the rendezvous (by host name), so a rank's own
        log is its file, logs/rank_<r>.log, which is on the results volume until collected into the run folder."""
        if rank is not None:
            collected = super().log_sources(handle, rank)
            if not collected:
                raise HarnessError(f"--rank {rank}: on Kubernetes a rank's own log (logs/rank_{rank}.log) is on the "
                                   f"results volume until `harness collect {handle.out_dir}` copies it here (`harness "
                                   "run` does when the job ends); without --rank, each pod's log holds its node's "
                                   "ranks' console")
            return collected
        _, api, namespace, name = handle_job(handle)
        _, core = clients()
        pods = call("list the job's pods", core.list_namespaced_pod, namespace,
                    label_selector=f"{api.pod_label}={name}")

        def fetch(pod: str):
            def read() -> str:
                try:  # a pod deleted since the listing (a restart's) has no log left: 404
                    return call("read pod logs", core.read_namespaced_pod_log, pod, namespace, container=api.container,
                                missing_ok=True) or ""
                except Refused as exc:
                    if exc.status == 400:  # its container is still starting (pulling the image): no log yet
                        return ""
                    raise
            return read

        return [TextLog(f"{pod.metadata.name} ({pod.status.phase})", pod.metadata.name, fetch(pod.metadata.name))
                for pod in sorted(pods.items, key=lambda p: p.metadata.name)]

    def cancel(self, handle: Handle) -> None:
        # The live state too: a job that ended since the last poll keeps its outcome (and one recorded ended
        # may be gone from the cluster already: nothing to ask).
        if JobState(handle.record().get("state", "UNKNOWN")).terminal or self.status(handle).terminal:
            return
        _, api, namespace, name = handle_job(handle)
        jobs, core = clients()
        job = call(f"read the {api.kind}", jobs.get_namespaced_custom_object, api.group, api.version, namespace,
                   api.plural, name)
        # Recorded once the API took the delete: a refused one leaves the job's state as it is, and says why.
        # Asked first, so that a `harness run` watching from another shell that finds the job gone before the
        # record reads it as cancelled (status).
        record_cancel(handle, cancel_requested=True)
        try:
            self.delete(handle)
        except HarnessError:
            record_cancel(handle, cancel_requested=False)  # a job deleted later by someone else is not our cancel
            raise
        record_cancel(handle, state=JobState.CANCELLED.value)
        record_event(core, api, job, JobState.CANCELLED, "cancelled by the user")

    def checked_nodes(self, handle: Handle) -> list[str]:
        """The Nodes the health job's pods were bound to; they stay after it ends (kubernetes_nodes.health_job)."""
        _, api, namespace, name = handle_job(handle)
        _, core = clients()
        pods = call("list the health job's pods", core.list_namespaced_pod, namespace,
                    label_selector=f"{api.pod_label}={name}").items
        return sorted({pod.spec.node_name for pod in pods if pod.spec and pod.spec.node_name})

    def delete(self, handle: Handle) -> None:
        """The job and, through their ownerReferences, its pods (propagationPolicy Background)."""
        _, api, namespace, name = handle_job(handle)
        jobs, _ = clients()
        call(f"delete the {api.kind} {name}", jobs.delete_namespaced_custom_object, api.group, api.version, namespace,
             api.plural, name, propagation_policy="Background")

    def collect(self, handle: Handle, poll_s: float = 1.0) -> list[Path]:
        return kubernetes_collect.collect(handle, poll_s)
