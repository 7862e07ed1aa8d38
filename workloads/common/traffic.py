"""The bytes one GPU sends per optimizer step, by collective and by link, for the decoders' layouts (GPT-3's and
llama31_8b's). No torch: `harness run --dry-run` prints it before anything starts.

Ring algorithms: each rank of a group of n sends (n - 1)/n of the buffer per all-gather or reduce-scatter,
twice that per all-reduce. A group stays on NVLink when it fits inside a node, else it crosses InfiniBand.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Traffic:
    fsdp_gather: float  # parameters all-gathered (bf16) before forward and again before backward, per micro batch
    fsdp_reduce: float  # gradients reduce-scattered (fp32) after each micro batch's backward
    replicate_reduce: float  # HSDP: each gradient shard all-reduced across the replicas (fp32), per micro batch
    tensor: float  # sequence parallel: all-gather and reduce-scatter around attention and MLP, per block and pass
    context: float  # keys and values all-gathered (their gradients reduce-scattered), per block and pass
    nvlink: float
    infiniband: float

    def describe(self) -> str:
        return (f"{self.nvlink / GB:.1f} GB over NVLink, {self.infiniband / GB:.1f} GB over InfiniBand (FSDP gathers "
                f"{self.fsdp_gather / GB:.1f}, reduce-scatters {self.fsdp_reduce / GB:.1f}; replica all-reduce "
                f"{self.replicate_reduce / GB:.1f}; tensor {self.tensor / GB:.1f}; context {self.context / GB:.1f} GB)")


def _ring(n: int) -> float:
    return (n - 1) / n


def estimate_traffic(*, params: float, n_layer: int, seq_len: int, d_model: int, kv_dim: int, tensor: int,
                     context: int, shard: int, replicate: int, micro_batch: int, grad_accum: int, procs_per_node: int,
                     recompute: bool, compute_bytes: int = 2, reduced_params: float | None = None) -> Traffic:
    """FSDP shards over shard x context; `recompute` (activation checkpointing) runs each block's forward twice.
    `reduced_params`: the parameters that have gradients, when fewer than all (LoRA's adapters)."""
    fsdp = shard * context
    per_tensor_rank = params / tensor
    reduced = (params if reduced_params is None else reduced_params) / tensor
    fsdp_gather = grad_accum * 2 * compute_bytes * per_tensor_rank * _ring(fsdp)
    fsdp_reduce = grad_accum * 4 * reduced * _ring(fsdp)
    replicate_reduce = grad_accum * 2 * 4 * reduced / fsdp * _ring(replicate)
    passes = 3 if recompute else 2
    positions = micro_batch * seq_len / context
    tensor_bytes = grad_accum * n_layer * passes * 4 * positions * d_model * compute_bytes * _ring(tensor)
    context_bytes = grad_accum * n_layer * passes * 2 * micro_batch * seq_len * kv_dim / tensor * compute_bytes \
        * _ring(context)
    inside = {"tensor": tensor <= procs_per_node, "context": tensor * context <= procs_per_node,
              "fsdp": tensor * fsdp <= procs_per_node, "replicate": replicate == 1}
    amounts = {"tensor": tensor_bytes, "context": context_bytes, "fsdp": fsdp_gather + fsdp_reduce,
               "replicate": replicate_reduce}
    return Traffic(fsdp_gather=fsdp_gather, fsdp_reduce=fsdp_reduce, replicate_reduce=replicate_reduce,
                   tensor=tensor_bytes, context=context_bytes,
                   nvlink=sum(v for k, v in amounts.items() if inside[k]),
                   infiniband=sum(v for k, v in amounts.items() if not inside[k]))
