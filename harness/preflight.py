"""Preflight verdicts: which nodes are healthy, which of them a job uses, and why the others are kept out.

The nodes measure (harness.health writes <out>/preflight/nodes/<node>.json); this module judges them
with one rule for all, picks the healthiest `--nodes` of the allocation (spares included), and writes
<out>/preflight.json. It runs where the decision is needed: inside the Slurm allocation (as
`python -m harness.preflight`, which prints the training nodes), or on the submitting side (Kubernetes,
local). Telling the cluster (drain, condition and taint) is each launcher's `remediate`.

A node is kept out when any of its checks fails, when it wrote no report, or when the newest failed
training attempt points at it (a rank killed by a signal other than the SIGTERM its peers get, or a node
whose agent never wrote its end: the node was lost).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

from harness.health import FAIL, NODES_DIR, PASS, SKIPPED, Check
from harness.blame import culprits
from harness.results.goodput import attempt_stragglers
from workloads.common.run_record import attempt_key, attempt_of, read_attempts, records_of, run_records

PREFLIGHT_FILE = "preflight.json"
VERDICTS_ENV = "HARNESS_PREFLIGHT_VERDICTS"  # pod_verdicts, where the run folder has no preflight.json
EXIT_PREFLIGHT = 6  # too few healthy nodes: the job stops before training
_FAILING = {">=": "<", "<=": ">", "==": "!="}


def reason(check: Check) -> str:
    """`<check> <measured> < <threshold>`: a failed check in one line (a Slurm drain reason, a condition message)."""
    op, _, value = check.threshold.partition(" ")
    measured = f"{check.measured}{' ' + check.unit if check.unit else ''}"
    where = f" ({check.where})" if check.where else ""
    if op in _FAILING:
        return f"{check.name} {measured} {_FAILING[op]} {value}{where}"
    return f"{check.name} {measured}, expected {check.threshold}{where}" + (f": {check.note}" if check.note else "")


def pair_checks(record: dict, unrun: frozenset[tuple[str, int]] = frozenset()) -> list[Check]:
    """The node's link checks, one per local rank of the pair phase (on a GPU node: per GPU and its NIC): the
    median of that rank's pair bandwidths, so one slow partner does not fail it. A rank that measured nothing
    fails, with what it left as the reason (timed out, died); a node whose phase never finished has no "pairs".
    `unrun`: (node, local rank) of the partners' pair ranks that ran no pair at all (unrun_pair_ranks: a GPU off
    the bus), whose pairs with this node are left out as an absent partner's are."""
    if "pairs" not in record:
        return []
    minimum = (record.get("thresholds") or {}).get("min_pair_busbw_gbps")
    device = "gpu" if record.get("gpu") else "rank"
    failures = record.get("pair_failures") or {}
    checks = []
    for local in range(record.get("pair_ranks") or 1):
        every = [p for p in record["pairs"] if p["gpu"] == local]
        # A partner that never joined the pair phase (its node wrote no report, or never started) blames its own
        # node, not this one: that pair is left out of the median. Only absent partners: not measured, no verdict.
        pairs = [p for p in every if not p.get("absent") and (p["peer"], local) not in unrun]
        if every and not pairs:
            checks.append(Check("pair_busbw", SKIPPED, where=f"{device} {local}",
                                note="not measured: its partner(s) never joined or ran no pair: "
                                     + ", ".join(p["peer"] for p in every)))
            continue
        if not pairs:
            checks.append(Check("pair_busbw", FAIL, "missing", "measured with another node", where=f"{device} {local}",
                                note=failures.get(str(local)) or "the between-node checks did not finish"))
            continue
        median = float(f"{statistics.median(p['busbw_gbps'] for p in pairs):.4g}")
        where = f"{device} {local}: median with {', '.join(p['peer'] for p in pairs)}"
        errors = "; ".join(f"{p['peer']}: {p['error']}" for p in pairs if p.get("error"))
        if minimum is None:
            checks.append(Check("pair_busbw", SKIPPED, median, unit="GB/s", where=where,
                                note="no threshold for this GPU model"))
        else:
            checks.append(Check("pair_busbw", PASS if median >= minimum else FAIL, median, f">= {minimum:g}", "GB/s",
                                where, note=errors))
    return checks


def store_fault(reports: dict[str, dict | None]) -> tuple[str | None, dict[str, str]]:
    """Where the pair phase's store (held by rank 0's health process) could not be reached: (the store's node, to
    be blamed, where it wrote a report; {node: why its pairs were not measured} for the nodes excused).

    `reports` maps every allocated node to its report (None: it wrote none). A node that could not reach the store
    is excused only where no other node reached it (no node but rank 0's has a pair phase of its own) and the
    store's node is known to have failed: it wrote a report as rank 0, or some node wrote none (rank 0's health
    process never started). Otherwise the node could not reach a store others reached: its own failure."""
    down = {n: r["store_unreachable"] for n, r in reports.items()
            if r and r.get("store_unreachable") and r.get("rank") != 0}
    if not down:
        return None, {}
    if any(r and r.get("rank") not in (0, None) and "pairs" in r and not r.get("store_unreachable")
           for r in reports.values()):
        return None, {}
    holder = next((n for n, r in reports.items() if r and r.get("rank") == 0), None)
    missing = [n for n, r in reports.items() if r is None]
    if holder is None and not missing:
        return None, {}
    blamed = holder or f"the node that wrote no report ({', '.join(missing)})"
    return holder, {n: f"not measured: {why}; blamed on {blamed}" for n, why in down.items()}


def newest_ended(records: list[dict]) -> int | None:
    """The newest attempt some node ended: on Kubernetes a recreated pod may have begun the next one already."""
    return max((r["attempt"] for r in records if r.get("event") == "end"), default=None)


def settled(records: list[dict]) -> bool:
    """Whether the newest ended attempt is over on every node: each node that began it has ended it or begun a
    later one (a lost node's recreated pod). Until then a node still running it would read as lost."""
    ended = [attempt_key(r) for r in records if r.get("event") == "end"]
    if not ended:
        return False
    key = max(ended)  # (attempt, launch): workloads.common.run_record.attempt_key
    over = {r["node"] for r in records if (attempt_key(r) == key and r.get("event") == "end")
            or (attempt_key(r) > key and r.get("event") == "start")}
    return all(r["node"] in over for r in records_of(records, key) if r.get("event") == "start")


def blamed_nodes(out: Path, attempt: int | None = None) -> dict[str, str]:
    """Machines a failed training attempt points at, with the cause: its culprits by the failure policy
    (harness.blame: a lost node, a GPU hardware error, the first failure with a cause of its own, never the
    peers NCCL aborted after it), and the node of a rank the straggler checks named (slow over several windows
    in a row). Where the agents ran in pods, a record's `host` (the Kubernetes node under the pod) is blamed.

    `attempt` is the one judged: by default the newest, which a requeued Slurm job's preflight judges even
    when no agent lived to record its end; the Kubernetes watcher names the newest that ended everywhere
    (settled()), since a recreated pod may have begun the next one already. On Slurm, where each run of a campaign
    is a step of its own in the same attempt, the attempt's newest step is judged (its records' `launch`,
    workloads.common.run_record.attempt_key), and only that run's stragglers."""
    records = read_attempts(out)
    key = attempt_of(records, attempt)
    if key is None:
        return {}
    attempt, launch = key
    mine = records_of(records, key)
    if any(r.get("event") == "end" and r.get("ok") for r in mine) and not any(
            r.get("event") == "end" and not r.get("ok") for r in mine):
        return {}
    host = {r["node"]: r.get("host", r["node"]) for r in mine if r.get("event") == "start"}
    blamed = culprits(mine)
    runs = run_records(out)
    if any("launch" in r for r in mine):  # a Slurm step does its own run only (the ones before it finished)
        runs = {launch: runs[launch]} if launch in runs else {}
    for record in runs.values():
        for slow in attempt_stragglers(record, attempt):
            node = str(slow["node"])
            blamed.setdefault(host.get(node, node), f"straggler: rank {slow['rank']} computed at "
                                                    f"{slow['score']:.2f} of the fastest rank's speed for "
                                                    f"{slow['windows']} windows in a row")
    return blamed


def blame_check(cause: str) -> Check:
    """A training failure pinned on a node, as a failed check of its own."""
    return Check("training_failure", FAIL, cause[:200], "no failure in the last attempt")


def judge(out: Path, allocated: list[str], blame_failures: bool = False) -> dict[str, dict]:
    """{node: {"gpu", "checks": [Check], "ok"}} for every allocated node, from the nodes' own reports."""
    verdicts = {}
    blamed = blamed_nodes(out) if blame_failures else {}
    reports = {node: _report_of(out, node) for node in allocated}
    holder, excused = store_fault(reports)
    unrun = unrun_pair_ranks(reports)
    for node in allocated:
        record = reports[node] or {"checks": [Check("health_report", FAIL, "missing", "written by the node",
                                                    note="the node did not run or finish the checks").to_dict()]}
        checks = [Check.from_dict(c) for c in record["checks"]]
        if node in excused:  # another node failed (the store's): it is blamed, not this one
            pairs = [Check("pair_busbw", SKIPPED, note=excused[node])]
        else:
            pairs = pair_checks(record, unrun)
        if node == holder:
            pairs.append(Check("pair_busbw", FAIL, "unreachable", "its store reached by the other nodes",
                               note=f"no other node could reach the pair phase's store this node held "
                                    f"({len(excused)} node(s) tried)"))
        if not pairs and len(allocated) > 1 and "node" in record:
            # A node that reported its own checks but no pair: the between-node phase never finished (a NIC
            # that breaks NCCL's set-up times it out on every node) or met no partner. Untested is no pass.
            pairs = [Check("pair_busbw", FAIL, "missing", "measured with another node",
                           note="the between-node checks did not finish")]
        checks += pairs
        if node in blamed:
            checks.append(blame_check(blamed[node]))
        verdicts[node] = {"gpu": record.get("gpu"), "started": record.get("started"), "checks": checks,
                          "seconds": _own_seconds(record), "world_busbw_gbps": record.get("world_busbw_gbps"),
                          "ok": not any(c.verdict == FAIL for c in checks)}
    return verdicts


def unrun_pair_ranks(reports: dict[str, dict | None]) -> frozenset[tuple[str, int]]:
    """(node, local rank) of every pair rank that failed before it measured any pair (its node's pair_failures,
    with no pair of that rank: a GPU off the bus, whose rank cannot even select its device). Its partners' pairs
    with it end after the operation timeout as a measured 0 (harness.health.allreduce.pair_rank): that rank's own
    failure, which fails its own node (pair_busbw missing), not theirs, so they are left out of their medians
    (pair_checks), as an absent partner's are. With one or two partners a rank's median cannot outvote it."""
    return frozenset((str(r["node"]), int(local)) for r in reports.values() if r and "node" in r
                     for local in (r.get("pair_failures") or {})
                     if str(local).isdigit() and not any(p.get("gpu") == int(local) for p in r.get("pairs") or []))


def _report_of(out: Path, node: str) -> dict | None:
    """A node's own report (<out>/preflight/nodes/<node>.json); None where it wrote none, or none readable."""
    try:
        record = json.loads((Path(out) / NODES_DIR / f"{node}.json").read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "checks" in record else None


def _own_seconds(record: dict) -> float | None:
    """How long a node's checks took, as the node measured them: its own end minus its own start (harness.health
    writes it when it finishes), so a node whose clock is set wrong still tells its duration right."""
    seconds = record.get("seconds")
    return float(seconds) if isinstance(seconds, (int, float)) and seconds >= 0 else None


def boot_clock() -> float:
    """This machine's seconds since boot, as /proc/uptime says (monotonic, Linux): the Slurm batch script reads
    the same file before the health step, and the judge, on the same host, reads it again at its verdict."""
    return float(Path("/proc/uptime").read_text().split()[0])


def _margin(checks: list[Check]) -> float:
    """How far above its thresholds a healthy node is: the smallest measured/threshold of its `>=` checks."""
    ratios = [float(c.measured) / float(c.threshold.split()[1]) for c in checks if c.verdict == PASS
              and c.threshold.startswith(">= ") and isinstance(c.measured, (int, float))
              and float(c.threshold.split()[1]) > 0]
    return min(ratios, default=1.0)


def choose(verdicts: dict[str, dict], wanted: int) -> tuple[list[str], list[str]]:
    """(the nodes training uses, healthy spares left over): the healthiest `wanted`, in allocation order."""
    healthy = [n for n, v in verdicts.items() if v["ok"]]
    best = sorted(healthy, key=lambda n: -_margin(verdicts[n]["checks"]))[:wanted]
    kept = [n for n in verdicts if n in best]
    return kept, [n for n in healthy if n not in kept]


MAX_MARKED_SHARE = 0.1  # the profile's preflight.max_marked_share, where no profile is at hand


def marking(failed: list[str], allocated: int, share: float = MAX_MARKED_SHARE) -> tuple[list[str], str | None]:
    """The one rule for how much one decision may mark on the cluster (drain, taint, a failed condition): (the
    nodes to mark, None), or ([], why) where `failed` is more than `share` of the `allocated` nodes (at least one
    node may always be marked). So many failing at once is a systemic fault (the image, the store, the network),
    which no node's mark fixes and a mark on each would outlive, as NVSentinel's circuit breaker holds."""
    cap = max(1, int(share * allocated))
    if len(failed) <= cap:
        return list(failed), None
    return [], (f"systemic failure: {len(failed)} of {allocated} node(s) failed, more than the {cap} one decision "
                f"may mark ({share:.0%}, preflight.max_marked_share); none is marked: look at what they share "
                "(the image, the pair phase's store, the network)")


def decide(out: Path, allocated: list[str], wanted: int, blame_failures: bool = False,
           seconds: float | None = None, max_marked_share: float = MAX_MARKED_SHARE) -> dict:
    """Judge, choose, and write <out>/preflight.json; returns what was written.

    `seconds` is how long the preflight took, from before its health job started to now, on the decider's own
    monotonic clock (run_health_job's; the Slurm judge's boot_clock). Without it, the slowest node's own
    duration stands in (the job's launch left out). A node's wall-clock start is never subtracted from the
    decider's clock: a node whose clock is ahead made that negative, one behind made it hours. Each node's
    figure is its own (_own_seconds)."""
    out = Path(out)
    verdicts = judge(out, allocated, blame_failures)
    kept, spare = choose(verdicts, wanted)
    excluded = {n: [reason(c) for c in v["checks"] if c.verdict == FAIL] for n, v in verdicts.items() if not v["ok"]}
    marked, systemic = marking(list(excluded), len(allocated), max_marked_share)
    if systemic:  # what they share, by check: the first clue to the common cause
        failed = collections.Counter(c.name for v in verdicts.values() for c in v["checks"] if c.verdict == FAIL)
        systemic += "; failed checks: " + ", ".join(f"{name} x{count}" for name, count in failed.most_common())
    passed = len(kept) == wanted and systemic is None  # a systemic fault is not one the spares make up for
    why = "; ".join(f"{n}: {', '.join(r)}" for n, r in excluded.items())
    message = (f"{len(kept)} of {len(allocated)} node(s) healthy, {wanted} needed" + (f"; kept out: {why}" if why
                                                                                      else ""))
    if systemic:
        message += f"; {systemic}"
    elif not passed:
        message += ("; no spare node left" if len(allocated) > wanted else "; there is no spare node (--spare-nodes)")
    if seconds is None:
        seconds = max((v["seconds"] for v in verdicts.values() if v["seconds"] is not None), default=0.0)
    # The earliest node's start, as its own clock read it: what tells this pass from the last (PreflightWatcher),
    # never subtracted from another clock.
    started = min((v["started"] for v in verdicts.values() if v.get("started")), default=time.time())
    previous = read(out)
    world = [v["world_busbw_gbps"] for v in verdicts.values() if v.get("world_busbw_gbps") is not None]
    record = {"passed": passed, "message": message, "wanted": wanted, "allocated": allocated, "kept": kept,
              "spare": spare, "excluded": excluded, "marked": marked, "systemic": systemic, "started": started,
              "seconds": round(seconds, 3),
              "seconds_total": round(seconds + (previous or {}).get("seconds_total", 0.0), 3),
              "world_busbw_gbps": round(statistics.median(world), 3) if world else None,
              "nodes": {n: {"gpu": v["gpu"], "ok": v["ok"], "seconds": v["seconds"],
                            "checks": [c.to_dict() for c in v["checks"]]} for n, v in verdicts.items()},
              "remediation": []}
    (out / PREFLIGHT_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def to_mark(record: dict) -> list[str]:
    """The nodes a launcher's remediation marks for `record` (preflight.json's shape): its `marked` (decide's
    marking()); a record without one (the Kubernetes watcher's, one attempt's culprits) marks what it excluded."""
    return list(record["marked"]) if "marked" in record else list(record["excluded"])


def read(out: Path) -> dict | None:
    try:
        return json.loads((Path(out) / PREFLIGHT_FILE).read_text())
    except (OSError, ValueError):
        return None


def record_remediation(out: Path, lines: list[str]) -> None:
    record = read(out)
    record["remediation"] = record.get("remediation", []) + lines
    (Path(out) / PREFLIGHT_FILE).write_text(json.dumps(record, indent=2) + "\n")


def record_blame(out: Path, blamed: dict[str, Check], lines: list[str]) -> None:
    """Add the nodes a training failure kept out after preflight (Kubernetes, where the job goes on rather than
    being submitted again) to preflight.json, with the failed check and what the cluster was told; no
    preflight, no file."""
    record = read(out)
    if record is None:
        return
    for node, check in blamed.items():
        record["excluded"][node] = record["excluded"].get(node, []) + [reason(check)]
        verdict = record["nodes"].setdefault(node, {"gpu": None, "checks": []})
        verdict["ok"] = False
        verdict["checks"].append(check.to_dict())
    record["kept"] = [n for n in record["kept"] if n not in blamed]
    record["remediation"] = record.get("remediation", []) + lines
    (Path(out) / PREFLIGHT_FILE).write_text(json.dumps(record, indent=2) + "\n")


def table(record: dict) -> str:
    """The per-node table: node, check, where, measured, threshold, verdict; skipped checks say why."""
    rows = [("node", "check", "where", "measured", "threshold", "verdict")]
    for node, verdict in record["nodes"].items():
        for c in verdict["checks"]:
            measured = "-" if c["measured"] is None else f"{c['measured']}{' ' + c['unit'] if c['unit'] else ''}"
            state = f"skipped: {c['note']}" if c["verdict"] == SKIPPED else c["verdict"]
            rows.append((node, c["name"], c["where"] or "", measured, c["threshold"] or "-", state))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    lines.append(f"preflight: {record['message']}; training on {', '.join(record['kept']) or 'no node'}"
                 f" ({record['seconds']:.1f} s)")
    return "\n".join(lines)


def check_verdicts(checks: list[dict]) -> dict[str, bool]:
    """{check: passed} for one node: a check measured on several GPUs or ports passes where every one passed;
    a check that was only skipped has no verdict."""
    verdicts: dict[str, bool] = {}
    for c in checks:
        if isinstance(c, dict) and c.get("verdict") in (PASS, FAIL):
            verdicts[str(c.get("name"))] = verdicts.get(str(c.get("name")), True) and c["verdict"] == PASS
    return verdicts


def pod_verdicts(record: dict) -> dict:
    """The verdicts of the nodes training may land on (kept and spare), small enough for one environment
    variable at 448 nodes: {"checks": [names], "nodes": {node: one character per check, 1 pass, 0 fail, - none}}."""
    per_node = {n: check_verdicts(record["nodes"][n]["checks"]) for n in record["kept"] + record["spare"]}
    names = sorted({name for verdicts in per_node.values() for name in verdicts})
    return {"checks": names, "nodes": {n: "".join({True: "1", False: "0"}.get(v.get(name), "-") for name in names)
                                       for n, v in per_node.items()}}


def verdicts_of(node: str, encoded: str) -> dict[str, bool]:
    """One node's {check: passed} from pod_verdicts as JSON (VERDICTS_ENV); nothing where it is unreadable."""
    try:
        table = json.loads(encoded)
        names, row = table["checks"], table["nodes"].get(node, "")
        return {str(name): flag == "1" for name, flag in zip(names, row) if flag in ("0", "1")}
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}


def kept_out_rows(record: dict) -> list[dict]:
    """Each failed check of each node kept out: {node, check, measured, unit, threshold, reason}, for the
    report's JSON, CSV, Markdown and HTML (the reason as the table and the Slurm drain say it)."""
    rows = []
    for node in record["excluded"]:
        for c in (record["nodes"].get(node) or {}).get("checks", []):
            if c["verdict"] == FAIL:
                rows.append({"node": node, "check": c["name"], "measured": c["measured"], "unit": c["unit"],
                             "threshold": c["threshold"], "reason": reason(Check.from_dict(c))})
    return rows


def kept_out_lines(record: dict) -> list[str]:
    """What `harness report` says about the preflight: each node kept out, and why."""
    lines = [f"preflight: kept out {node}: {'; '.join(reasons)}" for node, reasons in record["excluded"].items()]
    return lines + [f"preflight: {line}" for line in record.get("remediation", [])]


def _seconds_since(began: str) -> float | None:
    """Seconds on boot_clock since `began`; None where the batch script could not read the clock (an empty or odd
    value): the slowest node's own time stands in, and the allocation is judged all the same."""
    try:
        return max(0.0, boot_clock() - float(began))
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    """Inside the allocation: judge the nodes and print the training nodes (comma-separated) on stdout."""
    parser = argparse.ArgumentParser(prog="python -m harness.preflight", description=main.__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nodes", type=int, required=True, help="nodes the training needs")
    parser.add_argument("--allocated", required=True, help="the allocation's nodes, comma-separated")
    parser.add_argument("--blame-failures", action="store_true",
                        help="also keep out the nodes the newest failed training attempt points at")
    parser.add_argument("--max-marked-share", type=float, default=MAX_MARKED_SHARE,
                        help="the most of the allocation one decision marks (the profile's preflight.max_marked_share)")
    parser.add_argument("--began", default="",
                        help="this host's /proc/uptime when the health step started (boot_clock): the whole's clock")
    args = parser.parse_args(argv)
    seconds = _seconds_since(args.began)
    record = decide(args.out, [n for n in args.allocated.split(",") if n], args.nodes, args.blame_failures, seconds,
                    args.max_marked_share)
    print(table(record), file=sys.stderr, flush=True)
    if not record["passed"]:
        print(f"harness: error: preflight failed: {record['message']}", file=sys.stderr)
        return EXIT_PREFLIGHT
    print(",".join(record["kept"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
