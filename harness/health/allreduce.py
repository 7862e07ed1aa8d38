"""All-reduce bus bandwidth through torch.distributed: inside a node, between node pairs, over all nodes.

Bus bandwidth is nccl-tests' measure (its PERFORMANCE.md): algbw = bytes / time, and for all-reduce
busbw = algbw * 2 (n - 1) / n, which is comparable across rank counts and close to the link's speed.
NCCL on GPUs, gloo on CPUs.

Between nodes, one process per local GPU: local rank i of node A meets local rank i of node B, which in
NCCL's topology uses GPU i's nearest NIC, so every GPU/NIC pair the node's NCCL would use is measured (one
rank per node would measure only GPU 0's NIC). Node pairs come from the round-robin ("circle") schedule: in
each round every node meets a new partner, at most `rounds` rounds, so 448 nodes take 3 short all-reduces
each rather than 447. A slow NIC is slow with every partner; a partner of it is slow only once, so the
median over a GPU's pairs pins a slow link to the node and GPU at its end.
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from harness.health import fault_scale

WARMUP, ITERS = 2, 5
PROGRESS_POLL_S = 1.0  # how often the node reads its pair ranks' results to rewrite its report
TIMEOUT = timedelta(minutes=5)  # a rank that never joins or hangs fails the node's check, not the whole budget


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


def _store(timeout_s: float, master: bool = False):
    """The c10d store at MASTER_ADDR:MASTER_PORT that the pair phase meets at (CPU only: no GPU is touched)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=master,
                         wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


NONBLOCKING_TIMEOUT_ENV = "TORCH_NCCL_NONBLOCKING_TIMEOUT"  # torch's bound on a non-blocking NCCL init (default 30 min)


def group_arguments(device: str, op_timeout_s: float) -> dict:
    """init_process_group's arguments for a pair or world group on `device`, every wait bounded by `op_timeout_s`.

    On NCCL the communicator is made eagerly (`device_id`: at init_process_group, not at the first all-reduce) and
    non-blocking (`config.blocking = 0`, NCCL >= 2.14): a partner that never comes (a GPU off the bus) then fails
    this rank's set-up after `op_timeout_s` (torch polls the init under TORCH_NCCL_NONBLOCKING_TIMEOUT, set here),
    where a blocking ncclCommInitRank waits without limit. Gloo's set-up is bounded by `timeout` alone."""
    import torch
    import torch.distributed as dist

    arguments: dict = {"backend": "gloo", "timeout": timedelta(seconds=op_timeout_s)}
    if device.startswith("cuda"):
        options = dist.ProcessGroupNCCL.Options()
        options.config.blocking = 0
        os.environ[NONBLOCKING_TIMEOUT_ENV] = str(max(1, int(op_timeout_s)))  # read once, at the first NCCL init
        arguments.update(backend="nccl", pg_options=options, device_id=torch.device(device))
    return arguments


def _measured_in(prefix: str, store, rank: int, world: int, nbytes: int, device: str, op_timeout_s: float) -> float:
    """Bus bandwidth over a process group of its own (`prefix` in the store): made, measured, and ended."""
    import torch.distributed as dist

    dist.init_process_group(store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            **group_arguments(device, op_timeout_s))
    try:
        return measure(nbytes, device)
    finally:
        dist.destroy_process_group()


def pair_rank(node: str, index: int, nodes: int, local: int, ranks: int, nbytes: int, rounds: int, cuda: bool,
              op_timeout_s: float, rendezvous_s: float):
    """Local rank `local` of node `index`: its all-reduce with local rank `local` of each partner node (on a GPU
    node GPU `local`, whose nearest NIC NCCL uses), then the whole set. Each pair is a process group of its
    own, so a dead or hung rank costs only its partners' measurement of it (after `op_timeout_s`), never the
    other pairs. Yields {"pairs": [{"peer", "busbw_gbps"[, "error"]}], "world_busbw_gbps"?} as it grows."""
    import torch

    began = time.monotonic()
    store = _store(rendezvous_s)
    # Every wait after the connect (a partner's NCCL unique id, gloo's rendezvous) is one operation's: a partner
    # that never comes costs this rank `op_timeout_s`, never the whole phase.
    store.set_timeout(timedelta(seconds=op_timeout_s))
    device = f"cuda:{local}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local)
    scale = fault_scale(node, "pair_busbw") * fault_scale(f"{node}@{local}", "pair_busbw")
    schedule = pair_rounds(nodes, rounds)
    # A partner still in its own checks arrives late; one that never started never does. Partners are waited for
    # until the time the remaining rounds and the whole-set all-reduce (one operation timeout each) leave.
    arrive_by = began + max(op_timeout_s, rendezvous_s - (len(schedule) + 1) * op_timeout_s)
    result: dict = {"pairs": []}
    for number, round_pairs in enumerate(schedule):
        pair = next((p for p in round_pairs if index in p), None)
        if pair is None:  # an odd count: this node sits this round out
            continue
        peer = pair[1] if pair[0] == index else pair[0]
        entry = {"peer": f"node #{peer}"}  # until the peer's node has said its name
        try:
            store.wait([f"node/{peer}"], timedelta(seconds=max(1.0, arrive_by - time.monotonic())))
        except RuntimeError:  # never joined (its health process never started): its node is blamed, not this one
            entry.update(busbw_gbps=0.0, absent=True, error=f"never joined the pair phase (rank {peer})")
            result["pairs"].append(entry)
            yield result
            continue
        try:
            entry["peer"] = store.get(f"node/{peer}").decode()
            entry["busbw_gbps"] = scale * _measured_in(f"pair/{number}/{pair[0]}-{pair[1]}/{local}", store,
                                                       pair.index(index), 2, nbytes, device, op_timeout_s)
        except RuntimeError as exc:  # the partner never came, died or hung: this link is unmeasured, which is no pass
            entry.update(busbw_gbps=0.0, error=str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        result["pairs"].append(entry)
        yield result
    try:
        result["world_busbw_gbps"] = _measured_in("world", store, index * ranks + local, nodes * ranks, nbytes,
                                                  device, op_timeout_s)
    except RuntimeError:  # a rank missing from the whole set: recorded as not measured (it judges no node)
        pass
    yield result


def _pairs_of(value: object) -> list[dict]:
    """The pairs a pair rank's child has written so far (its last yield, or the part it left before failing)."""
    if isinstance(value, dict) and isinstance(value.get("partial"), dict):
        value = value["partial"]
    return list(value.get("pairs", [])) if isinstance(value, dict) else []


def between_nodes(node: str, ranks: int, nbytes: int, rounds: int, cuda: bool, op_timeout_s: float,
                  deadline_s: float, progress=None) -> dict:
    """This node's part of the pair rounds and the whole-set all-reduce, over the nodes that RANK/WORLD_SIZE/
    MASTER_ADDR/MASTER_PORT describe (Slurm's SLURM_PROCID/SLURM_NTASKS stand in): one child process per
    local rank (`ranks`: the node's GPUs, each with its own NIC), each waited for at most `deadline_s`.
    This process touches no GPU; on the first node it holds the store the children meet at until every
    node is done. Returns {"rank", "pair_ranks", "pairs": [{"peer", "gpu", "busbw_gbps"[, "error", "absent"]}],
    "pair_failures": {local rank: why it left no result}, "world_busbw_gbps"[, "store_unreachable": why]}: a store
    that cannot be reached (rank 0's health process never started) is said, never raised. `progress`, if given,
    is called with the pairs measured so far each time they grow (the node rewrites its report with them)."""
    from harness.health.isolate import Child

    index = int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)
    nodes = int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
    started = time.monotonic()
    try:
        store = _store(deadline_s, master=index == 0)
        store.set(f"node/{index}", node)
    except RuntimeError as exc:  # torch's DistStoreError and DistNetworkError: no store, so no pair at all
        # Said in the report, so that the judge blames the store's node (rank 0) and not this one, unless other
        # nodes reached the store (preflight.store_fault).
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        verb = "could not serve" if index == 0 else "could not reach"
        return {"rank": index, "pair_ranks": ranks, "pairs": [], "pair_failures": {}, "world_busbw_gbps": None,
                "store_unreachable": f"{verb} the pair phase's store at {where} (rank 0's node): "
                                     f"{str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}"}
    children = [Child("pair_busbw", f"{node}@{local}", "harness.health.allreduce:pair_rank",
                      dict(node=node, index=index, nodes=nodes, local=local, ranks=ranks, nbytes=nbytes, rounds=rounds,
                           cuda=cuda, op_timeout_s=op_timeout_s, rendezvous_s=deadline_s))
                for local in range(ranks)]
    pairs, failures, world = [], {}, None
    if progress is not None:  # each finished pair reaches the node's report at once: a later hang loses none
        shown = None
        while any(child.running() for child in children) and time.monotonic() - started < deadline_s:
            so_far = [{**p, "gpu": local} for local, child in enumerate(children) for p in _pairs_of(child.peek())]
            if so_far != shown:
                shown = so_far
                progress({"rank": index, "pair_ranks": ranks, "pairs": so_far, "pair_failures": {}})
            time.sleep(PROGRESS_POLL_S)
    for local, child in enumerate(children):
        outcome = child.wait(deadline_s)  # from the child's start
        value = outcome.value if isinstance(outcome.value, dict) else {}
        pairs += [{**p, "gpu": local} for p in value.get("pairs", [])]
        if outcome.failure is not None:
            failures[local] = outcome.failure.note or outcome.failure.measured
        if local == 0:
            world = value.get("world_busbw_gbps")
    store.set(f"done/{index}", "1")
    if index == 0:  # the store must outlive every node's pairs
        try:
            store.wait([f"done/{i}" for i in range(nodes)],
                       timedelta(seconds=max(1.0, deadline_s - (time.monotonic() - started))))
        except RuntimeError:  # a node that never finishes is judged by its own report
            pass
    return {"rank": index, "pair_ranks": ranks, "pairs": pairs, "pair_failures": failures, "world_busbw_gbps": world}
