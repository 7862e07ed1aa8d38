"""Fuzzing the log parser and the rule files: damage is reported and contained, never crashes a report.

Each example writes five valid ResNet runs and one log damaged by Hypothesis
(truncated, bytes flipped or inserted, lines dropped or duplicated, JSON values
swapped for arbitrary ones) into a fresh folder, then loads the folder the way
`harness report` does. Whatever the damage: no exception escapes, the five good
runs are still scored, and the damaged file is either parsed or named as skipped.
Rule files get the same treatment: a mangled target expression, or any text as a rule file,
makes at most its own (system, benchmark) group unscorable, with the reason.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from unittest import mock

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.report import render
from harness.results import load
from harness.results.compliance import Verdict
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


# Rule files: a mangled rule, or a rule for a benchmark that has none, must cost at most its own group.

RULESET = "4.0.0"
REAL_RULES = Path(str(resources.files("mlperf_logging") / "compliance_checker" / f"training_{RULESET}"))
SSD_SCORE = 3.0  # olympic mean of 1..5 minutes


@st.composite
def mangled_expression(draw) -> str:
    """The real resnet target with characters deleted, replaced or inserted, or any text at all."""
    if draw(st.booleans()):
        return draw(st.text(max_size=40))
    text = list("v['value'] >= 0.7590 and v['value'] < 1.0")
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        kind = draw(st.sampled_from(["delete", "replace", "insert"]))
        if kind == "delete" and at < len(text):
            del text[at]
        elif kind == "replace" and at < len(text):
            text[at] = draw(st.characters())
        else:
            text.insert(at, draw(st.sampled_from([" ", "(", ")", "'", "[", "]", ":", "\n", "x", "1/0", "s['k']"])))
    return "".join(text)


def rule_file(expression: str, key: str = "eval_accuracy") -> str:
    return yaml.safe_dump([{"KEY": {"NAME": key, "REQ": "AT_LEAST_ONE", "ATLEAST_ONE_CHECK": expression}}])


def all_pass(paths: list[Path], ruleset: str) -> dict:
    return {path: Verdict(True) for path in paths}


def check_rules(resnet_rule: str, newbench_rule: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "rules"
        rules = root / f"training_{RULESET}"
        rules.mkdir(parents=True)
        shutil.copy(REAL_RULES / "closed_ssd.yaml", rules)
        (rules / "closed_resnet.yaml").write_text(resnet_rule)
        (rules / "closed_newbench.yaml").write_text(newbench_rule)  # a benchmark mlperf-logging has no rule for
        logs = Path(tmp) / "logs"
        for benchmark, accuracy in (("resnet", 0.76), ("ssd", 0.35), ("newbench", 0.5)):
            (logs / benchmark).mkdir(parents=True)
            for i in range(5):
                write_run(logs / benchmark / f"result_{i}.txt", 1.0 + i, accuracy=accuracy, benchmark=benchmark,
                          platform=f"box-{benchmark}")
        # The rule files under test are the targets' only; the compliance checker reads the installed ones,
        # which the made-up ssd and newbench logs do not satisfy, so its verdicts are taken as passes here.
        with mock.patch("harness.results.rules.rules_root", return_value=root), \
                mock.patch("harness.results.compliance.verdicts", side_effect=all_pass):
            results = load([logs], ruleset=RULESET)
            for fmt in ("table", "json", "csv"):
                render(results, fmt)
        groups = {g.benchmark: g for g in results.groups}
        assert groups.keys() == {"resnet", "ssd", "newbench"}
        assert groups["ssd"].unscorable is None and abs(groups["ssd"].score_min - SSD_SCORE) < 1e-9
        for name in ("resnet", "newbench"):
            group = groups[name]
            if group.unscorable:  # the reason names the rule file
                assert group.score_min is None and f"closed_{name}.yaml" in group.unscorable


rule_fuzz = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@rule_fuzz
@given(mangled_expression())
def test_a_mangled_rule_costs_only_its_own_group(expression):
    check_rules(rule_file(expression), rule_file("v['value'] >= 0.4"))


@rule_fuzz
@given(st.text(max_size=200), st.sampled_from(["eval_accuracy", "aggregated_eval_accuracy"]), mangled_expression())
def test_any_rule_file_text_costs_only_its_own_group(text, key, expression):
    check_rules(text, rule_file(expression, key))


def test_an_unevaluable_rule_is_named_and_the_rest_scored():
    """The classic case: a rule that names what the checker does not give it; the report says why."""
    check_rules(rule_file("v['value'] >= s['target']"), rule_file("v['value'] >= 0.4"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for i in range(5):
            write_run(folder / f"result_{i}.txt", 1.0 + i, accuracy=0.76)
        rules = folder / "rules" / f"training_{RULESET}"
        rules.mkdir(parents=True)
        (rules / "closed_resnet.yaml").write_text(rule_file("v['value'] >="))
        with mock.patch("harness.results.rules.rules_root", return_value=folder / "rules"):
            [group] = load([folder], ruleset=RULESET).groups
            table = render(load([folder], ruleset=RULESET), "table")
    assert group.score_min is None and "is not a valid expression" in group.unscorable
    assert "unscorable: " in table and "closed_resnet.yaml" in table
