"""FAKE Kubernetes API server, for tests only: no real API server can be installed offline.

It speaks just the endpoints the k8s launcher uses, through the official client:
PyTorchJob custom objects (create, get, delete), pods (list by label), pod logs,
and events (create). Tests move a job through its life by editing `jobs` and
`pods` directly, as the training operator and the kubelet would.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

JOBS = re.compile(r"/apis/kubeflow\.org/v1/namespaces/([^/]+)/pytorchjobs(?:/([^/]+))?$")
PODS = re.compile(r"/api/v1/namespaces/([^/]+)/pods$")
POD_LOG = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$")
EVENTS = re.compile(r"/api/v1/namespaces/([^/]+)/events$")


class FakeKubeAPI:
    def __init__(self):
        self.jobs: dict[tuple[str, str], dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}  # (namespace, name) -> pod, with "log" text beside
        self.events: list[dict] = []
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, folder: Path) -> Path:
        path = folder / "kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))
        return path

    def __enter__(self) -> "FakeKubeAPI":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # What the operator and kubelet would do.
    def set_condition(self, namespace: str, name: str, kind: str, message: str = "") -> None:
        job = self.jobs[(namespace, name)]
        conditions = job.setdefault("status", {}).setdefault("conditions", [])
        for condition in conditions:
            condition["status"] = "False" if condition["type"] in ("Running", "Restarting") else condition["status"]
        conditions.append({"type": kind, "status": "True", "message": message or f"PyTorchJob {name} is {kind}"})

    def add_pod(self, namespace: str, job: str, name: str, phase: str, log: str) -> None:
        self.pods[(namespace, name)] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"training.kubeflow.org/job-name": job}},
            "status": {"phase": phase}, "log": log}

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _send(self, code: int, body) -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict:
                return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

            def _route(self, method: str) -> None:
                url = urlparse(self.path)
                fake.requests.append((method, url.path))
                if m := JOBS.match(url.path):
                    return self._jobs(method, m.group(1), m.group(2))
                if (m := PODS.match(url.path)) and method == "GET":
                    selector = parse_qs(url.query).get("labelSelector", [""])[0]
                    key, _, value = selector.partition("=")
                    items = [{k: v for k, v in pod.items() if k != "log"} for (ns, _), pod in fake.pods.items()
                             if ns == m.group(1) and pod["metadata"]["labels"].get(key) == value]
                    return self._send(200, {"apiVersion": "v1", "kind": "PodList", "items": items})
                if (m := POD_LOG.match(url.path)) and method == "GET":
                    pod = fake.pods.get((m.group(1), m.group(2)))
                    return self._send(200, pod["log"]) if pod else self._not_found("pods", m.group(2))
                if (m := EVENTS.match(url.path)) and method == "POST":
                    event = self._body()
                    event["metadata"]["name"] = event["metadata"].get("generateName", "") + uuid.uuid4().hex[:5]
                    fake.events.append(event)
                    return self._send(201, event)
                self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})

            def _not_found(self, kind: str, name: str) -> None:
                self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404,
                                 "message": f"{kind} {name!r} not found"})

            def _jobs(self, method: str, namespace: str, name: str | None) -> None:
                if method == "POST" and name is None:
                    job = self._body()
                    key = (namespace, job["metadata"]["name"])
                    if key in fake.jobs:
                        return self._send(409, {"kind": "Status", "status": "Failure", "reason": "AlreadyExists",
                                                "code": 409, "message": f"pytorchjobs {key[1]!r} already exists"})
                    job["metadata"]["uid"] = str(uuid.uuid4())
                    fake.jobs[key] = job
                    return self._send(201, job)
                if name is None or (namespace, name) not in fake.jobs:
                    return self._not_found("pytorchjobs", name or "")
                if method == "GET":
                    return self._send(200, fake.jobs[(namespace, name)])
                if method == "DELETE":
                    fake.jobs.pop((namespace, name))
                    return self._send(200, {"kind": "Status", "status": "Success"})
                self._send(405, {"kind": "Status", "status": "Failure", "code": 405})

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def do_DELETE(self):
                self._route("DELETE")

        return Handler
