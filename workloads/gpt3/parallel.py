"""GPT-3 parallelism: tensor parallel (DTensor) inside a node, FSDP2 (`fully_shard`) across the data ranks.

The device mesh is (data, tensor). Tensor parallelism splits each block Megatron-style:
q, k, v and the MLP's first linear by columns (heads), the output projections by rows,
so a block needs one all-reduce forward and one backward. FSDP2 then shards every
block's parameters, gradients and optimizer state over the data dimension, and
gathers one block's weights at a time (prefetching the next).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from workloads.gpt3.config import Layout
from workloads.gpt3.model import GPT


def build_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    return init_device_mesh(device.type, (layout.data, layout.tensor), mesh_dim_names=("data", "tensor"))


def parallelize(model: GPT, mesh: DeviceMesh, device: torch.device) -> GPT:
    """Apply tensor parallelism (when the tensor dimension is over 1), then FSDP2, in place."""
    if mesh["tensor"].size() > 1:
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh["tensor"], plan)
    # bf16 compute with fp32 master weights and fp32 gradient reduction, on GPUs; fp32 throughout on CPU.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data"], mp_policy=policy)
    fully_shard(model, mesh=mesh["data"], mp_policy=policy)
    return model
