"""Pipeline parallelism for the decoders (workloads.decoder.pipeline): the planner's stages and refusals, the split
of the blocks, and on CPU (gloo) each stage against the whole model in one process (tests/pipeline_parallel_worker.py):
llama31_8b's tiny model over 2 stages (alone, and FSDP 2 within each stage) and over 4 (middle stages), and
gpt_oss_20b's over 2 stages x expert parallel 2; and `harness run llama31_8b --pipeline-parallel 2` surviving a
killed rank."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from harness.errors import HarnessError
from harness.spec import JobSpec, validate
from tests.conftest import REPO, harness
from workloads.common.campaign import RunOptions
from workloads.decoder.config import GPT_OSS_PRESETS, PRESETS, layer_chunks, plan_layout
from workloads.decoder.pipeline import rank_model, stage_models
from workloads.decoder.stages import describe_stages

TINY = PRESETS["tiny"]


def test_the_planner_divides_the_world_by_the_pipeline_first():
    """8 processes, 2 a node, pipeline 2: each stage 4 consecutive ranks (2 nodes), FSDP over a node's 2 within it,
    replicated across its 2 nodes; the step's 8 sequences are 2 micro batches per data rank (the schedule's)."""
    layout = plan_layout(replace(TINY, pipeline_parallel=2, shard_nodes=1), world=8, procs_per_node=2)
    assert (layout.pipeline, layout.replicate, layout.shard, layout.context, layout.tensor) == (2, 2, 2, 1, 1)
    assert layout.world == 8 and layout.grad_accum == 2 and layout.global_batch == 8
    moe = plan_layout(replace(GPT_OSS_PRESETS["tiny"], pipeline_parallel=2, global_batch=8), world=4,
                      procs_per_node=4)
    assert (moe.pipeline, moe.shard, moe.expert, moe.grad_accum) == (2, 2, 2, 4)


@pytest.mark.parametrize("changes, world, words", [
    (dict(pipeline_parallel=3), 4, "pipeline parallel 3 must divide the world size 4"),
    (dict(pipeline_parallel=4), 4, "2 layers do not fill 4 pipeline stages"),
    (dict(pipeline_parallel=2, global_batch=1), 2, "needs at least 2 micro batches per data rank"),
    (dict(virtual_stages=2), 2, "virtual stages 2: 1, or with a pipeline"),
    (dict(pipeline_parallel=2, virtual_stages=2), 2, "2 layers do not fill 4 pipeline stages"),
    (dict(pipeline_parallel=2, virtual_stages=2, global_batch=5, model=replace(TINY.model, n_layer=4)), 2,
     "the 5 per data rank are not a multiple of 2"),
])
def test_the_planner_refuses_a_pipeline_that_cannot_split_the_world_the_layers_or_the_batch(changes, world, words):
    with pytest.raises(ValueError, match=words):
        plan_layout(replace(TINY, **changes), world=world, procs_per_node=world)


def test_the_blocks_split_as_megatron_bridge_splits_deepseek_v3():
    """ceil(layers / stages) a stage, the last the rest (set_deepseek_v3_pipeline_model_parallel_layout, PP4:
    16/16/16/13); a split that would leave the last stage empty is refused with the stage counts that fill."""
    assert layer_chunks(2, 2) == [range(0, 1), range(1, 2)]
    assert layer_chunks(32, 4) == [range(0, 8), range(8, 16), range(16, 24), range(24, 32)]
    assert layer_chunks(4, 4) == [range(n, n + 1) for n in range(4)]
    assert [len(chunk) for chunk in layer_chunks(61, 4)] == [16, 16, 16, 13]
    assert [len(chunk) for chunk in layer_chunks(61, 16)] == [4] * 15 + [1]
    with pytest.raises(ValueError, match="ceil\\(5 / 4\\) = 2 a stage leaves the last one empty"):
        layer_chunks(5, 4)


def test_the_dry_run_line_says_which_blocks_each_stage_holds():
    cfg = replace(TINY, pipeline_parallel=2)
    line = describe_stages(cfg, plan_layout(cfg, world=4, procs_per_node=2))
    assert line == ("pipeline 2 ranks, 2 stages, 1F1B over 4 micro batches per data rank: stage 0 (ranks 0-1): the "
                    "embedding, block 0; stage 1 (ranks 2-3): block 1, the final norm and output layer")
    cfg = replace(TINY, pipeline_parallel=2, virtual_stages=2, model=replace(TINY.model, n_layer=7))
    line = describe_stages(cfg, plan_layout(cfg, world=2, procs_per_node=2))
    assert line == ("pipeline 2 ranks, 4 stages, interleaved 1F1B, 2 stages a rank over 8 micro batches per data "
                    "rank: stage 0 (ranks 0-0): the embedding, blocks 0-1; stage 1 (ranks 1-1): blocks 2-3; stage 2 "
                    "(ranks 0-0): blocks 4-5; stage 3 (ranks 1-1): block 6, the final norm and output layer")
    assert describe_stages(TINY, plan_layout(TINY, world=2, procs_per_node=2)) == ""


def test_a_ranks_virtual_stages_are_one_module_under_the_whole_models_names_whose_hooks_see_each_forward():
    """StageChunks (a rank's virtual stages, for the loop, the optimizer and checkpoints): rank 0 of 2 holds stages 0
    and 2 of 4, the embedding and blocks 0 and 2 under their names; train()/eval() reach every chunk; forward hooks
    (the stragglers' timing, a slow fault) run on each chunk's forward and are removed together."""
    cfg = replace(TINY, pipeline_parallel=2, virtual_stages=2, model=replace(TINY.model, n_layer=4))
    chunks = stage_models(cfg.model, plan_layout(cfg, world=2, procs_per_node=2), pipeline_rank=0)
    model = rank_model(chunks)
    assert {name.split(".")[0] + "." + name.split(".")[1] for name, _ in model.named_parameters()} \
        == {"tok_embeddings.weight", "layers.0", "layers.2"}
    model.eval()
    assert not any(chunk.training for chunk in chunks)
    seen = []
    handle = model.register_forward_pre_hook(lambda module, args: seen.append(module))
    tokens = torch.zeros(1, 8, dtype=torch.long, device="meta")
    chunks[1](chunks[0](tokens))
    assert seen == chunks
    handle.remove()
    chunks[0](tokens)
    assert len(seen) == 2


def _workers(processes: int, *layouts: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(processes), str(REPO / "tests" / "pipeline_parallel_worker.py"), *layouts], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    for layout in layouts:
        assert proc.stdout.count(f"pipeline ok {layout}") == processes, proc.stdout
    return proc.stdout


@pytest.mark.slow
def test_two_stages_and_interleaved_virtual_stages_match_the_whole_model():
    """llama31_8b's tiny model over 2 stages, one process each: the initial weights, the 1F1B step's loss over 4
    micro batches, every gradient, the clipping norm and the eval's scored loss equal the whole model's, and a DCP
    checkpoint of the stages comes back whole; and with 4 blocks in 4 stages, 2 a rank (interleaved 1F1B: rank 0
    holds stages 0 and 2; its checkpoint through StageChunks); and deepseekv3_671b's tiny model over 2 stages, its
    multi-token prediction on the last stage reading what the first embeds."""
    _workers(2, "dense:2,1,1,1,1", "dense4:2x2,1,1,1,1", "deepseek:2,1,1,1,1")


@pytest.mark.slow
def test_stages_with_fsdp_tensor_context_and_expert_parallel_and_middle_stages_match_the_whole_model():
    """4 processes (pipeline, replicate, shard, context, tensor[, expert]): 2 stages x FSDP 2; 2 stages x tensor 2
    (sequence shards between the stages, the loss over vocabulary shards); 2 stages x context 2 (each stage given
    its chunks' positions); 4 stages of one block each (two middle stages, which read and send hidden states); and
    gpt_oss_20b's tiny model (at sequence 64) over 2 stages x expert parallel 2 (its experts split within each
    stage, the all-to-alls inside the stage's ranks); and deepseekv3_671b's tiny model (MLA, the balance loss, MTP)
    over 2 stages x expert parallel 2."""
    _workers(4, "dense:2,1,2,1,1", "dense:2,1,1,1,2", "dense:2,1,1,2,1", "dense4:4,1,1,1,1", "moe:2,1,2,1,1,2",
             "deepseek:2,1,2,1,1,2")


def test_the_option_is_refused_where_it_does_not_apply_or_divide(tmp_path):
    """--pipeline-parallel applies to the pretraining decoders; a count that does not divide the processes is
    refused before anything starts, naming the counts that do."""
    result = harness("run", "resnet", "--pipeline-parallel", "2", "--dry-run", "--out", str(tmp_path / "r"))
    assert result.returncode != 0 and "--pipeline-parallel applies to llama31_8b, gpt_oss_20b, deepseekv3_671b only" in result.stderr
    result = harness("run", "llama31_8b", "--pipeline-parallel", "3", "--dry-run", "--out", str(tmp_path / "l"))
    assert result.returncode != 0
    assert "pipeline parallel 3 must divide the world size 2" in result.stderr and "one of 1, 2" in result.stderr


def test_the_option_travels_from_the_command_line_to_every_rank(tmp_path):
    """`harness run --pipeline-parallel 2`: the spec keeps it through job.json and its own command line, and each
    rank's `python -m workloads` gets it."""
    from harness.cli import _spec_from_args, build_parser

    spec = JobSpec("llama31_8b", pipeline_parallel=2, out_dir=tmp_path / "o").resolved()
    assert _spec_from_args(build_parser().parse_args(spec.command_line("local")[1:])).resolved() == spec
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert RunOptions.parse(spec.worker_args()).pipeline_parallel == 2
    with pytest.raises(HarnessError, match="--pipeline-parallel must be at least 1"):
        validate(JobSpec("gpt_oss_20b", pipeline_parallel=0))

