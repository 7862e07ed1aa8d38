"""mlperf-logging's compliance checker, run on every result file as MLCommons' result summarizer runs it.

The summarizer (`result_summarizer._read_result_file`) checks each result file with
`mlp_compliance.main(file, 'training_<R>/common.yaml', mlp_compliance.make_checker('training', R,
quiet=True, werror=False))` and counts a file that fails as a failed run: its time is not scored,
and it is one of the runs olympic scoring may drop. We call those same functions, in-process, so the
verdicts are the checker's own and a new round's rules come with a newer mlperf-logging; nothing of
the rules is copied here.

The checker costs 0.02 to 0.4 s of CPU per real log (more than the rest of a report), so:
- verdicts are cached under the harness's cache folder (`workloads.common.cache.cache_root()`), one
  small JSON file per (mlperf-logging version, ruleset, sha256 of the file), so re-reading a tree
  (notebooks, CI) pays only for hashing;
- files not in the cache are checked in parallel worker processes, one per core;
- the checker re-reads its YAML rule files for every log it checks, which costs more than checking a
  small log (54% of its time on GigaComputing's 100 logs); while we call it, each rule file is parsed
  once per process and the checker gets a fresh copy of it each time (`_RuleFiles`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version
from multiprocessing import get_all_start_methods, get_context
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Iterator

import yaml

from workloads.common.cache import cache_root

USAGE = "training"
VERDICT_FORMAT = 2  # the cached verdicts' fields (2: failed_keys); a new format leaves the old cache unread


@dataclass(frozen=True)
class Verdict:
    passed: bool
    error: str | None = None  # the checker's first error, on one line; None when the file passed
    failed_keys: tuple[str, ...] = ()  # the keys whose CHECK failed ("CHECK for 'KEY' failed"), in the checker's order


@cache
def checker_version() -> str:
    """The installed mlperf-logging's version: a new one may judge the same file differently."""
    return version("mlperf-logging")


def _one_line(message: str) -> str:
    """The checker's message on one line, without what a report shows elsewhere or cannot show on a line: the
    log line it quotes (the report names the file) and its multi-line dumps of state (`current context[s]=...`).
    A failed CHECK then reads: CHECK for 'key' failed in line N: / failed test: <expression>."""
    kept = []
    for line in message.strip().splitlines():
        if line.startswith(("current context", "current line")):
            break
        if ":::MLLOG" not in line and line.strip():
            kept.append(line.strip())
    return " / ".join(kept)


@contextmanager
def _quiet_logging() -> Iterator[None]:
    """The checker logs every message through the root logger; the report names the first error itself.
    logging.warning() installs a stderr handler on a root logger that has none, so one is lent meanwhile."""
    root = logging.getLogger()
    lent = None if root.handlers else logging.NullHandler()
    if lent:
        root.addHandler(lent)
    disabled = root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(disabled)
        if lent:
            root.removeHandler(lent)


class _RuleFiles:
    """What mlp_compliance sees as its `yaml` module while we call it (its one use: `yaml.load(f,
    Loader=yaml.BaseLoader)` on a rule file). Each rule file is parsed once per process; the checker gets a
    deep copy each time, so it sees exactly what yaml would have given it, whatever it does with it."""

    BaseLoader = yaml.BaseLoader

    def __init__(self) -> None:
        self._parsed: dict[tuple, object] = {}

    def load(self, stream, Loader):  # noqa: N803 - yaml's own parameter name
        key = (os.path.realpath(stream.name), Loader)
        if key not in self._parsed:
            self._parsed[key] = yaml.load(stream, Loader=Loader)  # noqa: S506 - mlperf-logging's call, as it is
        return copy.deepcopy(self._parsed[key])


_RULE_FILES = _RuleFiles()


@contextmanager
def _remembered_rule_files(module) -> Iterator[None]:
    module.yaml = _RULE_FILES
    try:
        yield
    finally:
        module.yaml = yaml


def check_file(path: str, ruleset: str) -> Verdict:
    """The checker's verdict on one file, as `python -m mlperf_logging.compliance_checker --usage training
    --ruleset R FILE` gives it (exit 0 or 1). Where the checker itself raises (a rule file the ruleset does
    not have, a record its parser cannot take), the command exits 1 with a traceback: failed, with the
    exception as the error."""
    from mlperf_logging.compliance_checker import mlp_compliance

    # Rule files queued by a check that raised would otherwise be run on the next file.
    mlp_compliance.enqueued_configs.clear()
    checker = mlp_compliance.make_checker(USAGE, ruleset, True, False)
    try:
        with _quiet_logging(), _remembered_rule_files(mlp_compliance):
            passed, _, _, _ = mlp_compliance.main(path, f"{USAGE}_{ruleset}/common.yaml", checker)
    except Exception as exc:  # noqa: BLE001 - the checker is outside our control; any failure is a verdict
        return Verdict(False, _one_line(f"the checker stopped: {type(exc).__name__}: {exc}"))
    if passed:
        return Verdict(True)
    messages = [*checker.overwritable.values(), *checker.not_overwritable]  # the order it logs them in
    keys = tuple(m.split("CHECK for '", 1)[1].split("'", 1)[0] for m in messages if m.startswith("CHECK for '"))
    # Only a file whose every complaint is a key's CHECK lists its keys: any other complaint (a missing key, an
    # order) leaves failed_keys empty, so nothing reads such a file as failing those checks alone.
    return Verdict(False, _one_line(messages[0]), keys if len(keys) == len(messages) else ())


def _cache_file(digest: str, ruleset: str) -> Path:
    return cache_root() / "compliance" / f"mlperf-logging-{checker_version()}-v{VERDICT_FORMAT}" / f"{USAGE}_{ruleset}" / \
        f"{digest}.json"


def _cached(digest: str, ruleset: str) -> Verdict | None:
    try:
        record = json.loads(_cache_file(digest, ruleset).read_text())
        return Verdict(bool(record["passed"]), record["error"], tuple(record.get("failed_keys", ())))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store(digest: str, ruleset: str, verdict: Verdict) -> None:
    """Write one verdict (renamed into place, so a reader never sees half a file). A cache that cannot be
    written (a read-only home) costs only the next report's time, so the error is not raised."""
    path = _cache_file(digest, ruleset)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"passed": verdict.passed, "error": verdict.error,
                                   "failed_keys": list(verdict.failed_keys)}))
        os.replace(tmp, path)
    except OSError:
        pass


def _digest(path: Path) -> tuple[str, int] | None:
    """(sha256, size) of a file, None where it cannot be read."""
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest(), os.fstat(f.fileno()).st_size
    except OSError:
        return None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _threads() -> int:
    """The threads this process runs, native ones included (torch's OpenMP pool, an RPC library's receiver), which
    `threading.active_count()` does not see: /proc/self/task on Linux."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _start_method() -> BaseContext:
    """fork where it is safe: in a process that runs one thread, such as `harness report`, workers then start in
    milliseconds with the checker already imported (spawned ones take 0.4 s here). spawn where other threads
    run, such as a notebook's kernel or a process that has run torch: a forked child can inherit a lock that
    another thread held (a pytest worker with 30 native threads hung in a forked checker, counted as one)."""
    if _threads() == 1 and "fork" in get_all_start_methods():
        from mlperf_logging.compliance_checker import mlp_compliance  # noqa: F401 - imported once, for every worker

        return get_context("fork")
    return get_context("spawn")


def verdicts(paths: list[Path], ruleset: str) -> dict[Path, Verdict]:
    """The checker's verdict on each file: from the cache, else checked (in parallel) and cached. Files of the
    same content (copies of one log) are checked once."""
    found: dict[Path, Verdict] = {}
    digests: dict[Path, str] = {}
    todo: dict[str, tuple[Path, int]] = {}  # digest -> (a file of that content, its size)
    for path in paths:
        digest = _digest(path)
        if digest is None:
            found[path] = Verdict(False, "cannot be read")
        elif (verdict := _cached(digest[0], ruleset)) is not None:
            found[path] = verdict
        else:
            digests[path] = digest[0]
            todo.setdefault(digest[0], (path, digest[1]))
    # Largest first, so that no worker is left with a big file at the end.
    order = sorted(todo, key=lambda d: todo[d][1], reverse=True)
    files = [str(todo[d][0]) for d in order]
    workers = min(len(order), _cores())
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=_start_method()) as pool:
            checked = dict(zip(order, pool.map(check_file, files, [ruleset] * len(files))))
    else:  # one file, or one core: a worker would cost more than it saves
        checked = {digest: check_file(file, ruleset) for digest, file in zip(order, files)}
    for digest, verdict in checked.items():
        _store(digest, ruleset, verdict)
    found.update((path, checked[digest]) for path, digest in digests.items())
    return found
