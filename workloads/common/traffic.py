"""The bytes one GPU sends per optimizer step, by collective and by link, for the decoders' layouts (GPT-3's, the
Llamas', gpt_oss_20b's and deepseekv3_671b's). No torch: `harness run --dry-run` prints it before anything starts.

Ring algorithms: each rank of a group of n sends (n - 1)/n of the buffer per all-gather or reduce-scatter,
twice that per all-reduce. A group stays on NVLink when it fits inside a node, else it crosses InfiniBand.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Traffic:
    fsdp_gather: float  # parameters all-gathered (bf16): per micro batch before forward and backward, or (pipeline)
    #                     once per step
    fsdp_reduce: float  # gradients reduce-scattered (fp32): per micro batch, or (pipeline) once per step
    replicate_reduce: float  # HSDP: each gradient shard all-reduced across the replicas (fp32), as often
    tensor: float  # sequence parallel: all-gather and reduce-scatter around attention and MLP, per block and pass
    context: float  # keys and values all-gathered (their gradients reduce-scattered), per block and pass
    nvlink: float
    infiniband: float
    all_to_all: float = 0.0  # MoE: token copies sent to their experts' ranks and back, per MoE block and pass
    all_to_all_nvlink: float = 0.0  # the part of all_to_all whose copies go to a rank of the same node
    pipeline: float = 0.0  # point-to-point: each micro batch's activation forward and its gradient backward

    def describe(self) -> str:
        expert = (f"; expert all-to-all {self.all_to_all / GB:.1f} ({self.all_to_all_nvlink / GB:.1f} of it inside "
                  "the node)") if self.all_to_all else ""
        pipeline = f"; pipeline sends {self.pipeline / GB:.1f}" if self.pipeline else ""
        return (f"{self.nvlink / GB:.1f} GB over NVLink, {self.infiniband / GB:.1f} GB over InfiniBand (FSDP gathers "
                f"{self.fsdp_gather / GB:.1f}, reduce-scatters {self.fsdp_reduce / GB:.1f}; replica all-reduce "
                f"{self.replicate_reduce / GB:.1f}; tensor {self.tensor / GB:.1f}; context {self.context / GB:.1f}"
                f"{expert}{pipeline} GB)")


def _ring(n: int) -> float:
    return (n - 1) / n


def expert_share_inside(expert: int, procs_per_node: int) -> float:
    """Of a rank's token copies, the share whose expert is on another rank of its own node: the experts are spread
    evenly over the `expert` ranks, which fill whole nodes (or sit inside one)."""
    return (min(expert, procs_per_node) - 1) / expert


def estimate_traffic(*, params: float, n_layer: int, seq_len: int, d_model: int, kv_dim: int, tensor: int,
                     context: int, shard: int, replicate: int, micro_batch: int, grad_accum: int, procs_per_node: int,
                     recompute: bool, compute_bytes: int = 2, reduced_params: float | None = None,
                     expert_params: float = 0, expert: int = 1, top_k: int = 0, moe_layers: int | None = None,
                     pipeline: int = 1, virtual: int = 1, carried: int = 1,
                     replicas_reduce_once: bool = False) -> Traffic:
    """FSDP shards over shard x context; `recompute` (activation checkpointing) runs each block's forward twice.
    `reduced_params`: the parameters that have gradients, when fewer than all (LoRA's adapters). With experts
    (`expert_params` of them in all, split over `expert` ranks, tensor parallel 1), a rank gathers and
    reduce-scatters only its own experts, over the expert_shard = FSDP group / expert ranks that hold them, and
    sends each of its positions' top_k copies to their experts' ranks and back (all-to-all, (expert - 1)/expert of
    them leave the rank) in each pass of every MoE block (`moe_layers`, default every layer).

    With a pipeline (`pipeline` stages, `virtual` chunks each), `params`, `n_layer` and `expert_params` are one
    stage's. torch.distributed.pipelining keeps a stage's FSDP parameters unsharded and its gradients unsynced
    until the last micro batch (backward_maybe_with_nosync, as torchtitan runs FSDP under a pipeline), so FSDP
    gathers and reduce-scatters (and HSDP all-reduces) once per step; and each micro batch's activation goes
    forward and its gradient back across every chunk boundary: a rank sends s x b x d (over sequence and tensor
    ranks) twice per micro batch and chunk, times `carried` (1 + DeepSeek's MTP depths, whose embedded tokens travel
    beside the hidden states: workloads.decoder.mtp). Stages are the outermost dimension, so those sends cross nodes
    unless the whole pipeline sits inside one. `replicas_reduce_once`: HSDP all-reduces across the replicas after the
    last micro batch only (FSDP2's set_requires_all_reduce, as flux1 accumulates), not after each."""
    fsdp = shard * context
    syncs = 1 if pipeline > 1 else grad_accum  # FSDP's gathers/reductions per step
    gathers = 1 if pipeline > 1 else 2  # per sync: before forward, again before backward (resharded between)
    dense = (params - expert_params) / tensor
    reduced = (params - expert_params if reduced_params is None else reduced_params) / tensor
    experts_here = expert_params / expert
    fsdp_gather = syncs * gathers * compute_bytes * (dense * _ring(fsdp) + experts_here * _ring(fsdp // expert))
    fsdp_reduce = syncs * 4 * (reduced * _ring(fsdp) + experts_here * _ring(fsdp // expert))
    # A rank's shard: its part of the dense gradients (over fsdp) and of the experts (over expert x expert_shard,
    # which is fsdp too).
    replicate_reduce = (1 if replicas_reduce_once else syncs) * 2 * 4 * (reduced + expert_params) / fsdp \
        * _ring(replicate)
    passes = 3 if recompute else 2
    positions = micro_batch * seq_len / context
    tensor_bytes = grad_accum * n_layer * passes * 4 * positions * d_model * compute_bytes * _ring(tensor)
    context_bytes = grad_accum * n_layer * passes * 2 * micro_batch * seq_len * kv_dim / tensor * compute_bytes \
        * _ring(context)
    # Dispatch and combine, forward and backward (and the recomputed forward): two all-to-alls per pass.
    copies = grad_accum * (n_layer if moe_layers is None else moe_layers) * passes * 2 * positions * top_k \
        * d_model * compute_bytes
    all_to_all, all_to_all_nvlink = copies * _ring(expert), copies * expert_share_inside(expert, procs_per_node)
    sends = grad_accum * virtual * 2 * carried * positions * d_model / tensor * compute_bytes if pipeline > 1 else 0.0
    stage_ranks = tensor * fsdp * replicate
    inside = {"tensor": tensor <= procs_per_node, "context": tensor * context <= procs_per_node,
              "fsdp": tensor * fsdp <= procs_per_node, "replicate": replicate == 1,
              "pipeline": stage_ranks * pipeline <= procs_per_node}
    amounts = {"tensor": tensor_bytes, "context": context_bytes, "fsdp": fsdp_gather + fsdp_reduce,
               "replicate": replicate_reduce, "pipeline": sends}
    return Traffic(fsdp_gather=fsdp_gather, fsdp_reduce=fsdp_reduce, replicate_reduce=replicate_reduce,
                   tensor=tensor_bytes, context=context_bytes, all_to_all=all_to_all,
                   all_to_all_nvlink=all_to_all_nvlink, pipeline=sends,
                   nvlink=sum(v for k, v in amounts.items() if inside[k]) + all_to_all_nvlink,
                   infiniband=sum(v for k, v in amounts.items() if not inside[k]) + all_to_all - all_to_all_nvlink)
