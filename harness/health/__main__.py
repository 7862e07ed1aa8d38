"""`python -m harness.health`: run every preflight check on this node and write <out>/preflight/nodes/<node>.json.

Started once per node by the launcher's health job. With WORLD_SIZE (or SLURM_NTASKS) above 1 the
nodes then meet for the between-node all-reduces (pairs, then all). The node only measures; the
submitting side (harness.preflight) judges, so one rule decides for every node.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

from harness.health import NODES_DIR, at_least, fault_scale, skipped
from harness.health.allreduce import between_nodes, intra_node
from harness.health.gpu import NO_GPU, XidWatch, gpu_name, load_nvml, matmul_tflops, nvml_checks
from harness.health.ib import HCA_ENV, SYSFS_ROOT, ib_checks
from harness.health.storage import storage_checks
from harness.health.thresholds import resolve

CPU_RANKS = 2  # gloo processes for the intra-node all-reduce on a CPU node


def node_name() -> str:
    """Slurm's node name, the Kubernetes node (NODE_NAME from the downward API), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or os.environ.get("NODE_NAME") or socket.gethostname()


def _cuda_devices() -> int:
    """The GPUs this process may use (a container or CUDA_VISIBLE_DEVICES can show fewer than NVML does)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_checks(node: str, out: Path, settings: dict, gpus: int, rdma: int, nvml, sysfs: Path) -> tuple[list, dict]:
    """Every check of this node alone, and the thresholds they were held to."""
    name = gpu_name(nvml)
    th = resolve(settings, name)
    watch = XidWatch(nvml) if nvml is not None else None
    checks = matmul_tflops(node, gpus, th["min_matmul_tflops"])
    cuda = name is not None
    ranks = _cuda_devices() if cuda else CPU_RANKS
    if ranks >= 2:
        busbw = intra_node(ranks, th["allreduce_mib"] << 20, cuda) * fault_scale(node, "allreduce_busbw")
        checks.append(at_least("allreduce_busbw", busbw, th["min_allreduce_busbw_gbps"], "GB/s",
                               f"{ranks} {'GPUs' if cuda else 'CPU processes'}, {th['allreduce_mib']} MiB"))
    else:
        checks.append(skipped("allreduce_busbw", f"{ranks} usable GPU(s): nothing to all-reduce inside the node"))
    checks += nvml_checks(nvml, gpus, th)  # after the load: PCIe links leave their idle state under work
    checks.append(watch.check() if watch else skipped("xid_events", NO_GPU))
    checks += ib_checks(th, rdma, sysfs, os.environ.get(HCA_ENV))  # the HCAs NCCL uses, not every port
    checks += storage_checks(out / "preflight", node, th["min_free_gib"])
    return checks, th


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
    parser.add_argument("--sysfs", type=Path, default=SYSFS_ROOT, help=argparse.SUPPRESS)  # tests
    args = parser.parse_args(argv)
    started = time.time()
    node = node_name()
    nvml = load_nvml()
    checks, th = local_checks(node, args.out, json.loads(args.settings), args.gpus, args.rdma, nvml, args.sysfs)
    record = {"node": node, "started": started, "gpu": gpu_name(nvml), "thresholds": th,
              "checks": [c.to_dict() for c in checks]}
    path = args.out / NODES_DIR / f"{node}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, record)  # now, so a node that dies in the all-reduces below still shows what it measured
    if int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1) > 1:
        links = between_nodes(node, th["pair_mib"] << 20, th["pair_rounds"], nvml is not None and args.gpus > 0)
        scale = fault_scale(node, "pair_busbw")
        record["pairs"] = [{**p, "busbw_gbps": p["busbw_gbps"] * scale} for p in links["pairs"]]
        record["world_busbw_gbps"] = links["world_busbw_gbps"] * fault_scale(node, "world_busbw")
        record["world"] = links["names"]
    record["seconds"] = round(time.time() - started, 3)
    _write(path, record)
    failed = [c for c in checks if c.verdict == "fail"]
    print(f"harness.health: {node}: {len(checks)} checks, {len(failed)} failed"
          + (f" ({', '.join(sorted({c.name for c in failed}))})" if failed else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
