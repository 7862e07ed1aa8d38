"""Kubernetes: the API client, and the Kubeflow job resources as the API serves them.

The official client, configured from KUBECONFIG or in-cluster (`clients`); every call goes through `call`,
which turns a refusal or an unreachable server into one line. A job resource (`JobApi`) says where it lives,
how its state reads from its status, and how its pods are found; kubernetes_render builds it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable

import urllib3
from kubernetes import client as k8s

from harness.errors import HarnessError
from harness.launchers.base import Handle, JobState
from harness.spec import JobSpec


def to_dict(obj) -> dict:
    """A kubernetes-client model as the plain dict the API server receives (None fields dropped)."""
    return k8s.ApiClient().sanitize_for_serialization(obj)


def _last_true_condition(job: dict) -> dict | None:
    conditions = [c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    return conditions[-1] if conditions else None


# PyTorchJob conditions (the last one whose status is "True" wins) -> ours.
PYTORCHJOB_CONDITIONS = {"Created": JobState.PENDING, "Running": JobState.RUNNING, "Restarting": JobState.RUNNING,
                         "Succeeded": JobState.SUCCEEDED, "Failed": JobState.FAILED, "Suspended": JobState.PENDING}


def pytorchjob_state(job: dict) -> tuple[JobState, str]:
    """Our state and the operator's reason, from a PyTorchJob's status conditions."""
    last = _last_true_condition(job)
    if last is None:
        return JobState.PENDING, "no conditions yet"
    return PYTORCHJOB_CONDITIONS.get(last.get("type"), JobState.UNKNOWN), last.get("message") or last.get("type", "")


TRAINJOB_CONDITIONS = {"Complete": JobState.SUCCEEDED, "Failed": JobState.FAILED, "Suspended": JobState.PENDING}


def trainjob_state(job: dict) -> tuple[JobState, str]:
    """A TrainJob has conditions only at the ends (and when suspended); in between, its child Jobs say."""
    last = _last_true_condition(job)
    if last is not None and last.get("type") in TRAINJOB_CONDITIONS:
        return TRAINJOB_CONDITIONS[last["type"]], last.get("message") or last["type"]
    jobs = (job.get("status") or {}).get("jobsStatus") or []
    if any((j.get("active") or 0) + (j.get("ready") or 0) > 0 for j in jobs):
        return JobState.RUNNING, ", ".join(f"{j.get('name')}: {j.get('active') or 0} active" for j in jobs)
    return JobState.PENDING, last.get("type", "") if last else "no child jobs running yet"


@dataclass(frozen=True)
class JobApi:
    """One Kubeflow job resource: where it lives, how its state reads, how its pods are found
    (kubernetes_render builds it)."""

    group: str
    version: str
    plural: str
    kind: str
    pod_label: str  # the label the operator puts on the job's pods, valued with the job's name
    container: str  # the training container's name, which the operator looks for
    state: Callable[[dict], tuple[JobState, str]]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


PYTORCHJOB = JobApi("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob", "training.kubeflow.org/job-name", "pytorch",
                    pytorchjob_state)
TRAINJOB = JobApi("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob", "jobset.sigs.k8s.io/jobset-name",
                  "node", trainjob_state)
APIS = {"pytorchjob": PYTORCHJOB, "trainjob": TRAINJOB}


def handle_job(handle: Handle) -> tuple[JobSpec, JobApi, str, str]:
    """(spec, job resource, namespace, name) of a submitted job, from its handle."""
    spec = JobSpec.from_dict(handle.record()["spec"])
    namespace, _, name = handle.job_id.partition("/")
    return spec, APIS[spec.profile.kubernetes.api], namespace, name


def clients() -> tuple[k8s.CustomObjectsApi, k8s.CoreV1Api]:
    """The official client, configured from KUBECONFIG / ~/.kube/config, or in-cluster."""
    return apis(k8s.CustomObjectsApi, k8s.CoreV1Api)


def apis(*kinds: type) -> tuple:
    """One instance of each of the official client's API classes asked for (k8s.CoreV1Api,
    k8s.RbacAuthorizationV1Api, ...), sharing one client configured as `clients` says: `harness doctor` reads
    more kinds of object than the launcher, through the same configuration."""
    from kubernetes import config

    try:
        # Read KUBECONFIG now: the client reads it once, at import.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    except (config.ConfigException, OSError):  # no kubeconfig: maybe we run inside a pod
        try:
            config.load_incluster_config()
        except config.ConfigException:
            raise HarnessError("no Kubernetes configuration found: set KUBECONFIG or run inside the cluster") \
                from None
    # urllib3 logs each of its own retries as a warning; an outage is said once, by the loop that waits it out.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    api = k8s.ApiClient()
    return tuple(kind(api) for kind in kinds)


class Refused(HarnessError):
    """The API server answered with an error (`status`: 403 forbidden, 404 not found, 409 conflict, ...), as one
    line; `status` lets a caller that can go on (`harness doctor`, which turns a 403 into a failed check
    naming the permission) tell a refusal from a missing object."""

    def __init__(self, message: str, status: int):
        super().__init__(message, 1)
        self.status = status


class Unreachable(HarnessError):
    """The API server did not answer (no connection, a dropped one, a timeout): an outage, which a loop waits
    out (retrying), not a refusal, which it reports."""

    def __init__(self, message: str, server: str):
        super().__init__(message, 1)
        self.server = server


# What the client raises when the server does not answer: urllib3's errors (MaxRetryError once its own retries
# are spent, ProtocolError for a dropped connection, NewConnectionError), which are not OSErrors, and OSErrors.
UNREACHABLE = (OSError, urllib3.exceptions.HTTPError)


def _server(fn) -> str:
    """The API server a client method talks to (its address, as the kubeconfig or the pod's environment set it)."""
    api_client = getattr(getattr(fn, "__self__", None), "api_client", None)
    config = getattr(api_client, "configuration", None) or k8s.Configuration.get_default_copy()
    return config.host


def _why(exc: Exception) -> str:
    reason = exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason else exc
    return " ".join(f"{type(reason).__name__}: {reason}".split())


def call(what: str, fn, *args, missing_ok: bool = False, **kwargs):
    """fn(*args, **kwargs), with an API error or an unreachable server as one line (Refused, with the status;
    Unreachable); with `missing_ok`, None where the object is not there (404)."""
    try:
        return fn(*args, **kwargs)
    except k8s.ApiException as exc:
        if missing_ok and exc.status == 404:
            return None
        hint = "; pick another --name or delete the old job" if exc.status == 409 else ""
        raise Refused(f"Kubernetes refused to {what}: {exc.status} {exc.reason}: {exc.body}{hint}", exc.status) \
            from None
    except UNREACHABLE as exc:
        raise unreachable(what, fn, exc) from None


def unreachable(what: str, fn, exc: Exception) -> Unreachable:
    """The one line for `exc` (one of UNREACHABLE), raised by client method `fn` asked to do `what`."""
    server = _server(fn)
    return Unreachable(f"cannot reach the Kubernetes API server at {server} to {what}: {_why(exc)}", server)


@dataclass
class Backoff:
    """The waits between tries while the API server is unreachable: first_s, doubling, at most most_s; `sleep`
    does the waiting (a test's records it instead)."""

    first_s: float = 1.0
    most_s: float = 30.0
    sleep: Callable[[float], None] = time.sleep

    def delay(self, tries: int) -> float:
        return min(self.most_s, self.first_s * 2 ** min(tries, 32))


BACKOFF = Backoff()  # every loop's, unless given its own (tests replace it: they count tries, never seconds)


class Outage:
    """One loop's view of the API server being unreachable: said once when it begins (which server, what could
    not be done), once when it answers again, and waited out with the backoff in between. Thread-safe (the
    collection's pods run side by side)."""

    def __init__(self, say: Callable[[str], None], backoff: Backoff | None = None):
        self.say, self.backoff, self.tries, self.server = say, backoff, 0, ""
        self._lock = threading.Lock()

    def failed(self, exc: Unreachable) -> None:
        """An unreachable try: said if it begins an outage; then the backoff's wait."""
        with self._lock:
            tries, self.tries, self.server = self.tries, self.tries + 1, exc.server
        if tries == 0:
            self.say(f"{exc}; trying again, with backoff, until it answers")
        (self.backoff or BACKOFF).sleep((self.backoff or BACKOFF).delay(tries))

    def answered(self) -> None:
        """A try the server answered (with a refusal too): ends the outage, if one was under way."""
        with self._lock:
            tries, self.tries = self.tries, 0
        if tries:
            self.say(f"the Kubernetes API server at {self.server} answers again, after "
                     f"{tries} unanswered {'try' if tries == 1 else 'tries'}")


def retrying(outage: Outage, fn, *args, deadline: float | None = None, **kwargs):
    """fn(*args, **kwargs) (a `call`), tried again while the API server is unreachable (Outage); past
    `deadline` (time.monotonic()), where the caller has one, the outage is raised as one line. A refusal is
    raised at once: waiting changes nothing."""
    while True:
        try:
            result = fn(*args, **kwargs)
        except Unreachable as exc:
            if deadline is not None and time.monotonic() >= deadline:
                raise
            outage.failed(exc)
            continue
        except HarnessError:
            outage.answered()
            raise
        outage.answered()
        return result


def record_event(core: k8s.CoreV1Api, api: JobApi, job: dict, state: JobState, reason: str) -> None:
    """A Kubernetes Event on the job, so the cluster's own tools show what the harness saw."""
    meta = job["metadata"]
    now = datetime.now(timezone.utc)
    event = k8s.CoreV1Event(
        metadata=k8s.V1ObjectMeta(generate_name=f"{meta['name']}-", namespace=meta["namespace"]),
        involved_object=k8s.V1ObjectReference(api_version=api.api_version, kind=api.kind, name=meta["name"],
                                              namespace=meta["namespace"], uid=meta.get("uid")),
        reason=f"Harness{state.value.title()}", message=f"mlperf-harness: job {state.value}: {reason}",
        type="Warning" if state is JobState.FAILED else "Normal", first_timestamp=now, last_timestamp=now,
        count=1, source=k8s.V1EventSource(component="mlperf-harness"))
    call("record an event", core.create_namespaced_event, meta["namespace"], event)
