"""The resilience options every rank receives, parsed in one place (torch-free: the CLI validates with it).

--checkpoint-every 50 | 90s | 10m | 1h   save every N steps, or every so much wall time
--inject-failure RANK:STEP[:KIND]        a fault on the first attempt, for tests and demos
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# What --inject-failure can do to worker RANK when it reaches global step STEP.
FAULT_KINDS = {
    "kill": "SIGKILL the worker (a lost process or node)",
    "exception": "raise an exception in the training code (a workload error, which is not retried)",
    "kill-in-save": "SIGKILL the worker while it writes the first checkpoint taken at or after STEP",
    "corrupt": "damage the newest checkpoint on disk, then SIGKILL the worker",
    "slow": "make the worker's forward passes 0.2 s slower from STEP on (a straggler)",
}
_UNITS = {"s": 1, "m": 60, "h": 3600}


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
