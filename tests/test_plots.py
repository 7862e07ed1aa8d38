"""`report --plot` on a submission the size of University-of-Florida's v5.1 one: pictures that tell groups apart.

That tree (five system folders under one official name, seven benchmarks, about 300 runs) is not in
../shared, so the fixture builds its likeness from GigaComputing's v4.0 submission, whose four system
folders already share one name: five system folders, each with the same seven benchmarks (60 runs each,
300 in all) copied from GigaComputing's folders, every description naming the same system.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from PIL import Image

from harness.plots import figures
from harness.results import load
from tests.conftest import harness
from tests.test_results import SHARED_RESULTS, needs_shared

GIGA = SHARED_RESULTS / "training_v4.0" / "GigaComputing"
BENCHMARKS = ("bert", "dlrm_dcnv2", "gnn", "llama2_70b_lora", "resnet", "ssd", "stable_diffusion")
SYSTEMS = [f"G593-SD1_node{i}" for i in range(1, 6)]
NAME = "GIGABYTE G593-SD1"


@pytest.fixture(scope="module")
def crowded_tree(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("plots") / "University-of-Florida-like"
    description = json.loads((GIGA / "systems" / "G593-SD1_pytorch.json").read_text())
    (tree / "systems").mkdir(parents=True)
    for system in SYSTEMS:
        (tree / "systems" / f"{system}.json").write_text(json.dumps({**description, "system_name": NAME}))
        for benchmark in BENCHMARKS:
            [source] = (GIGA / "results").glob(f"*/{benchmark}")
            shutil.copytree(source, tree / "results" / system / benchmark)
    return tree


@needs_shared
def test_the_pictures_of_300_runs_on_five_same_named_systems_tell_them_apart(crowded_tree, tmp_path):
    result = harness("report", str(crowded_tree), "--ruleset", "4.0.0", "--plot", str(tmp_path / "plots"))
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr and "Traceback" not in result.stderr  # no layout that does not fit
    for name in ("quality", "throughput", "time_to_train"):
        with Image.open(tmp_path / "plots" / f"{name}.png") as png:
            width, height = png.size
        # Seven panels in a grid of three columns and three rows, not one row 4,620 pixels wide.
        assert (width, height) == (1815, 1386), (name, png.size)

    results = load([crowded_tree], ruleset="4.0.0")
    assert len(results.records) == 300 and len(results.groups) == 35
    labels = {f"{NAME} ({system})" for system in SYSTEMS}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "not compatible with tight_layout" and the like
        pictures = figures(results)
        for fig in pictures.values():
            fig.canvas.draw()
    colours: dict[str, set] = {}
    for name in ("quality", "throughput"):
        panels = pictures[name].axes
        assert len(panels) == len(BENCHMARKS)
        for ax in panels:
            if not ax.lines:
                assert name == "throughput"  # a benchmark that logs no throughput (stable diffusion)
                continue
            legend = ax.get_legend()
            entries = [text.get_text() for text in legend.get_texts()]
            assert len(entries) == 5 and set(entries) == labels, (name, ax.get_title(), entries)
            for label, handle in zip(entries, legend.legend_handles):
                colours.setdefault(label, set()).add(handle.get_color())
            # Every run's line in one of its five systems' colours: colour by system, not by run.
            assert len({line.get_color() for line in ax.lines}) == 5
    assert all(len(seen) == 1 for seen in colours.values()), colours  # a system keeps its colour in every panel
    assert len({seen.pop() for seen in colours.values()}) == 5
    for ax in pictures["time_to_train"].axes:
        assert sorted(tick.get_text() for tick in ax.get_xticklabels()) == sorted(labels)
        assert [text.get_text() for text in ax.get_legend().get_texts()] == ["run", "did not converge", "MLPerf score"]
