"""cache_clear: flush the page cache before each run, as the MLPerf reference scripts do, and log what is true.

The rules: "You must flush the cache or restart the system prior to benchmarking" (training_rules.adoc, Data
State at Start of Run). NVIDIA's submission scripts do it on the host, outside the container, on every node
before each run: `srun --ntasks="${SLURM_JOB_NUM_NODES}" bash -c "... sync && ${DROPCACHE_CMD}"` with
DROPCACHE_CMD `sudo /sbin/sysctl vm.drop_caches=3`, then log cache_clear true, in their loop over the runs
(run.sub in mlcommons/training_results_v3.1 NVIDIA/benchmarks/bert/implementations/v30-pytorch). An
unprivileged pod or a rootless container cannot write /proc/sys/vm/drop_caches, so the launchers run the flush
where it can work: Slurm as a host-side step per node before each run's own training step, Kubernetes as a
privileged init container per pod where the profile opts in (harness.cache_flush renders both). That step
leaves one record per node in <out>/page_cache/<hostname>: "flushed", or why not. A run takes its node's
record (once: a later run of the same launch has none) and otherwise tries the flush itself, which works
where the worker is root on the host; the run record says which did it (NodeFlush.by).

A closed run whose cache was not flushed on every node stops with the reasons before init_start, unless
the user accepts it (--allow-unflushed-cache); either way the log's cache_clear says what happened and the
run record says why.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the launchers render the flush step from here
    from workloads.common.distributed import DistContext

DROP_CACHES = Path("/proc/sys/vm/drop_caches")
HOST_FLUSH_COMMAND = f"sync && echo 3 > {DROP_CACHES}"  # the reference scripts' flush; a profile may name another
RECORDS = "page_cache"  # <out>/page_cache/<hostname>: what the launcher's per-node flush step did
FLUSHED = "flushed"
ALLOW_FLAG = "--allow-unflushed-cache"
HOST, WORKER = "host", "worker"  # who flushed a node (or tried last): the launcher's step, or the run's own worker


@dataclass(frozen=True)
class NodeFlush:
    """One node's flush before a run: who did it (HOST or WORKER) and, if it was not done, why not."""

    node: str
    by: str
    problem: str | None = None


def host_flush_script(out_dir: str, command: str = HOST_FLUSH_COMMAND) -> str:
    """The bash script the launcher's per-node step runs outside the training container: flush, and record on
    the shared output folder, under this node's hostname, whether it did or why not."""
    folder = shlex.quote(f"{out_dir}/{RECORDS}")
    return (f'mkdir -p {folder} && record={folder}/"$(hostname)" && '
            f'if why=$( ( {command} ) 2>&1 ); then echo {FLUSHED} > "$record"; '
            f'else echo "host flush failed ({command}): ${{why:-no message}}" | tr "\\n" " " > "$record"; fi')


def drop_page_cache(control: Path | None = None) -> str | None:
    """Write dirty pages back, then drop the clean page cache, dentries and inodes; None if done, else why not."""
    control = control or DROP_CACHES
    os.sync()
    try:
        with open(control, "w") as f:
            f.write("3\n")
    except OSError as exc:
        return f"cannot write {control}: {exc.strerror or exc}"
    return None


def take_host_record(out: Path) -> str | None:
    """This node's record from the launcher's flush step (removed as it is read), or None if there is none."""
    record = out / RECORDS / platform.node()
    try:
        text = record.read_text().strip()
    except OSError:
        return None
    record.unlink(missing_ok=True)
    return text


def flush_node(out: Path, control: Path | None = None) -> NodeFlush:
    """Take the launcher's flush of this node's page cache, or else flush it from here."""
    host = take_host_record(out)
    if host == FLUSHED:
        return NodeFlush(platform.node(), HOST)
    problem = drop_page_cache(control)
    return NodeFlush(platform.node(), WORKER, f"{host}; in the container: {problem}" if host and problem else problem)


def clear_page_caches(ctx: "DistContext", out: Path, control: Path | None = None) -> list[NodeFlush]:
    """Flush once per node (its local rank 0); every rank gets every node's NodeFlush."""
    import torch.distributed as dist

    flush = None
    if ctx.local_rank == 0:
        flush = flush_node(out, control)
        if flush.problem:
            print(f"workloads: cache_clear: the page cache of {flush.node} was not dropped ({flush.problem}); "
                  "the run logs cache_clear false", file=sys.stderr, flush=True)
    flushes: list = [None] * ctx.world_size
    dist.all_gather_object(flushes, flush)
    return [f for f in flushes if f is not None]


def refuse_unflushed(run: int, problems: list[str]) -> str:
    """The one-line reason a closed run stops when its cache was not flushed."""
    return (f"workloads: closed run {run + 1} stops before init_start: MLPerf's rules require flushing the page cache "
            f"before each run, and it was not flushed ({'; '.join(problems)}). Flush it on the host (Slurm: the "
            "job's per-node flush step needs root on the nodes: set the profile's slurm.flush_page_cache to e.g. "
            "'sudo /sbin/sysctl vm.drop_caches=3'; Kubernetes: the profile's kubernetes.flush_page_cache privileged "
            f"init step), or accept it with {ALLOW_FLAG} (the log keeps cache_clear false)")
