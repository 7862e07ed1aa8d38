"""One rank of tests/test_pipeline_parallel.py, started by torchrun: a decoder split into pipeline stages
(workloads.decoder.pipeline), FSDP2 or expert parallel within each stage, against the whole model in this process,
for each layout named on the command line:

    pipeline_parallel_worker.py KIND:P[xV],R,S,C,T[,E] [...]

KIND is `dense` (llama31_8b's tiny model), `dense4` (the same with 4 blocks, so that middle stages read and send
hidden states), `moe` (gpt_oss_20b's tiny model, 8 experts top 2 and a sliding window, at a short sequence) or
`deepseek` (deepseekv3_671b's tiny model at a short sequence: MLA, a dense first block, the grouped sigmoid router
with its sequence balance loss, a shared expert, and a multi-token-prediction depth on the last stage, which reads
the tokens ahead that the first stage embeds); P
pipeline ranks (each holding V virtual stages: the interleaved schedule) x R replicas x S shards x C context ranks x
T tensor ranks, E expert ranks. For each: every stage's initial weights drawn from one seed
equal the whole model's; the 1F1B step's loss over 4 micro batches per data rank, on every rank, and every
parameter's gradient (each stage's, gathered whole; together every parameter of the model) equal the whole
model's; one clipping norm over every stage; the eval's scored loss sums, at two batch shapes, too; and the
stages' parameters and AdamW state, saved with DCP and loaded into stages drawn from another seed, come back.
Prints "pipeline ok SPEC" per layout and rank.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.gpt3_parallel_worker import full, restores_whole, say
from workloads.common.language_model import accumulate_gradients, clip_grad_norm_, next_token_split, scored_loss_sum
from workloads.decoder.config import DEEPSEEK_TINY, GPT_OSS_PRESETS, PRESETS, Layout
from workloads.decoder.model import Decoder
from workloads.decoder.moe import MoE
from workloads.decoder.parallelize import ContextSplit, build_expert_mesh, build_mesh, parallelize
from workloads.decoder.pipeline import Pipeline, draw_weights, rank_model, stage_models

CONFIGS = {"dense": PRESETS["tiny"].model, "dense4": replace(PRESETS["tiny"].model, n_layer=4),
           "moe": replace(GPT_OSS_PRESETS["tiny"].model, seq_len=64), "deepseek": replace(DEEPSEEK_TINY, seq_len=64)}
MICRO_BATCH = 2
ACCUMULATE = 4
SEED = 5
CPU = torch.device("cpu")


def parity(kind: str, layout: Layout) -> None:
    config = CONFIGS[kind]
    mesh = build_mesh(layout, CPU)
    expert_mesh = build_expert_mesh(layout, CPU) if config.moe else None
    chunks = build_stages(config, layout, mesh, expert_mesh, SEED)
    model = rank_model(chunks)
    reference = Decoder(config)
    torch.manual_seed(SEED)
    reference.init_weights()
    wanted = dict(reference.named_parameters())
    for name, param in model.named_parameters():  # the stage's draws are the whole model's, every one
        assert_close(full(param.detach()), wanted[name].detach(), rtol=0, atol=0,
                     msg=lambda text, name=name: f"{name}: {text}")
    everyone: list[list[str]] = [[] for _ in range(layout.world)]
    dist.all_gather_object(everyone, [name for name, _ in model.named_parameters()])
    assert set().union(*everyone) == set(wanted), "the stages together hold every parameter, under its name"

    split = ContextSplit(mesh["context"].get_local_rank(), layout.context) if layout.context > 1 else next_token_split
    pipeline = Pipeline(chunks, mesh, layout, CPU, split)
    tokens = torch.randint(0, config.vocab_size, (layout.global_batch, config.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    data_rank = mesh["data"].get_local_rank()
    mine = [tokens[(step * layout.data + data_rank) * MICRO_BATCH:][:MICRO_BATCH] for step in range(ACCUMULATE)]
    # The balance loss's gradient scale (PretrainWorkload._expert_balance): 1 / the micro batches where each micro
    # batch's loss is divided by them; 1 in a stage, whose schedule divides the gradients after backward.
    for moe in (m for m in reference.modules() if isinstance(m, MoE)):
        moe.aux_loss_scale = MICRO_BATCH / layout.global_batch
    expected = accumulate_gradients(reference, tokens.split(MICRO_BATCH), layout.global_batch // MICRO_BATCH)
    loss = pipeline.train_step(iter(mine))
    assert loss.item() != 0  # every stage got the last stage's loss
    dist.all_reduce(loss)  # each rank's mean over its targets (a context rank's chunks): their mean is the batch's
    assert_close(loss / layout.world, expected)

    for name, param in model.named_parameters():
        assert_close(full(param.grad), wanted[name].grad, rtol=1e-4, atol=1e-6,
                     msg=lambda text, name=name: f"{name}: {text}")
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    norm = clip_grad_norm_(model.parameters(), 0.05, pipeline.group)
    assert expected_norm > 0.05  # the clip really scales
    assert_close(norm, expected_norm, rtol=1e-5, atol=0)
    for name, param in model.named_parameters():
        assert_close(full(param.grad), wanted[name].grad, rtol=1e-4, atol=1e-7,
                     msg=lambda text, name=name: f"{name}: {text}")

    # The eval: each data rank scores its sequences (the first one uncounted, as an eval shard's padding is), at two
    # batch shapes (an eval set's full batches and its last, shorter one).
    reference.eval(), model.eval()
    for batch in (MICRO_BATCH, 1):
        scored = tokens[:layout.data * batch]
        counted = torch.ones(len(scored), dtype=torch.bool)
        counted[0] = False
        want_sum, want_count = scored_loss_sum(reference, scored, counted)
        rows = slice(data_rank * batch, (data_rank + 1) * batch)
        got_sum, got_count = pipeline.scored_loss_sum(scored[rows], counted[rows])
        sums = torch.tensor([got_sum.item(), float(got_count)], dtype=torch.float64)
        dist.all_reduce(sums)  # only the last stage's ranks hold sums, each tensor rank of them the same
        assert_close(sums / layout.tensor, torch.tensor([want_sum.item(), float(want_count)], dtype=torch.float64),
                     rtol=1e-6, atol=0)  # float32 sums, added in another order
    checkpoint_round_trip(config, layout, mesh, expert_mesh, model)
    say(f"rank {dist.get_rank()}: pipeline ok {kind}:{shape_of(layout)}")


def build_stages(config, layout: Layout, mesh, expert_mesh, seed: int) -> list[Decoder]:
    chunks = stage_models(config, layout, mesh["pipeline"].get_local_rank())
    for chunk in chunks:
        parallelize(chunk, mesh, CPU, expert_mesh=expert_mesh)
        chunk.to_empty(device=CPU)
        torch.manual_seed(seed)
        draw_weights(chunk, CPU)
    return chunks


def checkpoint_round_trip(config, layout: Layout, mesh, expert_mesh, model: torch.nn.Module) -> None:
    """The stages' parameters and AdamW state, saved with DCP as the harness saves them (each stage's under the
    whole model's names), come back whole into stages drawn from another seed."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    fresh = rank_model(build_stages(config, layout, mesh, expert_mesh, SEED + 1))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    assert not all(torch.equal(full(a.detach()), full(b.detach())) for a, b in zip(model.parameters(),
                                                                                 fresh.parameters()))
    restores_whole(model, optimizer, fresh, fresh_optimizer)


def shape_of(layout: Layout) -> str:
    stages = f"{layout.pipeline}x{layout.virtual}" if layout.virtual > 1 else str(layout.pipeline)
    sizes = (layout.replicate, layout.shard, layout.context, layout.tensor) + (
        (layout.expert,) if layout.expert > 1 else ())
    return ",".join((stages, *map(str, sizes)))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for spec in sys.argv[1:]:
        kind, shape = spec.split(":")
        stages, *sizes = shape.split(",")
        pipeline, virtual = map(int, (stages + "x1").split("x")[:2])  # P, or PxV: V virtual stages a rank
        replicate, shard, context, tensor, *expert = map(int, sizes)
        parity(kind, Layout(world=dist.get_world_size(), procs_per_node=dist.get_world_size(), replicate=replicate,
                            shard=shard, context=context, tensor=tensor, micro_batch=MICRO_BATCH,
                            grad_accum=ACCUMULATE, expert=expert[0] if expert else 1, pipeline=pipeline,
                            virtual=virtual))
    dist.destroy_process_group()
