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
from workloads.common.memory import GIB, MemoryEstimate, fsdp_gathered
from workloads.common.traffic import Traffic

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
    pipeline_parallel: int = 1  # pipeline stages, the outermost dimension (workloads.gpt3.pipeline)
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
        init_checkpoint_step=REFERENCE_INIT_CHECKPOINT_STEP, tensor_parallel=8, activation_checkpointing=True,
        # Pipeline 8 (12 layers a stage): at 448 x 8 H100 it cuts InfiniBand bytes per GPU per step from 697 GB
        # (FSDP over 448 ranks, 4 micro batches) to 17 GB, at a 20% bubble (docs/benchmarks/gpt3.md).
        pipeline_parallel=8),
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
    """How `world` processes split the work: pipeline x data (FSDP) x tensor parallel (pipeline outermost)."""

    world: int
    tensor: int
    pipeline: int
    data: int
    micro_batch: int
    grad_accum: int  # micro batches per data rank per step (with a pipeline: the schedule's micro batches)
    procs_per_node: int | None = None  # where the groups' links change from NVLink to InfiniBand (the dry run's)
    virtual = 1  # one stage a pipeline rank (the decoders' Pipeline, which GPT-3's reuses, reads it)

    @property
    def global_batch(self) -> int:
        return self.data * self.micro_batch * self.grad_accum


def plan_layout(cfg: GPT3Config, world: int, procs_per_node: int) -> Layout:
    """Tensor parallel inside a node, pipeline stages across nodes (dividing the world first), FSDP over the rest;
    the global batch rounds up to whole micro batches."""
    tensor, pipeline = min(cfg.tensor_parallel, procs_per_node), cfg.pipeline_parallel
    if world % tensor or cfg.model.n_head % tensor or cfg.model.seq_len % tensor:
        raise ValueError(f"tensor parallel {tensor} must divide the world size {world}, the "
                         f"{cfg.model.n_head} attention heads and the sequence length {cfg.model.seq_len} "
                         "(sequence parallelism splits it)")
    if (world // tensor) % pipeline or cfg.model.n_layer % pipeline:
        raise ValueError(f"pipeline parallel {pipeline} must divide the {world // tensor} processes left by tensor "
                         f"parallel {tensor} and the {cfg.model.n_layer} layers: use a multiple of "
                         f"{tensor * pipeline} processes")
    data = world // (tensor * pipeline)
    grad_accum = max(1, math.ceil(cfg.global_batch / (data * cfg.micro_batch)))
    if grad_accum < pipeline:
        raise ValueError(f"pipeline parallel {pipeline} needs at least {pipeline} micro batches per data rank per step "
                         f"(1F1B keeps every stage busy only then), but global batch {cfg.global_batch} over {data} "
                         f"data ranks x micro batch {cfg.micro_batch} gives {grad_accum}: use a larger global batch, "
                         "a smaller micro batch (--batch-size) or fewer pipeline stages")
    layout = Layout(world=world, tensor=tensor, pipeline=pipeline, data=data, micro_batch=cfg.micro_batch,
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


def tensor_replicated_params(model: GPTConfig, layers: int | None = None, final_norm: bool = True) -> int:
    """Parameters every tensor-parallel rank holds whole: the LayerNorms (sequence parallel) and the biases
    of the row-parallel linears (attention output, MLP's second linear), of `layers` blocks (default all)."""
    return (model.n_layer if layers is None else layers) * 6 * model.d_model + (2 * model.d_model if final_norm else 0)


def stage_params(model: GPTConfig, pipeline: int, stage: int) -> tuple[float, float]:
    """A stage's parameters and, of them, the root's (embeddings, the final LayerNorm): n_layer / pipeline blocks;
    the first the token and position embeddings, the last the final LayerNorm and the tied output layer (a copy of
    the token embedding, as Megatron keeps one on the last stage and all-reduces the two copies' gradients)."""
    h, v = model.d_model, model.vocab_size
    first, last = stage == 0, stage == pipeline - 1
    root = (v * h + model.seq_len * h if first else 0) + (2 * h + (0 if first else v * h) if last else 0)
    return model.n_layer // pipeline * (12 * h * h + 13 * h) + root, root


def micro_batches_in_flight(layout: Layout, stage: int) -> int:
    """1F1B: stage i runs p - i forwards before its first backward, so holds min(p - i, m) micro batches' activations;
    one without a pipeline."""
    return min(layout.pipeline - stage, layout.grad_accum)


def bubble_fraction(layout: Layout) -> float:
    """The pipeline's idle share of a step under 1F1B: (p - 1) / (m + p - 1) (Narayanan et al., 2021)."""
    return (layout.pipeline - 1) / (layout.grad_accum + layout.pipeline - 1)


def estimate_memory(cfg: GPT3Config, layout: Layout, on_gpu: bool = True) -> MemoryEstimate:
    """Per-rank bytes at the step's peak, term by term, for the stage whose total is largest (estimate_stage)."""
    return max((estimate_stage(cfg, layout, stage, on_gpu) for stage in range(layout.pipeline)),
               key=lambda e: e.total)


def estimate_stage(cfg: GPT3Config, layout: Layout, stage: int, on_gpu: bool = True) -> MemoryEstimate:
    """One stage's bytes, each term at the peak's moment (the loss's backward on the last stage: every saved
    activation, the loss's tensors and the root's gathered weights at once, before any block's gradient). Compute
    runs in bf16 on GPUs (2 bytes) and fp32 on CPU (4).

    - weights, optimizer: fp32 master weights and Adam's two fp32 moments of this rank's shard.
    - gradients: zero_grad(set_to_none=True) frees them each step and FSDP2 makes a block's sharded gradient only
      after its backward, past the peak: none with one micro batch, the whole shard when micro batches accumulate.
    - gathered: without a pipeline the root's bf16 weights (the root is not resharded after forward), the current
      and the prefetched block's, and one block's unsharded gradient (bf16, then fp32 for the reduce-scatter); with
      a pipeline torch.distributed.pipelining keeps the stage unsharded and its gradients unsynced (fp32) until the
      last micro batch, so the stage's whole tensor-parallel share, in bf16 and fp32.
    - activations: what autograd keeps per block and position, eager: the two LayerNorms' inputs and outputs, q, k,
      v and the output of flash attention (which the projection keeps too: the same tensor), the fp32 logsumexp,
      the MLP's first linear's output and GELU's (4d each): 16 d elements (Korthikanti et al. (2022)'s 34 s b h less
      the dropout masks this model has not, and with the MLP's two); with activation checkpointing each block's
      input plus one block's set, recomputed; times the micro batches in flight.
    - logits: bf16 logits, fp32 log-probabilities (log_softmax's output), nll's fp32 gradient and log_softmax's
      fp32 gradient, alive together during log_softmax's backward: compute + 12 bytes each."""
    m, tp = cfg.model, layout.tensor
    s, b, h, v = m.seq_len, layout.micro_batch, m.d_model, m.vocab_size
    compute = 2 if on_gpu else 4
    layers = m.n_layer // layout.pipeline
    last = stage == layout.pipeline - 1
    params, root_params = stage_params(m, layout.pipeline, stage)
    replicated = tensor_replicated_params(m, layers, final_norm=last)
    shard = (params - replicated) / (tp * layout.data) + replicated / layout.data  # parameters per rank
    block = (12 * h * h + 7 * h) / tp + 6 * h  # one block's parameters on one tensor rank, unsharded
    root = root_params / tp
    if layout.pipeline > 1:
        gathered = (compute + 4) * ((params - replicated) / tp + replicated)
    else:
        gathered = fsdp_gathered(compute, block, root)
    per_block = s * b * (16 * h * compute / tp + 4 * m.n_head / tp)
    if cfg.activation_checkpointing:
        per_micro_batch, recomputed = layers * compute * s * b * h / tp, per_block
    else:
        per_micro_batch, recomputed = layers * per_block, 0
    activations = per_micro_batch * micro_batches_in_flight(layout, stage) + recomputed
    buffers = 2 * s * b * h / tp * compute if layout.pipeline > 1 else 0
    logits = s * b * v / tp * (compute + 12) if last else 0
    return MemoryEstimate(weights=4 * shard, gradients=4 * shard if layout.grad_accum > 1 else 0,
                          optimizer=8 * shard, gathered=gathered, activations=activations, pipeline_buffers=buffers,
                          logits=logits, reserve=4 * GIB if on_gpu else 0, stage=stage)


def describe(cfg: GPT3Config, layout: Layout, gpu_memory_gib: float | None) -> list[str]:
    """The lines `--dry-run` shows: the layout, the batch, the memory estimate term by term against the GPU's, the
    bytes each GPU sends per step by link, and the pipeline's bubble."""
    memory = estimate_memory(cfg, layout, on_gpu=bool(gpu_memory_gib))
    limit = f" of {gpu_memory_gib:g} GiB" if gpu_memory_gib else " (CPU: per process)"
    stage = f" (stage {memory.stage})" if layout.pipeline > 1 else ""
    steps = "pipeline micro batches" if layout.pipeline > 1 else "accumulation steps"
    return [
        f"gpt3 model: {cfg.model.n_layer} layers, d_model {cfg.model.d_model}, {cfg.model.n_head} heads, "
        f"sequence {cfg.model.seq_len}, {_count(cfg.model.params)} parameters",
        f"gpt3 layout: {layout.world} processes = tensor {layout.tensor} x pipeline {layout.pipeline} "
        f"x data (FSDP) {layout.data}; global batch {layout.global_batch} = {layout.data} x micro batch "
        f"{layout.micro_batch} x {layout.grad_accum} {steps}; "
        f"base LR {base_lr(cfg, layout.global_batch):g}",
        f"gpt3 memory per GPU{stage}: {memory.describe(limit)}; activation checkpointing "
        f"{'on' if cfg.activation_checkpointing else 'off'}",
        f"gpt3 traffic per GPU per step: {estimate_traffic(cfg, layout).describe()}",
        f"gpt3 pipeline bubble: {bubble_fraction(layout):.1%} of a step ((p - 1) / (m + p - 1) with p "
        f"{layout.pipeline}, m {layout.grad_accum})",
    ]


def estimate_traffic(cfg: GPT3Config, layout: Layout) -> Traffic:
    """The bytes each GPU sends per step (workloads.common.traffic), on the stage that sends most: FSDP over every
    data rank of a stage. With tensor parallel 8 filling each node, every FSDP group crosses nodes, so HSDP would
    not move its gathers to NVLink; what cuts them is a pipeline: a stage gathers and reduces only its own
    parameters, once per step (traffic.estimate_traffic), and sends each micro batch's activations instead."""
    m = cfg.model
    return max((traffic.estimate_traffic(params=stage_params(m, layout.pipeline, stage)[0],
                                         n_layer=m.n_layer // layout.pipeline, seq_len=m.seq_len, d_model=m.d_model,
                                         kv_dim=m.d_model, tensor=layout.tensor, context=1, shard=layout.data,
                                         replicate=1, micro_batch=layout.micro_batch, grad_accum=layout.grad_accum,
                                         procs_per_node=layout.procs_per_node or layout.world,
                                         recompute=cfg.activation_checkpointing, pipeline=layout.pipeline)
                for stage in range(layout.pipeline)), key=lambda t: t.nvlink + t.infiniband)


def check_fits(cfg: GPT3Config, layout: Layout, gpu_memory_gib: float) -> None:
    """Refuse, with the arithmetic (each term, the total, the limit), a config whose estimate exceeds the GPU's
    memory."""
    memory = estimate_memory(cfg, layout)
    if memory.total / GIB > gpu_memory_gib:
        raise ValueError(f"gpt3 needs about {memory.describe()} per GPU on stage {memory.stage} with tensor "
                         f"parallel {layout.tensor} x pipeline {layout.pipeline} over {layout.world} GPUs, more than "
                         f"the {gpu_memory_gib:g} GiB each has: use more nodes, more pipeline stages or a smaller "
                         "micro batch (--batch-size)")


def _count(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
