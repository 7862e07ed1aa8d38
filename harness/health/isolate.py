"""Checks that touch NVML or CUDA run in a child process with a deadline.

NVML and CUDA calls hang on a GPU after Xid 79 (the GPU fell off the bus). A hung call in the node's own
process would hold the node, and every node waiting for it in the between-node phase, until the wall-time
limit. So each such check runs in a fresh interpreter (`python -m harness.health.isolate`); the node waits
for it at most its deadline, then kills the child's whole process group (the ranks it started too) and fails
the check `timed out after N s`. A child stuck in the driver may outlive the kill (uninterruptible sleep): the
node does not wait for it, and its other checks and the other nodes go on.

A check's target is `module:function`, called with keyword arguments given as JSON. It returns a JSON-able
value (Checks become their dicts), or yields several: each yielded value is written at once, so a child killed
or failing later (a between-node all-reduce that hangs on a dead peer) still leaves what it measured before.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness.health import FAIL, Check, fault_hangs


KILL_GRACE_S = 5  # how long a killed child may take to go before the node stops waiting for it
_running: set[Child] = set()  # the children not yet collected, each in a session of its own


def stop_children(signum: int, frame) -> None:
    """The node process's SIGTERM handler (a cancel): its checks' children are not in its process group, so a
    signal to the group misses them, and a hung one would outlive the job. They are killed, then the node.

    Every child process of the node is killed, not only the registered ones: a signal that lands while Popen is
    starting a child (it exists, Popen has not returned) would otherwise miss that one. (Python runs the handler
    between bytecodes: in the C calls the node makes around the pairs, its store's connect and wait, when no
    child runs, the node goes when the call returns or at the scheduler's SIGKILL.)"""
    for pid in _children_of(os.getpid()):
        try:
            os.killpg(pid, signal.SIGKILL)  # its session: the ranks the check started too
        except ProcessLookupError:  # not yet in a session of its own, or gone
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for child in list(_running):
        child.kill()  # reaped, its folder removed
    raise SystemExit(128 + signum)


def _children_of(parent: int) -> list[int]:
    """The processes whose parent is `parent`, from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except (OSError, IndexError):  # it ended while we looked
            continue
        if int(fields[1]) == parent:
            children.append(int(stat.parent.name))
    return children


@dataclass
class Outcome:
    """What a child left: its last value (None if it wrote none) and, when it did not finish cleanly, the
    failed check that says why (timed out, or its error)."""

    value: object
    failure: Check | None


class Child:
    """One check running in its own process group; `wait` collects it.

    A check's deadline counts from its start. A watch (`watch=True`, the XID events) runs beside the node's other
    checks and reads stdin to know when to stop: its deadline counts from when `wait` tells it to."""

    def __init__(self, name: str, node: str, target: str, kwargs: dict, watch: bool = False):
        self.name = name
        self.folder = Path(tempfile.mkdtemp(prefix="harness-check-"))
        self.process = subprocess.Popen([sys.executable, "-m", "harness.health.isolate", target, json.dumps(kwargs),
                                         str(self.folder / "result.json"), node, name],
                                        stdin=subprocess.PIPE, start_new_session=True)
        _running.add(self)
        self.clock = time.monotonic()
        if not watch:
            self.process.stdin.close()

    def _read(self) -> object:
        try:
            return json.loads((self.folder / "result.json").read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        return self.process.poll() is None

    def peek(self) -> object:
        """What the child has written so far (its last yielded value), without waiting for it."""
        return self._read()

    def kill(self) -> object:
        """Kill the child's process group; what it wrote before."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended just now
            pass
        try:
            self.process.wait(timeout=KILL_GRACE_S)  # reaped, unless it is stuck in the driver
        except subprocess.TimeoutExpired:
            pass
        value = self._read()
        self._forget()
        return value

    def _forget(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        _running.discard(self)

    def wait(self, deadline: float) -> Outcome:
        """The child's outcome, `deadline` seconds after its clock started at the latest."""
        if not self.process.stdin.closed:
            self.process.stdin.close()
            self.clock = time.monotonic()
        try:
            code = self.process.wait(timeout=max(0.0, deadline - (time.monotonic() - self.clock)))
        except subprocess.TimeoutExpired:
            value = self.kill()
            return Outcome(value, Check(self.name, FAIL, f"timed out after {deadline:g} s",
                                        f"done within {deadline:g} s"))
        value = self._read()
        self._forget()
        error = value.get("error") if isinstance(value, dict) else None
        if code == 0 and error is None and value is not None:  # exit 0 without a result fails too
            return Outcome(value, None)
        return Outcome(value.get("partial") if error else None,
                       Check(self.name, FAIL, f"exit {code}", "exit 0",
                             note=(error or "the check's process died without a result")[:300]))


def isolated(name: str, node: str, target: str, kwargs: dict, deadline: float) -> Outcome:
    """Run one check in a child process and wait for it at most `deadline` seconds."""
    return Child(name, node, target, kwargs).wait(deadline)


def checks_of(outcome: Outcome) -> list[Check]:
    """The Checks a check's child returned, or the one failure that says why there are none."""
    if outcome.failure is not None:
        return [outcome.failure]
    return [Check.from_dict(c) for c in outcome.value]


def _write(path: Path, value: object) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(value, default=lambda o: o.to_dict()))
    temporary.replace(path)  # the parent never reads half a result


def main(argv: list[str]) -> int:
    target, kwargs, result, node, name = argv
    if fault_hangs(node, name):  # test-only: behave as a call stuck in the driver
        while True:
            time.sleep(3600)
    module, _, function = target.partition(":")
    call = getattr(importlib.import_module(module), function)
    partial = None
    try:
        value = call(**json.loads(kwargs))
        if inspect.isgenerator(value):
            for partial in value:
                _write(Path(result), partial)
        else:
            _write(Path(result), value)
    except Exception as exc:  # the parent fails the check with this line; the traceback goes to the node's log
        _write(Path(result), {"error": f"{type(exc).__name__}: {exc}", "partial": partial})
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
