"""The warm-up: compile, autotune and open the communicators in the untimed init, then put every state back.

Time-to-train counts from run_start. Before it, the rules allow "model initialization" (training_rules.adoc, "Run
Results": up to 30 minutes in the closed division, from when the system "first begins to construct or execute the
model"), and NVIDIA's implementations spend it warming up on synthetic data. The clock must start before any part of
the system touches the dataset, so the warm-up reads none: each workload hands synthetic batches of the shapes its
run will see (Workload.warm_up_inputs: the training batch, and each eval batch shape, the last shorter one too),
and the warm-up runs the workload's own train step and evaluation on them, so what torch.compile builds (and
autotunes, and the allocator grows) is what the timed steps run. Every process group's communicator is created
by one collective on it first.

Then the model's parameters and buffers, its modules' train/eval modes, the gradients, the optimizer, the LR
schedule, the workload's counters (Workload.position) and every RNG go back to what they were, bit for bit, so the
timed run is the run it would have been without the warm-up (tests/test_warm_up.py compares every loss).

A resumed attempt does not warm up: its clock has run since the first run_start, so compiling in a warm-up or in
its first step costs the same; it reads the compiled code from the campaign's cache (compile_cache).
"""

from __future__ import annotations

import copy
import itertools
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from workloads.common.compiling import compile_seconds

CACHE_FOLDER = "compile_cache"  # in the run folder: one per campaign, on the storage every node shares


def use_campaign_cache(out: Path) -> Path:
    """Point torch.compile's caches (Inductor's FX graphs and kernels, AOTAutograd's graphs, the autotuning
    results, Triton's binaries, which Inductor keeps under the same folder) at the campaign's folder, before
    anything compiles: runs 2 to N and every restarted attempt, on every node, then read what run 1 built. A
    folder the environment already names (TORCHINDUCTOR_CACHE_DIR, say a node-local disk in a profile's env) wins.
    Inductor writes each entry to a temporary name and renames it, so ranks writing the same entry at once, over
    NFS too, leave one whole file."""
    chosen = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(out, CACHE_FOLDER).resolve()))
    return Path(chosen)


@dataclass
class WarmUpInputs:
    """Synthetic input of every shape a run will see: `train` is what `steps` train steps read from their
    iterator (grad_accum micro batches a step for the decoders), `eval` what one evaluation reads."""

    train: list[Any]
    steps: int
    eval: list[Any]


@dataclass(frozen=True)
class WarmedUp:
    """What the warm-up did, for the run record (the init's time) and the progress line."""

    train_steps: int
    eval_batches: int
    groups: int
    seconds: float
    compile_seconds: float  # of `seconds`, torch.compile's (dynamo, AOTAutograd, Inductor)

    def details(self) -> dict[str, Any]:
        return {"train_steps": self.train_steps, "eval_batches": self.eval_batches, "groups": self.groups,
                "compile_s": round(self.compile_seconds, 3)}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _tensors(model: torch.nn.Module):
    """What a train step can change: the trained parameters and the buffers (batch norm's statistics). A frozen
    parameter (LoRA's base, most of a 70B model) is left out of the copy: no optimizer step touches it."""
    return itertools.chain((p for p in model.parameters() if p.requires_grad), model.buffers())


class _Snapshot:
    """Everything a train step and an evaluation change, taken before the warm-up and put back after it."""

    def __init__(self, workload):
        self.workload = workload
        model = workload.model
        self.tensors = [_local(t).clone() for t in _tensors(model)]
        self.modes = [(m, m.training) for m in model.modules()]
        self.optimizer = copy.deepcopy(workload.optimizer.state_dict())
        scheduler = getattr(workload, "scheduler", None)
        self.scheduler = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
        self.position = copy.deepcopy(workload.position())
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
                    torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

    @torch.no_grad()
    def put_back(self) -> None:
        workload = self.workload
        # FSDP2 keeps a module's gathered parameters after a forward without backward (the root's, which does not
        # reshard after forward): the next forward would use those, the warm-up's, whatever the shards hold.
        for module in workload.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        # Read again, not kept from the snapshot: FSDP2 may have given a parameter new storage meanwhile.
        for tensor, saved in zip(_tensors(workload.model), self.tensors, strict=True):
            _local(tensor).copy_(saved)
        for module, training in self.modes:
            module.training = training
        for param in workload.model.parameters():
            param.grad = None
        workload.optimizer.load_state_dict(self.optimizer)
        if self.scheduler is not None:
            workload.scheduler.load_state_dict(self.scheduler)
        else:
            del workload.scheduler  # the stand-in (warm_up)
        workload.load_position(self.position)
        python, numpy, cpu, cuda = self.rng
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def open_communicators(workload) -> int:
    """One collective on each of the workload's process groups, so each creates its communicator now (NCCL's is
    made at a group's first collective: seconds at scale, and a peer's absence shows here, before the clock)."""
    groups = workload.process_groups()
    for group in groups:
        dist.all_reduce(torch.zeros(1, device=workload.ctx.device), group=group)
    return len(groups)


def warm_up(workload) -> WarmedUp | None:
    """Run the workload's train step and evaluation on its warm-up inputs, then put its state back; None for a
    workload that has none (it compiles in its first steps, on the clock)."""
    inputs = workload.warm_up_inputs()
    if inputs is None:
        return None
    started, compiled_before = time.perf_counter(), compile_seconds()
    snapshot = _Snapshot(workload)
    groups = open_communicators(workload)
    if snapshot.scheduler is None:
        # A schedule that waits on the data (ResNet's steps per epoch come from the image count) is built after
        # run_start; the step runs under a constant one meanwhile (the schedule is never compiled).
        workload.scheduler = torch.optim.lr_scheduler.LambdaLR(workload.optimizer, lambda step: 1.0)
    batches = iter(inputs.train)
    for _ in range(inputs.steps):
        workload.train_step(batches)
    workload.evaluate(inputs.eval)
    snapshot.put_back()
    dist.barrier()
    return WarmedUp(train_steps=inputs.steps, eval_batches=len(inputs.eval), groups=groups,
                    seconds=time.perf_counter() - started, compile_seconds=compile_seconds() - compiled_before)


def eval_batch_sizes(shard: int, batch: int) -> list[int]:
    """The distinct batch sizes a loader of `shard` samples in batches of `batch` yields, in order: the full
    batch, and the last, shorter one."""
    sizes = [batch] if shard >= batch else []
    if shard % batch:
        sizes.append(shard % batch)
    return sizes
