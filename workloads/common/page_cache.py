"""cache_clear: drop the page cache before each run, as the MLPerf reference scripts do, and log what is true.

The reference launch scripts run `sync; echo 3 > /proc/sys/vm/drop_caches` on every node
before each run, so that no run starts with the dataset already in memory from the run
before. That needs root and a writable /proc/sys, which a container often lacks. Where a
node cannot, its stderr says why, and the run logs cache_clear false (the rules require
only that the key has a value) and notes it in the run record.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch.distributed as dist

from workloads.common.distributed import DistContext

DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache(control: Path = DROP_CACHES) -> str | None:
    """Write dirty pages back, then drop the clean page cache, dentries and inodes; None if done, else why not."""
    os.sync()
    try:
        with open(control, "w") as f:
            f.write("3\n")
    except OSError as exc:
        return f"cannot write {control}: {exc.strerror or exc}"
    return None


def clear_page_caches(ctx: DistContext, control: Path = DROP_CACHES) -> list[str]:
    """Drop the page cache once per node (its local rank 0); every rank gets the nodes' reasons for not doing so."""
    problem = None
    if ctx.local_rank == 0:
        problem = drop_page_cache(control)
        if problem:
            print(f"workloads: cache_clear: the page cache of {platform.node()} was not dropped ({problem}); "
                  "the run logs cache_clear false", file=sys.stderr, flush=True)
    problems: list = [None] * ctx.world_size
    dist.all_gather_object(problems, f"{platform.node()}: {problem}" if problem else None)
    return [p for p in problems if p]
