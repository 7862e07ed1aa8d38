"""Parsing MLPerf logs and scoring them by the official rules."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
from pathlib import Path

import pytest

from harness.results import load
from harness.results.parse import LogError, parse_file
from harness.results.score import benchmark_score, olympic_score, required_runs
from tests.conftest import SHARED, harness

SHARED_RESULTS = SHARED / "mlperf-results"
COREWEAVE = SHARED_RESULTS / "training_v3.0" / "NVIDIA_CoreWeave"
needs_shared = pytest.mark.skipif(not (SHARED_RESULTS / "official-scores.json").is_file(),
                                  reason=f"shared MLPerf results not found at {SHARED_RESULTS}")


def official_scores() -> dict[tuple[str, str], list[dict]]:
    """(folder, ruleset) -> the official rows, from MLCommons' result_summarizer (official-scores.json)."""
    rows: dict[tuple[str, str], list[dict]] = {}
    path = SHARED_RESULTS / "official-scores.json"
    for row in json.loads(path.read_text())["scores"] if path.is_file() else []:
        rows.setdefault((row["folder"], row["ruleset"]), []).append(row)
    return rows


OFFICIAL = official_scores()


def mllog(key, value=None, t=0, **metadata) -> str:
    return ":::MLLOG " + json.dumps({"namespace": "", "time_ms": t, "event_type": "POINT_IN_TIME", "key": key,
                                     "value": value, "metadata": metadata})


# Every key mlperf-logging's 4.0.0 compliance checker requires of a resnet run (closed: with its SGD keys), so a
# written run passes the checker as a real one does and only what a test changes decides its score.
RESNET_SGD = {"gradient_accumulation_steps": 1, "opt_name": "sgd", "sgd_opt_base_learning_rate": 0.2,
              "sgd_opt_end_learning_rate": 0.0001, "sgd_opt_learning_rate_decay_poly_power": 2,
              "sgd_opt_learning_rate_decay_steps": 100, "sgd_opt_weight_decay": 0.0001, "sgd_opt_momentum": 0.9,
              "model_bn_span": 32, "opt_learning_rate_warmup_epochs": 0, "train_samples": 5000, "eval_samples": 1000}


def write_run(path: Path, minutes: float, status: str = "success", prefix: str = "", division: str = "closed",
              accuracy: float = 0.8, benchmark: str = "resnet", platform: str = "box", batch_size: int = 3264,
              epochs: float = 2) -> Path:
    """A resnet run that mlperf-logging's compliance checker passes (ruleset 4.0.0), with noise among its lines."""
    lines = [mllog("cache_clear", True), mllog("init_start"), mllog("submission_benchmark", benchmark),
             mllog("submission_division", division), mllog("submission_org", "ACME"),
             mllog("submission_status", "onprem"), mllog("global_batch_size", batch_size),
             *(mllog(key, value) for key, value in RESNET_SGD.items()),
             mllog("submission_platform", platform), "plain noise from a worker", mllog("init_stop", t=500),
             mllog("run_start", t=1000), mllog("block_start", t=1000, first_epoch_num=1, epoch_count=1),
             mllog("epoch_start", t=1000, epoch_num=1), mllog("epoch_stop", t=2000, epoch_num=1),
             mllog("eval_start", t=2000, epoch_num=1), mllog("eval_accuracy", 0.5, t=2000, epoch_num=1),
             mllog("eval_stop", t=2000, epoch_num=1), mllog("block_stop", t=2000, first_epoch_num=1),
             mllog("tracked_stats", {"throughput": 100.0}, t=2000, step=1),
             mllog("eval_accuracy", accuracy, t=3000, epoch_num=epochs),
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
    (mllog("run_stop", t=1).encode() + b"\n", "run_start not recorded"),
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
@pytest.mark.parametrize("folder, ruleset", sorted(OFFICIAL))
def test_every_official_score_under_the_official_name_with_its_rcp_verdict(folder, ruleset):
    """All 30 scores of official-scores.json, each submission folder reported as a user would, with its ruleset."""
    result = harness("report", str(SHARED_RESULTS / folder), "--ruleset", ruleset, "--format", "json")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    groups = {(g["system"], g["benchmark"]): g for g in json.loads(result.stdout)}
    for row in OFFICIAL[(folder, ruleset)]:
        group = groups[(row["system"], row["benchmark"])]
        assert group["score_min"] == pytest.approx(row["score_min"], rel=1e-9), row
        assert group["rcp"] == row["rcp"], row
        assert group["system_id"] == Path(group["runs"][0]["file"]).parts[-3]
    table = harness("report", str(SHARED_RESULTS / folder), "--ruleset", ruleset).stdout
    for row in OFFICIAL[(folder, ruleset)]:
        assert f"{row['score_min']:.4f} min" in table


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
    for row in OFFICIAL[("training_v3.0/NVIDIA_CoreWeave", "3.0.0")]:
        assert scores[(row["system"], row["benchmark"])] == pytest.approx(row["score_min"], rel=1e-9), row


def test_report_path_does_not_import_torch_or_numpy():
    """torch: reports run anywhere; numpy (through mlperf-logging's logger): a quarter of a report's CPU time."""
    import subprocess
    import sys

    code = ("import sys, harness.cli, harness.report, harness.results; harness.results.load([]); "
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split() == \
        ["False", "False"]


def test_the_key_names_are_mlperf_loggings_and_the_writers():
    from mlperf_logging.mllog import constants

    from harness.results.keys import C, TRACKED_STATS
    from workloads.common.mlperf import TRACKED_STATS as WRITTEN

    assert TRACKED_STATS == WRITTEN
    assert {k: v for k, v in vars(C).items() if k.isupper()} == {k: v for k, v in vars(constants).items() if k.isupper()}


def test_the_rulesets_target_check_decides_convergence(tmp_path):
    from harness.results.rules import target_check

    def meets(ruleset, benchmark, value):
        return target_check(ruleset, "closed", benchmark).met_by([(value, {"epoch_num": 1})])

    assert meets("4.0.0", "resnet", 0.759) and not meets("4.0.0", "resnet", 0.75)
    assert meets("4.1.0", "gpt3", 2.69) and not meets("4.1.0", "gpt3", 2.7)
    assert meets("5.0.0", "bert", 0.72) and not meets("5.0.0", "bert", 0.71)
    assert meets("4.0.0", "unet3d", 0.91) and not meets("4.0.0", "unet3d", 0.9)  # its rule starts with a space
    assert meets("3.0.0", "maskrcnn", {"BBOX": 0.38, "SEGM": 0.35})  # a value that is no plain number
    assert not meets("3.0.0", "maskrcnn", {"BBOX": 0.38, "SEGM": 0.30}) and not meets("4.0.0", "resnet", "0.8")
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
    assert list(results.runs.columns[:7]) == ["submitter", "system", "system_id", "benchmark", "division", "status",
                                              "converged"]
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


def summarizer():
    """MLCommons' result_summarizer module (slow to import: scipy, pandas), for comparisons."""
    from mlperf_logging.result_summarizer import result_summarizer

    return result_summarizer


def test_an_unfinished_run_is_a_failed_run_scored_as_the_summarizer_scores_it(tmp_path):
    minutes = [2.0, 1.0, 4.0, 3.0]
    for i, m in enumerate(minutes):
        write_run(tmp_path / f"result_{i}.txt", m, accuracy=0.76)
    unfinished = write_run(tmp_path / "result_4.txt", 0.5, accuracy=0.76)
    unfinished.write_text("".join(line + "\n" for line in unfinished.read_text().splitlines()[:-1]))  # no run_stop
    skipped = []
    results = load([tmp_path], ruleset="4.0.0", on_error=lambda path, why: skipped.append(path))
    assert not skipped and len(results.records) == 5
    run = next(r for r in results.records if r.file.endswith("result_4.txt"))
    assert run.unfinished and run.time_to_train_min is None and not run.converged
    # The summarizer: the run failed, so one fewer score is dropped from the slow end.
    expected = summarizer()._compute_olympic_average(list(minutes), 1, 1)
    assert results.groups[0].score_min == pytest.approx(expected, rel=1e-12)
    table = harness("report", str(tmp_path), "--ruleset", "4.0.0").stdout
    assert "unfinished" in table and f"score {expected:.4f} min" in table


def test_the_olympic_mean_mirrors_the_summarizers():
    import random

    average = summarizer()._compute_olympic_average
    rng = random.Random(7)
    for _ in range(300):
        benchmark = rng.choice(["resnet", "unet3d", "gpt3"])
        scores = [rng.uniform(1, 100) for _ in range(rng.randint(1, 45))]
        dropped = rng.randint(0, 4 if benchmark == "unet3d" else 1)
        expected = average(list(scores), dropped, 4 if benchmark == "unet3d" else 1)
        assert olympic_score(scores, dropped, benchmark) == expected


def test_two_metric_evals_meet_their_own_targets():
    """Stable diffusion logs FID and CLIP as two eval_accuracy events; the aggregate must meet both."""
    from harness.results.rules import aggregate_metrics, target_check

    target = target_check("4.0.0", "closed", "stable_diffusion")
    passing = [(80.0, {"metric": "FID", "samples_count": 512}), (0.16, {"metric": "CLIP", "samples_count": 512})]
    assert target.met_by(passing)
    assert not target.met_by([(80.0, {"metric": "FID", "samples_count": 512}),
                              (0.14, {"metric": "CLIP", "samples_count": 512})])  # CLIP short of its target
    assert not target.met_by([(80.0, {"metric": "FID", "samples_count": 512}),
                              (0.16, {"metric": "CLIP", "samples_count": 1024})])  # never both at one step
    assert not target.met_by(passing[:1])  # CLIP never logged
    assert aggregate_metrics(passing, "samples_count") == [{"samples_count": 512, "FID": 80.0, "CLIP": 0.16}]


def test_aggregate_metrics_mirrors_the_rule_files_begin_block():
    """Every ruleset's BEGIN block of mlperf-logging's stable diffusion rules, run on the same records, builds the
    same values as aggregate_metrics with that ruleset's eval_step_key (3.1.0 pairs FID and CLIP by step_num,
    later rulesets by samples_count; the records below pair differently by the two)."""
    from dataclasses import dataclass

    import yaml
    from harness.results.rules import aggregate_metrics, eval_step_key, rules_root, rulesets

    @dataclass
    class LogLine:  # the fields mlp_parser's LogLine has
        full_string: str
        timestamp: float
        key: str
        value: dict
        lineno: int

    records = [(85.0, {"metric": "FID", "samples_count": 1, "step_num": 10}),
               (0.1, {"metric": "CLIP", "samples_count": 1, "step_num": 20}),
               (0.2, {"metric": "CLIP", "samples_count": 2, "step_num": 10}), (0.9, {"epoch_num": 3}),
               (70.0, {"metric": "FID", "samples_count": 2, "step_num": 20})]
    checked = []
    for ruleset in rulesets():
        rule_file = rules_root() / f"training_{ruleset}" / "closed_stable_diffusion.yaml"
        if not rule_file.is_file():
            continue
        loglines = [LogLine("", float(i), "eval_accuracy", {"value": v, "metadata": m}, i)
                    for i, (v, m) in enumerate(records)]
        code = next(r["BEGIN"]["CODE"] for r in yaml.safe_load(rule_file.read_text()) if "BEGIN" in r)
        scope = {"loglines": loglines}
        exec(code, scope)  # noqa: S102 - mlperf-logging's own rule text
        theirs = [line.value["value"] for line in scope["loglines"] if line.key == "aggregated_eval_accuracy"]
        assert theirs == aggregate_metrics(records, eval_step_key(ruleset)), ruleset
        checked.append(ruleset)
    assert {"3.1.0", "4.0.0", "5.0.0"} <= set(checked)


def test_the_t_test_equals_scipys():
    from scipy import stats

    from harness.results.rcp import p_value

    for subm, ref, stdev, n_subm, n_ref in [(10, 12, 1.5, 8, 18), (3.1, 3.0, 0.2, 3, 1), (40, 41, 5, 36, 78),
                                            (0.5, 0.9, 0.01, 8, 8), (100, 100.0001, 3, 1, 18)]:
        t, p = stats.ttest_ind_from_stats(subm, stdev, n_subm, ref, stdev, n_ref, equal_var=True)
        expected = p / 2 if t < 0 else 1 - p / 2
        assert p_value(subm, stdev, n_subm, ref, stdev, n_ref) == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_the_pruned_rcps_equal_the_rcp_checkers_for_every_ruleset_and_benchmark():
    from mlperf_logging.rcp_checker.rcp_checker import RCP_Checker

    from harness.results.rcp import RCP_ROOT, SUPPORTED, RcpUnavailable, pruned_rcps, submission_runs, with_limits

    compared = 0
    for ruleset in sorted(SUPPORTED):
        for path in sorted((RCP_ROOT / f"training_{ruleset}").glob("rcps_*.json")):
            benchmark = path.stem.removeprefix("rcps_")
            try:
                theirs = RCP_Checker("training", ruleset, benchmark, False).pruned_rcp_data.values()
            except KeyError:  # a benchmark the checker has no run count for (dlrm): it cannot check it, nor can we
                with pytest.raises(RcpUnavailable):
                    pruned_rcps(ruleset, benchmark)
                continue
            ours = pruned_rcps(ruleset, benchmark)
            assert [r["BS"] for r in ours] == [r["BS"] for r in theirs], (ruleset, benchmark)
            for mine, their in zip(ours, theirs):
                mine = with_limits(mine, mine["ref_n"], submission_runs()[benchmark])
                for field in ("RCP Mean", "RCP Stdev", "Min Epochs", "Max Speedup"):
                    assert mine[field] == pytest.approx(their[field], rel=1e-9), (ruleset, benchmark, field)
            compared += 1
    assert compared > 50


@needs_shared
def test_rcp_verdicts_equal_the_rcp_checkers_on_every_shared_folder():
    from mlperf_logging.rcp_checker import rcp_checker

    from harness.results.rcp import check

    seen = set()
    for (folder, ruleset), rows in OFFICIAL.items():
        results = load([SHARED_RESULTS / folder], ruleset=ruleset)
        for group in results.groups:
            if (ruleset, group.benchmark) in seen:  # one folder per RCP table keeps the test short
                continue
            seen.add((ruleset, group.benchmark))
            directory = str(Path(group.runs[0].file).parent)
            passed, message, norm = rcp_checker.check_directory(directory, "training", ruleset, False, False,
                                                                rcp_pass="pruned_rcps", set_scaling=False)
            ours = check(group.runs, ruleset)
            assert (ours.verdict == "Pass", ours.message) == (passed, message), directory
            assert ours.scaling == pytest.approx(norm, rel=1e-9), directory


@pytest.mark.parametrize("epochs, batch_size", [(37, 3264), (34, 3264), (30, 3264), (37, 3000), (10, 3000),
                                                (37, 100000)])
def test_rcp_verdicts_equal_the_rcp_checkers_on_made_up_runs(tmp_path, epochs, batch_size):
    """Pass, Fail (too fast), interpolated and missing RCPs, against the checker on the same files."""
    from mlperf_logging.rcp_checker import rcp_checker

    from harness.results.rcp import check

    for i in range(5):
        write_run(tmp_path / f"result_{i}.txt", 1.0 + i, accuracy=0.76, batch_size=batch_size, epochs=epochs + i % 2)
    [group] = load([tmp_path], ruleset="4.0.0").groups
    passed, message, norm = rcp_checker.check_directory(str(tmp_path), "training", "4.0.0", False, False,
                                                        rcp_pass="pruned_rcps", set_scaling=False)
    assert (group.rcp == "Pass", group.rcp_message) == (passed, message)
    assert check(group.runs, "4.0.0").scaling == pytest.approx(norm, rel=1e-9)


def test_energy_of_power_results_as_the_summarizer_computes_it(tmp_path):
    """Node power readings of 1000 W for a run's whole time-to-train are 1000 W x the run's seconds."""
    for i in range(5):
        write_run(tmp_path / f"result_{i}.txt", 1.0 + i, accuracy=0.76)
        node = tmp_path / "power" / f"result_{i}"
        node.mkdir(parents=True)
        seconds = (1.0 + i) * 60
        node.joinpath("node_0.txt").write_text("\n".join([
            mllog("power_measurement_start", t=0), *(mllog("power_reading", 1000.0, t=k * 1000)
                                                      for k in range(1, int(seconds) + 1)),
            mllog("power_measurement_stop", t=seconds * 1000)]) + "\n")
    [group] = load([tmp_path], ruleset="4.0.0").groups
    assert group.energy == pytest.approx(1000 * (2 + 3 + 4) * 60 / 3)  # the olympic mean of the runs' joules
    assert "energy 180000.0 J" in harness("report", str(tmp_path), "--ruleset", "4.0.0").stdout


def test_two_campaigns_on_one_platform_are_two_groups_each_scored_as_the_summarizer_scores_it(tmp_path):
    """The issue's case: two copies of the committed 5-run baseline in one folder, both logged as cpu_n1x2."""
    baseline = Path(__file__).resolve().parents[1] / "results" / "baselines" / "resnet-tiny"
    for name in ("a", "b"):
        shutil.copytree(baseline, tmp_path / "runs" / name)
    groups = json.loads(harness("report", str(tmp_path / "runs"), "--format", "json").stdout)
    assert [(g["system"], g["campaign"], len(g["runs"])) for g in groups] == \
        [("cpu_n1x2", str(tmp_path / "runs" / name), 5) for name in ("a", "b")]
    alone = summarizer()._compute_strong_score_standalone("resnet", "cpu_n1x2", False, str(baseline), "training",
                                                          "4.0.0")[0]
    assert [g["score_min"] for g in groups] == [pytest.approx(alone, rel=1e-12)] * 2
    assert round(alone, 4) == 0.2875
    table = harness("report", str(tmp_path / "runs")).stdout
    assert "harness / cpu_n1x2 (a) / resnet: score 0.2875 min" in table
    assert "harness / cpu_n1x2 (b) / resnet: score 0.2875 min" in table


@needs_shared
def test_a_system_without_a_description_is_left_out_of_a_tree_as_the_summarizer_leaves_it(tmp_path):
    tree = tmp_path / "NVIDIA_CoreWeave"
    shutil.copytree(COREWEAVE, tree)
    (tree / "systems" / "coreweave_hgxh100_n96_ngc23.04_pytorch.json").unlink()
    result = harness("report", str(tree), "--ruleset", "3.0.0", "--format", "json")
    assert result.returncode == 0 and "Traceback" not in result.stderr
    skipped = [line for line in result.stderr.splitlines() if "coreweave_hgxh100_n96_ngc23.04_pytorch" in line]
    assert len(skipped) == 3 and all("left out, as the summarizer leaves out a system" in line for line in skipped)
    scores = {g["system"]: g["score_min"] for g in json.loads(result.stdout)}
    assert "coreweave_hgxh100_n96_ngc23.04_pytorch" not in scores
    for row in OFFICIAL[("training_v3.0/NVIDIA_CoreWeave", "3.0.0")]:
        if row["system"] != "coreweave_hgxh100_n96_ngc23.04_pytorch":
            assert scores[row["system"]] == pytest.approx(row["score_min"], rel=1e-9)


def step_num_logs(dst: Path) -> Path:
    """Real stable diffusion logs (GigaComputing, v4.0) in 3.1's form: every samples_count in metadata becomes the
    step_num that 3.1 logged in its place (samples / global batch size). No real v3.1 log is in ../shared."""
    src = SHARED_RESULTS / "training_v4.0" / "GigaComputing" / "results" / "G593-SD1_pytorch" / "stable_diffusion"
    dst.mkdir(parents=True)
    marker = ":::MLLOG "
    for log in sorted(src.glob("result_*.txt")):
        lines, batch = [], None
        for line in log.read_text().splitlines():
            at = line.find(marker)
            if at >= 0:
                event = json.loads(line[at + len(marker):])
                batch = event["value"] if event["key"] == "global_batch_size" else batch
                metadata = event.get("metadata") or {}
                if "samples_count" in metadata:
                    metadata["step_num"] = metadata.pop("samples_count") // batch
                line = line[:at] + marker + json.dumps(event)
            lines.append(line)
        (dst / log.name).write_text("\n".join(lines) + "\n")
    return dst


@needs_shared
def test_3_1_stable_diffusion_converges_by_step_num_as_the_summarizer_scores_it(tmp_path):
    """3.1.0 pairs FID and CLIP by step_num: the runs converge, and score what the summarizer and its RCP checker say."""
    from mlperf_logging.rcp_checker import rcp_checker

    logs = step_num_logs(tmp_path / "stable_diffusion")
    [group] = load([logs], ruleset="3.1.0").groups
    assert not group.left_out and all(r.converged for r in group.runs)
    expected = summarizer()._compute_strong_score_standalone("stable_diffusion", "sys", False, str(logs),
                                                             "training", "3.1.0")[0]
    official_v4 = next(r["score_min"] for r in OFFICIAL[("training_v4.0/GigaComputing", "4.0.0")]
                       if r["benchmark"] == "stable_diffusion")
    assert group.score_min == pytest.approx(expected, rel=1e-12) == pytest.approx(official_v4, rel=1e-9)
    passed, message, _ = rcp_checker.check_directory(str(logs), "training", "3.1.0", False, False,
                                                     rcp_pass="pruned_rcps", set_scaling=False)
    assert (group.rcp == "Pass", group.rcp_message) == (passed, message)
    [by_samples] = load([logs], ruleset="4.0.0").groups  # 4.0.0 pairs by samples_count, which these logs lack
    assert by_samples.score_min is None


# --- synthetic input: throughput runs, kept out of scores ------------------------------------------------------

def write_campaign(folder: Path, runs: int, synthetic: bool, status: str = "success") -> Path:
    """`runs` converging resnet logs, each with the run record's input line as the workers write it."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(runs):
        write_run(folder / f"result_{i}.txt", 1.0 + i / 10, status=status)
        (folder / f"run_{i}.jsonl").write_text(json.dumps({"attempt": 0, "kind": "input", "start": 1.0, "end": 1.0,
                                                           "synthetic": synthetic}) + "\n")
    return folder


def test_synthetic_runs_are_kept_out_of_scores_with_the_reason(tmp_path):
    from harness.compare import compare
    from harness.errors import HarnessError
    from harness.export import plan
    from harness.report import render
    from harness.results import SYNTHETIC

    real, synthetic = write_campaign(tmp_path / "real", 5, False), write_campaign(tmp_path / "synthetic", 5, True)
    scored = load([real])
    assert scored.groups[0].score_min is not None and not scored.runs.synthetic.any()
    kept_out = load([synthetic])
    group = kept_out.groups[0]
    assert group.score_min is None and group.unscorable == SYNTHETIC
    assert not any(r.converged for r in group.runs) and kept_out.runs.synthetic.all()
    table = render(kept_out, "table")
    assert f"unscorable: {SYNTHETIC}" in table and table.count("success, synthetic input") == 5
    assert all(run["synthetic"] for run in json.loads(render(kept_out, "json"))[0]["runs"])
    with pytest.raises(HarnessError, match=r"the baseline holds time-to-train runs \(real input\) and the candidate "
                                           r"throughput runs \(synthetic input\)"):
        compare(scored, kept_out, 0.1)  # compared on its throughput, with throughput runs only
    with pytest.raises(HarnessError, match="cannot export runs on synthetic input"):
        plan([synthetic], "ACME")


def test_a_synthetic_run_that_finished_says_so_and_exits_0(tmp_path, capsys):
    from harness.campaign import summarize

    # Synthetic runs train to their step limit, so their logs say aborted: no target was reached.
    synthetic = write_campaign(tmp_path / "synthetic", 1, True, status="aborted")
    assert summarize(synthetic, job_ok=True, runs=1, ruleset="4.0.0") == 0
    out, err = capsys.readouterr()
    assert "harness: synthetic input: a throughput run, with no quality target or score (1 of 1 run(s) finished)" \
        in out and "did not reach" not in out + err
    real = write_campaign(tmp_path / "real", 1, False, status="aborted")
    assert summarize(real, job_ok=True, runs=1, ruleset="4.0.0") == 1
    assert "1 of 1 run(s) did not reach the quality target" in capsys.readouterr().err


# --- the ruleset that judges each log: the round its tree's path names, else the newest holding its benchmark -----

V51_NVIDIA = SHARED_RESULTS / "training_v5.1" / "NVIDIA"


def test_each_log_is_judged_by_its_rounds_ruleset_else_the_newest_that_holds_its_benchmark(tmp_path):
    from harness.results.rules import NoRuleset, ruleset_for
    from workloads.registry import BENCHMARKS

    loose = tmp_path / "runs" / "result_0.txt"  # a campaign's log: no round in its path
    assert ruleset_for(loose, "llama31_8b") == "6.1.0" and ruleset_for(loose, "resnet") == "4.0.0"
    # 5.1.0 still ships closed_bert.yaml, but round 5.1 retired bert (benchmark_meta): 5.0.0 is the newest to hold it.
    assert ruleset_for(loose, "bert") == "5.0.0" and ruleset_for(loose, "gnmt") == "0.7.0"
    assert ruleset_for(tmp_path / "training_v5.1" / "ACME" / "results" / "sys" / "llama31_8b" / "result_0.txt",
                       "llama31_8b") == "5.1.0"
    # MLCommons' repository name, and the innermost round folder where two are named.
    assert ruleset_for(tmp_path / "training_v6.0" / "training_results_v4.0" / "ACME" / "result_0.txt",
                       "resnet") == "4.0.0"
    # Every benchmark the harness trains is held by a ruleset, which judges `harness run`'s summary as the report.
    assert all(ruleset_for(loose, name) for name in BENCHMARKS)
    for path, benchmark, why in ((loose, "newbench", "no ruleset holds newbench: none of the installed "
                                                     "mlperf-logging's (0.6.0 to "),
                                 (loose, None, "the log names no benchmark"),
                                 (tmp_path / "training_v9.9" / "result_0.txt", "resnet",
                                  "training_v9.9 names ruleset 9.9.0, which the installed mlperf-logging does not "
                                  "know")):
        with pytest.raises(NoRuleset, match=re.escape(why)):
            ruleset_for(path, benchmark)


def test_a_benchmark_no_ruleset_holds_is_said_not_failed(tmp_path):
    from harness.report import render

    (tmp_path / "new").mkdir()
    for i in range(5):
        write_run(tmp_path / "new" / f"result_{i}.txt", 1.0 + i, benchmark="newbench")
    results = load([tmp_path / "new"])
    [group] = results.groups
    assert group.ruleset is None and group.unscorable.startswith("no ruleset holds newbench: ")
    assert group.score_min is None and not group.left_out and not any(r.converged for r in group.runs)
    assert results.runs.compliant.isna().all() and results.scores.ruleset.isna().all()  # nothing was checked
    table = harness("report", str(tmp_path / "new")).stdout
    assert "ACME / box / newbench: no ruleset holds newbench: " in table
    assert "failed" not in table and "compliance checker" not in table and "non-compliant" not in table
    [record] = json.loads(render(results, "json"))
    assert record["ruleset"] is None and record["left_out"] == 0 and record["runs"][0]["compliant"] is None
    # Forced, a ruleset judges it all the same: its checker has no rule file for newbench, so every run fails.
    [forced] = load([tmp_path / "new"], ruleset="4.0.0").groups
    assert forced.ruleset == "4.0.0" and len(forced.left_out) == 5


@needs_shared
@pytest.mark.parametrize("folder, ruleset", sorted(OFFICIAL))
def test_every_official_score_with_no_ruleset_given(folder, ruleset):
    """A user who names no ruleset gets the summarizer's scores: each tree's path names its round (training_v5.1)."""
    result = harness("report", str(SHARED_RESULTS / folder), "--format", "json")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    groups = {(g["system"], g["benchmark"]): g for g in json.loads(result.stdout)}
    for row in OFFICIAL[(folder, ruleset)]:
        group = groups[(row["system"], row["benchmark"])]
        assert (group["ruleset"], group["rcp"]) == (ruleset, row["rcp"]), row
        assert group["score_min"] == pytest.approx(row["score_min"], rel=1e-9), row
    assert all(g["ruleset"] == ruleset for g in groups.values())


@needs_shared
def test_one_set_holds_each_round_beside_the_others_and_a_forced_ruleset_judges_all(tmp_path):
    """The v5.1 reference, a v6.0 run and a campaign (a v5.1 log outside any tree: judged by the newest, 6.1.0),
    in one report and one frame, each group by its own ruleset; --ruleset forces one on all."""
    from harness.report import render

    cisco = SHARED_RESULTS / "training_v6.0" / "Cisco"
    campaign = tmp_path / "campaign"
    campaign.mkdir()
    shutil.copy(V51_NVIDIA / "results" / "theia_ngpu512_ngc25.09_nemo" / "llama31_8b" / "result_0.txt", campaign)
    results = load([V51_NVIDIA, cisco, campaign])
    theia, zeus = "theia_ngpu512_ngc25.09_nemo", "Zeus_16xH100_SXM_80GB"
    assert {(g.folder, g.benchmark): g.ruleset for g in results.groups} == {
        (theia, "llama31_8b"): "5.1.0", (theia, "llama2_70b_lora"): "5.1.0", (zeus, "llama31_8b"): "6.0.0",
        (zeus, "gpt_oss_20b"): "6.0.0", (str(campaign), "llama31_8b"): "6.1.0"}
    assert list(results.scores.ruleset) == [g.ruleset for g in results.groups] and results.ruleset is None
    official = {r["benchmark"]: r["score_min"] for r in OFFICIAL[("training_v5.1/NVIDIA", "5.1.0")]}
    reference = results.scores[results.scores.system_id == "theia_ngpu512_ngc25.09_nemo"]
    assert dict(zip(reference.benchmark, reference.score_min)) == pytest.approx(official, rel=1e-9)
    assert all(r.compliant is not None for r in results.records)  # every file checked, by its own ruleset
    table = render(results, "table")
    assert f"llama31_8b: score {official['llama31_8b']:.4f} min (scaled by 1.0107); RCP Pass; ruleset 5.1.0" in table
    assert "Zeus_16xH100_SXM_80GB / llama31_8b: no score (1 of 10 required runs); RCP Fail; ruleset 6.0.0" in table
    assert "ruleset 6.1.0" in table
    assert "| ruleset " in render(results, "markdown") and "<th>ruleset</th>" in render(results, "html")
    rows = list(csv.DictReader(io.StringIO(render(results, "csv"))))
    assert [row["ruleset"] for row in rows] == [run.ruleset for group in results.groups for run in group.runs]

    forced = load([V51_NVIDIA, campaign], ruleset="5.1.0")  # the copy's content is the reference's: cached verdicts
    assert set(forced.scores.ruleset) == {"5.1.0"} and forced.ruleset == "5.1.0"
    assert forced.scores.score_min.notna().sum() == 2  # the reference scores; the one-run campaign does not
    result = harness("report", str(V51_NVIDIA), "--ruleset", "5.0.0", "--format", "json")
    by_benchmark = {g["benchmark"]: g for g in json.loads(result.stdout)}
    assert {g["ruleset"] for g in by_benchmark.values()} == {"5.0.0"}
    assert by_benchmark["llama31_8b"]["score_min"] is None  # 5.0.0 has no llama31_8b: forced, its checker fails it
    unknown = harness("report", str(V51_NVIDIA), "--ruleset", "5.1")
    assert unknown.returncode == 2 and "unknown ruleset '5.1'; choose one of: 0.6.0, " in unknown.stderr
