"""Process-group setup from the environment every launcher sets (torchrun's RANK, WORLD_SIZE, ...).

Workloads never import a launcher: they only read this standard environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)


def init_distributed() -> DistContext:
    """Join the process group: NCCL when this rank has a GPU, gloo on CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        store = {"store": _store, "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])} \
            if _store is not None else {}
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None, **store)
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), device=device)


_checkpoint_group: dist.ProcessGroup | None = None
_store: dist.Store | None = None  # where init_distributed meets, instead of the environment's (a restart in process)


def use_store(store: dist.Store) -> None:
    """Meet in `store` at the next init_distributed: each in-process restart (workloads.common.inprocess) re-forms
    the groups under a prefix of its own, since the last ones' addresses are stale. The checkpoint group went with
    the groups the restart destroyed."""
    global _store, _checkpoint_group
    _store, _checkpoint_group = store, None


def checkpoint_group() -> dist.ProcessGroup:
    """The gloo group for checkpoint work, created on first use and shared by every run of the process.

    Checkpoint collectives get their own group so that an async writer's never interleave with
    training's, and it is gloo so that it works the same under NCCL. A new group per run would
    open another full mesh of TCP connections (N-1 per process, 3,583 at 3,584 ranks) every run.
    """
    global _checkpoint_group
    if _checkpoint_group is None:
        _checkpoint_group = dist.new_group(backend="gloo")
    return _checkpoint_group


def shutdown_distributed() -> None:
    """Leave the process group, the checkpoint group included."""
    global _checkpoint_group
    _checkpoint_group = None
    dist.destroy_process_group()  # every group, the default one last


def all_sum(values: list[float], ctx: DistContext) -> list[float]:
    """Sum a few numbers over all ranks (eval counts, losses)."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()


def broadcast_object(obj, ctx: DistContext):
    """Rank 0's value of `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=ctx.device)
    return box[0]
