"""notebooks/analysis.ipynb, executed top to bottom by a real Jupyter kernel (nbclient + ipykernel)."""

from __future__ import annotations

import os

import nbclient
import nbformat

from tests.conftest import REPO, TINY_RUNS
from tests.test_results import COREWEAVE, OFFICIAL, needs_shared

NOTEBOOK = REPO / "notebooks" / "analysis.ipynb"


def execute(monkeypatch, paths: list, ruleset: str | None = None, start_campaign: bool = True) -> list[dict]:
    """Run the notebook on `paths` (through its environment parameters), judged by `ruleset`, else by each log's own,
    starting its tiny campaign or not; return every output, in order."""
    monkeypatch.setenv("HARNESS_RESULTS", os.pathsep.join(map(str, paths)))
    monkeypatch.setenv("HARNESS_START_CAMPAIGN", "1" if start_campaign else "0")
    if ruleset:
        monkeypatch.setenv("HARNESS_RULESET", ruleset)
    else:
        monkeypatch.delenv("HARNESS_RULESET", raising=False)
    monkeypatch.delenv("HARNESS_SYSTEMS", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]


def text(outputs: list[dict]) -> str:
    return "\n".join(o.get("text") or o.get("data", {}).get("text/plain", "") for o in outputs)


def pictures(outputs: list[dict]) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs)


def test_notebook_on_a_tiny_run(monkeypatch, tiny_campaign):
    out, _ = tiny_campaign
    outputs = execute(monkeypatch, [out], "4.0.0")
    shown = text(outputs)
    assert f"{TINY_RUNS} runs in 1 (system, benchmark) groups, judged by ruleset 4.0.0" in shown
    assert "resnet" in shown and pictures(outputs) == 4  # quality, throughput, time_to_train, scaling
    assert "nothing to compare yet" in shown  # one system only
    assert "campaign through the API: SUCCEEDED, exit code 0" in shown  # the campaign the notebook starts


@needs_shared
def test_notebook_on_coreweave_and_a_tiny_run(monkeypatch, tiny_campaign):
    out, _ = tiny_campaign
    # No ruleset: the v3.0 tree's own, 3.0.0; the tiny run's, 4.0.0. The campaign cell ran in the test above.
    outputs = execute(monkeypatch, [COREWEAVE, out], start_campaign=False)
    shown = text(outputs)
    assert "START_CAMPAIGN is off: no campaign started." in shown and "campaign through the API" not in shown
    assert f"{24 + TINY_RUNS} runs in 6 (system, benchmark) groups, judged by each group's own ruleset" in shown
    assert pictures(outputs) == 4
    for row in OFFICIAL[("training_v3.0/NVIDIA_CoreWeave", "3.0.0")]:
        assert f"{row['score_min']:.6f}" in shown  # pandas shows six decimals
    # The default comparison: the smallest and largest GPT-3 systems, 768 and 3,584 H100s.
    assert "**coreweave_hgxh100_n96_ngc23.04_pytorch** against **coreweave_hgxh100_n448_ngc23.04_pytorch**" in \
        "\n".join(o.get("data", {}).get("text/markdown", "") for o in outputs)
    assert "4.168566" in shown and "0.893264" in shown  # speedup and scaling efficiency
