"""FLUX.1's shape, its exact parameter count and the sizes the memory arithmetic reads. No torch here: a dry run
imports this.

The schnell preset is MLPerf flux1's model: torchtitan's `flux_configs["flux-schnell"]`
(pytorch/torchtitan torchtitan/experiments/flux/__init__.py), which is Black Forest Labs'
`configs["flux-schnell"].params` (black-forest-labs/flux src/flux/util.py): in/out channels 64 (16 latent channels
packed 2x2), CLIP pooled 768, T5-XXL 4096, hidden 3072, MLP x4, 24 heads, 19 double and 38 single blocks, RoPE
axes (16, 56, 56), theta 10,000, qkv bias; schnell is not guidance-distilled, so guidance_embed is False (BFL's
util.py; torchtitan has no guidance_in at all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from workloads.common import traffic
from workloads.common.memory import GIB, MemoryEstimate, fsdp_gathered
from workloads.common.rcp_rows import BatchHyperparameters, open_hyperparameters, rcp_hyperparameters
from workloads.common.traffic import Traffic

TIME_EMBED_DIM = 256  # the sinusoidal timestep embedding's width, and guidance's (BFL model.py: time_in in_dim=256)


@dataclass(frozen=True)
class FluxConfig:
    in_channels: int = 64
    out_channels: int = 64
    vec_in_dim: int = 768  # CLIP-L's pooled output, `y`
    context_in_dim: int = 4096  # T5-XXL's hidden states, `txt`
    hidden_size: int = 3072
    mlp_ratio: float = 4.0
    num_heads: int = 24
    depth: int = 19  # double-stream blocks
    depth_single_blocks: int = 38
    axes_dim: tuple[int, ...] = (16, 56, 56)  # RoPE width per position axis; sums to head_dim
    theta: int = 10_000
    qkv_bias: bool = True
    guidance_embed: bool = False

    def __post_init__(self):
        # The model's own checks (BFL model.py), here so that a dry run refuses a bad shape without torch.
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if sum(self.axes_dim) != self.head_dim or any(d % 2 for d in self.axes_dim):
            raise ValueError(f"axes_dim {self.axes_dim} must be even and sum to head_dim {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)  # as BFL layers.py: int(hidden_size * mlp_ratio)

    @property
    def double_block_params(self) -> int:
        """One DoubleStreamBlock: an image and a text stream, each with a 6-way modulation, qkv, QK-norm scales,
        the attention's projection and a 2-layer MLP."""
        h, m = self.hidden_size, self.mlp_hidden
        stream = ((h * 6 * h + 6 * h)  # mod.lin
                  + (h * 3 * h + (3 * h if self.qkv_bias else 0))  # attn.qkv
                  + 2 * self.head_dim  # attn.norm: query_norm.scale, key_norm.scale
                  + (h * h + h)  # attn.proj
                  + (h * m + m) + (m * h + h))  # mlp.0, mlp.2
        return 2 * stream

    @property
    def single_block_params(self) -> int:
        """One SingleStreamBlock: linear1 (qkv and MLP in, fused), linear2 (projection and MLP out, fused),
        QK-norm scales and a 3-way modulation."""
        h, m = self.hidden_size, self.mlp_hidden
        return (h * (3 * h + m) + 3 * h + m) + ((h + m) * h + h) + 2 * self.head_dim + (h * 3 * h + 3 * h)

    @property
    def params(self) -> int:
        """Every parameter of `Flux(self)`, exactly (tests/test_flux_model.py checks it against the model)."""
        h = self.hidden_size

        def mlp_embedder(in_dim: int) -> int:  # in_layer, out_layer
            return in_dim * h + h + h * h + h

        embed = ((self.in_channels * h + h)  # img_in
                 + mlp_embedder(TIME_EMBED_DIM)  # time_in
                 + mlp_embedder(self.vec_in_dim)  # vector_in
                 + (mlp_embedder(TIME_EMBED_DIM) if self.guidance_embed else 0)  # guidance_in (not in schnell)
                 + (self.context_in_dim * h + h))  # txt_in
        final = (h * 2 * h + 2 * h) + (h * self.out_channels + self.out_channels)  # adaLN_modulation.1, linear
        return embed + self.depth * self.double_block_params + self.depth_single_blocks * self.single_block_params \
            + final


FLUX_SCHNELL = FluxConfig()

# A few-second model for 2-process CPU runs and the tests: 16 latent channels packed 2x2 (in/out 64, as schnell),
# 4 heads of 16, RoPE axes 4 + 6 + 6; the synthetic data's text and pooled widths are 32.
FLUX_TINY = FluxConfig(vec_in_dim=32, context_in_dim=32, hidden_size=64, num_heads=4, depth=2, depth_single_blocks=2,
                       axes_dim=(4, 6, 6))


# --- the benchmark: presets, the rules' values, the layout and its arithmetic -----------------------------------------
# Sources: mlcommons/training `text_to_image/README.md`; the torchtitan flux experiment it pins (branch
# mlperf-training-flux.1: `train.py`, `train_configs/flux_schnell_mlperf_preprocessed.toml`, `dataset/flux_mlperf.py`,
# `mlperf_logging.py`); mlperf-logging `compliance_checker/training_6.1.0/closed_flux1.yaml` and
# `rcp_checker/training_6.1.0/rcps_flux1.json`. docs/benchmarks/flux1.md gives each value with its source.

VAE_SHIFT, VAE_SCALE = 0.1159, 0.3611  # toml [encoder] autoencoder_shift/autoencoder_scale: x0 = (z - shift) * scale
CAPTION_DROPOUT = 0.1  # toml [training] classifer_free_guidance_prob: both encodings replaced by the empty caption's
EVAL_TIMESTEPS = 8  # the validation samples' fixed timesteps k / 8, k = 0..7 (README, train.py eval_step)
TRAIN_SAMPLES = 1_099_776  # README; mlperf_logging.py TRAIN_SAMPLES
EVAL_SAMPLES = 29_696  # README; mlperf_logging.py EVAL_SAMPLES; 3,712 per timestep
EVAL_INTERVAL_SAMPLES = 262_144  # README "every 262,144 training samples"; closed_flux1.yaml rounds it to whole steps
TARGET = 0.586  # closed_flux1.yaml and the toml's target_eval_loss: the mean validation loss
MAX_STEPS = 30_000  # the toml's [training] steps: a cap, the run stops at the target
ADAM_BETAS, ADAM_EPS, WEIGHT_DECAY, CLIP_NORM = (0.9, 0.95), 1e-8, 0.1, 1.0  # closed_flux1.yaml fixes each
LATENT_CHANNELS = 16  # the VAE's z_channels (torchtitan flux-schnell AutoEncoderParams)

# rcps_flux1.json: global batch -> (LR, warmup). The rows give warmup in steps (1,600, 800, 0, 100); here in samples
# (steps x batch), as rcp_hyperparameters interpolates it, so that a row's warmup comes back exact.
RCP_BATCHES: dict[int, tuple[float, int]] = {512: (2e-4, 1_600 * 512), 1024: (2.5e-4, 800 * 1024),
                                             2048: (2.5e-4, 0), 4096: (4e-4, 100 * 4096)}


@dataclass(frozen=True)
class SampleShape:
    """One sample's tensors, as the model config expects them: what a dataset is checked against."""

    text: tuple[int, int]  # T5 states: (tokens, context_in_dim)
    pooled: int  # CLIP's pooled width: vec_in_dim
    latent: tuple[int, int, int]  # (16 channels, height, width) of the mean and the log-variance

    def expected(self) -> dict[str, tuple[int, ...]]:
        return {"t5_encodings": self.text, "clip_encodings": (self.pooled,), "mean": self.latent,
                "logvar": self.latent}


def eval_interval(global_batch: int) -> int:
    """Samples between evaluations: 262,144 rounded up to whole steps, as closed_flux1.yaml computes the
    evaluation_frequency it checks (ceil(262144 / GBS) x GBS)."""
    return math.ceil(EVAL_INTERVAL_SAMPLES / global_batch) * global_batch


@dataclass(frozen=True)
class FluxTrainConfig:
    model: FluxConfig
    global_batch: int
    base_lr: float
    warmup_samples: int
    max_micro_batch: int  # a data rank's most samples per forward; more accumulate (the toml's batch_size 16)
    eval_batch: int  # validation samples per forward (torchtitan's job_config eval.batch_size 16)
    text_tokens: int  # T5 states per caption (the toml's max_t5_encoding_len 256)
    latent_size: int  # the latent's height and width (256 px / the VAE's 8)
    train_samples: int
    eval_samples: int
    target: float
    activation_checkpointing: bool
    eval_every_samples: int | None = None  # None: the rules' eval_interval(global_batch)
    max_steps: int = MAX_STEPS
    step_limit: int | None = None  # the tiny preset's cap, below max_steps
    shard_nodes: int = 1  # HSDP: FSDP over this many nodes' GPUs, replicas across groups (the reference: 1)
    loader_workers: int = 4
    hyperparameters: BatchHyperparameters | None = None

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup_samples / self.global_batch)

    @property
    def eval_every(self) -> int:
        """Steps between evaluations."""
        return (self.eval_every_samples or eval_interval(self.global_batch)) // self.global_batch

    @property
    def sample_shape(self) -> SampleShape:
        latent = (LATENT_CHANNELS, self.latent_size, self.latent_size)
        return SampleShape(text=(self.text_tokens, self.model.context_in_dim), pooled=self.model.vec_in_dim,
                           latent=latent)

    @property
    def image_tokens(self) -> int:
        return (self.latent_size // 2) ** 2

    def flops_per_sample(self) -> float:
        """Training FLOPs per sample (forward and backward: 6 per multiply-add of a weight, as MFU counts them): every
        token through its own stream's matrices in the double blocks and the shared ones in the single blocks, the
        embedders and modulations once per sample, attention's two products over all tokens; activation
        checkpointing's recomputation is not counted (MFU's convention)."""
        m, h = self.model, self.model.hidden_size
        tokens = self.image_tokens + self.text_tokens
        per_token = (m.depth + m.depth_single_blocks) * (4 * h * h + 2 * h * m.mlp_hidden)
        inputs = self.image_tokens * (m.in_channels + m.out_channels) * h + self.text_tokens * m.context_in_dim * h
        modulations = (12 * m.depth + 3 * m.depth_single_blocks + 2) * h * h
        per_sample = (TIME_EMBED_DIM + m.vec_in_dim + 2 * h) * h + modulations
        attention = 12 * (m.depth + m.depth_single_blocks) * tokens * tokens * h
        return 6 * (tokens * per_token + inputs + per_sample) + attention


PRESETS: dict[str, FluxTrainConfig] = {
    # The reference at its default batch: 1,024 (an RCP row: LR 2.5e-4, 800 warmup steps); --global-batch picks
    # another row or a batch between two.
    "full": FluxTrainConfig(model=FLUX_SCHNELL, global_batch=1024, base_lr=2.5e-4, warmup_samples=800 * 1024,
                            max_micro_batch=16, eval_batch=16, text_tokens=256, latent_size=32,
                            train_samples=TRAIN_SAMPLES, eval_samples=EVAL_SAMPLES, target=TARGET,
                            activation_checkpointing=True),
    # FLUX_TINY on the generated set (workloads.flux.data.write_tiny_set): 2 CPU processes, 64 px images (8 x 8
    # latents, 16 tokens), 8 text tokens; the rules' target, which the model reaches only by reading the caption,
    # in about 130 steps; an evaluation every 32 steps; activation checkpointing on, as the full preset runs (each
    # block recomputed under FSDP2).
    "tiny": FluxTrainConfig(model=FLUX_TINY, global_batch=16, base_lr=3e-3, warmup_samples=0, max_micro_batch=8,
                            eval_batch=32, text_tokens=8, latent_size=8, train_samples=4_096, eval_samples=256,
                            target=TARGET, activation_checkpointing=True, eval_every_samples=512, step_limit=640,
                            loader_workers=0),
}


def run_config(preset: str, global_batch: int | None = None, force: bool = False, learning_rate: float | None = None,
               warmup_samples: int | None = None) -> FluxTrainConfig:
    """A preset at `global_batch`: the full preset's LR and warmup from the RCP rows (a row's, interpolated between
    two, or given), the tiny preset's its own unless given."""
    cfg = PRESETS[preset]
    batch = global_batch or cfg.global_batch
    if preset == "full":
        chosen = rcp_hyperparameters("flux1", RCP_BATCHES, batch, preset=(cfg.base_lr, cfg.warmup_samples),
                                     learning_rate=learning_rate, warmup_samples=warmup_samples, force=force)
    else:
        chosen = open_hyperparameters("flux1", batch, (cfg.base_lr, cfg.warmup_samples), learning_rate,
                                      warmup_samples)
    return replace(cfg, global_batch=batch, base_lr=chosen.base_lr, warmup_samples=chosen.warmup_samples,
                   hyperparameters=chosen)


@dataclass(frozen=True)
class FluxLayout:
    """HSDP, as the reference runs it (README: "sharding over gpus in the same node, and using DDP across different
    nodes"): FSDP over `shard` ranks (a node, or shard_nodes nodes), `replicate` groups; every rank a data rank."""

    world: int
    procs_per_node: int
    replicate: int
    shard: int
    micro_batch: int
    grad_accum: int

    @property
    def global_batch(self) -> int:
        return self.world * self.micro_batch * self.grad_accum


def plan_layout(cfg: FluxTrainConfig, world: int, procs_per_node: int) -> FluxLayout:
    """FSDP over a node group, replicas across groups; each data rank's share of the batch in micro batches of at
    most max_micro_batch."""
    if cfg.global_batch % world:
        raise ValueError(f"flux1's global batch {cfg.global_batch} does not split evenly over {world} processes: "
                         f"give --global-batch a multiple of {world}")
    shard = min(world, procs_per_node * cfg.shard_nodes)
    if world % shard:
        raise ValueError(f"{world} processes do not form whole FSDP groups of {shard} (shard_nodes "
                         f"{cfg.shard_nodes} x {procs_per_node} per node)")
    per_rank = cfg.global_batch // world
    micro = next(m for m in range(min(per_rank, cfg.max_micro_batch), 0, -1) if per_rank % m == 0)
    return FluxLayout(world=world, procs_per_node=procs_per_node, replicate=world // shard, shard=shard,
                      micro_batch=micro, grad_accum=per_rank // micro)


class FluxMemory(MemoryEstimate):
    """The decoders' terms without the ones a diffusion transformer has none of (no pipeline, no vocabulary)."""

    TERMS = ("weights", "gradients", "optimizer", "gathered", "activations", "reserve")


def block_activation_elements(m: FluxConfig, double: bool) -> float:
    """Elements autograd keeps per token in one block's forward (what a checkpointed block recomputes in its
    backward): per stream of a double block the modulated norm's output, qkv, the normed q and k, rotated q and k,
    the attention's output and its projection's input, the second norm and its modulation, the MLP's input and
    GELU's input and output; a single block's the same over its fused linear1 (3h + mlp) and linear2 (h + mlp)."""
    h, mlp = m.hidden_size, m.mlp_hidden
    if double:
        return 13 * h + 2 * mlp
    return 9 * h + 3 * mlp + (h + mlp)


def estimate_memory(cfg: FluxTrainConfig, layout: FluxLayout, on_gpu: bool = True) -> FluxMemory:
    """Bytes per GPU at the step's peak, as the decoders' estimate counts each term (workloads.decoder.config.
    estimate_stage): fp32 master weights and AdamW moments of the FSDP shard; the root's and two blocks' bf16 weights
    gathered and one block's unsharded gradient; the micro batch's T5 states. The peak is the larger of two moments:
    backward's start, where every block's saved activations are alive (with checkpointing each block's input, image
    and text tokens, plus the last block recomputed) and the sharded fp32 gradients only if earlier micro batches
    left them; and backward's end, where every block's sharded gradient exists (FSDP2 keeps them until zero_grad)
    and one block is recomputed. The decoders' start-of-backward peak, at its two measured shapes, is the first."""
    m = cfg.model
    compute = 2 if on_gpu else 4
    shard = m.params / layout.shard
    block = m.double_block_params
    root = m.params - m.depth * m.double_block_params - m.depth_single_blocks * m.single_block_params
    tokens = (cfg.image_tokens + cfg.text_tokens) * layout.micro_batch
    blocks = m.depth + m.depth_single_blocks
    per_token = [block_activation_elements(m, True)] * m.depth + [block_activation_elements(m, False)] \
        * m.depth_single_blocks
    recomputed = tokens * compute * max(per_token) if cfg.activation_checkpointing else 0
    saved = tokens * compute * (blocks * m.hidden_size if cfg.activation_checkpointing else sum(per_token))
    inputs = layout.micro_batch * cfg.text_tokens * m.context_in_dim * compute
    accumulated = 4 * shard if layout.grad_accum > 1 else 0
    start, end = accumulated + saved + recomputed, 4 * shard + recomputed
    return FluxMemory(weights=4 * shard, gradients=accumulated if start >= end else 4 * shard, optimizer=8 * shard,
                      gathered=fsdp_gathered(compute, block, root),
                      activations=(saved + recomputed if start >= end else recomputed) + inputs, pipeline_buffers=0,
                      logits=0, reserve=4 * GIB if on_gpu else 0)


def estimate_traffic(cfg: FluxTrainConfig, layout: FluxLayout) -> Traffic:
    """Bytes per GPU per step: FSDP's gathers (before forward and backward, per micro batch) and reduce-scatters
    inside a group, HSDP's all-reduce of each shard across the replicas once a step (workloads.common.traffic)."""
    m = cfg.model
    return traffic.estimate_traffic(params=m.params, n_layer=m.depth + m.depth_single_blocks,
                                    seq_len=cfg.image_tokens + cfg.text_tokens, d_model=m.hidden_size,
                                    kv_dim=m.hidden_size, tensor=1, context=1, shard=layout.shard,
                                    replicate=layout.replicate, micro_batch=layout.micro_batch,
                                    grad_accum=layout.grad_accum, procs_per_node=layout.procs_per_node,
                                    recompute=cfg.activation_checkpointing, replicas_reduce_once=True)


def describe(cfg: FluxTrainConfig, layout: FluxLayout, gpu_memory_gib: float | None) -> list[str]:
    """The lines `--dry-run` shows: the model, the layout, memory per GPU term by term, bytes per GPU per step by
    link, and how the batch's LR and warmup were chosen."""
    m = cfg.model
    memory = estimate_memory(cfg, layout, on_gpu=bool(gpu_memory_gib))
    limit = f" of {gpu_memory_gib:g} GiB" if gpu_memory_gib else " (CPU: per process)"
    return [
        f"flux1 model: {m.depth} double-stream and {m.depth_single_blocks} single-stream blocks, hidden "
        f"{m.hidden_size}, {m.num_heads} heads, MLP {m.mlp_hidden}, {cfg.image_tokens} image + {cfg.text_tokens} "
        f"text tokens, {m.params:,} parameters; {cfg.flops_per_sample() / 1e12:.3g} TFLOP per sample trained",
        f"flux1 layout: {layout.world} processes = replicate {layout.replicate} x shard {layout.shard} (HSDP: FSDP "
        f"over {layout.shard}); global batch {layout.global_batch} = {layout.world} data ranks x micro batch "
        f"{layout.micro_batch} x {layout.grad_accum} accumulation steps; peak LR {cfg.base_lr:g}, warmup "
        f"{cfg.warmup_steps} steps, then constant; eval every {cfg.eval_every} steps "
        f"({cfg.eval_every * cfg.global_batch:,} samples)",
        f"flux1 memory per GPU: {memory.describe(limit)}; activation checkpointing "
        f"{'on' if cfg.activation_checkpointing else 'off'}",
        f"flux1 traffic per GPU per step: {estimate_traffic(cfg, layout).describe()}",
        *([f"flux1 hyperparameters: {cfg.hyperparameters.describe()}"] if cfg.hyperparameters else []),
    ]


def check_fits(cfg: FluxTrainConfig, layout: FluxLayout, gpu_memory_gib: float) -> None:
    """Refuse a layout whose estimate exceeds the GPU's memory, with each term and what would shrink it."""
    memory = estimate_memory(cfg, layout)
    if memory.total / GIB > gpu_memory_gib:
        raise ValueError(f"flux1 needs about {memory.describe()} per GPU with replicate {layout.replicate} x FSDP "
                         f"{layout.shard} and micro batch {layout.micro_batch}, more than the {gpu_memory_gib:g} GiB "
                         f"each has: the weights, gradients and AdamW moments (16 bytes a parameter) shrink as the "
                         f"FSDP group grows: more GPUs per node, or FSDP over several nodes (the preset's shard_nodes, "
                         f"workloads/flux/config.py)")
