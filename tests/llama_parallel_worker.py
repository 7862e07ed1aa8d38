"""One rank of tests/test_llama_parallel.py, started by torchrun: a small decoder on a (replicate, shard, context,
tensor) mesh, with experts on the expert mesh too, against the whole model in this process, for each layout named
on the command line:

    llama_parallel_worker.py [lora:|moe:|moe-idle:|moe-recompute:|deepseek:]R,S,C,T[,E] [...]

For each layout: the initial weights drawn from one seed equal the whole model's (no two shards alike), and the
loss over 2 accumulated micro batches, every gradient, the clipped gradients (one norm over every mesh) and the
eval's scored loss sum must match the whole model's. With `lora:`, the model carries llama2_70b_lora's adapters
(made non-zero, so every adapter has a gradient) on a frozen base, whose parameters must get no gradient. With
`moe:`, it is a gpt-oss-like model (8 experts, top 2, a sliding window in its first layer) whose experts are split
over E ranks; `moe-idle:` routes no token to the experts past the third, so some experts, and under expert parallel
2 a whole rank's experts, receive nothing; `moe-recompute:` checkpoints each block's activations, so backward
recomputes its forward, all-to-alls included; `moe-mtp:` adds a DeepSeek-V3 multi-token prediction depth (an MoE
block, its experts split too) whose loss joins the backward. With `deepseek:`, a DeepSeek-V3-like model (MLA with YaRN, a dense
first layer, the grouped sigmoid router with a non-zero expert bias, a shared expert, the sequence balance loss),
whose expert bias update after the step must match too. Prints "parity ok SPEC" per layout and rank.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.testing import assert_close

from tests.gpt3_parallel_worker import full, gradients_and_clipping_match, say
from workloads.common.language_model import accumulate_gradients, next_token_split, scored_loss_sum
from workloads.decoder.config import DecoderConfig, Layout, LoraConfig, MlaConfig, MoeConfig, RopeScaling, YarnScaling
from workloads.decoder.lora import freeze_base
from workloads.decoder.model import Decoder
from workloads.decoder.moe import MoE, update_expert_bias
from workloads.decoder.parallelize import ContextSplit, build_expert_mesh, build_mesh, parallelize

LORA = LoraConfig(rank=4, alpha=8, dropout=0.0)  # no dropout: the ranks' masks could not match one process's
CONFIG = DecoderConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=48,
                     rope_scaling=RopeScaling(original_context=8))
MOE_CONFIG = DecoderConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=48,
                           kv_channels=12, rope_theta=150_000.0, rope_scaling=None, sliding_window=5,
                           full_attention_every=2, moe=MoeConfig(experts=8, top_k=2, hidden=24))
DEEPSEEK_CONFIG = DecoderConfig(
    vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_kv_head=4, d_model=32, ffn_hidden=48, rope_theta=10_000.0,
    rope_scaling=YarnScaling(factor=4.0, original_context=8), dense_layers=1,
    mla=MlaConfig(q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12),
    moe=MoeConfig(experts=8, top_k=2, hidden=24, score="sigmoid", groups=2, top_groups=1, routed_scale=2.5,
                  shared_experts=1, bias_update_rate=1e-3, aux_loss_coeff=0.1))
MICRO_BATCH = 2
ACCUMULATE = 2
CPU = torch.device("cpu")


def idle_experts_after(model: torch.nn.Module, last: int) -> None:
    """Route no token to the experts past `last`: their logits pushed far down (a fixed shift, not a parameter)."""
    for module in model.modules():
        if isinstance(module, MoE):
            shift = torch.zeros(module.n_experts)
            shift[last + 1:] = -1e4
            module.router.forward = _shifted_router(module.router, shift)


def _shifted_router(router, shift):
    def forward(x):
        logits = torch.nn.functional.linear(x.float(), router.gate.weight.float()) + shift
        top_logits, experts = logits.topk(router.top_k, dim=-1)
        return top_logits.softmax(dim=-1), experts
    return forward


def balance_scales(model: torch.nn.Module, micro_batches: int) -> None:
    """The balance loss scaled as accumulate_gradients scales the main loss (PretrainWorkload does this)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.aux_loss_scale = 1 / micro_batches


def draws_match(reference: torch.nn.Module, model: torch.nn.Module) -> None:
    """Both drawn by init_weights from one seed: the split model holds the whole model's values, piece by piece."""
    torch.manual_seed(5)
    reference.init_weights()
    torch.manual_seed(5)
    model.init_weights()
    params = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        assert_close(full(params[name].detach()), param.detach(), rtol=0, atol=0,
                     msg=lambda text, name=name: f"{name}: {text}")


def parity(layout: Layout, kind: str = "") -> None:
    lora = LORA if kind == "lora" else None
    config = MOE_CONFIG if kind.startswith("moe") else DEEPSEEK_CONFIG if kind == "deepseek" else CONFIG
    if kind == "moe-mtp":
        config = replace(config, mtp_layers=1, mtp_loss_scale=0.1)
    recompute = kind == "moe-recompute"  # activation checkpointing: backward runs each block's all-to-alls again
    torch.manual_seed(0)
    reference = Decoder(config, lora=lora)
    with torch.device("meta"):
        model = Decoder(config, activation_checkpointing=recompute, lora=lora)
    mesh = build_mesh(layout, CPU)
    parallelize(model, mesh, CPU, expert_mesh=build_expert_mesh(layout, CPU) if config.moe else None)
    if lora:
        freeze_base(model)  # after tensor parallelism, whose styles make new (trainable) parameters
    model.to_empty(device=CPU)
    draws_match(reference, model)
    if lora:
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if ".lora_" in name:
                    param.normal_(0, 0.1)
        freeze_base(reference)
    if kind == "moe-idle":
        idle_experts_after(reference, 2)
        idle_experts_after(model, 2)
    if kind == "deepseek":
        with torch.no_grad():
            for module in reference.modules():
                if isinstance(module, MoE):
                    module.router.expert_bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
        balance_scales(reference, layout.global_batch // MICRO_BATCH)
        balance_scales(model, ACCUMULATE)
    set_model_state_dict(model, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
    split = ContextSplit(mesh["context"].get_local_rank(), layout.context) if layout.context > 1 else next_token_split

    tokens = torch.randint(0, config.vocab_size, (layout.global_batch, config.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    data_rank = mesh["data"].get_local_rank()
    mine = [tokens[(step * layout.data + data_rank) * MICRO_BATCH:][:MICRO_BATCH] for step in range(ACCUMULATE)]
    expected = accumulate_gradients(reference, tokens.split(MICRO_BATCH), layout.global_batch // MICRO_BATCH)
    loss = accumulate_gradients(model, mine, ACCUMULATE, split)
    dist.all_reduce(loss)  # every rank's mean over its own targets: their mean is the whole batch's
    assert_close(loss / layout.world, expected)

    params = dict(model.named_parameters())
    assert len({p.device_mesh for p in params.values()}) == (2 if config.moe else 1)  # experts have a mesh of their own
    gradients_and_clipping_match(reference, model)
    if kind == "deepseek":
        update_expert_bias(reference)
        update_expert_bias(model, mesh["replicate", "shard", "context"]._flatten("expert_balance").get_group())
        for (name, want), got in zip(reference.named_buffers(), model.buffers()):
            assert_close(got, want, rtol=0, atol=0, msg=lambda text, name=name: f"{name}: {text}")

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
    assert_close(sums / layout.tensor, torch.tensor([want_sum.item(), float(want_count)], dtype=torch.float64),
                 rtol=1e-6, atol=0)  # float32 sums, added in another order
    say(f"rank {dist.get_rank()}: parity ok {kind + ':' if kind else ''}{shape_of(layout)}")


def shape_of(layout: Layout) -> str:
    sizes = (layout.replicate, layout.shard, layout.context, layout.tensor)
    sizes += (layout.expert,) if layout.expert > 1 else ()
    return ",".join(map(str, sizes))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for spec in sys.argv[1:]:
        kind, _, shape = spec.rpartition(":")
        replicate, shard, context, tensor, *expert = map(int, shape.split(","))
        parity(Layout(world=dist.get_world_size(), procs_per_node=dist.get_world_size(), replicate=replicate,
                      shard=shard, context=context, tensor=tensor, micro_batch=MICRO_BATCH, grad_accum=ACCUMULATE,
                      expert=expert[0] if expert else 1), kind)
    dist.destroy_process_group()
