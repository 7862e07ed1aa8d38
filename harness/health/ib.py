"""InfiniBand ports as the kernel shows them: /sys/class/infiniband/<hca>/ports/<n>/{state,rate,counters/*}.

Only the ports NCCL uses are judged: those NCCL_IB_HCA selects, read as NCCL reads it. A node also holds a
front-end or storage NIC, or an uncabled second port, that training never touches; judging those would fail
every node. The sysfs root is a parameter so tests can hand over a fake tree.
"""

from __future__ import annotations

from pathlib import Path

from harness.health import FAIL, PASS, Check, at_least, at_most, skipped

SYSFS_ROOT = Path("/sys/class/infiniband")
HCA_ENV = "NCCL_IB_HCA"
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


def nccl_selects(selection: str | None, hca: str, port: str) -> bool:
    """Whether NCCL_IB_HCA's `selection` picks `port` of `hca`, as NCCL reads it: a comma list of HCA names,
    each a prefix (`mlx5` takes mlx5_0, mlx5_1, ...) or, after a leading `=`, exact; `:N` limits a name to
    port N; a leading `^` excludes the listed ones instead. No selection: every port, as NCCL's default."""
    if not selection or not selection.strip():
        return True
    text = selection.strip()
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    listed = False
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, wanted_port = item.partition(":")
        named = hca == name if exact else hca.startswith(name)
        if named and (not wanted_port or wanted_port == port):
            listed = True
            break
    return listed != exclude


def ib_checks(th: dict, expected_ports: int, root: Path = SYSFS_ROOT, selection: str | None = None) -> list[Check]:
    """State, rate and link-error counters of every port NCCL_IB_HCA's `selection` takes; `expected_ports`: the
    HCAs the profile asks for."""
    ports = [port for port in (sorted(root.glob("*/ports/*")) if root.is_dir() else [])
             if nccl_selects(selection, port.parent.parent.name, port.name)]
    if not ports:
        if expected_ports:
            found = "no InfiniBand ports found" + (f" that {HCA_ENV}={selection} selects" if selection else "")
            return [Check("ib_ports", FAIL, 0, f">= {expected_ports}", note=found)]
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
        checks.append(at_least("ib_port_rate", _number(_read(port / "rate")), rate, "Gb/s", where) if rate != 0
                      else skipped("ib_port_rate", "any rate accepted (preflight.ib_rate_gbps is 0)", where))
        errors = sum(_number(_read(port / "counters" / name)) for name in LINK_ERROR_COUNTERS)
        checks.append(at_most("ib_link_errors", errors, th.get("max_ib_link_errors"), "", where))
    if expected_ports:
        checks.append(at_least("ib_ports", active, expected_ports, "active"))
    return checks
