"""Straggler detection while the job runs: which rank computes slower than the others.

In synchronous data parallel training every rank's step takes as long as the slowest
rank's, because the fast ones wait in the gradient all-reduce; step times cannot tell
ranks apart. What differs is the time a rank spends computing, so each rank times its
model's forward passes (hooks on the inner module, after DDP's own start-of-forward
sync; CUDA events on GPUs, read only at the end of a window). With FSDP the forward
also holds parameter all-gathers, which blurs, but does not hide, a slow rank.

On CPU the forward's time is the thread's CPU time (time.thread_time), not wall time: on
a shared host (a laptop, a CI machine, ranks beside other work) the OS deschedules
whichever rank loses its neighbours' lottery, which did not compute slower, and a wall
clock would name it. A rank whose compute is slow spends that CPU time and is named.

Every window (about `--straggler-window` seconds of training, as a step count that every
rank agrees on) the ranks all-gather their mean forward time and mean step time, two
floats each, and score themselves as NVIDIA's resiliency extension does: the fastest
rank's time / this rank's (1.0: as fast as the fastest). A rank under the threshold
(0.75) is a straggler; rank 0 writes every window to the run record and names, once, a
straggler that stays for STRAGGLER_PERSIST windows in a row. The detector's own time is measured
too, so its overhead is a recorded fact.

The window's step count follows the pace: each is sized from the slowest rank's step
time in the window before it (at CALIBRATE_STEP, from the steps so far), and every rank
computes the same count from the same gathered figures, so no rank enters a collective
alone. A count may at most double from one window to the next, so the windows start
short and grow to their length: a pace measured on a few fast first steps cannot make a
window of thousands of slow ones. A GPU that throttles mid-run, or a rank slowed from
some step on, still closes windows about every `--straggler-window` seconds. A window
given as a step count (`20steps`) stays that count: tests count windows, not seconds.
"""

from __future__ import annotations

import math
import socket
import time

import torch
import torch.distributed as dist

from workloads.common.distributed import DistContext
from workloads.common.metrics_feed import FEED
from workloads.common.progress import announce
from workloads.common.resilience_options import STRAGGLER_PERSIST, StragglerWindow

THRESHOLD = 0.75
CALIBRATE_STEP = 5  # steps before the window length is fixed (start-up steps are slow on every rank)


class StragglerWatch:
    def __init__(self, model: torch.nn.Module, ctx: DistContext, record, window: StragglerWindow,
                 threshold: float = THRESHOLD):
        self.ctx, self.record, self.window, self.threshold = ctx, record, window, threshold
        self.module = getattr(model, "module", model)  # DDP's inner module: after its start-of-forward sync
        self.cuda = ctx.device.type == "cuda"
        self.window_steps: int | None = None
        self.hooks_s = 0.0  # the detector's own time in forward hooks ...
        self.windows_s = 0.0  # ... and in calibration and window collectives
        self._events: list = []  # (start, end) CUDA events, or seconds on CPU
        self._started = None
        self._steps = 0
        self._step_time = 0.0
        self._nodes: list[str] | None = None
        self._streak: dict[int, int] = {}
        self._named: set[int] = set()
        self._handles = [self.module.register_forward_pre_hook(self._before),
                         self.module.register_forward_hook(self._after)]

    # --- timing forward passes -----------------------------------------------------------------
    # The hooks run eagerly even when the model is compiled. torch.compile of a DDP module compiles every Python
    # frame its forward runs, these hooks included (DDP skips only its own frames): dynamo then guarded on the
    # float the hook stores and on len(self._events), which grows each step, so each of the first 8 steps
    # recompiled the hooks (about 1 s a step on 2 CPU cores) until dynamo gave up at its recompile limit.

    @torch.compiler.disable
    def _before(self, module, args) -> None:
        if not module.training:
            return  # evals are not training speed
        clock = time.perf_counter()
        if self.cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = time.thread_time()
        self.hooks_s += time.perf_counter() - clock

    @torch.compiler.disable
    def _after(self, module, args, output) -> None:
        if not module.training or self._started is None:
            return
        clock = time.perf_counter()
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._started, end))
        else:
            self._events.append(time.thread_time() - self._started)
        self._started = None
        self.hooks_s += time.perf_counter() - clock

    # --- windows --------------------------------------------------------------------------------

    def after_step(self, step: int, seconds: float) -> None:
        """Called by every rank after every step, with the step's wall time."""
        self._steps += 1
        self._step_time += seconds
        if self.window_steps is None:
            if self._steps >= CALIBRATE_STEP:
                self._calibrate()
            return
        if self._steps >= self.window_steps:
            self._close_window(step)

    def _calibrate(self) -> None:
        """Size the first window from the slowest rank's mean step time, and learn every rank's node."""
        clock = time.perf_counter()
        mean = torch.tensor([self._step_time / self._steps], dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        self.window_steps = self._steps_for(mean.item(), grown_from=self._steps)
        names = [None] * self.ctx.world_size
        dist.all_gather_object(names, socket.gethostname())
        self._nodes = [str(n) for n in names]
        self._reset()
        self.windows_s += time.perf_counter() - clock

    def _close_window(self, step: int) -> None:
        clock = time.perf_counter()
        if self.cuda:
            torch.cuda.synchronize(self.ctx.device)
            times = [start.elapsed_time(end) / 1000 for start, end in self._events]
        else:
            times = list(self._events)
        mine = [sum(times) / len(times) if times else float("nan"), self._step_time / self._steps]
        gathered = [torch.zeros(2, dtype=torch.float64, device=self.ctx.device) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, torch.tensor(mine, dtype=torch.float64, device=self.ctx.device))
        figures = torch.stack(gathered).tolist()  # one copy to the host, not one per rank
        means = [forward for forward, _ in figures]
        scores = score(means)
        FEED.straggler_score(scores[self.ctx.rank])
        self.windows_s += time.perf_counter() - clock
        if self.ctx.is_main:
            self._report(step, means, scores)
        self.window_steps = self._steps_for(max(step_s for _, step_s in figures), grown_from=self.window_steps)
        self._reset()

    def _steps_for(self, step_s: float, grown_from: int) -> int:
        """The next window's step count: the fixed one, or as many steps of `step_s` (the slowest rank's) as fill
        the window's seconds, at most twice `grown_from` (the steps the last window, or the calibration, took)."""
        if self.window.steps:
            return self.window.steps
        return max(1, min(math.ceil(self.window.seconds / max(step_s, 1e-6)), 2 * grown_from))

    def _report(self, step: int, means: list[float], scores: list[float]) -> None:
        slow = [r for r, s in enumerate(scores) if s < self.threshold]
        for rank in range(len(scores)):
            self._streak[rank] = self._streak.get(rank, 0) + 1 if rank in slow else 0
        now = time.time()
        self.record.interval("stragglers", now, now, (step, step), {
            "forward_s": [round(m, 6) for m in means], "scores": [round(s, 4) for s in scores],
            "stragglers": [{"rank": r, "node": self._nodes[r], "score": round(scores[r], 4)} for r in slow],
            "threshold": self.threshold, "window_steps": self.window_steps,
            "overhead_s": {"hooks": round(self.hooks_s, 6), "windows": round(self.windows_s, 6)}})
        for rank, streak in self._streak.items():
            if streak >= STRAGGLER_PERSIST and rank not in self._named:
                self._named.add(rank)
                announce(f"straggler: rank {rank} on {self._nodes[rank]} computes at {scores[rank]:.2f} of the "
                         f"fastest rank's speed, {streak} windows in a row (threshold {self.threshold})")

    def _reset(self) -> None:
        self._events.clear()
        self._steps, self._step_time = 0, 0.0

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def score(means: list[float]) -> list[float]:
    """Each rank's speed relative to the fastest: fastest time / its time (a rank with no figure scores 1)."""
    known = [m for m in means if math.isfinite(m) and m > 0]
    fastest = min(known) if known else 0.0
    return [fastest / m if math.isfinite(m) and m > 0 else 1.0 for m in means]
