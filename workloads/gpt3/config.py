"""GPT-3 presets, the parallel layout and the per-GPU memory estimate. No torch here: `harness run
--dry-run` imports this to show the layout and to refuse a config that cannot fit, before anything starts.

The full preset follows MLPerf's GPT-3 175B reference (ruleset 4.1.0,
mlcommons/training retired_benchmarks/gpt3/megatron-lm/run_gpt3.sh): its schedule is defined in samples
(`--lr-warmup-samples 407040 --lr-decay-samples 166809600`, 265 and 108,600 steps of batch 1536) and so is
its starting point (`--ext-lr-steps` 4000 x 1536 samples); the steps logged at the batch actually used are
those samples over the batch, as NVIDIA's logs show them (at 3072: warmup 132, decay 54300,
init_checkpoint_step 2000; at 2688: 151, 62057 and 2286). The base LR follows the rules' table by batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workloads.common import traffic
from workloads.common.traffic import Traffic

GIB = 2**30
REFERENCE_BATCH = 1536  # the global batch MLPerf's schedule is written for
REFERENCE_WARMUP_STEPS = 265
REFERENCE_DECAY_STEPS = 108_600
REFERENCE_INIT_CHECKPOINT_STEP = 4000  # the step of MLPerf's starting checkpoint
INIT_INFO = "harness-init.json"  # beside a starting checkpoint (DCP): the step and global batch it was trained to
EVAL_INTERVAL_SAMPLES = 24_576  # evaluate every this many sequences (rounded up to whole steps)

# The base LR by global batch: the batches MLPerf's GPT-3 RCPs were measured at, and their LR (mlperf-logging
# rcp_checker/training_4.1.0/rcps_gpt3.json: 1536, 2048 and 3072 at 2e-5; 4096, 6144 and 8192 at 3e-5; the
# rules' GPT-3 table in training_rules.adoc says the same). Between 3072 and 4096 the rules allow either (the
# harness takes the nearer end); below 1536 or above 8192 there is no RCP, so no closed run.
LR_TABLE = ((1536, 3072, 2e-5), (4096, 8192, 3e-5))


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape."""

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int

    @property
    def params(self) -> int:
        """Parameters: tied token embedding, learned positions, 12 d^2 (+ biases, norms) per layer."""
        d = self.d_model
        per_layer = 12 * d * d + 13 * d  # q, k, v, proj (4d^2 + 4d), fc and fc2 (8d^2 + 5d), 2 LayerNorms (4d)
        return self.vocab_size * d + self.seq_len * d + self.n_layer * per_layer + 2 * d

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N for the matmuls plus 12 L T d for attention (PaLM's MFU formula)."""
        return 6 * self.params + 12 * self.n_layer * self.seq_len * self.d_model


@dataclass(frozen=True)
class GPT3Config:
    model: GPTConfig
    global_batch: int  # sequences per optimizer step, before rounding to the layout
    micro_batch: int  # sequences per process per forward pass
    base_lr: float | None  # None: by the global batch, from LR_TABLE (the closed preset)
    end_lr_ratio: float  # end LR = base LR x this (MLPerf: 10%)
    warmup_steps: int  # at `lr_batch`; scaled with the real global batch
    decay_steps: int
    lr_batch: int
    eval_interval: int  # sequences between evaluations
    eval_sequences: int | None  # None: the whole eval set
    target: float  # log perplexity that ends the run
    init_checkpoint_step: int  # steps the starting checkpoint trained, at `lr_batch`
    weight_decay: float = 0.1
    tensor_parallel: int = 1  # at most the GPUs of a node; 1 on CPU
    activation_checkpointing: bool = False
    max_steps: int = 100_000
    loader_workers: int = 2  # processes per rank that read the samples ahead (0: the training thread)


PRESETS = {
    # MLPerf closed: GPT-3 175B on C4, target log perplexity 2.69, starting from the reference checkpoint.
    "full": GPT3Config(
        model=GPTConfig(vocab_size=50_304, seq_len=2048, n_layer=96, n_head=96, d_model=12_288),
        global_batch=REFERENCE_BATCH, micro_batch=1, base_lr=None, end_lr_ratio=0.1,
        warmup_steps=REFERENCE_WARMUP_STEPS, decay_steps=REFERENCE_DECAY_STEPS, lr_batch=REFERENCE_BATCH,
        eval_interval=EVAL_INTERVAL_SAMPLES, eval_sequences=5_760, target=2.69,
        init_checkpoint_step=REFERENCE_INIT_CHECKPOINT_STEP, tensor_parallel=8, activation_checkpointing=True),
    # A 2-layer GPT on generated Markov-chain text, same sequence length and optimizer keys, from a
    # warm-start checkpoint the harness trains once (as MLPerf starts from its reference checkpoint).
    "tiny": GPT3Config(
        model=GPTConfig(vocab_size=128, seq_len=2048, n_layer=2, n_head=4, d_model=128),
        global_batch=4, micro_batch=1, base_lr=3e-5, end_lr_ratio=0.1, warmup_steps=2, decay_steps=4000,
        lr_batch=4, eval_interval=16, eval_sequences=16, target=2.69, init_checkpoint_step=30, max_steps=300,
        loader_workers=0),  # as BERT's tiny preset: no loader process to compete with the ranks for cores
}


@dataclass(frozen=True)
class Layout:
    """How `world` processes split the work: tensor x pipeline x data (FSDP) parallel."""

    world: int
    tensor: int
    pipeline: int
    data: int
    micro_batch: int
    grad_accum: int
    procs_per_node: int | None = None  # where the groups' links change from NVLink to InfiniBand (the dry run's)

    @property
    def global_batch(self) -> int:
        return self.data * self.micro_batch * self.grad_accum


def plan_layout(cfg: GPT3Config, world: int, procs_per_node: int) -> Layout:
    """Tensor parallel inside a node, FSDP across the rest; the global batch rounds up to whole micro batches."""
    tensor = min(cfg.tensor_parallel, procs_per_node)
    if world % tensor or cfg.model.n_head % tensor or cfg.model.seq_len % tensor:
        raise ValueError(f"tensor parallel {tensor} must divide the world size {world}, the "
                         f"{cfg.model.n_head} attention heads and the sequence length {cfg.model.seq_len} "
                         "(sequence parallelism splits it)")
    data = world // tensor
    grad_accum = max(1, math.ceil(cfg.global_batch / (data * cfg.micro_batch)))
    layout = Layout(world=world, tensor=tensor, pipeline=1, data=data, micro_batch=cfg.micro_batch,
                    grad_accum=grad_accum, procs_per_node=procs_per_node)
    base_lr(cfg, layout.global_batch)  # a batch with no LR in the rules' table is refused with the layout
    return layout


def base_lr(cfg: GPT3Config, global_batch: int) -> float:
    """The preset's base LR, or (closed preset) the rules' LR for this global batch; a batch the table does not
    cover is refused with the table."""
    if cfg.base_lr is not None:
        return cfg.base_lr
    for low, high, lr in LR_TABLE:
        if low <= global_batch <= high:
            return lr
    (_, gap_low, low_lr), (gap_high, _, high_lr) = LR_TABLE
    if gap_low < global_batch < gap_high:  # either is allowed: the nearer end's, ties to the lower
        return low_lr if global_batch - gap_low <= gap_high - global_batch else high_lr
    table = "; ".join(f"batch {low}-{high}: {lr:g}" for low, high, lr in LR_TABLE)
    raise ValueError(f"gpt3: global batch {global_batch} has no base LR in MLPerf's GPT-3 table ({table}; "
                     f"either in between; above {LR_TABLE[-1][1]} needs a new RCP): choose nodes and a micro batch "
                     "(--batch-size) whose global batch it covers")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process at the peak of a training step: what parallel.py's layout really holds."""

    weights: float  # fp32 master weights: this rank's FSDP shard of its tensor-parallel share
    gradients: float  # fp32 gradients, the same shard (reduce-scattered after every micro batch)
    optimizer: float  # Adam's two fp32 moments, the same shard
    gathered: float  # what FSDP unshards at once: two blocks and the root's weights, one block's gradients
    activations: float  # what backward keeps (sequence parallel: 1/tensor of the positions), one block recomputed
    logits: float  # this rank's vocabulary shard of the logits, and what the loss keeps for backward
    reserve: float  # CUDA context, NCCL buffers, allocator fragmentation (GPUs only)

    TERMS = ("weights", "gradients", "optimizer", "gathered", "activations", "logits", "reserve")

    @property
    def total(self) -> float:
        return sum(getattr(self, term) for term in self.TERMS)


def tensor_replicated_params(model: GPTConfig) -> int:
    """Parameters every tensor-parallel rank holds whole: the LayerNorms (sequence parallel) and the biases
    of the row-parallel linears (attention output, MLP's second linear)."""
    return model.n_layer * 6 * model.d_model + 2 * model.d_model


def estimate_memory(cfg: GPT3Config, layout: Layout, on_gpu: bool = True) -> MemoryEstimate:
    """Per-rank bytes, term by term. Compute runs in bf16 on GPUs (2 bytes) and fp32 on CPU (4).

    Activations follow Korthikanti et al. (2022) with sequence parallelism and flash attention
    (34 s b h / t bytes per block at 16 bits, no s^2 term), scaled to the compute dtype."""
    m, tp = cfg.model, layout.tensor
    s, b, h, v = m.seq_len, layout.micro_batch, m.d_model, m.vocab_size
    compute = 2 if on_gpu else 4
    replicated = tensor_replicated_params(m)
    shard = (m.params - replicated) / layout.world + replicated / layout.data  # parameters per rank
    block = (12 * h * h + 7 * h) / tp + 6 * h  # one block's parameters on one tensor rank, unsharded
    root = (v * h + s * h) / tp + 2 * h  # embeddings and the final LayerNorm
    # Unsharded gradients in the compute dtype, plus FSDP's fp32 copy for the reduce-scatter when that differs.
    unsharded_grad = compute + (4 if compute != 4 else 0)
    block_activations = 34 * s * b * h / tp * compute / 2
    if cfg.activation_checkpointing:
        activations = m.n_layer * compute * s * b * h / tp + block_activations  # each block's input kept
    else:
        activations = m.n_layer * block_activations
    # The compute-dtype logits, their fp32 copy (on GPUs), the fp32 log-probabilities and their gradient.
    logits = s * b * v / tp * (compute + (4 if compute != 4 else 0) + 4 + 4)
    return MemoryEstimate(weights=4 * shard, gradients=4 * shard, optimizer=8 * shard,
                          gathered=compute * (2 * block + root) + unsharded_grad * max(block, root),
                          activations=activations, logits=logits, reserve=4 * GIB if on_gpu else 0)


def describe(cfg: GPT3Config, layout: Layout, gpu_memory_gib: float | None) -> list[str]:
    """The lines `--dry-run` shows: the layout, the batch, and the memory estimate against the GPU's."""
    memory = estimate_memory(cfg, layout, on_gpu=bool(gpu_memory_gib))
    parts = ", ".join(f"{name} {getattr(memory, name) / GIB:.1f}" for name in memory.TERMS)
    limit = f" of {gpu_memory_gib:g} GiB" if gpu_memory_gib else " (CPU: per process)"
    return [
        f"gpt3 model: {cfg.model.n_layer} layers, d_model {cfg.model.d_model}, {cfg.model.n_head} heads, "
        f"sequence {cfg.model.seq_len}, {_count(cfg.model.params)} parameters",
        f"gpt3 layout: {layout.world} processes = tensor {layout.tensor} x pipeline {layout.pipeline} "
        f"x data (FSDP) {layout.data}; global batch {layout.global_batch} = {layout.data} x micro batch "
        f"{layout.micro_batch} x {layout.grad_accum} accumulation steps; base LR {base_lr(cfg, layout.global_batch):g}",
        f"gpt3 memory per GPU: {memory.total / GIB:.1f} GiB{limit} ({parts} GiB; activation checkpointing "
        f"{'on' if cfg.activation_checkpointing else 'off'})",
        f"gpt3 traffic per GPU per step: {estimate_traffic(cfg, layout).describe()}",
    ]


def estimate_traffic(cfg: GPT3Config, layout: Layout) -> Traffic:
    """The bytes each GPU sends per step (workloads.common.traffic): FSDP over every data rank. With tensor
    parallel 8 filling each node, every FSDP group of 175B crosses nodes, so HSDP would not move its gathers
    to NVLink (it would add the replicas' all-reduce); what cuts this is fewer micro batches per step."""
    m = cfg.model
    return traffic.estimate_traffic(params=m.params, n_layer=m.n_layer, seq_len=m.seq_len, d_model=m.d_model,
                                    kv_dim=m.d_model, tensor=layout.tensor, context=1, shard=layout.data, replicate=1,
                                    micro_batch=layout.micro_batch, grad_accum=layout.grad_accum,
                                    procs_per_node=layout.procs_per_node or layout.world,
                                    recompute=cfg.activation_checkpointing)


def check_fits(cfg: GPT3Config, layout: Layout, gpu_memory_gib: float) -> None:
    """Refuse, with the numbers, a config whose estimate exceeds the GPU's memory."""
    total = estimate_memory(cfg, layout).total / GIB
    if total > gpu_memory_gib:
        raise ValueError(f"gpt3 needs about {total:.1f} GiB per GPU with tensor parallel {layout.tensor} over "
                         f"{layout.world} GPUs, more than the {gpu_memory_gib:g} GiB each has: use more nodes "
                         "or a smaller micro batch (--batch-size)")


def _count(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
