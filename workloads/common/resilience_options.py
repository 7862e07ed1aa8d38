"""The resilience options every rank receives, parsed in one place (torch-free: the CLI validates with it).

--checkpoint-every 50 | 90s | 10m | 1h   save every N steps, or every so much wall time
--inject-failure RANK:STEP[:KIND]        a fault on the first attempt, for tests and demos
--straggler-window 60 | 90s | 2m | 20steps   seconds of training between straggler checks (the step count
                                         follows the pace), or a fixed step count; 0 turns them off
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# What --inject-failure can do to worker RANK when it reaches global step STEP.
FAULT_KINDS = {
    "kill": "SIGKILL the worker (a lost process or node)",
    "exception": "raise an exception in the training code (a workload error, which is not retried)",
    "io-error": "raise OSError EIO in the training code (a passing file-system error, which is retried: in process "
                "where --restart in-process)",
    "kill-in-save": "SIGKILL the worker while it writes the first checkpoint taken at or after STEP",
    "corrupt": "damage the newest checkpoint on disk, then SIGKILL the worker",
    "slow": "make the worker's forward passes compute 0.2 s longer from STEP on (a straggler)",
    "stall": "hold the worker 10 s at STEP, then go on (a GPU or file system that stops for a while)",
    "hang": "stop the worker at STEP without exiting, as a hung GPU does (its job must be ended from outside)",
}
STALL_S = 10.0  # what --inject-failure RANK:STEP:stall holds the worker for
_UNITS = {"s": 1, "m": 60, "h": 3600}
# Straggler windows in a row below the threshold before a rank is named (and its node blamed): one slow
# window is noise (a checkpoint flush, a page-cache miss), never a verdict, however short the attempt.
STRAGGLER_PERSIST = 3


@dataclass(frozen=True)
class CheckpointEvery:
    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> "CheckpointEvery":
        found = re.fullmatch(r"\s*(\d+)\s*([smh]?)\s*", text or "")
        if not found or int(found.group(1)) < 1:
            raise ValueError(f"--checkpoint-every {text!r}: give a step count (e.g. 50) or a time "
                             "(e.g. 90s, 10m, 1h), at least 1")
        count, unit = int(found.group(1)), found.group(2)
        return cls(seconds=count * _UNITS[unit]) if unit else cls(steps=count)


@dataclass(frozen=True)
class StragglerWindow:
    """How long a straggler window is: `seconds` of training (its step count is agreed again at every window,
    from the last window's step times), or a fixed number of `steps` (what tests use: a count, not a pace)."""
    seconds: float | None = None
    steps: int | None = None

    @property
    def off(self) -> bool:
        return not self.seconds and not self.steps

    @classmethod
    def parse(cls, text: str) -> "StragglerWindow":
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|steps?)?\s*", str(text))
        if not found or (found.group(2) or "").startswith("step") and "." in found.group(1):
            raise ValueError(f"--straggler-window {text!r}: give seconds of training (e.g. 60, 90s, 2m), a whole "
                             "number of steps (e.g. 20steps), or 0 to turn the checks off")
        count, unit = float(found.group(1)), found.group(2) or "s"
        if unit.startswith("step"):
            return cls(steps=int(count)) if count else cls()
        return cls(seconds=count * _UNITS[unit]) if count else cls()


@dataclass(frozen=True)
class FaultPlan:
    rank: int
    step: int
    kind: str = "kill"

    @classmethod
    def parse(cls, text: str) -> "FaultPlan":
        parts = (text or "").split(":")
        kinds = ", ".join(FAULT_KINDS)
        if len(parts) not in (2, 3) or not all(p.strip().isdigit() for p in parts[:2]):
            raise ValueError(f"--inject-failure {text!r}: expected RANK:STEP or RANK:STEP:KIND, with KIND one "
                             f"of {kinds}")
        kind = parts[2] if len(parts) == 3 else "kill"
        if kind not in FAULT_KINDS:
            raise ValueError(f"--inject-failure {text!r}: unknown kind {kind!r}; choose one of {kinds}")
        plan = cls(rank=int(parts[0]), step=int(parts[1]), kind=kind)
        if plan.step < 1:
            raise ValueError(f"--inject-failure {text!r}: STEP counts from 1")
        return plan
