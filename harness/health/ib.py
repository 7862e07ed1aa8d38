"""InfiniBand ports as the kernel shows them: /sys/class/infiniband/<hca>/ports/<n>/{state,rate,counters/*}.

The sysfs root is a parameter so tests can hand over a fake tree.
"""

from __future__ import annotations

from pathlib import Path

from harness.health import FAIL, PASS, Check, at_least, at_most, skipped

SYSFS_ROOT = Path("/sys/class/infiniband")
# Counters that count a link going down or retraining (NVIDIA resiliency-ext watches link_downed too).
LINK_ERROR_COUNTERS = ("link_downed", "link_error_recovery")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _number(text: str) -> int:
    """The leading number of a sysfs value: "4: ACTIVE" -> 4, "400 Gb/sec (4X NDR)" -> 400."""
    head = text.split(":")[0].split()[0] if text.split() else ""
    try:
        return int(float(head))
    except ValueError:
        return 0


def ib_checks(th: dict, expected_ports: int, root: Path = SYSFS_ROOT) -> list[Check]:
    """State, rate and link-error counters of every port; `expected_ports`: the HCAs the profile asks for."""
    ports = sorted(root.glob("*/ports/*")) if root.is_dir() else []
    if not ports:
        if expected_ports:
            return [Check("ib_ports", FAIL, 0, f">= {expected_ports}", note="no InfiniBand ports found")]
        return [skipped("ib_ports", "no InfiniBand devices")]
    checks = []
    active = 0
    for port in ports:
        where = f"{port.parent.parent.name}/{port.name}"
        state = _read(port / "state")
        up = _number(state) == 4  # 4: ACTIVE
        active += up
        checks.append(Check("ib_port_state", PASS if up else FAIL, state.split(":")[-1].strip() or "unreadable",
                            "ACTIVE", where=where))
        rate = th.get("ib_rate_gbps")
        checks.append(at_least("ib_port_rate", _number(_read(port / "rate")), rate, "Gb/s", where) if rate
                      else skipped("ib_port_rate", "any rate accepted (preflight.ib_rate_gbps is 0)", where))
        errors = sum(_number(_read(port / "counters" / name)) for name in LINK_ERROR_COUNTERS)
        checks.append(at_most("ib_link_errors", errors, th.get("max_ib_link_errors"), "", where))
    if expected_ports:
        checks.append(at_least("ib_ports", active, expected_ports, "active"))
    return checks
