"""When to save a checkpoint: one answer, the same on every rank.

A save is a collective (every rank writes its shards and meets the others), so a rank
that decides alone to save while another goes on to the next step's all-reduce hangs
the job. A step interval (--checkpoint-every 50) is the same on every rank by
construction. A wall-clock interval (--checkpoint-every 15m) is not: each rank has its
own clock and started at its own moment. So rank 0's clock decides, at check steps
every rank knows in advance: there, every rank enters one tiny broadcast of rank 0's
answer, "save now or not, and the next check step". Rank 0 puts the next check halfway
to where its measured step time says the interval ends, so an interval costs a few
broadcasts (about log2 of its steps), not one per step, and a save comes at most a
step or two late, or one eval late when an eval falls in between.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from workloads.common.distributed import DistContext
from workloads.common.resilience_options import CheckpointEvery


class SaveSchedule:
    """Says at each step whether every rank saves now. Every rank calls due() after every step."""

    def __init__(self, every: CheckpointEvery | None, ctx: DistContext):
        self.every, self.ctx = every, ctx
        self.restart(0)

    def restart(self, step: int) -> None:
        """The interval starts again at `step` (a save, or the step a run resumed from)."""
        self._since_step, self._since_time = step, time.monotonic()
        self._next_check = step + 1

    def due(self, step: int) -> bool:
        if self.every is None:
            return False
        if self.every.steps is not None:
            return step - self._since_step >= self.every.steps
        if step < self._next_check:
            return False
        save, self._next_check = self._agree(self._rank0_answer(step) if self.ctx.is_main else (0, 0))
        return bool(save)

    def _rank0_answer(self, step: int) -> tuple[int, int]:
        elapsed = time.monotonic() - self._since_time
        if elapsed >= self.every.seconds:
            return 1, step + 1  # the caller saves and calls restart(step)
        seconds_per_step = elapsed / max(1, step - self._since_step)
        steps_left = (self.every.seconds - elapsed) / max(seconds_per_step, 1e-9)
        return 0, step + max(1, math.floor(steps_left / 2))

    def _agree(self, answer: tuple[int, int]) -> tuple[int, int]:
        # On the training group (NCCL on GPUs), in step order with training's collectives; only at check steps.
        box = torch.tensor(answer, dtype=torch.int64, device=self.ctx.device)
        dist.broadcast(box, src=0)
        save, next_check = box.tolist()
        return save, next_check
