"""One rank of tests/test_gpt3_parallel.py, started by torchrun: a small GPT-3 on a (data, tensor) mesh,
checked against the same model whole in this process.

    gpt3_parallel_worker.py parity:DATA:TENSOR:ACCUM   loss, gradients, clipping and one AdamW step
    gpt3_parallel_worker.py memory:DATA:TENSOR:ACCUM   bytes of gradients (after each micro batch), weights and
                                                       Adam moments this rank holds (JSON line)
    gpt3_parallel_worker.py pipeline:DATA:TENSOR:ACCUM pipeline stages (the world over DATA x TENSOR) against the
                                                       whole model: initial weights, the 1F1B step's loss and
                                                       every gradient, the tied output layer's copies, clipping,
                                                       one AdamW step and the eval's scored sums
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from workloads.common.language_model import accumulate_gradients, clip_grad_norm_, optimizer_groups, rolled_split, \
    scored_loss_sum
from workloads.common.resilience import _ModelAndOptimizer
from workloads.gpt3.config import GPT3Config, GPTConfig, Layout, estimate_memory
from workloads.gpt3.model import GPT
from workloads.gpt3.parallel import build_mesh, parallelize
from workloads.gpt3.pipeline import TIED, TIED_COPY, GPT3Pipeline, stage_model

CONFIG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)
MICRO_BATCH = 2
CPU = torch.device("cpu")


def build(layout: Layout) -> tuple[GPT, GPT]:
    """The reference model (whole, in this process) and the same weights split over the mesh."""
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    with torch.device("meta"):
        model = GPT(CONFIG)
    parallelize(model, build_mesh(layout, CPU), CPU)
    model.to_empty(device=CPU)
    set_model_state_dict(model, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
    return reference, model


def micro_batches(tokens: torch.Tensor, layout: Layout, data_rank: int) -> list[torch.Tensor]:
    """This data rank's micro batches of the global batch, in accumulation order."""
    return [tokens[(step * layout.data + data_rank) * MICRO_BATCH:][:MICRO_BATCH] for step in range(layout.grad_accum)]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gradients_and_clipping_match(reference: torch.nn.Module, model: torch.nn.Module) -> None:
    """Every gradient equals the whole model's, and so does the norm clipping reduces over the whole mesh (a
    clip that really scales), and the clipped gradients."""
    params = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        if param.grad is None:  # frozen (LoRA's base): frozen in the parallel model too
            assert params[name].grad is None and not params[name].requires_grad, name
            continue
        assert_close(full(params[name].grad), param.grad, rtol=1e-4, atol=1e-6, msg=lambda text, name=name: f"{name}: {text}")
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    norm = clip_grad_norm_(model.parameters(), 0.05)
    assert expected_norm > 0.05 and not isinstance(norm, DTensor)  # the clip really scales
    assert_close(norm, expected_norm, rtol=1e-5, atol=0)
    for name, param in reference.named_parameters():
        if param.grad is not None:
            assert_close(full(params[name].grad), param.grad, rtol=1e-4, atol=1e-7,
                         msg=lambda text, name=name: f"{name}: {text}")


def parity(layout: Layout) -> None:
    reference, model = build(layout)
    tokens = torch.randint(0, CONFIG.vocab_size, (layout.global_batch, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    data_rank = dist.get_rank() // layout.tensor
    expected = accumulate_gradients(reference, tokens.split(MICRO_BATCH), layout.global_batch // MICRO_BATCH)
    loss = accumulate_gradients(model, micro_batches(tokens, layout, data_rank), layout.grad_accum)
    dist.all_reduce(loss)
    assert_close(loss / layout.world, expected)  # each tensor rank of a data rank reports the same loss
    params = dict(model.named_parameters())
    assert params.keys() == dict(reference.named_parameters()).keys()
    assert model.lm_head.weight is model.wte.weight  # still tied
    assert len({p.device_mesh for p in params.values()}) == 1  # every parameter on the one (data, tensor) mesh
    gradients_and_clipping_match(reference, model)
    for m in (reference, model):
        torch.optim.AdamW(optimizer_groups(m, 0.1), lr=1e-2).step()
    # Adam's first step moves a weight by about lr x sign(gradient): where a gradient is near 0, rounding in
    # its reduction can move the weight by a small fraction of lr.
    for name, param in reference.named_parameters():
        assert_close(full(params[name]).detach(), param.detach(), rtol=1e-4, atol=1e-4, msg=lambda text, name=name: f"{name}: {text}")
    say(f"rank {dist.get_rank()}: parity ok")


def pipelined(layout: Layout) -> None:
    """A stage of the model drawn from one seed holds the whole model's initial weights (the last stage's copy of
    the tied output layer too); over ACCUM micro batches per data rank, the 1F1B step's loss on every rank and every
    gradient equal the whole model's (both copies of the tied weight: the embedding's and the output layer's uses
    summed), the clipping norm counts the copy once, one AdamW step keeps the copies equal, and the eval's sums
    match."""
    mesh = build_mesh(layout, CPU)
    config = _config(layout)
    model = stage_model(config, layout, mesh["pipeline"].get_local_rank())
    parallelize(model, mesh, CPU)
    model.to_empty(device=CPU)
    torch.manual_seed(3)
    model.init_weights()
    reference = GPT(CONFIG)
    torch.manual_seed(3)
    reference.init_weights()  # the draws after the seed (the constructor's drew after the modules' own)
    wanted = dict(reference.named_parameters(remove_duplicate=False))  # "lm_head.weight" too: the tied weight
    params = dict(model.named_parameters())
    for name, param in params.items():
        assert_close(full(param.detach()), wanted[name].detach(), rtol=0, atol=0, msg=lambda t, name=name: f"{name}: {t}")
    everyone: list[list[str]] = [[] for _ in range(layout.world)]
    dist.all_gather_object(everyone, list(params))
    assert set().union(*everyone) == set(wanted), "the stages together hold every parameter, under its name"

    pipeline = GPT3Pipeline(model, mesh, layout, CPU)
    tokens = torch.randint(0, CONFIG.vocab_size, (layout.global_batch, CONFIG.seq_len),
                           generator=torch.Generator().manual_seed(1))
    data_rank = mesh["data"].get_local_rank()
    expected = accumulate_gradients(reference, tokens.split(MICRO_BATCH), layout.global_batch // MICRO_BATCH,
                                    rolled_split)
    loss = pipeline.train_step(iter(micro_batches(tokens, layout, data_rank)))
    dist.all_reduce(loss)
    assert_close(loss / layout.world, expected)  # every rank got the last stage's loss, each data rank's its own mean
    for name, param in params.items():
        assert_close(full(param.grad), wanted[name].grad, rtol=1e-4, atol=1e-6, msg=lambda t, name=name: f"{name}: {t}")
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    norm = clip_grad_norm_(model.parameters(), 0.05, pipeline.group, pipeline.copies)
    assert expected_norm > 0.05  # the clip really scales
    assert_close(norm, expected_norm, rtol=1e-5, atol=0)
    optimizer = torch.optim.AdamW(optimizer_groups(model, 0.1, decay_vectors=True), lr=1e-2)
    torch.optim.AdamW(optimizer_groups(reference, 0.1, decay_vectors=True), lr=1e-2).step()
    optimizer.step()
    for name, param in params.items():
        assert_close(full(param.detach()), wanted[name].detach(), rtol=1e-4, atol=1e-4,
                     msg=lambda t, name=name: f"{name}: {t}")
    if pipeline.tied is not None:  # the first and the last stage: their copies stay equal, to the bit
        copies = [torch.empty_like(full(pipeline.tied.detach())) for _ in range(2)]
        dist.all_gather(copies, full(pipeline.tied.detach()), group=pipeline.ends)
        assert torch.equal(*copies) and (TIED in params) != (TIED_COPY in params)

    reference.eval(), model.eval()
    for batch in (MICRO_BATCH, 1):  # an eval set's full batches and its last, shorter one
        scored = tokens[:layout.data * batch]
        counted = torch.ones(len(scored), dtype=torch.bool)
        counted[0] = False  # as an eval shard's padding
        want_sum, want_count = scored_loss_sum(reference, scored, counted, rolled_split)
        rows = slice(data_rank * batch, (data_rank + 1) * batch)
        got_sum, got_count = pipeline.scored_loss_sum(scored[rows], counted[rows])
        sums = torch.tensor([got_sum.item(), float(got_count)], dtype=torch.float64)
        dist.all_reduce(sums)  # only the last stage's ranks hold sums, each tensor rank of them the same
        assert_close(sums / layout.tensor, torch.tensor([want_sum.item(), float(want_count)], dtype=torch.float64),
                     rtol=1e-6, atol=0)
    checkpoint_round_trip(config, layout, mesh, model, optimizer)
    say(f"rank {dist.get_rank()}: pipeline ok")


def checkpoint_round_trip(config: GPT3Config, layout: Layout, mesh, model: GPT, optimizer) -> None:
    """The stages' parameters (the last stage's copy of the tied weight under its own name) and AdamW state, saved as a
    pipelined run saves them (keyed by parameter name: GPT3Workload.ranks_hold_other_parameters), come back whole
    into stages drawn from another seed, hyperparameters included."""
    fresh = stage_model(config, layout, mesh["pipeline"].get_local_rank())
    parallelize(fresh, mesh, CPU)
    fresh.to_empty(device=CPU)
    torch.manual_seed(4)
    fresh.init_weights()
    fresh_optimizer = torch.optim.AdamW(optimizer_groups(fresh, 0.1, decay_vectors=True), lr=5e-3)
    restores_whole(model, optimizer, fresh, fresh_optimizer)
    assert [group["lr"] for group in fresh_optimizer.param_groups] == [group["lr"] for group in optimizer.param_groups]


def restores_whole(model: torch.nn.Module, optimizer, fresh: torch.nn.Module, fresh_optimizer) -> None:
    """`model` and `optimizer` saved with DCP keyed by parameter name (as a pipelined run saves them), loaded into
    `fresh` and `fresh_optimizer`: every parameter and every AdamW state tensor comes back to the bit."""
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    dcp.save({"train": _ModelAndOptimizer(model, optimizer, flat=True)}, checkpoint_id=folder[0])
    dcp.load({"train": _ModelAndOptimizer(fresh, fresh_optimizer, flat=True)}, checkpoint_id=folder[0])
    restored = dict(fresh.named_parameters())
    for name, param in model.named_parameters():
        assert_close(full(restored[name].detach()), full(param.detach()), rtol=0, atol=0,
                     msg=lambda t, name=name: f"{name}: {t}")
        for key, value in optimizer.state[param].items():
            assert_close(full(fresh_optimizer.state[restored[name]][key]), full(value), rtol=0, atol=0)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0])


def _config(layout: Layout) -> GPT3Config:
    return GPT3Config(model=CONFIG, global_batch=layout.global_batch, micro_batch=MICRO_BATCH, base_lr=0,
                      end_lr_ratio=0, warmup_steps=1, decay_steps=1, lr_batch=1, eval_interval=1, eval_sequences=1,
                      target=0, init_checkpoint_step=0, pipeline_parallel=layout.pipeline)


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def gradient_bytes() -> int:
    """Bytes of every live parameter's gradient, whichever object holds the parameter: the sharded DTensors
    the optimizer sees and the unsharded parameters FSDP swaps in during forward and backward (which keep
    their gradients between micro batches when gradient sync is off)."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Parameter) and obj.grad is not None:
            grad = obj.grad.to_local() if isinstance(obj.grad, DTensor) else obj.grad
            storages[grad.untyped_storage().data_ptr()] = grad.untyped_storage().nbytes()
    return sum(storages.values())


def memory(layout: Layout) -> None:
    """Gradient bytes held after each micro batch, then this rank's weights and Adam moments, against the
    estimate's terms (one JSON line)."""
    _, model = build(layout)
    tokens = torch.randint(0, CONFIG.vocab_size, (layout.global_batch, CONFIG.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    held = []
    for batch in micro_batches(tokens, layout, dist.get_rank() // layout.tensor):
        accumulate_gradients(model, [batch], layout.grad_accum)
        held.append(gradient_bytes())
    optimizer = torch.optim.AdamW(optimizer_groups(model, 0.1))
    optimizer.step()
    moments = sum(local_bytes(state[kind]) for state in optimizer.state.values() for kind in ("exp_avg", "exp_avg_sq"))
    estimate = estimate_memory(_config(layout), layout, on_gpu=False)
    say(json.dumps({"rank": dist.get_rank(), "gradients": held, "weights": sum(map(local_bytes, model.parameters())),
                    "optimizer": moments, "estimate": {term: getattr(estimate, term)
                                                       for term in ("gradients", "weights", "optimizer")}}))


def say(line: str) -> None:
    """One write per line: the ranks share stdout, and print's separate writes of the text and its newline
    interleave with another rank's on a busy machine (seen under tests/under_load.sh: two JSON lines as one)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for job in sys.argv[1:]:  # MODE:DATA:TENSOR:ACCUM, one after another in this one process group
        mode, data, tensor, accum = job.split(":")[0], *map(int, job.split(":")[1:])
        stages = dist.get_world_size() // (data * tensor) if mode == "pipeline" else 1
        layout = Layout(world=stages * data * tensor, tensor=tensor, pipeline=stages, data=data,
                        micro_batch=MICRO_BATCH, grad_accum=accum)
        gc.collect()  # the last job's models (FSDP's sit in reference cycles) hold no gradients to count
        {"parity": parity, "memory": memory, "pipeline": pipelined}[mode](layout)
    dist.destroy_process_group()
