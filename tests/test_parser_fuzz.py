"""Fuzzing the log parser: damaged logs are reported and left out, never crash a report.

Each example writes five valid ResNet runs and one log damaged by Hypothesis
(truncated, bytes flipped or inserted, lines dropped or duplicated, JSON values
swapped for arbitrary ones) into a fresh folder, then loads the folder the way
`harness report` does. Whatever the damage: no exception escapes, the five good
runs are still scored, and the damaged file is either parsed or named as skipped.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.results import load
from tests.test_results import mllog, write_run

GOOD_MINUTES = [1.0, 1.1, 1.2, 1.3, 1.4]
GOOD_SCORE = 1.2  # olympic mean of the five

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def valid_log() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        return write_run(Path(tmp) / "result_9.txt", 2.0).read_bytes()


VALID = valid_log()


@st.composite
def byte_damage(draw) -> bytes:
    """Raw damage: truncation, flipped or inserted bytes, dropped or repeated lines."""
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["truncate", "flip", "insert", "drop_line", "repeat_line"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "truncate":
            del data[at:]
        elif kind == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            lines = bytes(data).splitlines(keepends=True)
            if lines:
                i = draw(st.integers(0, len(lines) - 1))
                lines[i:i + 1] = [] if kind == "drop_line" else [lines[i]] * draw(st.integers(2, 50))
                data = bytearray(b"".join(lines))
    return bytes(data)


@st.composite
def json_damage(draw) -> bytes:
    """Well-formed JSON with wrong content: a field of one record replaced by an arbitrary JSON value."""
    lines = VALID.decode().splitlines()
    mllog_lines = [i for i, line in enumerate(lines) if line.startswith(":::MLLOG ")]
    i = draw(st.sampled_from(mllog_lines))
    record = json.loads(lines[i].removeprefix(":::MLLOG "))
    field = draw(st.sampled_from(["key", "value", "time_ms", "metadata", "namespace"]))
    record[field] = draw(json_values)
    if draw(st.booleans()):  # also a metadata field, where status and epoch live
        record["metadata"] = {draw(st.sampled_from(["status", "epoch_num", "samples_count"])): draw(json_values)}
    lines[i] = ":::MLLOG " + json.dumps(record)
    return ("\n".join(lines) + "\n").encode()


def check_folder_with(damaged: bytes) -> None:
    skipped: list[tuple[Path, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for i, minutes in enumerate(GOOD_MINUTES):
            write_run(folder / f"result_{i}.txt", minutes)
        bad = folder / "result_5.txt"
        bad.write_bytes(damaged)
        results = load([folder], on_error=lambda path, reason: skipped.append((path, reason)))
        # Every frame a notebook would build, from whatever was parsed.
        results.runs, results.events, results.scores
        files = {Path(r.file).name for r in results.records}
        assert {f"result_{i}.txt" for i in range(5)} <= files
        if "result_5.txt" in files:  # damage the parser can live with, such as a lost line of noise
            assert not skipped
        else:
            assert [p.name for p, _ in skipped] == ["result_5.txt"] and all(reason for _, reason in skipped)
            [group] = results.groups
            assert abs(group.score_min - GOOD_SCORE) < 1e-9


fuzz = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fuzz
@given(byte_damage())
def test_byte_damage_never_escapes(damaged):
    check_folder_with(damaged)


@fuzz
@given(json_damage())
def test_wrong_json_content_never_escapes(damaged):
    check_folder_with(damaged)


@fuzz
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_escape(damaged):
    check_folder_with(damaged)


def test_a_damaged_run_stop_is_named(tmp_path):
    """The reason a user reads for one classic damage: the last line cut mid-record."""
    write_run(tmp_path / "result_0.txt", 1.0)
    cut = tmp_path / "result_1.txt"
    cut.write_text(mllog("run_start", t=0) + "\n" + mllog("run_stop", t=60000)[:-7] + "\n")
    skipped = []
    load([tmp_path], on_error=lambda path, reason: skipped.append((path.name, reason)))
    assert skipped and skipped[0][0] == "result_1.txt" and "line 2: damaged MLLOG record" in skipped[0][1]
