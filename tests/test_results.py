"""Parsing MLPerf logs and scoring them by the official rules."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.results import load
from harness.results.parse import LogError, parse_file
from harness.results.score import benchmark_score, olympic_score, required_runs
from tests.conftest import SHARED, harness

COREWEAVE = SHARED / "mlperf-results" / "training_v3.0" / "NVIDIA_CoreWeave"
# The official scores, from ../shared/mlperf-results/README.md (MLCommons' result_summarizer).
OFFICIAL = {
    ("coreweave_hgxh100_n96_ngc23.04_pytorch", "gpt3"): 45.60585,
    ("coreweave_hgxh100_n192_ngc23.04_pytorch", "gpt3"): 23.611233333333335,
    ("coreweave_hgxh100_n448_ngc23.04_pytorch", "gpt3"): 10.940416666666666,
    ("coreweave_hgxh100_n384_ngc23.04_pytorch", "bert"): 0.13380625000000002,
    ("coreweave_hgxh100_n448_ngc23.04_mxnet", "resnet"): 0.18298333333333336,
}
needs_shared = pytest.mark.skipif(not COREWEAVE.is_dir(), reason=f"shared MLPerf results not found at {COREWEAVE}")


def mllog(key, value=None, t=0, **metadata) -> str:
    return ":::MLLOG " + json.dumps({"namespace": "", "time_ms": t, "event_type": "POINT_IN_TIME", "key": key,
                                     "value": value, "metadata": metadata})


def write_run(path: Path, minutes: float, status: str = "success", prefix: str = "", division: str = "closed",
              accuracy: float = 0.8) -> Path:
    lines = [mllog("submission_benchmark", "resnet"), mllog("submission_division", division),
             mllog("submission_org", "ACME"),
             mllog("submission_platform", "box"), "plain noise from a worker",
             mllog("run_start", t=1000), mllog("eval_accuracy", 0.5, t=2000, epoch_num=1),
             mllog("tracked_stats", {"throughput": 100.0}, t=2000, step=1),
             mllog("eval_accuracy", accuracy, t=3000, epoch_num=2),
             mllog("run_stop", t=1000 + minutes * 60000, status=status)]
    path.write_text("".join(prefix + line + "\n" for line in lines))
    return path


def test_parse_ignores_noise_and_rank_prefixes(tmp_path):
    run = parse_file(write_run(tmp_path / "result_0.txt", 2.0, prefix="17: "))
    assert run.time_to_train_min == pytest.approx(2.0)
    assert run.quality == 0.8 and run.samples_per_s == 100.0 and run.status == "success"
    assert run.evals == [(1000.0, 0.5), (2000.0, 0.8)]


def test_token_rate_and_mfu_are_reported_where_logged(tmp_path):
    for name in ("resnet", "gpt3"):
        (tmp_path / name).mkdir()
    resnet = write_run(tmp_path / "resnet" / "result_0.txt", 1.0)
    gpt = tmp_path / "gpt3" / "result_0.txt"
    stats = [mllog("tracked_stats", {"throughput": 2.0, "tokens_per_second": 4096.0 * k, "mfu": 0.4 * k}, t=2000,
                   step=k) for k in (1, 2)]
    gpt.write_text("".join(line + "\n" for line in [mllog("submission_benchmark", "gpt3"), mllog("run_start", t=1000),
                                                   *stats, mllog("run_stop", t=61000, status="success")]))
    run = parse_file(gpt)
    assert run.tokens_per_s == 6144.0 and run.mfu == pytest.approx(0.6) and run.samples_per_s == 2.0
    assert parse_file(resnet).tokens_per_s is None and parse_file(resnet).mfu is None
    table = harness("report", str(tmp_path)).stdout
    gpt_lines = table.split("gpt3:")[1].splitlines()
    assert "tokens/s  MFU" in gpt_lines[1] and "6144" in gpt_lines[2] and "0.600" in gpt_lines[2]
    assert "tokens/s" not in table.split("resnet:")[1].split("gpt3")[0]  # no empty columns for ResNet
    records = {g["benchmark"]: g["runs"][0] for g in json.loads(harness("report", str(tmp_path), "--format", "json").stdout)}
    assert records["gpt3"]["mfu"] == pytest.approx(0.6) and records["resnet"]["tokens_per_s"] is None


def test_parse_takes_the_first_run_stop_among_duplicates(tmp_path):
    path = write_run(tmp_path / "result_0.txt", 1.0)
    with path.open("a") as f:
        for rank in range(1000):  # per-rank duplicates, later and out of order
            f.write(mllog("run_stop", t=999_999 - rank, status="success") + "\n")
    assert parse_file(path).time_to_train_min == pytest.approx(1.0)


@pytest.mark.parametrize("content, reason", [
    (b"", "empty"),
    (b"just text\n", "no MLLOG"),
    (b':::MLLOG {"key": "run_start", "time_ms": 1\n', "damaged"),
    (b"\x00\xff\xfe:::MLLOG \x81\x82\n", "damaged"),
    (mllog("run_start", t=1).encode() + b"\n", "run_stop not recorded"),
])
def test_unusable_files_are_named_with_a_reason(tmp_path, content, reason):
    path = tmp_path / "result_0.txt"
    path.write_bytes(content)
    with pytest.raises(LogError, match=reason):
        parse_file(path)


def test_load_reports_bad_files_and_keeps_the_rest(tmp_path):
    for i in range(5):
        write_run(tmp_path / f"result_{i}.txt", 1.0 + i, accuracy=0.76)
    (tmp_path / "result_9.txt").write_text(mllog("run_start")[:30])
    errors = []
    results = load([tmp_path], on_error=lambda path, why: errors.append((path.name, why)))
    assert [name for name, _ in errors] == ["result_9.txt"]
    assert len(results.records) == 5
    assert results.groups[0].score_min == pytest.approx(3.0)  # mean of 2, 3, 4


def test_olympic_score_rules():
    assert required_runs("resnet") == 5 and required_runs("bert") == 10 and required_runs("gpt3") == 3
    assert olympic_score([1, 2, 3, 4, 5], 0, "resnet") == pytest.approx(3.0)
    # One failed run counts as the slowest: drop it and the fastest.
    assert olympic_score([1, 2, 3, 4], 1, "resnet") == pytest.approx(3.0)
    assert olympic_score([1, 2, 3], 2, "resnet") is None  # more than one failure: no score
    assert olympic_score([1, 2, 3, 4, 5], 0, "resnet", scaling_factor=2.0) == pytest.approx(6.0)
    assert benchmark_score([1.0] * 4, [True] * 4, "resnet") is None  # fewer runs than required


def test_scaling_json_is_applied_and_never_written(tmp_path):
    for i in range(5):
        write_run(tmp_path / f"result_{i}.txt", 2.0, accuracy=0.76)
    (tmp_path / "scaling.json").write_text('{"scaling_factor": 1.5}')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert load([tmp_path]).groups[0].score_min == pytest.approx(3.0)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@needs_shared
def test_coreweave_scores_equal_the_official_ones(tmp_path):
    groups = json.loads(harness("report", str(COREWEAVE), "--ruleset", "3.0.0", "--format", "json").stdout)
    scores = {(g["system"], g["benchmark"]): g["score_min"] for g in groups}
    assert scores.keys() == OFFICIAL.keys()
    for key, official in OFFICIAL.items():
        assert scores[key] == pytest.approx(official, rel=1e-9), key
    assert {g["submitter"] for g in groups} == {"NVIDIA+CoreWeave"}


@needs_shared
def test_a_corrupt_log_beside_real_ones_is_named_and_scores_stand(tmp_path):
    tree = tmp_path / "NVIDIA_CoreWeave"
    shutil.copytree(COREWEAVE, tree)
    bad = tree / "results" / "coreweave_hgxh100_n448_ngc23.04_pytorch" / "gpt3" / "result_9.txt"
    bad.write_bytes(b':::MLLOG {"key": "run_start", "ti')
    result = harness("report", str(tree), "--ruleset", "3.0.0", "--format", "json")
    assert result.returncode == 0
    assert str(bad) in result.stderr
    scores = {(g["system"], g["benchmark"]): g["score_min"] for g in json.loads(result.stdout)}
    for key, official in OFFICIAL.items():
        assert scores[key] == pytest.approx(official, rel=1e-9), key


def test_report_path_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, harness.report, harness.results; harness.results.load([]); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_the_rulesets_target_check_decides_convergence(tmp_path):
    from harness.results.rules import target_check

    assert target_check("4.0.0", "closed", "resnet")(0.759) and not target_check("4.0.0", "closed", "resnet")(0.75)
    assert target_check("4.1.0", "closed", "gpt3")(2.69) and not target_check("4.1.0", "closed", "gpt3")(2.7)
    assert target_check("5.0.0", "closed", "bert")(0.72) and not target_check("5.0.0", "closed", "bert")(0.71)
    for i, accuracy in enumerate([0.76, 0.77, 0.75, 0.78, 0.79]):  # run 2 logged success below the target
        write_run(tmp_path / f"result_{i}.txt", 1.0 + i, accuracy=accuracy)
    results = load([tmp_path], ruleset="4.0.0")
    assert list(results.runs.converged) == [True, True, False, True, True]
    # The unconverged run is the dropped slowest, the fastest (1.0) goes too: mean of 2, 4, 5.
    assert results.groups[0].score_min == pytest.approx((2 + 4 + 5) / 3)
    write_run(tmp_path / "result_0.txt", 1.0, status="aborted", accuracy=0.76)
    assert load([tmp_path], ruleset="4.0.0").groups[0].score_min is None  # two runs failed


def test_frames_of_a_result_set(tmp_path):
    for i in range(5):
        write_run(tmp_path / f"result_{i}.txt", 1.0 + i, accuracy=0.76)
    results = load([tmp_path])
    assert list(results.runs.columns[:6]) == ["submitter", "system", "benchmark", "division", "status", "converged"]
    assert len(results.runs) == 5 and results.runs.time_to_train_min.tolist() == pytest.approx([1, 2, 3, 4, 5])
    events = results.events
    assert set(events.key) >= {"run_start", "run_stop", "eval_accuracy", "tracked_stats"}
    assert events[events.key == "eval_accuracy"].epoch.tolist() == [1, 2] * 5
    scores = results.scores
    assert scores.loc[0, "score_min"] == pytest.approx(3.0) and scores.loc[0, "runs"] == 5
    assert (scores.loc[0, "min_min"], scores.loc[0, "max_min"]) == pytest.approx((1.0, 5.0))


def test_markdown_and_html_reports(tmp_path):
    folder = tmp_path / "<b>odd"
    folder.mkdir()
    for i in range(5):
        write_run(folder / f"result_{i}.txt", 1.0 + i, accuracy=0.76)
    markdown = harness("report", str(folder), "--format", "markdown")
    assert markdown.returncode == 0
    assert "## Scores" in markdown.stdout and "| ACME" in markdown.stdout and "3.0000" in markdown.stdout
    html = harness("report", str(folder), "--format", "html").stdout
    assert "<h2>Scores</h2>" in html and "<td>ACME</td>" in html
    assert "<b>odd" not in html and "&lt;b&gt;odd" in html  # names are escaped, not markup


def test_plot_writes_quality_throughput_and_time_to_train_pictures(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    for i in range(2):
        write_run(runs / f"result_{i}.txt", 1.0 + i, accuracy=0.76)
    result = harness("report", str(runs), "--plot", str(tmp_path / "plots"))
    assert result.returncode == 0, result.stderr
    for name in ("quality.png", "throughput.png", "time_to_train.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 10_000
    assert sorted(p.name for p in runs.iterdir()) == ["result_0.txt", "result_1.txt"]  # input untouched


@needs_shared
def test_compare_systems_names_the_known_systems_on_a_typo():
    results = load([COREWEAVE], ruleset="3.0.0")
    with pytest.raises(ValueError, match="no system 'n96'.*coreweave_hgxh100_n96_ngc23.04_pytorch"):
        results.compare_systems("n96", "coreweave_hgxh100_n448_ngc23.04_pytorch")
