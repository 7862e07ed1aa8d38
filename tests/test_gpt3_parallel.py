"""GPT-3's parallel layout on CPU (gloo): tensor + sequence parallel with FSDP2 matches the whole model, and
gradient accumulation holds only each rank's shard of the gradients; 2 pipeline stages match the whole model too
(tests/gpt3_parallel_worker.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # real multi-process or compiled training steps


def torchrun(procs: int, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(procs), str(REPO / "tests" / "gpt3_parallel_worker.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    return proc.stdout


@pytest.mark.parametrize("procs,jobs", [(2, ("memory:2:1:2", "parity:1:2:2")),
                                        (4, ("memory:2:2:2", "parity:2:2:2"))])
def test_tensor_parallel_matches_the_whole_model_and_holds_only_sharded_gradients(procs, jobs):
    """Parity: loss, every gradient, the clipped gradients and one AdamW step, with 2 accumulated micro batches,
    on (data, tensor) meshes (1, 2) and (2, 2). Memory: after every micro batch, each rank holds exactly the
    estimate's gradient bytes, its FSDP shard of its tensor-parallel share (gradient sync off between micro
    batches would hold every unsharded gradient); its weights and Adam moments match their terms too. Each
    process count runs its two jobs in one torchrun."""
    out = torchrun(procs, *jobs)
    assert out.count("parity ok") == procs
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(reports) == procs
    for report in reports:
        estimate = report["estimate"]
        assert report["gradients"] == [estimate["gradients"]] * 2, report
        assert report["weights"] == estimate["weights"] and report["optimizer"] == estimate["optimizer"], report


def test_two_pipeline_stages_match_the_whole_model_with_the_tied_output_layer_exact():
    """Pipeline 2 (one process a stage, 4 micro batches of 1F1B): each stage's initial weights, drawn from one seed,
    are the whole model's (the last stage's copy of the tied output layer too); the loss on both ranks and every
    gradient equal the whole model's (both copies of the tied weight hold the sum of its two uses); clipping counts
    the copy once; after one AdamW step the weights match and the two copies are equal to the bit; the eval's
    scored sums match; and a DCP checkpoint of the stages, keyed by parameter name as a pipelined run saves it,
    comes back whole, AdamW's state and hyperparameters included."""
    assert torchrun(2, "pipeline:1:1:4").count("pipeline ok") == 2


def test_a_pipelined_gpt3_keys_its_checkpoints_by_parameter_name():
    """A pipelined run's stages hold different parameters: its checkpoints key the optimizer state by name (the
    format the worker's round trip restores; the positional one loses the other stages' hyperparameters)."""
    from workloads.gpt3.train import GPT3Workload

    work = object.__new__(GPT3Workload)
    assert not work.ranks_hold_other_parameters
    work.pipeline = object()
    assert work.ranks_hold_other_parameters
