"""How long training waits for an async checkpoint, against a synchronous save of the same state
(goal: at least 10x less).

    python bench/async_checkpoint.py [--mib 512] [--repeats 3] [--json results/bench/async_checkpoint.json]

One process, gloo, the harness's Checkpointer (DCP write, fsync, per-file sha256,
manifest, rename). The state is a ResNet-50-sized set of fp32 tensors scaled to --mib.
Blocking time is what Checkpointer.save returns: the whole save when synchronous; the
staging copy to host memory when async (the write and commit go on in the background,
and are waited for, untimed, before the next save).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from workloads.common.checkpoint import Checkpointer
from workloads.common.distributed import DistContext

from summary import machine, publish  # bench/summary.py, beside this script


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="state size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    tensors = args.mib * 2**20 // 4 // 2**20  # 1 Mi-element (4 MiB) tensors
    state = {f"layer{i}": torch.randn(2**20) for i in range(tensors)}
    figures = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        for mode in ("sync", "async"):
            ckpt = Checkpointer(Path(tmp) / mode, ctx, keep=1, async_save=mode == "async")
            blocked = []
            for step in range(1, args.repeats + 1):
                blocked.append(ckpt.save(step, state, {}))
                ckpt.wait()
            figures[mode] = {"median_s": round(statistics.median(blocked), 4), "all_s": [round(b, 4) for b in blocked]}
    dist.destroy_process_group()
    ratio = figures["sync"]["median_s"] / figures["async"]["median_s"]
    summary = {"machine": machine(),
               "state_mib": args.mib, "blocking": figures, "sync_over_async": round(ratio, 1),
               "goal_ratio": 10.0, "met": ratio >= 10.0}
    publish(summary, args.json)
    return 0 if summary["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
