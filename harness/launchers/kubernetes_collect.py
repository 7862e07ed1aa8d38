"""Kubernetes collection: the job's run folder, copied back from the results volume.

Collection runs in short-lived pods on the results volume, read-only, and reads back through the pod-log
API: first a manifest of the run folder (every file but the checkpoints: name, size, sha256), then the
files' bytes in chunks, one pod per chunk. The kubelet rotates a container's log at 10 MiB
(containerLogMaxSize) and the log API serves only the newest part, so no pod prints more than
CHUNK_BYTES (base64: 4/3 of that). Nothing but the client's pod and log calls is needed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kubernetes import client as k8s

from harness.errors import HarnessError
from harness.launchers.base import Handle
from harness.launchers.kubernetes_api import Outage, call, clients, handle_job, retrying, to_dict
from harness.launchers.kubernetes_nodes import NODE_NAME_FIELD
from harness.launchers.kubernetes_render import own_pod, pull_secrets, results_volume, tolerations
from harness.launchers.kubernetes_resources import SMALL_POD
from harness.spec import JobSpec

MANIFEST_SCRIPT = """\
import hashlib, json, os, sys
root = sys.argv[1]
if not os.path.isdir(root):
    sys.exit(f"no folder {root}")
files = []
for folder, subfolders, names in os.walk(root):
    subfolders[:] = sorted(d for d in subfolders if os.path.relpath(os.path.join(folder, d), root) != "checkpoints")
    for name in sorted(names):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not os.path.islink(path):
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(2**20), b""):
                    digest.update(block)
            files.append([os.path.relpath(path, root), os.path.getsize(path), digest.hexdigest()])
print(json.dumps(files))
"""
CHUNK_SCRIPT = """\
import base64, json, os, sys
root, pieces = sys.argv[1], json.loads(sys.argv[2])
out = bytearray()
for name, offset, length in pieces:
    with open(os.path.join(root, name), "rb") as f:
        f.seek(offset)
        out += f.read(length)
sys.stdout.write(base64.b64encode(bytes(out)).decode())
"""
CHUNK_BYTES = 4 * 2**20  # 5.3 MiB of base64 per pod log, well under the kubelet's 10 MiB rotation
ARG_BYTES = 64 * 2**10  # a chunk's pieces, as one argument: Linux takes at most 128 KiB in one
COLLECT_TIMEOUT_S = 300
COLLECT_PODS = 16  # chunk pods at once: ~7,000 rank logs at 448 nodes are some 60 pods' work, not 60 in a row


@dataclass(frozen=True)
class RemoteFile:
    name: str  # relative to the run folder, POSIX
    size: int
    sha256: str


def parse_manifest(text: str) -> list[RemoteFile]:
    """The results pod's manifest; a name that tarfile's `data` filter would refuse or alter (absolute,
    '..', outside the folder) is refused, so nothing lands outside the local run folder."""
    try:
        files = [RemoteFile(str(name), int(size), str(digest)) for name, size, digest in json.loads(text)]
        for remote in files:
            member = tarfile.TarInfo(remote.name)
            member.size = remote.size
            if tarfile.data_filter(member, "/collect").name != remote.name or remote.size < 0:
                raise ValueError(f"{remote.name!r} is not a plain name inside the run folder")
        return files
    except (ValueError, TypeError, tarfile.FilterError) as exc:
        raise HarnessError(f"the results pod's manifest is unreadable: {exc}", 1) from None


def plan_chunks(files: list[RemoteFile], limit: int = CHUNK_BYTES,
                arg_limit: int = ARG_BYTES) -> list[list[tuple[str, int, int]]]:
    """(name, offset, length) pieces, grouped so that no chunk holds more than `limit` bytes, nor more
    pieces than fit in `arg_limit` bytes of arguments: small files share a chunk, a large one spans several."""
    chunks: list[list[tuple[str, int, int]]] = [[]]
    room = arg_room = 0

    def next_chunk() -> None:
        nonlocal room, arg_room
        if chunks[-1]:
            chunks.append([])
        room, arg_room = limit, arg_limit

    next_chunk()
    for remote in files:
        offset = 0
        while True:
            arg = len(json.dumps([remote.name, remote.size, remote.size])) + 2  # the piece's widest form
            if arg > arg_room:
                next_chunk()
            length = min(room, remote.size - offset)
            chunks[-1].append((remote.name, offset, length))
            offset, room, arg_room = offset + length, room - length, arg_room - arg
            if room == 0:
                next_chunk()
            if offset >= remote.size:
                break
    return [chunk for chunk in chunks if chunk]


def write_pieces(staging: Path, pieces: list[tuple[str, int, int]], log: str) -> None:
    """Write one chunk's bytes (its pod's log, base64) into the staged files at their offsets."""
    try:
        data = base64.b64decode(log.strip(), validate=True)
    except ValueError as exc:
        raise HarnessError(f"a results pod's chunk is unreadable: {exc}", 1) from None
    if len(data) != sum(length for _, _, length in pieces):
        raise HarnessError(f"a results pod's chunk holds {len(data)} bytes, not the "
                           f"{sum(length for _, _, length in pieces)} asked for; was its log cut?", 1)
    at = 0
    for name, offset, length in pieces:
        with open(staging / name, "r+b") as f:  # made by `stage`: chunks of one file are written side by side
            f.seek(offset)
            f.write(data[at:at + length])
        at += length


def stage(staging: Path, files: list[RemoteFile]) -> None:
    """Every file of the manifest at its size in the staging folder, before any chunk is written into it."""
    for remote in files:
        path = staging / remote.name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(remote.size)


def merge_run_folder(staging: Path, files: list[RemoteFile], out_dir: Path) -> tuple[list[Path], list[str]]:
    """Move the staged files into out_dir once each matches its manifest checksum: new files are added,
    identical ones skipped, and a local file that differs is kept as it is (and named), so nothing
    already written is lost."""
    for remote in files:
        path = staging / remote.name
        with open(path, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != remote.sha256:
                raise HarnessError(f"{remote.name} changed on the results volume while it was collected; "
                                   "run `harness collect` again", 1)
    fetched, kept = [], []
    for remote in files:
        source, target = staging / remote.name, out_dir / remote.name
        if target.exists() and target.read_bytes() == source.read_bytes():
            continue
        if target.exists():
            kept.append(remote.name)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)
        fetched.append(target)
    return fetched, kept


def collector_pod(spec: JobSpec, name: str, script: str, args: list[str], near: list[str] = ()) -> dict:
    """A one-shot pod that runs `script` on the results volume, read-only and unprivileged. Its image is the
    profile's kubernetes.collect_image (the scripts need only a Python, any small one), else the training image;
    the scheduler is asked to prefer the Nodes in `near` (those the job ran on: the training image is there
    already, and so is the volume's client)."""
    kube = spec.profile.kubernetes
    affinity = k8s.V1Affinity(node_affinity=k8s.V1NodeAffinity(
        preferred_during_scheduling_ignored_during_execution=[k8s.V1PreferredSchedulingTerm(
            weight=100, preference=k8s.V1NodeSelectorTerm(match_fields=[k8s.V1NodeSelectorRequirement(
                key=NODE_NAME_FIELD, operator="In", values=sorted(near))]))])) if near else None
    container = k8s.V1Container(
        name="collect", image=kube.collect_image or spec.profile.image, command=["python", "-c", script, *args],
        volume_mounts=[k8s.V1VolumeMount(name="results", mount_path=kube.results_mount, read_only=True)],
        resources=SMALL_POD,
        security_context=k8s.V1SecurityContext(privileged=False, allow_privilege_escalation=False,
                                               read_only_root_filesystem=True,
                                               capabilities=k8s.V1Capabilities(drop=["ALL"])))
    return own_pod(spec, to_dict(k8s.V1Pod(
        api_version="v1", kind="Pod",
        metadata=k8s.V1ObjectMeta(name=name, namespace=kube.namespace,
                                  labels={"app.kubernetes.io/name": "mlperf-harness", "mlperf-harness/role": "collect"}),
        spec=k8s.V1PodSpec(containers=[container], volumes=[results_volume(kube.results_pvc)],
                           restart_policy="Never", automount_service_account_token=False,
                           tolerations=tolerations(kube), image_pull_secrets=pull_secrets(kube), affinity=affinity))))


def collect(handle: Handle, poll_s: float = 1.0) -> list[Path]:
    """Copy the job's run folder from the results volume: a manifest, then the files in chunks, each
    through a one-shot pod and its log; checked against the manifest's checksums before use. The files whose
    chunks came back are kept even when some did not; those are then named in one error."""
    with tempfile.TemporaryDirectory(dir=handle.out_dir, prefix=".collect-") as staging:
        files, failed = fetch(handle, "", Path(staging), poll_s)
        fetched, kept = merge_run_folder(Path(staging), [f for f in files if f.name not in failed], handle.out_dir)
    if kept:
        print(f"harness: kept the local copies of {', '.join(kept)}, which differ from the results volume's",
              file=sys.stderr)
    if failed:
        why = "; ".join(sorted(set(failed.values())))
        raise HarnessError(f"{len(failed)} of {len(files)} file(s) did not come back from the results volume "
                           f"({', '.join(sorted(failed))}): {why}; they stay there (`harness collect "
                           f"{handle.out_dir}` tries again)", 1)
    return fetched


def fetch(handle: Handle, sub: str, into: Path, poll_s: float = 1.0) -> tuple[list[RemoteFile], dict[str, str]]:
    """Copy the folder `sub` of the job's run folder on the results volume ("": all of it) into `into`:
    a manifest, then the files in chunks, each through a one-shot pod and its log, up to COLLECT_PODS at once.
    Returns the manifest and {file: why} for the files a failed chunk pod left incomplete. `collect` checks
    every file against its checksum before use; the blame watch reads attempt records, whose reader skips a
    torn last line, so a torn copy at worst delays its judgement to a later poll."""
    spec, api, namespace, name = handle_job(handle)
    folder = handle.record().get("pvc_folder")
    if not folder:
        raise HarnessError(f"{handle.out_dir}/job.json names no folder on the results volume (pvc_folder); "
                           "it was submitted by an older harness", 1)
    folder = str(PurePosixPath(folder, sub)) if sub else folder
    _, core = clients()
    nonce = secrets.token_hex(3)
    pods = call("list the job's pods", core.list_namespaced_pod, namespace, label_selector=f"{api.pod_label}={name}")
    near = sorted({pod.spec.node_name for pod in pods.items if pod.spec and pod.spec.node_name})

    outage = Outage(lambda line: print(f"harness: {line}", file=sys.stderr, flush=True))  # one for all the pods

    def run_pod(step: str, script: str, args: list[str]) -> str:
        return _run_collector(core, spec, namespace, f"{name}-collect-{nonce}-{step}", script, args, folder, poll_s,
                              near, outage)

    files = parse_manifest(run_pod("m", MANIFEST_SCRIPT, [folder]))
    stage(into, files)

    def run_chunk(index: int, pieces: list[tuple[str, int, int]]) -> None:
        write_pieces(into, pieces, run_pod(str(index), CHUNK_SCRIPT, [folder, json.dumps(pieces)]))

    failed: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=COLLECT_PODS) as pool:
        chunks = {pool.submit(run_chunk, index, pieces): pieces for index, pieces in enumerate(plan_chunks(files))}
        for done in as_completed(chunks):
            if done.exception() is not None:
                if not isinstance(done.exception(), HarnessError):
                    raise done.exception()
                failed.update({piece[0]: str(done.exception()) for piece in chunks[done]})
    return files, failed


def _run_collector(core, spec: JobSpec, namespace: str, pod_name: str, script: str, args: list[str],
                   folder: str, poll_s: float, near: list[str], outage: Outage | None = None) -> str:
    """Run one collector pod to its end and return its log; the pod is deleted either way. Its reads wait out
    an API server outage (`outage`: said once for all the pods) until the pod's deadline, then say it."""
    outage = outage or Outage(lambda line: print(f"harness: {line}", file=sys.stderr, flush=True))
    call("start a results pod", core.create_namespaced_pod, namespace,
         collector_pod(spec, pod_name, script, args, near))
    try:
        deadline = time.monotonic() + COLLECT_TIMEOUT_S
        while (phase := retrying(outage, call, "read a results pod", core.read_namespaced_pod, pod_name,
                                 namespace, deadline=deadline).status.phase) not in ("Succeeded", "Failed"):
            if time.monotonic() > deadline:
                raise HarnessError(f"the results pod {namespace}/{pod_name} is still {phase} after "
                                   f"{COLLECT_TIMEOUT_S} s; is the claim {spec.profile.kubernetes.results_pvc} "
                                   "mountable (ReadWriteMany)?", 1)
            time.sleep(poll_s)
        # Raw bytes: the client would parse a log that reads as JSON (the manifest) and hand back its repr.
        log = retrying(outage, call, "read a results pod's log", core.read_namespaced_pod_log, pod_name, namespace,
                       _preload_content=False, deadline=deadline).data.decode(errors="replace")
        if phase == "Failed":
            raise HarnessError(f"the results pod {pod_name} could not read {folder} on "
                               f"{spec.profile.kubernetes.results_pvc}: {log.strip()[-500:]}", 1)
        return log
    finally:
        call("delete a results pod", core.delete_namespaced_pod, pod_name, namespace)
