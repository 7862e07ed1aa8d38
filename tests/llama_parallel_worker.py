"""One rank of tests/test_llama_parallel.py, started by torchrun: a small Llama on a (replicate, shard, context,
tensor) mesh against the whole model in this process, for each layout named on the command line:

    llama_parallel_worker.py [lora:]R,S,C,T [[lora:]R,S,C,T ...]

For each layout: the loss over 2 accumulated micro batches, every gradient, the clipped gradients (one norm
over the whole mesh) and the eval's scored loss sum must match the whole model's. With `lora:`, the model
carries llama2_70b_lora's adapters (made non-zero, so every adapter has a gradient) on a frozen base, whose
parameters must get no gradient. Prints "parity ok [lora:]R,S,C,T" per layout and rank.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.testing import assert_close

from tests.gpt3_parallel_worker import gradients_and_clipping_match, say
from workloads.common.language_model import accumulate_gradients, next_token_split, scored_loss_sum
from workloads.decoder.config import Layout, DecoderConfig, LoraConfig, RopeScaling
from workloads.decoder.lora import freeze_base
from workloads.decoder.model import Decoder
from workloads.decoder.parallelize import ContextSplit, build_mesh, parallelize

LORA = LoraConfig(rank=4, alpha=8, dropout=0.0)  # no dropout: the ranks' masks could not match one process's
CONFIG = DecoderConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=48,
                     rope_scaling=RopeScaling(original_context=8))
MICRO_BATCH = 2
ACCUMULATE = 2
CPU = torch.device("cpu")


def parity(layout: Layout, lora: LoraConfig | None = None) -> None:
    torch.manual_seed(0)
    reference = Decoder(CONFIG, lora=lora)
    with torch.device("meta"):
        model = Decoder(CONFIG, lora=lora)
    if lora:
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if ".lora_" in name:
                    param.normal_(0, 0.1)
        freeze_base(reference)
    mesh = build_mesh(layout, CPU)
    parallelize(model, mesh, CPU)
    if lora:
        freeze_base(model)  # after tensor parallelism, whose styles make new (trainable) parameters
    model.to_empty(device=CPU)
    model.rope_freqs.copy_(reference.rope_freqs)
    set_model_state_dict(model, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
    split = ContextSplit(mesh["context"].get_local_rank(), layout.context) if layout.context > 1 else next_token_split

    tokens = torch.randint(0, CONFIG.vocab_size, (layout.global_batch, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    data_rank = mesh["data"].get_local_rank()
    mine = [tokens[(step * layout.data + data_rank) * MICRO_BATCH:][:MICRO_BATCH] for step in range(ACCUMULATE)]
    expected = accumulate_gradients(reference, tokens.split(MICRO_BATCH), layout.global_batch // MICRO_BATCH)
    loss = accumulate_gradients(model, mine, ACCUMULATE, split)
    dist.all_reduce(loss)  # every rank's mean over its own targets: their mean is the whole batch's
    assert_close(loss / layout.world, expected)

    params = dict(model.named_parameters())
    assert len({p.device_mesh for p in params.values()}) == 1  # one mesh: one norm over all of it
    gradients_and_clipping_match(reference, model)

    # The eval: each data rank scores its sequences (the first one uncounted, as an eval shard's padding is).
    scored = tokens[:layout.data * MICRO_BATCH]
    counted = torch.ones(len(scored), dtype=torch.bool)
    counted[0] = False
    reference.eval(), model.eval()
    want_sum, want_count = scored_loss_sum(reference, scored, counted)
    rows = slice(data_rank * MICRO_BATCH, (data_rank + 1) * MICRO_BATCH)
    got_sum, got_count = scored_loss_sum(model, scored[rows], counted[rows], split)
    sums = torch.tensor([got_sum.item(), float(got_count)], dtype=torch.float64)
    dist.all_reduce(sums)
    # Every tensor rank holds the same sums: the whole world counts each scored token `tensor` times.
    assert_close(sums / layout.tensor, torch.tensor([want_sum.item(), float(want_count)], dtype=torch.float64))
    say(f"rank {dist.get_rank()}: parity ok {'lora:' if lora else ''}"
        f"{layout.replicate},{layout.shard},{layout.context},{layout.tensor}")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for spec in sys.argv[1:]:
        adapters, _, shape = spec.rpartition(":")
        replicate, shard, context, tensor = map(int, shape.split(","))
        parity(Layout(world=dist.get_world_size(), procs_per_node=dist.get_world_size(), replicate=replicate,
                      shard=shard, context=context, tensor=tensor, micro_batch=MICRO_BATCH, grad_accum=ACCUMULATE),
               LORA if adapters == "lora" else None)
    dist.destroy_process_group()
