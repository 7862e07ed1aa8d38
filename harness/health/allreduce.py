"""All-reduce bus bandwidth through torch.distributed: inside a node, between node pairs, over all nodes.

Bus bandwidth is nccl-tests' measure (its PERFORMANCE.md): algbw = bytes / time, and for all-reduce
busbw = algbw * 2 (n - 1) / n, which is comparable across rank counts and close to the link's speed.
NCCL on GPUs, gloo on CPUs.

Between nodes, one rank per node. Node pairs come from the round-robin ("circle") schedule: in each
round every node meets a new partner, at most `rounds` rounds, so 448 nodes take 3 short all-reduces
each rather than 447. A slow node is slow with every partner; a partner of it is slow only once, so the
median over a node's pairs pins a slow link to the node at its end.
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

WARMUP, ITERS = 2, 5
TIMEOUT = timedelta(minutes=5)  # a node that never joins or hangs fails the health job, not the whole budget


def busbw_gbps(nbytes: int, seconds: float, ranks: int) -> float:
    return nbytes / seconds * 2 * (ranks - 1) / ranks / 1e9


def measure(nbytes: int, device: str, group=None) -> float:
    """Bus bandwidth (GB/s) of an all-reduce of `nbytes` over `group` (default: the whole world)."""
    import torch
    import torch.distributed as dist

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tensor = torch.ones(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(WARMUP):
        dist.all_reduce(tensor, group=group)
    sync()
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(ITERS):
        dist.all_reduce(tensor, group=group)
    sync()
    seconds = (time.perf_counter() - start) / ITERS
    return busbw_gbps(tensor.numel() * tensor.element_size(), seconds, dist.get_world_size(group))


def _intra_rank(rank: int, world: int, nbytes: int, cuda: bool, folder: str) -> None:
    import torch
    import torch.distributed as dist

    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        value = measure(nbytes, f"cuda:{rank}" if cuda else "cpu")
        if rank == 0:
            Path(folder, "busbw").write_text(repr(value))
    finally:
        dist.destroy_process_group()


def intra_node(ranks: int, nbytes: int, cuda: bool) -> float:
    """Bus bandwidth of `ranks` processes on this node (one per GPU, or CPU processes with gloo)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="harness-allreduce-") as folder:
        # fork is cheap and safe before CUDA is touched; CUDA ranks need a fresh interpreter.
        mp.start_processes(_intra_rank, args=(ranks, nbytes, cuda, folder), nprocs=ranks, join=True,
                           start_method="spawn" if cuda else "fork")
        return float(Path(folder, "busbw").read_text())


def pair_rounds(nodes: int, rounds: int) -> list[list[tuple[int, int]]]:
    """Up to `rounds` rounds of disjoint pairs by the circle method: node 0 stays, the others rotate.
    With an odd count one node sits out each round."""
    seats = list(range(nodes)) + ([None] if nodes % 2 else [])
    schedule = []
    for _ in range(min(rounds, len(seats) - 1)):
        half = len(seats) // 2
        pairs = [(a, b) for a, b in zip(seats[:half], reversed(seats[half:])) if a is not None and b is not None]
        schedule.append([tuple(sorted(p)) for p in pairs])
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return schedule


def between_nodes(node: str, nbytes: int, rounds: int, cuda: bool) -> dict:
    """This node's part of the pair rounds and the whole-set all-reduce, one rank per node, over the
    world that RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT describe (Slurm's SLURM_PROCID/SLURM_NTASKS stand in).
    Returns {"names": every node by rank, "pairs": [{"peer", "busbw_gbps"}], "world_busbw_gbps"}."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("RANK", os.environ.get("SLURM_PROCID", "0"))
    os.environ.setdefault("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))
    device = "cuda:0" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        names: list = [None] * world
        dist.all_gather_object(names, node)
        pairs = []
        for round_pairs in pair_rounds(world, rounds):
            mine, _ = dist.new_subgroups_by_enumeration([list(p) for p in round_pairs])
            if mine is not None:
                peer = next(b if a == rank else a for a, b in round_pairs if rank in (a, b))
                pairs.append({"peer": names[peer], "busbw_gbps": measure(nbytes, device, mine)})
        return {"names": names, "pairs": pairs, "world_busbw_gbps": measure(nbytes, device)}
    finally:
        dist.destroy_process_group()
