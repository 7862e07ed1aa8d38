"""The one reader of MLPerf result logs: the workloads (where a restarted run continues) and the report use it.

A line counts when it holds `:::MLLOG {json}` anywhere, so prefixes such as srun's
`-l` rank labels are ignored, as are all other lines. Light on purpose (orjson, no
torch, no pandas): both the training workers and the report path import it.
"""

from __future__ import annotations

from typing import Iterable

import orjson

MARKER = b":::MLLOG "


class LogError(ValueError):
    """Why a result file cannot be read (or scored)."""


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def iter_events(data: bytes, skip_damaged: bool = False) -> Iterable[dict]:
    """Every MLLOG event in a log, in file order. A damaged MLLOG line raises LogError, or with
    `skip_damaged` is left out (a log whose writer may have been killed mid-line)."""
    for number, line in enumerate(data.splitlines(), 1):
        at = line.find(MARKER)
        if at < 0:
            continue
        try:
            event = _event(line[at + len(MARKER):], number)
        except LogError:
            if skip_damaged:
                continue
            raise
        yield event


def _event(body: bytes, number: int) -> dict:
    try:
        event = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise LogError(f"line {number}: damaged MLLOG record ({exc})") from None
    if not isinstance(event, dict) or not isinstance(event.get("key"), str):
        raise LogError(f"line {number}: MLLOG record without a text key")
    if not is_number(event.get("time_ms")):
        raise LogError(f"line {number}: MLLOG record whose time_ms is not a number")
    return event
