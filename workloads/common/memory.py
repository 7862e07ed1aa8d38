"""Memory per GPU at a training step's peak, term by term: what the dry runs print and check_fits holds against a
GPU's memory (the decoders', flux1's). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process at the peak of a training step, term by term, on the pipeline stage that needs most."""

    weights: float  # this rank's FSDP shard of its stage's tensor-parallel share: fp32 master weights, or for LoRA
    #                 the frozen base in the compute dtype and the adapters in fp32
    gradients: float  # fp32 sharded gradients of what trains: alive at the peak only when micro batches accumulate
    optimizer: float  # AdamW's two fp32 moments of what trains, the same shard
    gathered: float  # unsharded bf16 parameters (and gradients) FSDP holds at once
    activations: float  # what backward keeps, for every micro batch in flight on this stage
    pipeline_buffers: float  # the received activation and gradient of each chunk (pipeline only)
    logits: float  # this rank's vocabulary shard of its positions' logits, and what the loss keeps (last stage)
    reserve: float  # CUDA context, NCCL buffers, allocator fragmentation (GPUs only): outside max_memory_allocated
    stage: int = 0  # the pipeline stage these terms are for (the one whose total is largest)

    TERMS = ("weights", "gradients", "optimizer", "gathered", "activations", "pipeline_buffers", "logits", "reserve")

    @property
    def total(self) -> float:
        return sum(getattr(self, term) for term in self.TERMS)

    @property
    def allocated(self) -> float:
        """What torch.cuda.max_memory_allocated would report: every term but the reserve (the CUDA context and
        NCCL's buffers are not the caching allocator's), so the figure to hold against a measured peak."""
        return self.total - self.reserve

    def describe(self, limit: str = "") -> str:
        """The total (against `limit`, e.g. " of 80 GiB"), each term, and the figure to compare with a measured
        max_memory_allocated, in GiB."""
        parts = ", ".join(f"{name.replace('_', ' ')} {getattr(self, name) / GIB:.1f}" for name in self.TERMS)
        return (f"{self.total / GIB:.1f} GiB{limit} ({parts} GiB; {self.allocated / GIB:.1f} GiB without the "
                "reserve, what max_memory_allocated counts)")


def fsdp_gathered(compute: int, block: float, root: float) -> float:
    """What FSDP2 holds unsharded at a step's peak without a pipeline, in bytes: the root's weights in the compute
    dtype (it is not resharded after forward), the block in backward's and the prefetched next one's, and the block's
    unsharded gradient (in the compute dtype, then fp32 for the reduce-scatter; once where compute is fp32). `block`
    and `root` count parameters: one block's and the root's, as this rank holds them before FSDP shards them."""
    return compute * (2 * block + root) + (compute + (4 if compute != 4 else 0)) * block
