"""llama31_8b presets, the RCP batch table, the parallel layout, and its memory and traffic per GPU.

No torch here: `harness run --dry-run` imports this to show the layout, refuse a batch with no RCP or a
config that cannot fit, and print the bytes each GPU sends per step, before anything starts.

The full preset is MLCommons' reference (mlcommons/training `small_language_model_pretraining/nemo/`,
`pretrain_llama31.py`) under the 6.1.0 rules (mlperf-logging `compliance_checker/training_6.1.0/
closed_llama31_8b.yaml`) and RCPs (`rcp_checker/training_6.1.0/rcps_llama31_8b.json`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from workloads.common import traffic
from workloads.common.traffic import Traffic

GIB = 2**30
MAX_STEPS = 1_200_000  # closed_llama31_8b.yaml: max_steps == 1200000, decay steps == max_steps - warmup
EVAL_INTERVAL_SAMPLES = 12_288  # pretrain_llama31.py: evaluate every 12,288 sequences
EVAL_SEQUENCES = 1_024  # closed_llama31_8b.yaml: eval_samples == 1024

# rcps_llama31_8b.json: global batch -> (peak LR, warmup samples). A closed run uses one of these, so that
# the RCP checker has a reference convergence to compare it with.
RCP_BATCHES: dict[int, tuple[float, int]] = {
    16: (4e-4, 256),
    32: (8e-4, 4_096),
    64: (8e-4, 6_144),
    96: (1e-3, 16_348),
    128: (2e-3, 32_768),
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (Meta's `apply_scaling`): long wavelengths slowed by `factor`,
    short ones kept, a smooth blend between."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    """The model's shape."""

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    n_kv_head: int  # grouped-query attention: each key/value head serves n_head / n_kv_head query heads
    d_model: int
    ffn_hidden: int  # SwiGLU's hidden width
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling: RopeScaling | None = RopeScaling()
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    def block_params(self) -> int:
        """One block: q and o (d^2 each), k and v (d x kv_dim each), SwiGLU's three matrices, two RMSNorms."""
        d = self.d_model
        return 2 * d * d + 2 * d * self.kv_dim + 3 * d * self.ffn_hidden + 2 * d

    @property
    def params(self) -> int:
        """Untied input embedding and output layer, the blocks, the final RMSNorm."""
        return 2 * self.vocab_size * self.d_model + self.n_layer * self.block_params() + self.d_model

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N for the matmuls (embedding lookups excluded) plus 12 L T d for
        attention (PaLM's MFU formula, as NVIDIA's MFU figures count it)."""
        matmul_params = self.params - self.vocab_size * self.d_model
        return 6 * matmul_params + 12 * self.n_layer * self.seq_len * self.d_model


@dataclass(frozen=True)
class LlamaPretrainConfig:
    model: LlamaConfig
    global_batch: int  # sequences per optimizer step
    base_lr: float
    warmup_samples: int
    end_lr_ratio: float  # end LR = base LR x this
    max_steps: int  # the schedule's length: decay steps = max_steps - warmup steps
    eval_interval: int  # sequences between evaluations
    eval_sequences: int
    target: float  # validation log perplexity that ends the run
    weight_decay: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-5
    clip_norm: float = 1.0
    micro_batch: int = 1  # sequences per data rank per forward pass
    eval_batch: int = 4  # sequences per data rank per eval forward pass (no gradients or activations kept)
    tensor_parallel: int = 1  # at most the GPUs of a node
    shard_nodes: int = 1  # HSDP: FSDP shards within groups of this many nodes, and replicates across groups
    activation_checkpointing: bool = False
    loader_workers: int = 2
    step_limit: int | None = None  # stop after this many steps whatever the schedule (tiny: a bound on CPU time)

    @property
    def warmup_steps(self) -> int:
        return math.ceil(self.warmup_samples / self.global_batch)


LLAMA31_8B = LlamaConfig(vocab_size=128_256, seq_len=8192, n_layer=32, n_head=32, n_kv_head=8, d_model=4096,
                         ffn_hidden=14_336)

PRESETS = {
    # MLPerf closed: Llama 3.1 8B from scratch on C4 to validation log perplexity 3.3, at global batch 64 (NVIDIA's
    # v5.1 submission on 512 GPUs; the RCP table's row: peak LR 8e-4, 6,144 warmup samples).
    "full": LlamaPretrainConfig(
        model=LLAMA31_8B, global_batch=64, base_lr=RCP_BATCHES[64][0], warmup_samples=RCP_BATCHES[64][1],
        end_lr_ratio=0.1, max_steps=MAX_STEPS, eval_interval=EVAL_INTERVAL_SAMPLES, eval_sequences=EVAL_SEQUENCES,
        target=3.3, tensor_parallel=2, activation_checkpointing=True),
    # A 2-layer Llama (GQA, RoPE with 3.1's scaling, SwiGLU, RMSNorm all kept) on generated Markov-chain text
    # written into the same Megatron files, from scratch to a log perplexity its text allows.
    "tiny": LlamaPretrainConfig(
        model=LlamaConfig(vocab_size=128, seq_len=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                          ffn_hidden=192, rope_scaling=RopeScaling(original_context=64)),
        global_batch=8, base_lr=3e-3, warmup_samples=32, end_lr_ratio=0.1, max_steps=2_000, eval_interval=64,
        eval_sequences=32, target=0.9, loader_workers=0, step_limit=400),
}


def preset_config(preset: str, global_batch: int | None = None, force: bool = False) -> LlamaPretrainConfig:
    """The preset, at another global batch when asked: the full preset takes that batch's RCP row (peak LR,
    warmup), and refuses, with the table, a batch the RCPs were not measured at unless forced (then the
    preset's LR and warmup stay, and the runs cannot pass the RCP check)."""
    cfg = PRESETS[preset]
    if global_batch is None or global_batch == cfg.global_batch:
        return cfg
    if preset == "full" and global_batch not in RCP_BATCHES and not force:
        table = "; ".join(f"{batch}: LR {lr:g}, warmup {warmup:,} samples" for batch, (lr, warmup)
                          in RCP_BATCHES.items())
        raise ValueError(f"llama31_8b has no reference convergence point (RCP) at global batch {global_batch}, so "
                         f"its runs could not pass the RCP check; choose one of {table} (or add --force-batch)")
    lr, warmup = RCP_BATCHES.get(global_batch, (cfg.base_lr, cfg.warmup_samples)) if preset == "full" \
        else (cfg.base_lr, cfg.warmup_samples)
    return replace(cfg, global_batch=global_batch, base_lr=lr, warmup_samples=warmup)


@dataclass(frozen=True)
class Layout:
    """How `world` processes split the work: replicate x shard (the data ranks, HSDP) x context x tensor.

    FSDP2 shards parameters, gradients and Adam's moments over shard x context (context ranks hold the
    same weights, so they share their shards too), within a node or group of nodes; groups replicate,
    and only the gradients' all-reduce crosses between them."""

    world: int
    procs_per_node: int
    replicate: int
    shard: int
    context: int
    tensor: int
    micro_batch: int
    grad_accum: int

    @property
    def data(self) -> int:
        return self.replicate * self.shard

    @property
    def fsdp(self) -> int:
        """The ranks one FSDP group shards over."""
        return self.shard * self.context

    @property
    def global_batch(self) -> int:
        return self.data * self.micro_batch * self.grad_accum


def plan_layout(cfg: LlamaPretrainConfig, world: int, procs_per_node: int) -> Layout:
    """Tensor parallel inside a node; context parallel when the batch leaves a data rank less than one
    sequence; FSDP within groups of `shard_nodes` nodes, replicated across groups (HSDP)."""
    m = cfg.model
    tensor = min(cfg.tensor_parallel, procs_per_node, world)
    if world % tensor or m.n_kv_head % tensor or m.n_head % tensor:
        raise ValueError(f"tensor parallel {tensor} must divide the world size {world}, the {m.n_head} attention "
                         f"heads and the {m.n_kv_head} key/value heads")
    # The smallest context parallel (a power of two: each rank holds two chunks of seq_len / 2^k) that leaves
    # every data rank whole sequences, in whole micro batches.
    context = 1
    while True:
        data = world // (tensor * context)
        if world % (tensor * context) == 0 and m.seq_len % (2 * context) == 0 and data \
                and cfg.global_batch % (data * cfg.micro_batch) == 0:
            break
        context *= 2
        if context > world // tensor or m.seq_len % (2 * context):
            raise ValueError(f"global batch {cfg.global_batch} does not split evenly over {world} processes with "
                             f"tensor parallel {tensor} and micro batch {cfg.micro_batch} at any context parallel "
                             f"(a power of two up to {world // tensor}): the data ranks, {world} / (tensor x "
                             "context), must divide the global batch; use a process count of a power of two times "
                             "the tensor parallel, or another batch")
    per_group = max(1, procs_per_node // (tensor * context)) * cfg.shard_nodes  # data ranks in one FSDP group
    shard = math.gcd(data, per_group)
    return Layout(world=world, procs_per_node=procs_per_node, replicate=data // shard, shard=shard,
                  context=context, tensor=tensor, micro_batch=cfg.micro_batch,
                  grad_accum=cfg.global_batch // (data * cfg.micro_batch))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process at the peak of a training step."""

    weights: float  # fp32 master weights: this rank's FSDP shard of its tensor-parallel share
    gradients: float  # fp32 gradients, the same shard
    optimizer: float  # AdamW's two fp32 moments, the same shard
    gathered: float  # what FSDP unshards at once: two blocks, the root (embeddings, output), one block's grads
    activations: float  # what backward keeps for this rank's share of the sequence
    logits: float  # this rank's vocabulary shard of its positions' logits, and what the loss keeps
    reserve: float  # CUDA context, NCCL buffers, allocator fragmentation (GPUs only)

    TERMS = ("weights", "gradients", "optimizer", "gathered", "activations", "logits", "reserve")

    @property
    def total(self) -> float:
        return sum(getattr(self, term) for term in self.TERMS)


def estimate_memory(cfg: LlamaPretrainConfig, layout: Layout, on_gpu: bool = True) -> MemoryEstimate:
    """Per-rank bytes, term by term; bf16 compute on GPUs (2 bytes), fp32 on CPU (4).

    Activations per block follow Korthikanti et al. (2022) with sequence parallelism and flash attention
    (no s^2 term), for SwiGLU's wider MLP: this rank holds s / context positions, split again by tensor
    between the blocks."""
    m, tp, cp = cfg.model, layout.tensor, layout.context
    s, b, h = m.seq_len // cp, layout.micro_batch, m.d_model
    compute = 2 if on_gpu else 4
    norms = m.n_layer * 2 * h + h  # RMSNorm weights: whole on every tensor rank (sequence parallel)
    shard = (m.params - norms) / (tp * layout.fsdp) + norms / layout.fsdp
    block = (m.block_params() - 2 * h) / tp + 2 * h
    root = 2 * m.vocab_size * h / tp + h
    unsharded_grad = compute + (4 if compute != 4 else 0)
    # Per block, per position: the norms' inputs and outputs, q, k, v, attention output, SwiGLU's three
    # intermediates (in bytes at 16 bits: 2 x (4h + 2 kv + 3 ffn)), with everything between norms split by tp.
    per_position = 2 * (2 * h + (2 * h + 2 * m.kv_dim + 3 * m.ffn_hidden) / tp)
    block_activations = s * b * per_position * compute / 2
    if cfg.activation_checkpointing:
        activations = m.n_layer * compute * s * b * h / tp + block_activations
    else:
        activations = m.n_layer * block_activations
    logits = s * b * m.vocab_size / tp * (compute + (4 if compute != 4 else 0) + 4 + 4)
    return MemoryEstimate(weights=4 * shard, gradients=4 * shard, optimizer=8 * shard,
                          gathered=compute * (2 * block + root) + unsharded_grad * max(block, root),
                          activations=activations, logits=logits, reserve=4 * GIB if on_gpu else 0)


def estimate_traffic(cfg: LlamaPretrainConfig, layout: Layout) -> Traffic:
    """The bytes each GPU sends per step (workloads.common.traffic)."""
    m = cfg.model
    return traffic.estimate_traffic(params=m.params, n_layer=m.n_layer, seq_len=m.seq_len, d_model=m.d_model,
                                    kv_dim=m.kv_dim, tensor=layout.tensor, context=layout.context, shard=layout.shard,
                                    replicate=layout.replicate, micro_batch=layout.micro_batch,
                                    grad_accum=layout.grad_accum, procs_per_node=layout.procs_per_node,
                                    recompute=cfg.activation_checkpointing)


def describe(cfg: LlamaPretrainConfig, layout: Layout, gpu_memory_gib: float | None) -> list[str]:
    """The lines `--dry-run` shows: the model, the layout, memory per GPU and traffic per GPU per step."""
    m = cfg.model
    memory = estimate_memory(cfg, layout, on_gpu=bool(gpu_memory_gib))
    parts = ", ".join(f"{name} {getattr(memory, name) / GIB:.1f}" for name in memory.TERMS)
    limit = f" of {gpu_memory_gib:g} GiB" if gpu_memory_gib else " (CPU: per process)"
    return [
        f"llama31_8b model: {m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads ({m.n_kv_head} key/value), "
        f"SwiGLU {m.ffn_hidden}, sequence {m.seq_len}, {_count(m.params)} parameters",
        f"llama31_8b layout: {layout.world} processes = replicate {layout.replicate} x shard {layout.shard} "
        f"(HSDP: FSDP over shard x context = {layout.fsdp}) x context {layout.context} x tensor {layout.tensor}; "
        f"global batch {layout.global_batch} = {layout.data} data ranks x micro batch {layout.micro_batch} "
        f"x {layout.grad_accum} accumulation steps; peak LR {cfg.base_lr:g}, warmup {cfg.warmup_steps} steps",
        f"llama31_8b memory per GPU: {memory.total / GIB:.1f} GiB{limit} ({parts} GiB; activation checkpointing "
        f"{'on' if cfg.activation_checkpointing else 'off'})",
        f"llama31_8b traffic per GPU per step: {estimate_traffic(cfg, layout).describe()}",
    ]


def check_fits(cfg: LlamaPretrainConfig, layout: Layout, gpu_memory_gib: float) -> None:
    total = estimate_memory(cfg, layout).total / GIB
    if total > gpu_memory_gib:
        raise ValueError(f"llama31_8b needs about {total:.1f} GiB per GPU with tensor {layout.tensor} x context "
                         f"{layout.context} x FSDP {layout.fsdp}, more than the {gpu_memory_gib:g} GiB each has: "
                         "use more GPUs per FSDP group (more nodes per shard group) or activation checkpointing")


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
