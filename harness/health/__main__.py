"""`python -m harness.health`: run every preflight check on this node and write <out>/preflight/nodes/<node>.json.

Started once per node by the launcher's health job. With WORLD_SIZE (or SLURM_NTASKS) above 1 the
nodes then meet for the between-node all-reduces (pairs, then all), one process per local GPU. This
process touches no GPU itself: every NVML and CUDA call runs in a child with a deadline, so a hung GPU
fails its check instead of holding the node. The node only measures; the submitting side
(harness.preflight) judges, so one rule decides for every node.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from harness.health import NODES_DIR, Check, at_least, fault_scale, skipped
from harness.health.allreduce import between_nodes
from harness.health.gpu import NO_GPU, UNDER_LOAD, nvml_checks
from harness.health.isolate import Child, checks_of, isolated, stop_children
from harness.health.ib import HCA_ENV, SYSFS_ROOT, ib_checks
from harness.health.storage import storage_checks
from harness.health.thresholds import resolve

CPU_RANKS = 2  # gloo processes for the intra-node all-reduce on a CPU node
REPORT_MARGIN_S = 30  # of the phase's deadline, kept to write the report after the between-node phase


KILL_AT_ENV = "HARNESS_HEALTH_KILL_AT"  # the scheduler's end of the health step, epoch seconds, where it tells it


def _kill_at() -> float | None:
    try:
        return float(os.environ[KILL_AT_ENV])
    except (KeyError, ValueError):
        return None


def phase_seconds(deadline_s: float, elapsed: float, now: float, kill_at: float | None) -> float:
    """How long the between-node phase may take: the node's own deadline counts from its own start (after the image
    pull: the scheduler's limit is `deadline_s` + `start_allowance_s`), and where the scheduler's end is known
    (`kill_at`, on this cluster's clock: Slurm's batch script writes it) it ends no later, so that the node rewrites
    its report before it is killed. REPORT_MARGIN_S is kept for that either way."""
    left = deadline_s - elapsed
    if kill_at is not None:
        left = min(left, kill_at - now)
    return left - REPORT_MARGIN_S


def node_name() -> str:
    """Slurm's node name, the Kubernetes node (NODE_NAME from the downward API), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or os.environ.get("NODE_NAME") or socket.gethostname()


def local_checks(node: str, out: Path, settings: dict, gpus: int, rdma: int, sysfs: Path,
                 checkpoints_gib: float | None = None) -> tuple[list, dict, dict]:
    """Every check of this node alone, the thresholds they were held to, and what the node has ({"gpu": its
    model, "cuda_devices"}). Whatever calls NVML or CUDA runs in a child process with a deadline
    (harness.health.isolate): a hung GPU fails its check, and the node's other checks still run."""
    deadline = float(resolve(settings, None)["check_deadline_s"])
    found = isolated("gpu_inventory", node, "harness.health.gpu:inventory", {}, deadline)
    name = found.value["gpu"] if found.failure is None else None
    th = resolve(settings, name)
    if found.failure is not None:  # nothing on this node's GPUs can be trusted to answer
        checks = [found.failure]
        devices = 0
    else:
        devices = found.value["cuda_devices"]
        xid = Child("xid_events", node, "harness.health.gpu:xid_watch", {}, watch=True) if name else None
        checks = checks_of(isolated("matmul_tflops", node, "harness.health.gpu:under_load", dict(node=node, th=th),
                                    deadline)) if gpus and devices else [skipped(c, NO_GPU) for c in UNDER_LOAD]
        checks.append(_intra_node(node, th, devices if name else CPU_RANKS, name is not None, deadline))
        checks += checks_of(isolated("nvml", node, "harness.health.gpu:nvml_readings", dict(expected=gpus, th=th),
                                     deadline)) if name else nvml_checks(None, gpus, th)
        checks += checks_of(xid.wait(deadline)) if xid else [skipped("xid_events", NO_GPU)]
    checks += ib_checks(th, rdma, sysfs, os.environ.get(HCA_ENV))  # the HCAs NCCL uses, not every port
    checks += storage_checks(out / "preflight", node, th["min_free_gib"], checkpoints_gib)
    return checks, th, {"gpu": name, "cuda_devices": devices}


def _intra_node(node: str, th: dict, ranks: int, cuda: bool, deadline: float) -> Check:
    if ranks < 2:
        return skipped("allreduce_busbw", f"{ranks} usable GPU(s): nothing to all-reduce inside the node")
    done = isolated("allreduce_busbw", node, "harness.health.allreduce:intra_node",
                    dict(ranks=ranks, nbytes=th["allreduce_mib"] << 20, cuda=cuda), deadline)
    if done.failure is not None:
        return done.failure
    return at_least("allreduce_busbw", done.value * fault_scale(node, "allreduce_busbw"),
                    th["min_allreduce_busbw_gbps"], "GB/s",
                    f"{ranks} {'GPUs' if cuda else 'CPU processes'}, {th['allreduce_mib']} MiB")


def _write(path: Path, record: dict) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=2) + "\n")
    temporary.replace(path)  # a reader never sees half a report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.health", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the run folder (shared by every node)")
    parser.add_argument("--settings", default="{}", help="the profile's preflight settings, as JSON")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs the profile promises per node")
    parser.add_argument("--rdma", type=int, default=0, help="InfiniBand HCAs the profile promises per node")
    parser.add_argument("--checkpoints-gib", type=float, help="the space the run's checkpoints take in the run folder")
    parser.add_argument("--sysfs", type=Path, default=SYSFS_ROOT, help=argparse.SUPPRESS)  # tests
    # tests: processes per CPU node in the pair phase, standing in for a GPU node's one per GPU
    parser.add_argument("--cpu-pair-ranks", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # `started` stamps the report (the preflight watcher tells passes apart by it); durations are on the
    # monotonic clock, which NTP stepping the node's clock mid-check (chrony's makestep after boot) does not move.
    started, clock = time.time(), time.monotonic()
    node = node_name()
    checks, th, found = local_checks(node, args.out, json.loads(args.settings), args.gpus, args.rdma, args.sysfs,
                                     args.checkpoints_gib)
    record = {"node": node, "started": started, "gpu": found["gpu"], "thresholds": th,
              "checks": [c.to_dict() for c in checks]}
    path = args.out / NODES_DIR / f"{node}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, record)  # now, so a node that dies in the all-reduces below still shows what it measured
    if int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1) > 1:
        # Every node runs as many pair ranks as the profile promises GPUs (a GPU missing here fails its own
        # pairs), so that local rank i of each node has its partners.
        cuda = found["gpu"] is not None and args.gpus > 0
        left = phase_seconds(th["deadline_s"], time.monotonic() - clock, time.time(), _kill_at())
        links = between_nodes(node, args.gpus if cuda else args.cpu_pair_ranks, th["pair_mib"] << 20,
                              th["pair_rounds"], cuda, th["check_deadline_s"], max(th["check_deadline_s"], int(left)),
                              progress=lambda so_far: _write(path, {**record, **so_far}))
        world = links.pop("world_busbw_gbps")
        record.update(links, world_busbw_gbps=None if world is None else world * fault_scale(node, "world_busbw"))
    record["seconds"] = round(time.monotonic() - clock, 3)
    _write(path, record)
    failed = [c for c in checks if c.verdict == "fail"]
    print(f"harness.health: {node}: {len(checks)} checks, {len(failed)} failed"
          + (f" ({', '.join(sorted({c.name for c in failed}))})" if failed else ""), flush=True)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stop_children)  # here only: main() also runs inside tests' processes
    sys.exit(main())
