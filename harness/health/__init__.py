"""Preflight health checks, run on every node before a job trusts it (`python -m harness.health`).

Each check yields a `Check`: what was measured, the threshold it was held to, and a verdict
(pass, fail, or skipped with the reason, e.g. `skipped: no GPU`; a check never passes
because it could not run). The node writes its checks to <out>/preflight/nodes/<node>.json;
the submitting side (harness.preflight) judges the nodes from those files.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
NODES_DIR = Path("preflight") / "nodes"  # each node's report, <out>/preflight/nodes/<node>.json
# Test-only fault: "NODE:CHECK:FACTOR[,...]" scales CHECK's measurement on NODE (e.g. node2:allreduce_busbw:0.1),
# so the tests can make one node of a healthy cluster fail a check; FACTOR `hang` makes the check's child
# process hang instead, as an NVML or CUDA call does on a GPU after Xid 79 (harness.health.isolate). NODE may
# name one local rank of the pair phase as NODE@RANK (node2@1:pair_busbw:0.1).
FAULT_ENV = "HARNESS_PREFLIGHT_FAULT"
HANG = "hang"
NO_THRESHOLD = "no threshold for this GPU model: set it in the profile's preflight section"


@dataclass
class Check:
    name: str
    verdict: str
    measured: float | int | str | None = None
    threshold: str = ""  # the rule, e.g. ">= 460" or "== 8"
    unit: str = ""
    where: str = ""  # the device or port the check looked at, e.g. "gpu 3", "mlx5_0/1"
    note: str = ""  # why it was skipped, or what failed in words

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict) -> "Check":
        return cls(**{k: record.get(k) for k in ("name", "verdict", "measured", "threshold", "unit", "where",
                                                  "note") if k in record})


def skipped(name: str, why: str, where: str = "") -> Check:
    return Check(name, SKIPPED, where=where, note=why)


def _shown(value: float) -> float:
    """Four significant digits: enough to compare with a threshold, and small values stay visible."""
    return value if isinstance(value, int) else float(f"{value:.4g}")


def at_least(name: str, measured: float, minimum: float | None, unit: str = "", where: str = "") -> Check:
    if minimum is None:
        return skipped(name, NO_THRESHOLD, where)
    return Check(name, PASS if measured >= minimum else FAIL, _shown(measured), f">= {minimum:g}", unit, where)


def at_most(name: str, measured: float, maximum: float | None, unit: str = "", where: str = "") -> Check:
    if maximum is None:
        return skipped(name, NO_THRESHOLD, where)
    return Check(name, PASS if measured <= maximum else FAIL, _shown(measured), f"<= {maximum:g}", unit, where)


def equal(name: str, measured, expected, where: str = "") -> Check:
    return Check(name, PASS if measured == expected else FAIL, measured, f"== {expected}", "", where)


def _fault(node: str, check: str) -> str | None:
    """The test-only FACTOR that HARNESS_PREFLIGHT_FAULT gives `check` on `node`, as written; None without one."""
    for entry in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        parts = entry.split(":")
        if len(parts) == 3 and parts[0] == node and parts[1] == check:
            return parts[2]
    return None


def fault_scale(node: str, check: str) -> float:
    """The test-only factor for `check` on `node` from HARNESS_PREFLIGHT_FAULT; 1.0 without one."""
    factor = _fault(node, check)
    if factor is None or factor == HANG:
        return 1.0
    try:
        return float(factor)
    except ValueError:
        raise SystemExit(f"{FAULT_ENV}: {node}:{check}:{factor}: the factor must be a number or {HANG}") from None


def fault_hangs(node: str, check: str) -> bool:
    """Whether HARNESS_PREFLIGHT_FAULT makes `check` on `node` hang (test-only)."""
    return _fault(node, check) == HANG
