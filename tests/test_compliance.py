"""mlperf-logging's compliance checker in the report: its verdicts, what the summarizer does with them, the cache."""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness.results import compliance, load
from harness.results.compliance import Verdict, check_file, verdicts
from tests.conftest import REPO, compliance as checker_cli, harness
from tests.test_results import OFFICIAL, SHARED_RESULTS, needs_shared, summarizer

BASELINE = REPO / "results" / "baselines" / "resnet-tiny"
BASELINE_SCORE = 0.2875  # the committed campaign's score (5 runs), to 4 decimals


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> Path:
    """Each test starts from an empty verdict cache of its own (the harness CLI it starts inherits it)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("HARNESS_DATA_DIR", str(path))
    return path


def broken_copy(dst: Path, drop: str = "cache_clear", files: int = 5) -> Path:
    """The committed baseline with every line logging `drop` removed from its first `files` logs."""
    dst.mkdir(parents=True)
    for i, log in enumerate(sorted(BASELINE.glob("result_*.txt"))):
        lines = log.read_bytes().splitlines(keepends=True)
        if i < files:
            lines = [line for line in lines if f'"key": "{drop}"'.encode() not in line]
        (dst / log.name).write_bytes(b"".join(lines))
    return dst


def summarizer_score(folder: Path, benchmark: str, ruleset: str) -> float | None:
    """MLCommons' result_summarizer's own score of one benchmark folder (compliance check included)."""
    score, _, _ = summarizer()._compute_strong_score_standalone(benchmark, "sys", False, str(folder), "training",
                                                                ruleset)
    return score


def test_the_broken_baseline_gets_the_summarizers_answer_and_names_every_file(tmp_path):
    """The issue's case: the baseline logs without cache_clear fail the checker, so there is no score."""
    broken = broken_copy(tmp_path / "broken")
    assert summarizer_score(broken, "resnet", "4.0.0") is None
    [group] = json.loads(harness("report", str(broken), "--format", "json").stdout)
    assert group["score_min"] is None and group["left_out"] == 5
    error = "Required AT_LEAST_ONE occurrence of 'cache_clear' but found 0"
    assert all(not run["compliant"] and run["compliance_error"] == error for run in group["runs"])
    table = harness("report", str(broken)).stdout
    assert "5 of 5 runs left out by the compliance checker" in table
    for log in sorted(broken.glob("result_*.txt")):
        assert f"left out by the compliance checker: {log}: {error}" in table
    rows = harness("report", str(broken), "--format", "csv").stdout.splitlines()
    header = rows[0].split(",")
    assert {"compliant", "compliance_error"} <= set(header)
    assert sum(f"False,{error}," in row for row in rows[1:]) == 5
    html = harness("report", str(broken), "--format", "html").stdout.split("<h2>Left out by the compliance checker</h2>")
    assert len(html) == 2 and all(f"<td>{log}</td>" in html[1] for log in broken.glob("result_*.txt"))
    assert html[1].count(f"<td>{error}</td>") == 5


def test_one_broken_file_counts_as_a_failed_run_as_the_summarizer_counts_it(tmp_path):
    broken = broken_copy(tmp_path / "one", files=1)
    expected = summarizer_score(broken, "resnet", "4.0.0")
    [group] = load([broken]).groups
    assert expected is not None and group.score_min == pytest.approx(expected, rel=1e-12)
    assert [Path(r.file).name for r in group.left_out] == ["result_0.txt"]
    assert group.score_min != pytest.approx(load([BASELINE]).groups[0].score_min)


def test_a_run_that_ended_aborted_is_named_aborted_not_by_the_checkers_noise(tmp_path, capsys):
    """A run whose data failed to open logs run_start, then run_stop aborted (workloads.common.campaign.open_data):
    no train_samples, which the checker then names ("Required EXACTLY_ONE occurrence of 'train_samples'"). Such a
    run failed already; the report and `harness run`'s summary say it ended aborted, its log kept, in one line.
    A run that ended success without train_samples is still left out, with the checker's words."""
    from harness.campaign import summarize
    from harness.report import render

    aborted = tmp_path / "aborted"
    aborted.mkdir()
    lines = (BASELINE / "result_0.txt").read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if '"key": "run_start"' in line)
    stop = next(line for line in lines if '"key": "run_stop"' in line).replace('"success"', '"aborted"')
    opened = ('"key": "train_samples"', '"key": "eval_samples"')  # logged once the data is open
    kept = [line for line in lines[:start + 1] if not any(key in line for key in opened)]
    (aborted / "result_0.txt").write_text("".join(kept) + stop)
    assert "train_samples" in check_file(str(aborted / "result_0.txt"), "4.0.0").error  # what was shown before
    [group] = load([aborted]).groups
    assert group.left_out == [] and group.runs[0].aborted and not group.runs[0].converged
    table = render(load([aborted]), "table")
    assert "train_samples" not in table and "compliance checker" not in table and "non-compliant" not in table
    assert f"aborted: {aborted / 'result_0.txt'}: the run stopped before its quality target; its log is kept" in table
    assert summarize(aborted, job_ok=True, runs=1, ruleset="4.0.0") == 1
    out, err = capsys.readouterr()
    assert "train_samples" not in out + err and "did not reach the quality target" in err and "left out" not in err

    finished = broken_copy(tmp_path / "finished", drop="train_samples", files=1)
    [group] = load([finished]).groups
    assert [Path(r.file).name for r in group.left_out] == ["result_0.txt"]
    table = render(load([finished]), "table")
    assert f"left out by the compliance checker: {finished / 'result_0.txt'}: Required EXACTLY_ONE occurrence of " \
           "'train_samples'" in table and "aborted:" not in table


def test_the_checkers_own_failure_is_a_failed_verdict_and_spoils_no_later_file(tmp_path):
    """resnet has no 5.0.0 rule file: the checker raises (its command exits 1 with a traceback)."""
    log = str(BASELINE / "result_0.txt")
    stopped = check_file(log, "5.0.0")
    assert not stopped.passed and stopped.error.startswith("the checker stopped: FileNotFoundError")
    assert check_file(log, "4.0.0") == Verdict(True)  # no rule file left queued from the failed check


def test_the_checker_in_process_prints_nothing_and_leaves_logging_as_it_was(tmp_path, capfd):
    root = logging.getLogger()
    handlers, disabled = list(root.handlers), root.manager.disable
    broken = broken_copy(tmp_path / "broken", files=1)
    assert not check_file(str(broken / "result_0.txt"), "4.0.0").passed
    assert capfd.readouterr() == ("", "")
    assert root.handlers == handlers and root.manager.disable == disabled


def test_the_checker_parses_each_rule_file_once_per_process_and_its_yaml_is_given_back(monkeypatch):
    import yaml
    from mlperf_logging.compliance_checker import mlp_compliance

    parsed = []
    real = yaml.load
    monkeypatch.setattr(yaml, "load", lambda stream, Loader: parsed.append(Path(stream.name).name) or
                        real(stream, Loader=Loader))
    monkeypatch.setattr(compliance, "_RULE_FILES", compliance._RuleFiles())
    for log in sorted(BASELINE.glob("result_*.txt")):
        assert check_file(str(log), "4.0.0") == Verdict(True)
    assert sorted(parsed) == ["common.yaml", "open_common.yaml", "open_resnet.yaml"]  # once each, for five logs
    assert mlp_compliance.yaml is yaml


def test_verdicts_are_cached_by_content_ruleset_and_checker_version(tmp_path, private_cache, monkeypatch):
    logs = broken_copy(tmp_path / "logs", files=1)
    paths = sorted(logs.glob("result_*.txt"))
    first = verdicts(paths, "4.0.0")
    assert [first[p].passed for p in paths] == [False, True, True, True, True]
    cached = sorted((private_cache / "compliance").rglob("*.json"))
    assert len(cached) == 5
    folder = f"mlperf-logging-{compliance.checker_version()}-v{compliance.VERDICT_FORMAT}"
    assert all(folder in p.parts and "training_4.0.0" in p.parts for p in cached)

    def no_checker(path, ruleset):
        raise AssertionError(f"{path} was checked again")

    monkeypatch.setattr(compliance, "check_file", no_checker)
    assert verdicts(paths, "4.0.0") == first  # warm: nothing checked
    assert load([logs]).groups[0].left_out[0].compliance_error == first[paths[0]].error
    checked = []
    monkeypatch.setattr(compliance, "check_file", lambda path, ruleset: checked.append(path) or Verdict(True))
    paths[1].write_bytes(paths[1].read_bytes() + b"a line of noise\n")  # new content: checked again
    verdicts(paths, "4.0.0")
    assert checked == [str(paths[1])]
    checked.clear()
    verdicts(paths[:1], "4.1.0")  # another ruleset
    assert checked == [str(paths[0])]
    checked.clear()
    monkeypatch.setattr(compliance, "checker_version", lambda: "9.9.9")  # another mlperf-logging
    verdicts(paths[:1], "4.0.0")
    assert checked == [str(paths[0])]


def test_copies_of_one_log_are_checked_once(tmp_path, monkeypatch):
    copies = [tmp_path / name / "result_0.txt" for name in ("a", "b", "c")]
    for copy in copies:
        copy.parent.mkdir()
        copy.write_bytes((BASELINE / "result_0.txt").read_bytes())
    checked = []
    monkeypatch.setattr(compliance, "check_file", lambda path, ruleset: checked.append(path) or Verdict(True))
    assert verdicts(copies, "4.0.0") == {copy: Verdict(True) for copy in copies}
    assert len(checked) == 1


def test_files_are_checked_in_worker_processes_with_the_same_verdicts(tmp_path, monkeypatch):
    logs = broken_copy(tmp_path / "logs", drop="init_stop", files=2)
    paths = sorted(logs.glob("result_*.txt"))
    pools = []
    real = compliance.ProcessPoolExecutor

    def recorded(workers, **kwargs):
        pools.append(workers)
        return real(workers, **kwargs)

    monkeypatch.setattr(compliance, "ProcessPoolExecutor", recorded)
    monkeypatch.setattr(compliance, "_cores", lambda: 2)
    pooled = verdicts(paths, "4.0.0")
    assert pools == [2]
    assert pooled == {path: check_file(str(path), "4.0.0") for path in paths}
    assert [pooled[p].passed for p in paths] == [False, False, True, True, True]


def test_workers_are_spawned_where_a_native_thread_runs():
    """A native thread (torch's OpenMP pool, an RPC library's receiver) is invisible to threading.active_count(); a
    checker forked beside one can inherit a lock it held and hang (a pytest worker with 30 of them did). Only a
    process of one thread forks its workers."""
    import _thread
    import threading

    assert compliance._threads() >= threading.active_count()
    release = threading.Event()  # a thread of threading's own, waited on by a native one
    started = threading.Event()

    def native():
        started.set()
        release.wait()

    _thread.start_new_thread(native, ())
    try:
        assert started.wait(timeout=120)
        assert compliance._start_method().get_start_method() == "spawn"
    finally:
        release.set()


@needs_shared
def test_the_report_names_the_one_shared_log_the_checker_fails():
    """tinycorp's run that never logged run_stop: the checker fails it, the score stays the official one."""
    result = harness("report", str(SHARED_RESULTS / "training_v4.0" / "tinycorp"), "--ruleset", "4.0.0",
                     "--format", "json")
    left = [(run["file"], run["compliance_error"]) for group in json.loads(result.stdout) for run in group["runs"]
            if not run["compliant"]]
    assert [Path(file).parts[-3:] for file, _ in left] == [("tinybox_green", "resnet", "result_0.txt")]
    assert left[0][1] == "Required EXACTLY_ONE occurrence of 'run_stop' but found 0"


def shared_logs() -> list[tuple[Path, str]]:
    """Every result file under ../shared/mlperf-results/, with the ruleset of its folder."""
    return [(path, ruleset) for (folder, ruleset) in sorted(OFFICIAL)
            for path in sorted((SHARED_RESULTS / folder).rglob("result_*.txt"))]


@needs_shared
@pytest.mark.slow
def test_verdicts_equal_the_checker_commands_on_every_shared_log_and_broken_baselines(tmp_path):
    """`python -m mlperf_logging.compliance_checker` on each file (242 commands, 2 at a time) against our verdicts:
    the same pass or fail, and our first error is one the command printed."""
    broken = [(path, "4.0.0") for drop in ("cache_clear", "init_stop", "run_stop", "submission_org")
              for path in sorted(broken_copy(tmp_path / drop, drop=drop, files=1).glob("result_*.txt"))[:1]]
    files = shared_logs() + broken + [(BASELINE / "result_0.txt", "5.0.0")]
    assert len(files) > 240
    ours = {}
    for ruleset in {r for _, r in files}:
        ours.update(verdicts([p for p, r in files if r == ruleset], ruleset))
    with ThreadPoolExecutor(2) as pool:
        theirs = list(pool.map(lambda item: checker_cli(item[0], item[1], cwd=tmp_path), files))
    failed = 0
    for (path, ruleset), command in zip(files, theirs):
        verdict = ours[path]
        assert verdict.passed == (command.returncode == 0), (path, ruleset, command.stdout + command.stderr)
        if not verdict.passed:
            failed += 1
            printed = command.stdout + command.stderr
            assert all(part in printed for part in verdict.error.removeprefix("the checker stopped: ").split(" / ")), \
                (path, verdict.error)
    assert failed == 1 + len(broken) + 1  # tinycorp's unfinished run, the broken copies, resnet under 5.0.0
