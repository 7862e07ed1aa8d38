"""GPT-3 parallelism, the torchtitan way: tensor and sequence parallel (DTensor) inside a node, FSDP2 across.

The device mesh is (pipeline, data, tensor): pipeline stages outermost (workloads.gpt3.pipeline: each stage's
ranks a (data, tensor) mesh of their own, which everything below applies to, for the stage's parts). Tensor
parallelism covers every parameter, so that every parameter (and gradient) ends up a DTensor on the same 2-D
mesh once FSDP2 shards it over the data dimension; gradient clipping then reduces one norm over the whole mesh
(and sums the stages' squares):

- token embedding: split by vocabulary rows; its output is reduce-scattered over the sequence;
- position embedding: split by position rows, its output reduce-scattered the same way;
- LayerNorms: sequence parallel (each rank normalises its share of the positions);
- attention and MLP: Megatron's column/row split by heads; their inputs are all-gathered
  over the sequence and their outputs reduce-scattered back (so the residual stream, and what
  activation checkpointing keeps, is 1/tensor of the sequence on each rank);
- output layer: split by vocabulary (tied to the token embedding, which is split the same way),
  producing vocabulary-sharded logits that the loss consumes where they lie (loss_parallel):
  no rank ever holds the whole (sequence x vocabulary) logits.

FSDP2 shards every block's parameters, gradients and Adam moments over the data ranks and
gathers one block at a time, prefetching the next. Gradients are reduce-scattered after every
micro batch (accumulate_gradients), so a rank never holds more than its shard of them.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, \
    SequenceParallel, parallelize_module

from workloads.gpt3.config import Layout
from workloads.gpt3.model import GPT


def build_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    return init_device_mesh(device.type, (layout.pipeline, layout.data, layout.tensor),
                            mesh_dim_names=("pipeline", "data", "tensor"))


def parallelize(model: GPT, mesh: DeviceMesh, device: torch.device, compiled: bool = False) -> GPT:
    """Apply tensor and sequence parallelism (when the tensor dimension is over 1), torch.compile per block
    (when `compiled`), then FSDP2, in place."""
    if mesh["tensor"].size() > 1:
        _tensor_parallel(model, mesh["tensor"])
    if compiled:
        # Block by block, as torchtitan compiles: every block has the same graph, so it compiles once, and
        # FSDP2's per-block gathers stay outside it. In place, so parameter names (and checkpoints) keep theirs.
        for block in model.blocks:
            block.compile(fullgraph=True)
    # bf16 compute with fp32 master weights and fp32 gradient reduction, on GPUs; fp32 throughout on CPU.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    # Under a pipeline a stage's blocks stay gathered across its micro batches (gathered once a step, as
    # estimate_traffic counts): workloads.decoder.parallelize does the same.
    reshard = mesh["pipeline"].size() == 1
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data"], mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["data"], mp_policy=policy, reshard_after_forward=reshard)
    return model


def _tensor_parallel(model: GPT, tp: DeviceMesh) -> None:
    sequence_sharded = Shard(1)  # activations are (batch, sequence, features)
    root = {  # what this model holds of them: a pipeline stage holds the embeddings (first) or the output (last)
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence_sharded),
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),  # (sequence, features)
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=sequence_sharded, output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    parallelize_module(model, tp, {name: plan for name, plan in root.items() if getattr(model, name) is not None})
    # MLPerf's GPT-3 ties the output layer to the token embedding, so the closed model must too. Both are
    # split by vocabulary rows (Shard(0) on the tensor mesh), so the two modules can share one DTensor again
    # (parallelize_module distributed each module's reference separately). A last pipeline stage holds a copy
    # (workloads.gpt3.pipeline), split the same way as the first stage's embedding.
    if model.wte is not None and model.lm_head is not None:
        model.lm_head.weight = model.wte.weight
    gathered = PrepareModuleInput(input_layouts=(sequence_sharded,), desired_input_layouts=(Replicate(),))
    for block in model.blocks:
        parallelize_module(block, tp, {
            "ln1": SequenceParallel(),
            "attn": gathered,
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=sequence_sharded),
            "ln2": SequenceParallel(),
            "mlp": gathered,
            "mlp.fc": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(output_layouts=sequence_sharded),
        })
