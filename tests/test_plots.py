"""The pictures answer what campaign owners ask, on real submissions: how close to linear a system scales, where
the quality target lies, what throughput NVIDIA's logs carry, and which of eight same-named systems is which.

University of Florida's v5.1 tree (eight system folders under one official name, seven benchmarks) is not in
../shared, so a fixture builds its likeness from GigaComputing's v4.0 submission: UFL's eight folders and name,
each benchmark's GigaComputing runs copied into five of the folders (300 runs in all), as UFL ran each benchmark
on some of its node counts.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import statistics
import warnings
from pathlib import Path

import pytest
from PIL import Image

from harness.plots import figures
from harness.results import ResultSet, load
from harness.results.parse import parse_file
from harness.results.rules import RuleError, Threshold, rules_root, rulesets, target_check
from tests.conftest import harness
from tests.test_results import OFFICIAL, SHARED_RESULTS, needs_shared

GIGA = SHARED_RESULTS / "training_v4.0" / "GigaComputing"
BENCHMARKS = ("bert", "dlrm_dcnv2", "gnn", "llama2_70b_lora", "resnet", "ssd", "stable_diffusion")
NODES = (1, 2, 4, 8, 9, 16, 32, 56)  # UFL's system folders, hpg.dgxb200x8.n<nodes>, 8 B200 a node
NAME = "HiPerGator NVIDIA DGX B200 (8x B200-SXM-180GB)"  # the official system_name of all eight
HEADING = f"{NAME} (hpg.dgxb200x8.…)"  # what every label shares, said once per panel
V51 = SHARED_RESULTS / "training_v5.1" / "NVIDIA" / "results" / "theia_ngpu512_ngc25.09_nemo"


def nodes_of(benchmark: str) -> tuple[int, ...]:
    """The five node counts a benchmark ran on in the likeness: together the seven benchmarks use all eight."""
    first = BENCHMARKS.index(benchmark) % 4
    return NODES[first:first + 5]


@pytest.fixture(scope="module")
def ufl_tree(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("plots") / "University-of-Florida-like"
    description = json.loads((GIGA / "systems" / "G593-SD1_pytorch.json").read_text())
    (tree / "systems").mkdir(parents=True)
    for nodes in NODES:
        (tree / "systems" / f"hpg.dgxb200x8.n{nodes}.json").write_text(
            json.dumps({**description, "system_name": NAME, "number_of_nodes": str(nodes)}))
    for benchmark in BENCHMARKS:
        [source] = (GIGA / "results").glob(f"*/{benchmark}")
        for nodes in nodes_of(benchmark):
            shutil.copytree(source, tree / "results" / f"hpg.dgxb200x8.n{nodes}" / benchmark)
    return tree


@functools.cache
def loaded(folder: str, ruleset: str) -> ResultSet:
    return load([SHARED_RESULTS / folder], ruleset=ruleset)


def panels(fig) -> dict[str, object]:
    """benchmark -> its panel."""
    return {ax.get_title().split(":")[0]: ax for ax in fig.axes}


def mllog_events(path: Path) -> list[dict]:
    return [json.loads(line.split(":::MLLOG", 1)[1]) for line in path.read_text().splitlines() if ":::MLLOG" in line]


@needs_shared
def test_the_pictures_of_eight_same_named_systems_show_only_what_tells_them_apart(ufl_tree, tmp_path):
    result = harness("report", str(ufl_tree), "--ruleset", "4.0.0", "--plot", str(tmp_path / "plots"))
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr and "Traceback" not in result.stderr  # no layout that does not fit
    for name in ("quality", "throughput", "time_to_train", "scaling"):
        with Image.open(tmp_path / "plots" / f"{name}.png") as png:
            # Seven panels in a grid of three columns and three rows, not one row 4,620 pixels wide.
            assert png.size == (1815, 1386), (name, png.size)

    results = load([ufl_tree], ruleset="4.0.0")
    assert len(results.records) == 300 and len(results.groups) == 35
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "not compatible with tight_layout" and the like
        pictures = figures(results)
        for fig in pictures.values():
            fig.canvas.draw()
    colours: dict[str, set] = {}
    for name in ("quality", "throughput", "scaling"):
        for benchmark, ax in panels(pictures[name]).items():
            if not ax.get_legend():
                assert name == "throughput" and benchmark == "stable_diffusion"  # it logs no throughput
                continue
            legend = ax.get_legend()
            # The shared name and folder prefix once, as the heading; each system by its node count, smallest first.
            assert legend.get_title().get_text().replace("\n", " ") == HEADING
            entries = [(text.get_text(), handle) for text, handle in zip(legend.get_texts(), legend.legend_handles)
                       if not text.get_text().startswith(("target", "ideal"))]
            assert [label for label, _ in entries] == [f"n{nodes}" for nodes in nodes_of(benchmark)], (name, benchmark)
            for label, handle in entries:
                colours.setdefault(label, set()).add(handle.get_color())
    assert all(len(seen) == 1 for seen in colours.values()), colours  # a system keeps its colour in every panel
    assert len({seen.pop() for seen in colours.values()}) == len(NODES)
    for benchmark, ax in panels(pictures["time_to_train"]).items():
        # Systems down the side, written across: no label rotated, none longer than its node count.
        assert [tick.get_text() for tick in ax.get_yticklabels()] == [f"n{nodes}" for nodes in nodes_of(benchmark)]
        assert ax.get_ylabel().replace("\n", " ") == HEADING
        assert [text.get_text() for text in ax.get_legend().get_texts()] == ["run", "did not converge", "MLPerf score"]
    for fig in pictures.values():
        for ax in fig.axes:
            assert all(tick.get_rotation() == 0 for tick in [*ax.get_xticklabels(), *ax.get_yticklabels()])


@needs_shared
@pytest.mark.parametrize("folder, ruleset", [("training_v3.0/NVIDIA_CoreWeave", "3.0.0"),
                                             ("training_v5.0/IBM+CoreWeave+NVIDIA", "5.0.0")])
def test_the_scaling_plot_puts_each_systems_official_score_against_its_accelerators(folder, ruleset):
    """gpt3 on 768, 1,536 and 3,584 H100; llama31_405b on 512 to 2,496 GB200: one point per system at its official
    score, and the line of ideal scaling from the smallest system (its GPU-minutes over more accelerators)."""
    official = OFFICIAL[(folder, ruleset)]
    scaling = panels(figures(loaded(folder, ruleset))["scaling"])
    assert set(scaling) == {row["benchmark"] for row in official}
    for benchmark, ax in scaling.items():
        rows = sorted((row["accelerators"], row["score_min"]) for row in official if row["benchmark"] == benchmark)
        assert ax.get_xscale() == ax.get_yscale() == "log"
        points = [line for line in ax.lines if line.get_marker() == "o"]
        assert [len(line.get_xdata()) for line in points] == [1] * len(rows)  # one point per system
        assert [line.get_xdata()[0] for line in points] == [count for count, _ in rows]
        assert [line.get_ydata()[0] for line in points] == pytest.approx([score for _, score in rows], rel=1e-9)
        ideal = [line for line in ax.lines if line.get_label().startswith("ideal scaling")]
        if len(rows) == 1:
            assert not ideal and not ax.texts
            continue
        (smallest, score), largest = rows[0], rows[-1][0]
        assert list(ideal[0].get_xdata()) == [smallest, largest]
        assert list(ideal[0].get_ydata()) == pytest.approx([score, score * smallest / largest])
        # Beside each point, how much of the ideal speed-up the system reaches.
        assert [text.get_text() for text in ax.texts] == \
            [f"{score * smallest / (count * minutes):.0%}" for count, minutes in rows]
        assert ax.texts[0].get_text() == "100%" and all(text.get_text() != "100%" for text in ax.texts[1:])
    assert sum(len(ax.texts) for ax in scaling.values()) >= 3  # a tree with a scaling series


@needs_shared
def test_quality_panels_draw_the_rulesets_target_with_plain_tick_labels():
    results = loaded("training_v3.0/NVIDIA_CoreWeave", "3.0.0")
    fig = figures(results)["quality"]
    fig.canvas.draw()
    expected = {"bert": Threshold(">=", 0.72), "gpt3": Threshold("<=", 2.69), "resnet": Threshold(">=", 0.759)}
    quality = panels(fig)
    assert set(quality) == set(expected)
    for benchmark, ax in quality.items():
        assert target_check("3.0.0", "closed", benchmark).threshold == expected[benchmark]
        [line] = [line for line in ax.lines if line.get_label().startswith("target")]
        assert set(line.get_ydata()) == {expected[benchmark].value}
        label = f"target {expected[benchmark].op} {expected[benchmark].value:g} (ruleset 3.0.0)"
        assert line.get_label() == label and label in [text.get_text() for text in ax.get_legend().get_texts()]
        assert ax.yaxis.get_offset_text().get_text() == ""  # no "+2.69" or "1e-3" above the axis
        assert all(re.fullmatch(r"-?[\d.,]+", tick.get_text()) for tick in ax.get_yticklabels()), benchmark


@needs_shared
def test_throughput_comes_from_the_step_times_nvidias_v51_logs_carry():
    log = V51 / "llama31_8b" / "result_0.txt"
    events = mllog_events(log)
    start = next(e["time_ms"] for e in events if e["key"] == "run_start")
    steps = [(e["time_ms"], e["value"]["train_step_time"]) for e in events
             if e["key"] == "tracked_stats" and "train_step_time" in e["value"]]
    assert steps and not any("throughput" in e["value"] for e in events if e["key"] == "tracked_stats")
    run = parse_file(log)  # global_batch_size 64 sequences of max_sequence_length 8,192 tokens
    assert run.samples_per_s == pytest.approx(statistics.mean(64 / seconds for _, seconds in steps))
    assert run.tokens_per_s == pytest.approx(run.samples_per_s * 8192)
    # bench/gpu_throughput.py's figure for the same log (its median step time): 11,980 tokens/s per GPU of 512.
    assert run.tokens_per_s / 512 == pytest.approx(11_980, rel=0.01)

    throughput = panels(figures(loaded("training_v5.1/NVIDIA", "5.1.0"))["throughput"])
    assert set(throughput) == {"llama2_70b_lora", "llama31_8b"}
    assert [len(ax.lines) for ax in throughput.values()] == [10, 10]  # every run has a line
    llama = throughput["llama31_8b"]
    assert llama.get_ylabel() == "tokens/s" and throughput["llama2_70b_lora"].get_ylabel() == "samples/s"
    first = llama.lines[0]  # result_0's
    assert list(first.get_ydata()) == pytest.approx([64 * 8192 / seconds for t, seconds in steps if t >= start])
    assert list(first.get_xdata()) == pytest.approx([(t - start) / 60000 for t, _ in steps if t >= start])
    assert all(300 < y < 400 for line in throughput["llama2_70b_lora"].lines for y in line.get_ydata())

    # A log with step times is read by them: NeMo's gpt3 logs of v3.0 also log a `throughput` that is tokens/s.
    gpt3 = SHARED_RESULTS / "training_v3.0/NVIDIA_CoreWeave/results/coreweave_hgxh100_n96_ngc23.04_pytorch/gpt3"
    events = mllog_events(gpt3 / "result_0.txt")
    timings = [e["value"]["train_step_timing"] for e in events
               if e["key"] == "tracked_stats" and "train_step_timing" in e["value"]]
    assert any(e["value"].get("throughput", 0) > 400_000 for e in events if e["key"] == "tracked_stats")
    assert parse_file(gpt3 / "result_0.txt").samples_per_s == \
        pytest.approx(statistics.mean(3072 / seconds for seconds in timings))


def test_the_target_drawn_is_where_the_rules_own_check_flips():
    """Every rule file of every ruleset the installed mlperf-logging has: the threshold read from its expression
    passes just inside and fails just outside under the compiled check itself; a rule with no one value to draw
    (two metrics, an open division's range check) has none."""
    known = {("4.0.0", "closed", "resnet"): Threshold(">=", 0.759),
             ("5.1.0", "closed", "llama31_8b"): Threshold("<=", 3.3),  # a log perplexity: lower is better
             ("3.0.0", "closed", "gpt3"): Threshold("<=", 2.69), ("4.0.0", "closed", "stable_diffusion"): None,
             ("4.0.0", "open", "resnet"): None, ("6.1.0", "closed", "dlrmv4"): None}  # dlrmv4: s['target_accuracy']
    for (ruleset, division, benchmark), threshold in known.items():
        assert target_check(ruleset, division, benchmark).threshold == threshold, (ruleset, division, benchmark)
    checked = 0
    for ruleset in rulesets():
        for rule_file in sorted((rules_root() / f"training_{ruleset}").glob("*_*.yaml")):
            division, _, benchmark = rule_file.stem.partition("_")
            try:
                target = target_check(ruleset, division, benchmark)
            except RuleError:
                continue
            threshold = target and target.threshold
            if not threshold:
                continue
            inward = 1 if threshold.op in (">=", ">") else -1  # the side of the threshold that meets the target
            step = 1e-9 * max(1.0, abs(threshold.value))
            meets = lambda value: target.met_by([(value, {})])  # noqa: E731
            assert meets(threshold.value) == (threshold.op in (">=", "<=")), rule_file
            assert meets(threshold.value + inward * step) and not meets(threshold.value - inward * step), rule_file
            checked += 1
    assert checked >= 40
