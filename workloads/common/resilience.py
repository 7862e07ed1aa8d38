"""What the training loop (workloads.common.loop) calls so that a run survives failures, whatever the workload.

    support.restore()            at the start: the step to continue from (0: a fresh run)
    support.after_step(step, loss)
                                 after each optimizer step: record, stop every rank together on a
                                 non-finite loss (when one was read), inject a fault, checkpoint when due
    with support.phase("eval")   around an evaluation, so the run record knows where the time went
    support.finish()             when the run stops: flush, wait for a save in flight, drop the checkpoints

The training state is the workload's model, optimizer and LR scheduler (through DCP's
get/set_state_dict, so DDP and FSDP2 save alike), each rank's RNG, the step, which is
also the data position (each workload starts reading input there), and whatever
counters the workload keeps beside it (Workload.position), and the open block of training
(its numbers for the log's block_stop after a resume).
"""

from __future__ import annotations

import errno
import math
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from workloads import STARTED
from workloads.common.checkpoint import Checkpointer
from workloads.common.compiling import compile_seconds
from workloads.common.distributed import DistContext
from workloads.common.inprocess import restarted_at
from workloads.common.metrics_feed import FEED
from workloads.common.mlperf import ResultLog
from workloads.common.progress import announce
from workloads.common.resilience_options import STALL_S, CheckpointEvery, FaultPlan, StragglerWindow
from workloads.common.run_record import RunRecord, current_attempt, run_record_path
from workloads.common.save_schedule import SaveSchedule
from workloads.common.stragglers import StragglerWatch

SLOW_FAULT_S = 0.2  # what --inject-failure RANK:STEP:slow adds to each forward pass


class TrainingDiverged(RuntimeError):
    """The loss is not finite: a workload error, which no restart can fix."""


def finite_everywhere(loss: float, ctx: DistContext) -> bool:
    """Whether every rank's loss is finite. Ranks read their loss at the same steps, and a rank-local loss
    can diverge alone: deciding alone, that rank would raise while the others went on into the next step's
    collective and hung there until the NCCL timeout. One flag, reduced to its minimum, makes them stop
    together with the same error."""
    flag = torch.tensor([1.0 if math.isfinite(loss) else 0.0], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@dataclass(frozen=True)
class Block:
    """A block of training between evaluations, in the unit the log's epoch_num counts."""

    first: int
    count: int


def evaluation_block(step: int, every: int, total: int, per_step: int, first: int | None = None) -> Block:
    """The block of training that begins after `step` when the evaluations follow step `first` (default: `every`)
    and then every `every` steps, none past `total`: from the evaluation at or before `step` (or the start) to the
    next, `per_step` of the log's unit a step (sequences, samples, tokens)."""
    first = every if first is None else first
    start = 0 if step < first else step - (step - first) % every
    end = min(total, first if step < first else start + every)
    return Block(start * per_step, (end - start) * per_step)


class InjectedFault(RuntimeError):
    """Raised by --inject-failure RANK:STEP:exception."""


class _ModelAndOptimizer(Stateful):
    """The model and its optimizer; with `frozen` False, only the parameters that train (LoRA's adapters: the
    frozen base comes back from its own checkpoint when the workload is built again). With `flat`, the optimizer's
    state and hyperparameters are keyed by parameter name (Workload.ranks_hold_other_parameters)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, frozen: bool = True,
                 flat: bool = False):
        self.model, self.optimizer = model, optimizer
        self.options = StateDictOptions(ignore_frozen_params=not frozen, strict=frozen,
                                        flatten_optimizer_state_dict=flat)

    def state_dict(self) -> dict[str, Any]:
        model, optim = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=self.options)


class _RankRNG(Stateful):
    """This rank's torch RNGs (data augmentation, dropout), so a resumed run draws what it would have."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)


class Resilience:
    """Checkpoints, restore, fault injection and the run record of one run (see the module docstring)."""

    def __init__(self, workload, out: Path, run_index: int, checkpoint_every: str | None, keep: int,
                 async_save: bool, inject_failure: str | None, mlog: ResultLog, straggler_window: str = "60",
                 straggler_threshold: float = 0.75):
        self.workload, self.ctx, self.mlog = workload, workload.ctx, mlog
        ctx: DistContext = self.ctx
        self.attempt = current_attempt()
        self.schedule = SaveSchedule(CheckpointEvery.parse(checkpoint_every) if checkpoint_every else None, ctx)
        self.checkpointer = Checkpointer(Path(out) / "checkpoints" / f"run_{run_index}", ctx, keep=keep,
                                         async_save=async_save, report=lambda text: announce(text, ctx.is_main))
        fault = FaultPlan.parse(inject_failure) if inject_failure else None
        # A fault fires on the first attempt only, so the restarted run can finish.
        self.fault = fault if fault and fault.rank == ctx.rank and self.attempt == 0 else None
        self.record_path = run_record_path(out, run_index)
        self.record = RunRecord(self.record_path if ctx.is_main else None, self.attempt,
                                compile_seconds if workload.compiled else None)
        window = StragglerWindow.parse(straggler_window)
        self.stragglers = StragglerWatch(workload.model, ctx, self.record, window, straggler_threshold) \
            if not window.off and ctx.world_size > 1 else None
        self._step_started = time.time()
        self.block: Block | None = None  # the open block, set by the training loop and saved with each checkpoint
        self.save_seconds = 0.0  # spent in checkpoint saves so far: throughput leaves it out

    # --- start ---------------------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest valid checkpoint of this run, if any; returns its step (0 for a fresh start)."""
        started = time.time()
        # A resumed attempt's start-up began when its process did, or when it re-entered the campaign after a restart
        # in process; a fresh run's at run_start (now).
        self.record.interval("startup", (restarted_at() or STARTED) if self.attempt else started, started)
        restored = self.checkpointer.restore(self._state)
        step = 0
        if restored is not None:
            step = restored.step
            self.workload.scheduler.load_state_dict(restored.extra["scheduler"])
            self.workload.load_position(restored.extra.get("position", {}))
            self.block = Block(**restored.extra["block"]) if restored.extra.get("block") else None
            self.record.interval("restore", started, time.time(), (step, step))
            announce(f"resumed from {restored.path} at step {step}", self.ctx.is_main)
        self.schedule.restart(step)
        self._step_started = time.time()
        return step

    def _state(self, manifest: dict | None = None) -> dict[str, Any]:
        state: dict[str, Any] = {"train": _ModelAndOptimizer(
            self.workload.model, self.workload.optimizer, getattr(self.workload, "checkpoint_frozen", True),
            getattr(self.workload, "ranks_hold_other_parameters", False))}
        # RNG states are per rank: restorable only onto the same world size.
        if manifest is None or manifest.get("world_size") == self.ctx.world_size:
            state[f"rng_rank{self.ctx.rank}"] = _RankRNG(self.ctx.device)
        return state

    # --- each step ------------------------------------------------------------------------------

    def after_step(self, step: int, loss: float | None = None) -> None:
        self.record.trained(step, self._step_started)
        seconds = time.time() - self._step_started
        FEED.step(step, seconds, loss)
        if self.stragglers:
            self.stragglers.after_step(step, seconds)
        if loss is not None and not finite_everywhere(loss, self.ctx):
            # The loss is read every few steps: the first non-finite one may lie a few steps before this.
            raise TrainingDiverged(f"the training loss is not finite by step {step} (the read at that step on "
                                   f"this rank: {loss})")
        if self.fault and step == self.fault.step:
            self._inject(step)
        if self.schedule.due(step):
            self.save(step)
        self._step_started = time.time()

    def save(self, step: int) -> None:
        self.record.flush()
        FEED.state("checkpoint")
        self.mlog.sync()  # on disk before the checkpoint: a run resumed from it never finds its log behind it
        started = time.time()
        self.checkpointer.save(step, self._state(), {"scheduler": self.workload.scheduler.state_dict(),
                                                     "position": self.workload.position(),
                                                     "block": asdict(self.block) if self.block else None})
        self.record.interval("save", started, time.time(), (step, step))
        self.save_seconds += time.time() - started
        self.schedule.restart(step)

    @contextmanager
    def phase(self, kind: str, step: int):
        """Time a non-training phase (eval, after `step`) in the run record."""
        self.record.flush()
        FEED.state(kind)
        started = time.time()
        try:
            yield
        finally:
            self.record.interval(kind, started, time.time(), (step, step), self.record.compiled_since())
            self._step_started = time.time()

    def finish(self) -> None:
        self.record.flush()
        if self.stragglers:
            self.stragglers.close()
        self.checkpointer.remove_all()

    # --- faults --------------------------------------------------------------------------------

    def _inject(self, step: int) -> None:
        kind = self.fault.kind
        announce(f"injecting fault {kind!r} on rank {self.ctx.rank} at step {step} (--inject-failure)")
        if kind == "exception":
            raise InjectedFault(f"injected workload error at step {step}")
        if kind == "io-error":
            self._note_fault(step)
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected at step {step})")
        if kind == "slow":
            inner = getattr(self.workload.model, "module", self.workload.model)
            inner.register_forward_pre_hook(lambda module, args: _compute_for(SLOW_FAULT_S) if module.training else None)
            return
        if kind in ("stall", "hang"):
            self._hold(step, STALL_S if kind == "stall" else None)
            return
        if kind == "kill-in-save":
            # A save is a collective, which no rank may start alone: the fault waits for the next agreed save.
            self.checkpointer.fault_hook = self._kill
            return
        if kind == "corrupt":
            committed = self.checkpointer.committed()
            if committed:
                _damage(committed[0][1])
        self._kill(step)

    def _hold(self, step: int, seconds: float | None) -> None:
        """Stop here for `seconds`, or for good (None), neither stepping nor exiting, as a rank on a stalled or
        hung GPU does; rank 0's record of the steps so far is on disk first, so a watcher sees where it stopped."""
        self.record.flush()
        FEED.flush()
        now = time.time()
        RunRecord(self.record_path, self.attempt).interval("fault", now, now, (step, step))
        while seconds is None:
            time.sleep(3600)
        time.sleep(seconds)

    def _kill(self, step: int) -> None:
        """SIGKILL this worker, first noting the moment in the run record (whichever rank this is)."""
        self._note_fault(step)
        os.kill(os.getpid(), signal.SIGKILL)

    def _note_fault(self, step: int) -> None:
        now = time.time()
        RunRecord(self.record_path, self.attempt).interval("fault", now, now, (step, step))


def _compute_for(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU time: a forward pass that computes longer, which the straggler watch
    sees on CPU (it times CPU time there, so a sleep would be invisible) and on GPUs (the kernels start later)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _damage(folder: Path) -> None:
    """Flip bytes in the middle of a checkpoint's largest shard (a disk or copy error, for tests)."""
    shard = max(folder.glob("__*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        data = f.read(64)
        f.seek(shard.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in data))
