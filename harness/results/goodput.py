"""Restarts, goodput and badput of one run, from its run record and the node agents' attempt record.

goodput = productive time / wall time, as Google's ml-goodput-measurement defines it:
wall time is the MLPerf time-to-train (run_start to run_stop), and productive time is the
training and evaluation whose results the run kept. The rest is badput, split into
    startup       a process start (or run_start) to the first step, for each attempt
    compile       torch.compile's time inside the timed run (a record's "compile_s"): none when the warm-up
                  compiled everything before run_start; a restarted attempt's first step, read from the cache
    save          time training waited for checkpoints
    restore       loading the checkpoint after a restart
    lost          work done after the last checkpoint a failed attempt wrote, then redone
    recovery      from a failure to the next attempt's process start (detection, restart), or, restarted in
                  process, to its re-entry into the campaign (the run record's `restart` interval)
    other         whatever is left (logging, waiting at barriers)
    preflight     checking the nodes before training (harness.preflight's preflight.json, every pass after
                  a requeue included); it comes before run_start, so it is counted on the first run and added
                  to the wall time goodput divides by
    warmup        the warm-up in the untimed init (workloads.common.warm_up): off the clock as preflight is, and
                  counted as preflight is, on the wall time goodput divides by
Logs without a run record (other people's submissions) get None: nothing is guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workloads.common.run_record import read_attempts, read_json_lines, record_beside
from workloads.common.resilience_options import STRAGGLER_PERSIST

BADPUT_KINDS = ("startup", "compile", "save", "restore", "lost", "recovery", "other", "preflight", "warmup")


@dataclass
class Accounting:
    restarts: int
    goodput: float
    badput: dict[str, float]  # seconds, by BADPUT_KINDS
    stragglers: list[dict]  # {"rank", "node", "score", "windows"}: ranks the straggler checks named


def _intervals(path: Path) -> list[dict]:
    """Well-formed intervals of a run record (a damaged line is skipped, not fatal)."""
    good = []
    for r in read_json_lines(path):
        if isinstance(r.get("attempt"), int) and isinstance(r.get("kind"), str) and \
                all(isinstance(r.get(k), (int, float)) for k in ("start", "end")):
            steps = r.get("steps")
            r["steps"] = steps if isinstance(steps, list) and len(steps) == 2 and \
                all(isinstance(s, int) for s in steps) else None
            good.append(r)
    return good


def _kept_share(interval: dict, kept_step: float) -> float:
    """The part of a train/eval interval whose steps a later attempt did not redo."""
    if interval["steps"] is None:
        return 1.0
    first, last = interval["steps"]
    if last <= kept_step:
        return 1.0
    if first > kept_step:
        return 0.0
    return (kept_step - first + 1) / (last - first + 1)


def _preflight_seconds(folder: Path) -> float:
    """Seconds spent in preflight before the first run (harness.preflight writes preflight.json)."""
    try:
        return float(json.loads((folder / "preflight.json").read_text()).get("seconds_total") or 0.0)
    except (OSError, ValueError, AttributeError, TypeError):
        return 0.0


def account(result_file: Path, run_start_ms: float, run_stop_ms: float) -> Accounting | None:
    record = record_beside(result_file)
    if record is None:
        return None
    folder, index = record.parent, int(record.stem.removeprefix("run_"))
    intervals = _intervals(record)
    if not intervals:
        return None
    start, stop = run_start_ms / 1000, run_stop_ms / 1000
    wall = max(stop - start, 1e-9)
    # On Slurm each run is a step of its own, its agents' records marked with it (`launch`): this run's ends only.
    ends = {r["attempt"]: r for r in read_attempts(folder)
            if r.get("event") == "end" and isinstance(r.get("time"), (int, float))
            and r.get("launch", index) == index}
    attempts = sorted({r["attempt"] for r in intervals})
    spent = dict.fromkeys(BADPUT_KINDS, 0.0)
    productive = 0.0
    for n, attempt in enumerate(attempts):
        mine = [r for r in intervals if r["attempt"] == attempt]
        later = attempts[n + 1] if n + 1 < len(attempts) else None
        kept = float("inf")
        if later is not None:
            restored = [r["steps"][0] for r in intervals if r["attempt"] == later and r["kind"] == "restore"
                        and r["steps"]]
            kept = restored[0] if restored else 0
        for r in mine:
            seconds = max(0.0, min(r["end"], stop) - max(r["start"], start))
            if r["kind"] in ("train", "eval"):
                compiling = min(seconds, max(0.0, float(r.get("compile_s") or 0.0)))
                share = _kept_share(r, kept)
                spent["compile"] += compiling
                productive += (seconds - compiling) * share
                spent["lost"] += (seconds - compiling) * (1 - share)
            elif r["kind"] in ("startup", "save", "restore"):
                spent[r["kind"]] += seconds
            elif r["kind"] == "restart":  # a restart in process: from the failure to re-entering the campaign
                spent["recovery"] += seconds
        if later is not None:
            faults = [r["start"] for r in mine if r["kind"] == "fault"]
            last_work = max((r["end"] for r in mine if r["kind"] != "fault"), default=mine[0]["start"])
            failed_at = faults[0] if faults else ends.get(attempt, {}).get("time", last_work)
            failed_at = max(last_work, min(failed_at, stop))
            spent["lost"] += failed_at - last_work  # unrecorded work between the last record and the failure
            next_start = min(r["start"] for r in intervals if r["attempt"] == later)
            spent["recovery"] += max(0.0, next_start - failed_at)
    spent["other"] = max(0.0, wall - productive - sum(spent.values()))
    spent["preflight"] = _preflight_seconds(folder) if index == 0 else 0.0
    spent["warmup"] = sum(r["end"] - r["start"] for r in intervals if r["kind"] == "warm_up" and r["end"] <= start)
    restarts = len(attempts) - 1 + sum(1 for a, r in ends.items() if not r.get("ok") and r.get("run") == index
                                       and a not in attempts)
    return Accounting(restarts=restarts, goodput=min(1.0, productive / (wall + spent["preflight"] + spent["warmup"])),
                      badput={k: round(v, 3) for k, v in spent.items()}, stragglers=named_stragglers(intervals))


def attempt_stragglers(record: Path, attempt: int) -> list[dict]:
    """The stragglers one attempt of a run named (its run record's straggler windows)."""
    return named_stragglers([r for r in _intervals(record) if r["attempt"] == attempt])


def named_stragglers(intervals: list[dict], persist: int = STRAGGLER_PERSIST) -> list[dict]:
    """Ranks below the threshold in `persist` straggler windows in a row, with their median score over the
    windows where they were slow (workloads.common.stragglers). An attempt with fewer windows names none:
    one slow window is no verdict, and the next attempt's preflight must not keep a node out for it."""
    windows = [r for r in intervals if r["kind"] == "stragglers" and isinstance(r.get("stragglers"), list)]
    streak: dict[int, int] = {}
    found: dict[int, dict] = {}
    for window in windows:
        slow = {s.get("rank"): s for s in window["stragglers"] if isinstance(s, dict) and isinstance(s.get("rank"), int)}
        for rank in set(streak) | set(slow):
            streak[rank] = streak.get(rank, 0) + 1 if rank in slow else 0
        for rank, entry in slow.items():
            named = found.setdefault(rank, {"rank": rank, "node": entry.get("node"), "scores": [], "windows": 0})
            named["scores"].append(entry.get("score"))
            named["windows"] = max(named["windows"], streak[rank])
    result = []
    for rank, named in sorted(found.items()):
        scores = sorted(s for s in named.pop("scores") if isinstance(s, (int, float)))
        if named["windows"] >= persist and scores:
            result.append({**named, "score": scores[len(scores) // 2]})
    return result
