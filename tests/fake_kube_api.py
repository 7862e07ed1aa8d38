"""FAKE Kubernetes API server, for tests only: no real API server can be installed offline.

It speaks just the endpoints the k8s launcher uses, through the official client:
PyTorchJob and TrainJob custom objects (create, get, delete), pods (list by
label, create, get, delete), pod logs, events (create), and Nodes (list, get, and
strategic-merge patches of the node and of its status). Tests move a job
through its life by editing `jobs` and `pods` directly, as the operator and the
kubelet would. A pod created through the API (the harness's results pod) is
"run" as a fake kubelet would: its command runs here, with each volume claim
named in `claims` standing for a local folder, and its stdout becomes its log.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

JOBS = re.compile(r"/apis/(kubeflow\.org/v1|trainer\.kubeflow\.org/v1alpha1)/namespaces/([^/]+)/"
                  r"(pytorchjobs|trainjobs)(?:/([^/]+))?$")
PODS = re.compile(r"/api/v1/namespaces/([^/]+)/pods$")
POD = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
POD_LOG = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$")
EVENTS = re.compile(r"/api/v1/namespaces/([^/]+)/events$")
NODES = re.compile(r"/api/v1/nodes$")
NODE = re.compile(r"/api/v1/nodes/([^/]+)(/status)?$")


class FakeKubeAPI:
    def __init__(self):
        self.jobs: dict[tuple[str, str], dict] = {}  # (namespace, name) -> job, of either kind
        self.claims: dict[str, Path] = {}  # PersistentVolumeClaim name -> the local folder standing for it
        self.pods: dict[tuple[str, str], dict] = {}  # (namespace, name) -> pod, with "log" text beside
        self.events: list[dict] = []
        self.nodes: dict[str, dict] = {}  # name -> Node; add_node() adds one
        self.patches: list[tuple[str, str]] = []  # (path, Content-Type) of every PATCH
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

    def set_jobs_status(self, namespace: str, name: str, active: int) -> None:
        """What the TrainJob controller reports while its child jobs run."""
        self.jobs[(namespace, name)].setdefault("status", {})["jobsStatus"] = [
            {"name": "node", "active": active, "ready": active, "succeeded": 0, "failed": 0, "suspended": 0}]

    def add_pod(self, namespace: str, job: str, name: str, phase: str, log: str,
                label: str = "training.kubeflow.org/job-name") -> None:
        self.pods[(namespace, name)] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {label: job}},
            "status": {"phase": phase}, "log": log}

    def add_node(self, name: str) -> None:
        self.nodes[name] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                            "spec": {"taints": [{"key": "example.com/other", "effect": "NoExecute"}]},
                            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}

    def _patch_node(self, name: str, patch: dict, status: bool) -> dict:
        """A strategic merge patch as the API server applies it to a Node: status conditions merge by type;
        spec.taints (no merge key) is replaced whole."""
        node = self.nodes[name]
        if status:
            conditions = node["status"]["conditions"]
            for condition in patch.get("status", {}).get("conditions", []):
                conditions[:] = [c for c in conditions if c["type"] != condition["type"]] + [condition]
        else:
            node["spec"].update(patch.get("spec", {}))
        return node

    def _run_pod(self, pod: dict) -> dict:
        """The fake kubelet: run the pod's one container here, claims mapped to local folders."""
        spec = pod["spec"]
        [container] = spec["containers"]
        claims = {v["name"]: self.claims[v["persistentVolumeClaim"]["claimName"]] for v in spec.get("volumes", [])
                  if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] in self.claims}
        mounts = {m["mountPath"]: claims[m["name"]] for m in container.get("volumeMounts", []) if m["name"] in claims}
        command = [sys.executable if part == "python" else part for part in container["command"]]
        for mount, folder in mounts.items():
            command = [str(folder) + part[len(mount):] if part.startswith(mount) else part for part in command]
        done = subprocess.run(command, capture_output=True, text=True)
        pod["status"] = {"phase": "Succeeded" if done.returncode == 0 else "Failed"}
        pod["log"] = done.stdout + done.stderr
        return pod

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
                    return self._jobs(method, m.group(3), m.group(2), m.group(4))
                if (m := PODS.match(url.path)) and method == "POST":
                    pod = fake._run_pod(self._body())
                    fake.pods[(m.group(1), pod["metadata"]["name"])] = pod
                    return self._send(201, {k: v for k, v in pod.items() if k != "log"})
                if m := POD.match(url.path):
                    pod = fake.pods.get((m.group(1), m.group(2)))
                    if pod is None:
                        return self._not_found("pods", m.group(2))
                    if method == "DELETE":
                        fake.pods.pop((m.group(1), m.group(2)))
                    return self._send(200, {k: v for k, v in pod.items() if k != "log"})
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
                if (m := NODE.match(url.path)) and method in ("GET", "PATCH"):
                    if m.group(1) not in fake.nodes:
                        return self._not_found("nodes", m.group(1))
                    if method == "GET":
                        return self._send(200, fake.nodes[m.group(1)])
                    fake.patches.append((url.path, self.headers.get("Content-Type", "")))
                    return self._send(200, fake._patch_node(m.group(1), self._body(), bool(m.group(2))))
                if NODES.match(url.path) and method == "GET":
                    return self._send(200, {"apiVersion": "v1", "kind": "NodeList", "items": list(fake.nodes.values())})
                self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})

            def _not_found(self, kind: str, name: str) -> None:
                self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404,
                                 "message": f"{kind} {name!r} not found"})

            def _jobs(self, method: str, plural: str, namespace: str, name: str | None) -> None:
                if method == "POST" and name is None:
                    job = self._body()
                    key = (namespace, job["metadata"]["name"])
                    if key in fake.jobs:
                        return self._send(409, {"kind": "Status", "status": "Failure", "reason": "AlreadyExists",
                                                "code": 409, "message": f"{plural} {key[1]!r} already exists"})
                    job["metadata"]["uid"] = str(uuid.uuid4())
                    fake.jobs[key] = job
                    return self._send(201, job)
                if name is None or (namespace, name) not in fake.jobs:
                    return self._not_found(plural, name or "")
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

            def do_PATCH(self):
                self._route("PATCH")

        return Handler
