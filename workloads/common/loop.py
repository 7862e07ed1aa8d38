"""The one training loop every benchmark runs: resume, blocks, evaluations and checkpoints.

MLPerf times a run as blocks of training, each closed by an evaluation; the run stops at the
first evaluation that reaches the target, or at the step limit. What differs between benchmarks
is only the model, the data and the step, and the unit that the log's `epoch_num` counts
(epochs for ResNet, sequences for BERT, tokens for GPT-3): the Workload answers those questions
(see campaign.Workload), and this loop owns the rest, so a fix to resuming, blocks or saving is
made once.

Resuming: the step support.restore() returns is where the input continues. A run resumed inside
a block continues that block (its block_start is logged already; the block's numbers come back
from the checkpoint). A run resumed right after the step that closes a block (the last step
included) evaluates first, since the checkpoint was taken before that evaluation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from mlperf_logging.mllog import constants as C

from workloads.common import mlperf as K
from workloads.common.progress import Progress
from workloads.common.resilience import Resilience

LOSS_READ_EVERY = 10  # .item() waits for the device: the loss is read every this many steps and at block ends


@dataclass
class _BlockClock:
    """Samples trained and seconds spent training in the open block. Checkpoint saves are left out, and so is
    an attempt's first step (compilation); a resumed block counts only what this attempt trained. So the rate
    is the steady training rate."""

    started: float
    saves_before: float
    samples: int = 0

    def rate(self, support: Resilience) -> float:
        seconds = time.perf_counter() - self.started - (support.save_seconds - self.saves_before)
        return self.samples / seconds if seconds > 0 else 0.0


class _LossReader:
    """Reads the loss every LOSS_READ_EVERY steps. The losses between reads stay on the device (detached
    scalars) and are all checked at the read, so a NaN in an unread step is still caught (the read then
    reports NaN), and a step that is not read adds no device operation (bench/loop_overhead.py)."""

    def __init__(self):
        self.unread: list[torch.Tensor] = []

    def after(self, loss: torch.Tensor, read: bool) -> float | None:
        self.unread.append(loss)
        if not read:
            return None
        losses = torch.stack(self.unread).float()
        self.unread.clear()
        value, finite = torch.stack([losses[-1], losses.isfinite().all().float()]).tolist()
        return value if finite else float("nan")


@dataclass(frozen=True)
class Target:
    """The quality a run trains to, and how it is shown."""

    name: str  # in messages: "top-1"
    short: str  # on the progress bar: "top1"
    value: float
    higher_is_better: bool = True

    def reached(self, quality: float) -> bool:
        return quality >= self.value if self.higher_is_better else quality <= self.value


def train(workload, mlog: K.ResultLog, progress_desc: str, support: Resilience) -> bool:
    """Train until the quality target or the step limit; True if the target was reached."""
    resumed = support.restore()
    progress = Progress(workload.total_steps, progress_desc, show=workload.ctx.is_main, initial=resumed)
    try:
        reached, last_step = _train_blocks(workload, mlog, progress_desc, support, progress, resumed)
    finally:
        progress.close()
    if workload.logs_trained_samples:
        mlog.event(C.TRAIN_SAMPLES, workload.epoch_num(last_step))
    return reached


def _train_blocks(workload, mlog: K.ResultLog, progress_desc: str, support: Resilience, progress: Progress,
                  resumed: int) -> tuple[bool, int]:
    """The loop itself; returns whether the target was reached and the last step trained."""
    total, batches, losses = workload.total_steps, workload.batches(resumed), _LossReader()
    clock = None
    if resumed and (resumed == total or workload.block_ends(resumed)):  # the step that closed a block
        if _evaluate(workload, mlog, resumed, support, progress, progress_desc, None):
            return True, resumed
    elif resumed:  # inside a block whose start is logged
        support.block = support.block or workload.next_block(resumed)
        clock = _BlockClock(time.perf_counter(), support.save_seconds)
    for step in range(resumed + 1, total + 1):
        if clock is None:
            support.block = workload.next_block(step - 1)
            mlog.start(C.BLOCK_START, metadata={C.FIRST_EPOCH_NUM: support.block.first,
                                                C.EPOCH_COUNT: support.block.count})
            clock = _BlockClock(time.perf_counter(), support.save_seconds)
        workload.step_starts(step, mlog)
        loss, samples = workload.train_step(batches)
        block_ends = step == total or workload.block_ends(step)
        if step == resumed + 1 and not block_ends:
            # An attempt's first step compiles and autotunes: the rate is the steady one from the second on.
            clock = _BlockClock(time.perf_counter(), support.save_seconds)
        else:
            clock.samples += samples
        value = losses.after(loss, read=block_ends or step % LOSS_READ_EVERY == 0)
        progress.advance(1, **({"loss": value} if value is not None else {}))
        support.after_step(step, value)
        workload.step_ended(step, mlog, last=step == total)
        if not block_ends:
            continue
        mlog.end(C.BLOCK_STOP, metadata={C.FIRST_EPOCH_NUM: support.block.first})
        stats = workload.tracked_stats(clock.rate(support))
        mlog.event(K.TRACKED_STATS, stats, metadata={"step": workload.epoch_num(step)})
        clock = None
        if _evaluate(workload, mlog, step, support, progress, progress_desc, stats):
            return True, step
    return False, max(resumed, total)


def _evaluate(workload, mlog: K.ResultLog, step: int, support: Resilience, progress: Progress, progress_desc: str,
              stats: dict[str, float] | None) -> bool:
    """Evaluate after `step`, log it, and say whether the target is reached."""
    epoch_num = workload.epoch_num(step)
    target = workload.target
    at = {workload.eval_count_key: epoch_num}
    with support.phase("eval", step):
        mlog.start(C.EVAL_START, metadata=at)
        quality = workload.evaluate()
        mlog.event(C.EVAL_ACCURACY, quality, metadata=at)
        for key in workload.eval_also_logged_as:
            mlog.event(key, quality, metadata=at)
        mlog.end(C.EVAL_STOP, metadata=at)
    label, key = workload.rate_shown
    rate = {label: stats[key]} if stats else {}
    progress.set(**{target.short: quality}, **rate)
    rate_text = f", {stats[key]:,.1f} {label}" if stats else ""
    # Synthetic input measures throughput only: its eval means nothing, so it never stops the run.
    synthetic = workload.opts.synthetic
    goal = "synthetic input: no target" if synthetic else f"target {target.value}"
    progress.message(f"{progress_desc} step {step}: eval {target.name} {quality:.4f} ({goal}){rate_text}")
    return target.reached(quality) and not synthetic
