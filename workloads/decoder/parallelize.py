"""The decoders' parallelism, the torchtitan way, on a (pipeline, replicate, shard, context, tensor) mesh, and for a
Mixture of Experts a second mesh of the same ranks, (pipeline, replicate, expert_shard, expert), that splits the
experts. The pipeline's stages (workloads.decoder.pipeline) are its outermost blocks of ranks; everything below
applies within a stage, to the stage's part of the model.

- tensor: Megatron's column/row split of attention (by query and key/value heads, LoRA's adapters alongside)
  and SwiGLU, with sequence parallelism between them (the norms and the residual stream hold 1/tensor of the
  positions); the input
  embedding split by vocabulary rows and the output layer by vocabulary columns, its logits consumed where
  they lie (loss_parallel). Kept inside a node: it talks twice per block and pass.
- context: each rank holds two chunks of every sequence, chunk r and chunk 2C-1-r of 2C (load-balanced: a
  causal rank early in the sequence also holds one late in it), and attends its queries over keys and values
  all-gathered from the context group. This is the context parallelism Llama 3 was trained with, and it
  runs on gloo as on NCCL (torch's context_parallel dispatches only CUDA attention kernels).
- shard x context: FSDP2 shards parameters, gradients and AdamW's moments over them (context ranks hold the
  same weights), within a node or group of nodes, gathering one block at a time.
- replicate: HSDP's groups hold whole copies of the shards; only the gradient all-reduce crosses between
  them, once per micro batch, so FSDP's gathers stay on the fast links.
- expert: an MoE layer's experts are split over `expert` consecutive ranks of an FSDP group (the inner ones: a
  node's, so the all-to-all runs over NVLink), as torchtitan borrows expert ranks from the data ranks; FSDP2
  shards each rank's experts over the ranks of its FSDP group that hold the same experts (expert_shard = FSDP
  group / expert), and HSDP replicates them across groups like every other parameter. Each token's copies go to
  their experts' ranks and back (workloads.decoder.moe). Tensor parallel stays 1 for an MoE model: the planner
  uses context parallel where a data rank would hold less than a sequence.

Every parameter ends up a DTensor: the experts on the expert mesh, the rest on the dense one. Gradient clipping
reduces one norm per mesh and adds them (workloads.common.language_model.clip_grad_norm_).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, \
    SequenceParallel, parallelize_module

from workloads.common.language_model import Split, next_token_split
from workloads.decoder.config import Layout
from workloads.decoder.model import Decoder, visible
from workloads.decoder.moe import MoE

MESH_DIMS = ("pipeline", "replicate", "shard", "context", "tensor")
EXPERT_MESH_DIMS = ("pipeline", "replicate", "expert_shard", "expert")
# torchtitan's way of naming flattened dimensions (sliced from the root mesh) warns of a deprecation in a
# torch later than the one the harness pins; its replacement is not in 2.14.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh will be deprecated")


def build_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    """The 5-D mesh, the pipeline outermost (each stage a block of consecutive ranks: a node or group of nodes),
    with shard x context flattened for FSDP ("fsdp") and replicate x shard for the data ranks ("data"); a stage
    parallelizes over its own slice of these."""
    mesh = init_device_mesh(device.type, (layout.pipeline, layout.replicate, layout.shard, layout.context,
                                          layout.tensor), mesh_dim_names=MESH_DIMS)
    mesh["shard", "context"]._flatten("fsdp")
    mesh["replicate", "shard"]._flatten("data")
    return mesh


def build_expert_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    """The same ranks as (pipeline, replicate, FSDP group / expert, expert): expert ranks are consecutive inside an
    FSDP group (tensor parallel is 1 with experts, so an FSDP group's ranks are consecutive)."""
    mesh = init_device_mesh(device.type, (layout.pipeline, layout.replicate, layout.fsdp // layout.expert,
                                          layout.expert), mesh_dim_names=EXPERT_MESH_DIMS)
    # Named by nothing here: DTensor finds a flattened group by its layout, and reduces the experts' gradient norm
    # over it in one all-reduce rather than one per dimension (clipping).
    mesh["expert_shard", "expert"]._flatten("expert_fsdp")
    return mesh


def parallelize(model: Decoder, mesh: DeviceMesh, device: torch.device, compiled: bool = False,
                expert_mesh: DeviceMesh | None = None) -> Decoder:
    """Tensor parallel, context parallel, expert parallel, torch.compile per block, then FSDP2 (HSDP), in place.
    A model with experts needs `expert_mesh` (build_expert_mesh)."""
    if mesh["tensor"].size() > 1:
        if len(model.mtp):  # its blocks and its loss over vocabulary-sharded logits are not split here
            raise ValueError("multi-token prediction runs at tensor parallel 1, as deepseekv3_671b's reference does")
        _tensor_parallel(model, mesh["tensor"])
    if mesh["context"].size() > 1:
        if len(model.mtp):  # its roll would need the next context rank's first token (Megatron's roll_tensor)
            raise ValueError("multi-token prediction runs at context parallel 1, as deepseekv3_671b's reference does")
        for layer in model.layers:
            core = layer.attention.core
            layer.attention.core = ContextParallelAttention(mesh["context"], core.window, core.scale)
            if isinstance(layer.feed_forward, MoE):  # its balance loss counts each sequence over the context ranks
                layer.feed_forward.context_group = mesh["context"]
    blocks = [*model.layers, *(depth.block for depth in model.mtp)]  # with the MTP depths' (workloads.decoder.mtp)
    moe_layers = [block.feed_forward for block in blocks if isinstance(block.feed_forward, MoE)]
    if moe_layers and expert_mesh is None:
        raise ValueError("a model with experts is parallelized with an expert mesh (build_expert_mesh)")
    for moe in moe_layers:
        _expert_parallel(moe, expert_mesh)
    if compiled:
        # Block by block, as torchtitan compiles: every block has the same graph, so it compiles once. An MoE
        # block's token counts are data (all_to_all splits, grouped GEMM offsets): graph breaks there.
        for block in blocks:
            block.compile(fullgraph=mesh["context"].size() == 1 and not moe_layers)
    # bf16 compute with fp32 master weights and fp32 gradient reduction, on GPUs; fp32 throughout on CPU.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    fsdp_mesh = mesh["replicate", "fsdp"]  # 2-D: HSDP (replicate across, shard within)
    # Under a pipeline a stage's blocks stay gathered from forward to backward across its micro batches (torchtitan's
    # reshard_after_forward off for pipelines): gathered once a step, as the traffic arithmetic counts, not once a
    # micro batch; the memory arithmetic holds the stage's share whole.
    reshard = mesh["pipeline"].size() == 1
    for moe in moe_layers:
        fully_shard(moe.experts, mesh=expert_mesh["replicate", "expert_shard"], mp_policy=policy,
                    reshard_after_forward=reshard)
    for layer in [*model.layers, *model.mtp]:  # an MTP depth gathers its eh_proj and norms with its block
        fully_shard(layer, mesh=fsdp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    return model


def _expert_parallel(moe: MoE, expert_mesh: DeviceMesh) -> None:
    """Each expert tensor becomes a DTensor split along the experts over the mesh's expert dimension (each rank
    keeps its own experts' rows: no data moves, the model is still on the meta device or is drawn after)."""
    group = expert_mesh["expert"]
    if moe.n_experts % group.size():
        raise ValueError(f"expert parallel {group.size()} must divide the {moe.n_experts} experts")
    for name, param in list(moe.experts.named_parameters()):
        split = distribute_tensor(param.data, group, [Shard(0)], src_data_rank=None)
        moe.experts.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
    moe.expert_group = group if group.size() > 1 else None
    moe.experts.gradient_scale = 1 / group.size()  # see Experts: their gradients sum over the group's ranks


def _tensor_parallel(model: Decoder, tp: DeviceMesh) -> None:
    sequence_sharded = Shard(1)  # activations are (batch, sequence, features)
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence_sharded),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=sequence_sharded, output_layouts=Shard(-1), use_local_output=False),
    }
    # A pipeline stage holds some of these (the embedding on the first, the norm and output on the last); between
    # stages the hidden states travel as this rank's sequence shard, as between blocks.
    parallelize_module(model, tp, {name: style for name, style in root.items() if getattr(model, name) is not None})
    for layer in model.layers:
        parallelize_module(layer, tp, {
            "attention_norm": SequenceParallel(),
            # (x, rope tables, positions): x is gathered over the sequence; the tables are plain tensors.
            "attention": PrepareModuleInput(input_layouts=(sequence_sharded, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=sequence_sharded),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(sequence_sharded,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=sequence_sharded),
        })
        if layer.attention.lora_qkv is not None:
            parallelize_module(layer.attention, tp, {
                # qkv's A: its rank rows split, its output gathered whole for the B, whose rows split by heads as
                # wq's, wk's and wv's do.
                "lora_qkv.a": ColwiseParallel(output_layouts=Replicate()),
                "lora_qkv.b.0": ColwiseParallel(), "lora_qkv.b.1": ColwiseParallel(),
                "lora_qkv.b.2": ColwiseParallel(),
                # o's A reads this rank's heads, as wo does, and its partial sums are reduce-scattered into
                # sequence shards; its B (r x d, replicated) then works on this rank's positions, where wo's output is.
                "lora_o.a": RowwiseParallel(output_layouts=sequence_sharded),
                "lora_o.b.0": SequenceParallel(use_local_output=True),
            })


# --- context parallelism -------------------------------------------------------------------------------


def context_chunks(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """This context rank's two chunks of `x` along `dim` (chunk rank and chunk 2 size - 1 - rank of 2 size),
    side by side."""
    chunks = x.chunk(2 * size, dim=dim)
    return torch.cat((chunks[rank], chunks[2 * size - 1 - rank]), dim=dim)


class ContextSplit:
    """A `split` (workloads.common.language_model) for a context-parallel rank: its chunks of the inputs and
    targets that `whole` makes of a batch (next-token prediction by default), and the inputs' positions in the
    whole sequence."""

    def __init__(self, rank: int, size: int, whole: Split = next_token_split):
        self.rank, self.size, self.whole = rank, size, whole

    def __call__(self, tokens: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        (inputs,), targets = self.whole(tokens)
        positions = torch.arange(inputs.size(1), device=tokens.device)
        return ((context_chunks(inputs, self.rank, self.size), context_chunks(positions, self.rank, self.size, 0)),
                context_chunks(targets, self.rank, self.size))


class ContextParallelAttention(nn.Module):
    """Causal attention for a rank holding two chunks of the sequence: keys and values are all-gathered over
    the context group (through autograd: their gradients are reduce-scattered back in backward), put back in
    sequence order, and each local chunk of queries attends to the keys up to and including its own chunk,
    with the causal diagonal offset by where the chunk starts (and, with a window, only its last keys). Keys and
    values are gathered before the grouped-query expansion: n_kv_head heads, a quarter of the query heads' bytes
    for Llama 3.1 8B."""

    def __init__(self, group: DeviceMesh, window: int | None = None, scale: float | None = None):
        super().__init__()
        self.group, self.window, self.scale = group, window, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        size, rank = self.group.size(), self.group.get_local_rank()
        chunk = q.size(2) // 2
        keys, values = (self._in_sequence_order(self._gather(t), size) for t in (k, v))
        outputs = []
        for local, index in enumerate((rank, 2 * size - 1 - rank)):
            queries = q[:, :, local * chunk:(local + 1) * chunk]
            end = (index + 1) * chunk  # keys of every chunk up to this one
            start = max(0, index * chunk - self.window) if self.window is not None else 0  # a window's first key
            query_at = positions[local * chunk:(local + 1) * chunk]
            mask = visible(query_at, torch.arange(start, end, device=q.device), self.window)
            outputs.append(F.scaled_dot_product_attention(queries, keys[:, :, start:end], values[:, :, start:end],
                                                          attn_mask=mask, enable_gqa=True, scale=self.scale))
        return torch.cat(outputs, dim=2)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, heads, 2 chunks, dim) from every context rank, stacked along the sequence in rank order."""
        return funcol.all_gather_tensor_autograd(t.contiguous(), gather_dim=2, group=self.group)

    @staticmethod
    def _in_sequence_order(gathered: torch.Tensor, size: int) -> torch.Tensor:
        """Rank r's pair is (chunk r, chunk 2 size - 1 - r): undo that interleaving."""
        pieces = gathered.chunk(2 * size, dim=2)  # rank 0's two chunks, rank 1's two, ...
        order = [None] * (2 * size)
        for rank in range(size):
            order[rank], order[2 * size - 1 - rank] = pieces[2 * rank], pieces[2 * rank + 1]
        return torch.cat(order, dim=2)
