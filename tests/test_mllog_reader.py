"""One MLLOG reader, shared by the workloads (where a restarted run continues) and the report."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.results import parse
from tests.conftest import REPO
from workloads.common import mllog_reader
from workloads.common.mlperf import LoggedRun, logged_run


def test_the_workloads_and_the_report_read_logs_with_one_reader(tmp_path):
    assert parse.iter_events is mllog_reader.iter_events and parse.LogError is mllog_reader.LogError
    log = tmp_path / "result_0.txt"
    log.write_bytes(b'0: :::MLLOG {"key": "seed", "value": 5, "time_ms": 1}\n'
                    b'a line that is no record\n'
                    b':::MLLOG {"key": "run_start", "value": null, "time_ms": 2}\n'
                    b':::MLLOG {"key": "run_st')  # cut by a killed writer
    assert logged_run(log) == LoggedRun(started=True, stopped=False, seed=5)
    with pytest.raises(mllog_reader.LogError, match="line 4: damaged MLLOG record"):
        list(mllog_reader.iter_events(log.read_bytes()))


def test_the_reader_is_light_enough_for_every_worker():
    """Neither torch nor the report's pandas comes with it."""
    code = ("import sys, workloads.common.mllog_reader; "
            "print(sorted(m for m in ('torch', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
