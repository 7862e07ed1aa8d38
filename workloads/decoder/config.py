"""The decoder benchmarks' presets (llama31_8b's and gpt_oss_20b's pretraining, llama2_70b_lora's fine-tuning),
their RCP batch tables, the parallel layout, and memory and traffic per GPU.

No torch here: `harness run --dry-run` imports this to show the layout, refuse a batch outside the RCP table or a
config that cannot fit, and print the bytes each GPU sends per step, before anything starts.

llama31_8b's full preset is MLCommons' reference (mlcommons/training `small_language_model_pretraining/nemo/`,
`pretrain_llama31.py`) under the 6.1.0 rules (mlperf-logging `compliance_checker/training_6.1.0/
closed_llama31_8b.yaml`) and RCPs (`rcp_checker/training_6.1.0/rcps_llama31_8b.json`). llama2_70b_lora's is
mlcommons/training `llama2_70b_lora/` (`run_llama_70B_scrolls_r16.sh`, `scripts/train.py`, `scripts/utils.py`)
under `closed_llama2_70b_lora.yaml` and `rcps_llama2_70b_lora.json`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from workloads.common import traffic
from workloads.common.memory import GIB, MemoryEstimate, fsdp_gathered
from workloads.common.rcp_rows import BatchHyperparameters, open_hyperparameters, rcp_hyperparameters
from workloads.common.traffic import Traffic
from workloads.flux import config as flux  # torch-free: its RCP rows join the CLI's table below

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
class YarnScaling:
    """YaRN's RoPE scaling (Peng et al., 2023) as DeepSeek-V3 uses it (Hugging Face `rope_scaling` of type "yarn";
    Megatron-Core's YarnRotaryEmbedding): frequencies whose wavelength spans fewer than `beta_fast` rotations of the
    original context are kept, those spanning more than `beta_slow` divided by `factor`, a linear ramp between; the
    attention's softmax scale grows by mscale(factor, mscale_all_dim)^2 and the cos/sin tables by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), where mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1)."""

    factor: float = 40.0
    original_context: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through a low-rank bottleneck (`q_lora_rank`, None:
    one projection), keys and values from a shared `kv_lora_rank` latent (RMSNorm-ed) plus one RoPE key of
    `qk_rope_head_dim` shared by every head; each head's query and key are a `qk_nope_head_dim` part without
    positions and a `qk_rope_head_dim` part with them, its value `v_head_dim` wide."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, d_model: int, n_head: int) -> int:
        """q (down, its norm, up; or one d x heads x qk), kv down (latent and the shared RoPE key) and its norm, kv up
        (each head's nope key and value), o."""
        q = (d_model * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n_head * self.qk_head_dim
             if self.q_lora_rank else d_model * n_head * self.qk_head_dim)
        kv = d_model * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank \
            + self.kv_lora_rank * n_head * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + n_head * self.v_head_dim * d_model


@dataclass(frozen=True)
class MoeConfig:
    """A Mixture-of-Experts feed-forward (workloads.decoder.moe): `experts` SwiGLU MLPs of width `hidden`, each
    token sent to the `top_k` its router scores highest, their outputs summed with the router's weights. Every token
    reaches its k experts: no capacity limit, no token dropped.

    The router is gpt-oss's by default (softmax over the top k logits). DeepSeek-V3's (`score="sigmoid"`): sigmoid
    scores; the experts split into `groups`, only the `top_groups` groups with the highest sum of their two best
    scores (score + expert bias) eligible; the top k of those chosen by score + bias (the bias, a buffer moved by
    `bias_update_rate` x sign(mean load - load) after each step, balances the load without a loss); weights the
    chosen scores normalized to sum 1, times `routed_scale`. `shared_experts` SwiGLUs of width `hidden` (one of
    shared_experts x hidden) see every token beside the routed ones. `aux_loss_coeff`: the sequence-level balance
    loss's weight (DeepSeek-V3's complementary sequence-wise auxiliary loss; Megatron's seq_aux_loss)."""

    experts: int
    top_k: int
    hidden: int
    score: str = "softmax"  # "softmax" (gpt-oss) | "sigmoid" (DeepSeek-V3)
    groups: int = 1
    top_groups: int = 1
    routed_scale: float = 1.0
    shared_experts: int = 0
    bias_update_rate: float = 0.0
    aux_loss_coeff: float = 0.0

    def routed_params(self, d_model: int) -> int:
        """The routed experts' three matrices each: what expert parallelism splits."""
        return self.experts * 3 * d_model * self.hidden

    def params(self, d_model: int) -> int:
        """The router (d x experts), the routed experts, the shared experts (the expert bias is a buffer)."""
        return d_model * self.experts + self.routed_params(d_model) + 3 * d_model * self.hidden * self.shared_experts


@dataclass(frozen=True)
class DecoderConfig:
    """The model's shape: one decoder with its parts chosen here (workloads.decoder.model). Attention is grouped-query,
    over the whole causal prefix or, with `sliding_window`, over the last `sliding_window` keys before each query
    in all but every `full_attention_every`-th layer, or with `mla` multi-head latent attention; the feed-forward is
    a dense SwiGLU, or `moe`'s experts in every layer after the first `dense_layers` (DeepSeek-V3's
    first_k_dense_replace)."""

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    n_kv_head: int  # grouped-query attention: each key/value head serves n_head / n_kv_head query heads
    d_model: int
    ffn_hidden: int  # SwiGLU's hidden width
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling: RopeScaling | YarnScaling | None = RopeScaling()
    init_std: float = 0.02
    kv_channels: int | None = None  # each head's width, where it is not d_model / n_head (Megatron's kv_channels)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Megatron's qk_layernorm)
    sliding_window: int | None = None  # keys before a query that a windowed layer attends to (besides itself)
    full_attention_every: int = 1  # with a window: layers n, 2n, ... (counted from 1) attend to the whole prefix
    moe: MoeConfig | None = None
    mla: MlaConfig | None = None
    dense_layers: int = 0  # with moe: the first layers keep a dense SwiGLU of ffn_hidden
    # DeepSeek-V3's multi-token prediction (workloads.decoder.mtp): depths after the last block, each predicting one
    # token further ahead (Megatron's mtp_num_layers), and the weight of their mean loss in training (its
    # mtp_loss_scaling_factor); 0: none.
    mtp_layers: int = 0
    mtp_loss_scale: float = 0.0

    def windowed(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) attends through the sliding window: Megatron's rule (window_attn_skip_freq,
        megatron/core/transformer/attention.py): layer numbers counted from 1 that the frequency divides are full."""
        return self.sliding_window is not None and (layer + 1) % self.full_attention_every != 0

    @property
    def head_dim(self) -> int:
        """Each head's query/key width (MLA: the nope and RoPE parts together)."""
        if self.mla:
            return self.mla.qk_head_dim
        return self.kv_channels or self.d_model // self.n_head

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla else self.head_dim

    @property
    def kv_dim(self) -> int:
        """Keys' width per position (MLA: every head's, as its kv up-projection expands them)."""
        return (self.n_head if self.mla else self.n_kv_head) * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) has experts."""
        return self.moe is not None and layer >= self.dense_layers

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(layer) for layer in range(self.n_layer))

    def attention_params(self) -> int:
        """q and o (d x q_dim each), k and v (d x kv_dim each); MLA's (MlaConfig.params)."""
        if self.mla:
            return self.mla.params(self.d_model, self.n_head)
        return 2 * self.d_model * (self.q_dim + self.kv_dim)

    def expert_params(self) -> int:
        """One MoE block's routed experts: what expert parallelism splits (0 for a dense model)."""
        return self.moe.routed_params(self.d_model) if self.moe else 0

    def block_params(self, layer: int | None = None) -> int:
        """One block: attention, the feed-forward (SwiGLU's three matrices, or the router and experts), two RMSNorms.
        Layer None: the largest block (an MoE block where the model has experts)."""
        d = self.d_model
        moe = self.is_moe(layer) if layer is not None else self.moe is not None
        ffn = self.moe.params(d) if moe else 3 * d * self.ffn_hidden
        return self.attention_params() + ffn + 2 * d + (2 * self.head_dim if self.qk_norm else 0)

    def mtp_blocks(self) -> list[int]:
        """The MTP depths' blocks, by the layer index each is built with (n_layer + k)."""
        return [self.n_layer + k for k in range(self.mtp_layers)]

    def mtp_params(self) -> int:
        """The multi-token prediction depths: each its two input RMSNorms (the embedding's and the hidden state's),
        eh_proj (2 d -> d), a block (layer n_layer + k: an MoE block where the model has experts) and its final RMSNorm.
        The embedding and the output layer are the model's, shared."""
        d = self.d_model
        return sum(3 * d + 2 * d * d + self.block_params(self.n_layer + k) for k in range(self.mtp_layers))

    @property
    def params(self) -> int:
        """Untied input embedding and output layer, the blocks, the final RMSNorm, the MTP depths (they train and are
        checkpointed, though evaluation never runs them)."""
        blocks = sum(self.block_params(layer) for layer in range(self.n_layer))
        return 2 * self.vocab_size * self.d_model + blocks + self.d_model + self.mtp_params()

    @property
    def active_params(self) -> int:
        """The parameters one token passes through: an MoE block's top_k routed experts, not all of them."""
        if not self.moe:
            return self.params
        idle = self.moe.experts - self.moe.top_k
        mtp_moe_layers = sum(self.is_moe(self.n_layer + k) for k in range(self.mtp_layers))
        return self.params - (self.moe_layers + mtp_moe_layers) * idle * 3 * self.d_model * self.moe.hidden

    def attended_keys(self) -> float:
        """Keys a query attends to, on average over the layers and the sequence's positions (causal: T / 2 in full
        attention; about the window in a windowed layer)."""
        full = self.seq_len / 2
        windowed = sum(self.windowed(layer) for layer in range(self.n_layer))
        window = min(self.sliding_window or 0, self.seq_len) + 1
        return ((self.n_layer - windowed) * full + windowed * min(window, full)) / self.n_layer

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N for the matmuls over the active parameters (embedding lookups excluded)
        plus 6 L T heads (qk + v) for attention's two matmuls (PaLM's 12 L T d where qk = v = d / heads, as NVIDIA's
        MFU figures count it; T the keys attended, 2 x the mean for a causal mask, so a sliding window counts the
        keys it attends). Each MTP depth adds its block and eh_proj, one more pass through the shared output layer, and
        attention to the whole causal prefix (DeepSeek-V3's: no window)."""
        mtp_output_passes = self.mtp_layers * self.vocab_size * self.d_model
        matmul_params = self.active_params - self.vocab_size * self.d_model + mtp_output_passes
        widths = self.n_head * (self.head_dim + self.v_head_dim)
        mtp_attention = 6 * self.mtp_layers * self.seq_len * widths
        return 6 * matmul_params + 6 * self.n_layer * 2 * self.attended_keys() * widths + mtp_attention


def steps_per(samples: int, global_batch: int, framework: str) -> int:
    """Whole steps for `samples` sequences, as the reference rounds them: up in NeMo's pretrain_llama31.py
    (ceil(12,288 / GBS)); down in Primus' config_*_1x8x1.sh, whose shell divides integers (PRIMUS_EVAL_INTERVAL =
    12,288 / GBS, PRIMUS_EVAL_ITERS = 1,024 / GBS: NVIDIA's v6.0 gpt_oss_20b run at batch 36 evaluated every 341
    steps). At least one."""
    if framework == "megatron":
        return max(1, samples // global_batch)
    return max(1, math.ceil(samples / global_batch))


@dataclass(frozen=True)
class PretrainConfig:
    model: DecoderConfig
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
    end_lr: float | None = None  # the schedule's floor, where it is a constant rather than end_lr_ratio x peak
    # The reference's trainer, whose LR schedule and validation sample count the run follows: "nemo" (llama31_8b's
    # pretrain_llama31.py) or "megatron" (gpt_oss_20b's, Megatron-LM's pretrain_gpt.py through Primus).
    framework: str = "nemo"
    eod_mask_loss: bool = False  # targets whose input token is the end-of-document token are not scored
    eod_token: int = 128_001  # Llama 3.1's <|end_of_text|>, which ends every C4 document in the Megatron files
    expert_parallel: int = 8  # at most this many ranks split an MoE layer's experts (a node's GPUs: NVLink)
    pipeline_parallel: int = 1  # pipeline stages (torch.distributed.pipelining), across nodes
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B when above 1)
    hyperparameters: "BatchHyperparameters | None" = None  # how preset_config chose base_lr and warmup_samples
    first_eval: int | None = None  # the step of the first evaluation, where it is not eval_every's
    decay_iters: int | None = None  # Megatron's lr_decay_iters, where it is not decay_steps (deepseekv3_671b's)
    validation_batch: int | None = None  # the eval's global batch, where it is not the training one's

    @property
    def warmup_steps(self) -> int:
        return math.ceil(self.warmup_samples / self.global_batch)

    @property
    def eval_every(self) -> int:
        """Steps between evaluations (steps_per, the reference's rounding)."""
        return steps_per(self.eval_interval, self.global_batch, self.framework)

    @property
    def first_eval_step(self) -> int:
        return self.first_eval or self.eval_every

    @property
    def decay_steps(self) -> int:
        """The logged opt_learning_rate_decay_steps: max_steps - warmup. gpt_oss_20b's reference also passes it as
        Megatron's lr_decay_iters (config_*_1x8x1.sh); deepseekv3_671b's leaves that at max_steps (decay_iters)."""
        return self.max_steps - self.warmup_steps

    @property
    def schedule_decay_iters(self) -> int:
        """Megatron's lr_decay_iters: the step where the cosine reaches its floor."""
        return self.decay_iters or self.decay_steps

    @property
    def floor_lr(self) -> float:
        return self.end_lr if self.end_lr is not None else self.base_lr * self.end_lr_ratio


LLAMA31_8B = DecoderConfig(vocab_size=128_256, seq_len=8192, n_layer=32, n_head=32, n_kv_head=8, d_model=4096,
                         ffn_hidden=14_336)
# Llama 2 70B as the llama2_70b_lora reference loads it (mlcommons/training `llama2_70b_lora/scripts/
# regiss_llama_70b_model_config/config.json`): RoPE theta 10,000 without frequency scaling, 32,000 tokens, untied.
LLAMA2_70B = DecoderConfig(vocab_size=32_000, seq_len=8192, n_layer=80, n_head=64, n_kv_head=8, d_model=8192,
                         ffn_hidden=28_672, rope_theta=10_000.0, rope_scaling=None)

PRESETS = {
    # MLPerf closed: Decoder 3.1 8B from scratch on C4 to validation log perplexity 3.3, at global batch 64 (NVIDIA's
    # v5.1 submission on 512 GPUs; the RCP table's row: peak LR 8e-4, 6,144 warmup samples).
    "full": PretrainConfig(
        model=LLAMA31_8B, global_batch=64, base_lr=RCP_BATCHES[64][0], warmup_samples=RCP_BATCHES[64][1],
        end_lr_ratio=0.1, max_steps=MAX_STEPS, eval_interval=EVAL_INTERVAL_SAMPLES, eval_sequences=EVAL_SEQUENCES,
        target=3.3, tensor_parallel=2, activation_checkpointing=True),
    # A 2-layer Llama (GQA, RoPE with 3.1's scaling, SwiGLU, RMSNorm all kept) on generated Markov-chain text
    # written into the same Megatron files, from scratch to a log perplexity its text allows.
    "tiny": PretrainConfig(
        model=DecoderConfig(vocab_size=128, seq_len=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                          ffn_hidden=192, rope_scaling=RopeScaling(original_context=64)),
        global_batch=8, base_lr=3e-3, warmup_samples=32, end_lr_ratio=0.1, max_steps=2_000, eval_interval=64,
        eval_sequences=32, target=0.9, loader_workers=0, step_limit=400),
}


# --- gpt_oss_20b: the Mixture-of-Experts pretraining benchmark ------------------------------------------------------
# mlcommons/training `small_llm_moe_pretraining/primus/conf/gpt_oss_20B-pretrain.yaml` (its overrides of Primus'
# gpt_oss_20B model yaml) and `config_*_1x8x1.sh`, under `closed_gpt_oss_20b.yaml` and `rcps_gpt_oss_20b.json`;
# docs/benchmarks/gpt_oss_20b.md gives each value's source.
GPT_OSS_MAX_STEPS = 1_200_000  # train_iters; closed_gpt_oss_20b.yaml: max_steps == 1200000
GPT_OSS_END_LR = 4e-5  # min_lr (PRIMUS_MIN_LR), the same at every RCP batch (the RCP logs' opt_end_learning_rate)
# rcps_gpt_oss_20b.json: global batch -> (peak LR, warmup samples).
GPT_OSS_RCP_BATCHES: dict[int, tuple[float, int]] = {
    16: (4e-4, 2_048),
    32: (8e-4, 4_096),
    64: (1e-3, 12_288),
}

GPT_OSS_20B = DecoderConfig(
    vocab_size=128_256, seq_len=8192, n_layer=24, n_head=64, n_kv_head=8, d_model=2880, ffn_hidden=2880,
    kv_channels=64, qk_norm=True, norm_eps=1e-6, rope_theta=150_000.0, rope_scaling=None, init_std=0.008, sliding_window=128,
    full_attention_every=2, moe=MoeConfig(experts=32, top_k=4, hidden=2880))

GPT_OSS_PRESETS = {
    # MLPerf closed: gpt-oss 20B from scratch on the llama31_8b C4 files to validation log perplexity 3.34, at global
    # batch 64 (Cisco's v6.0 submission on 16 x 8 H100s), the RCP table's row: peak LR 1e-3, 12,288 warmup samples.
    "full": PretrainConfig(
        model=GPT_OSS_20B, global_batch=64, base_lr=GPT_OSS_RCP_BATCHES[64][0],
        warmup_samples=GPT_OSS_RCP_BATCHES[64][1], end_lr_ratio=GPT_OSS_END_LR / GPT_OSS_RCP_BATCHES[64][0],
        end_lr=GPT_OSS_END_LR, max_steps=GPT_OSS_MAX_STEPS, eval_interval=EVAL_INTERVAL_SAMPLES,
        eval_sequences=EVAL_SEQUENCES, target=3.34, adam_eps=1e-5, activation_checkpointing=True, eval_batch=1,
        framework="megatron", eod_mask_loss=True),
    # A 2-layer gpt-oss (8 experts, top 2, a 32-key sliding window in the first layer and full attention in the
    # second, QK norm, RoPE unscaled, the EOD loss mask) on the llama31_8b tiny preset's generated text, whose
    # documents end in token 0, from scratch to a log perplexity its text allows. Sequences of 8,192 tokens, as the
    # rules fix them for the open division too (open_gpt_oss_20b.yaml), two a step.
    "tiny": PretrainConfig(
        model=DecoderConfig(vocab_size=128, seq_len=8192, n_layer=2, n_head=4, n_kv_head=2, d_model=64, ffn_hidden=64,
                            kv_channels=16, qk_norm=True, rope_theta=150_000.0, rope_scaling=None, init_std=0.02,
                            sliding_window=32, full_attention_every=2, moe=MoeConfig(experts=8, top_k=2, hidden=64)),
        global_batch=2, base_lr=3e-3, warmup_samples=4, end_lr_ratio=0.1, max_steps=2_000, eval_interval=16,
        eval_sequences=4, target=0.9, eval_batch=1, loader_workers=0, step_limit=200, framework="megatron",
        eod_mask_loss=True, eod_token=0),
}


# --- deepseekv3_671b: the round's scale benchmark ------------------------------------------------------------------
# mlcommons/training `llm_moe_pretraining/nemo/` (Megatron-Bridge's DeepSeekV3ModelProvider) under
# `closed_deepseekv3_671b.yaml` and `rcps_deepseekv3_671b.json`; docs/benchmarks/deepseekv3_671b.md gives each
# value's source.
DEEPSEEK_V3_671B = DecoderConfig(
    vocab_size=129_280, seq_len=4096, n_layer=61, n_head=128, n_kv_head=128, d_model=7168, ffn_hidden=18_432,
    norm_eps=1e-6, rope_theta=10_000.0, rope_scaling=YarnScaling(factor=40.0, original_context=4096),
    init_std=0.006, dense_layers=3,
    mla=MlaConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    moe=MoeConfig(experts=256, top_k=8, hidden=2048, score="sigmoid", groups=8, top_groups=4, routed_scale=2.5,
                  shared_experts=1, bias_update_rate=1e-3, aux_loss_coeff=1e-2),
    mtp_layers=1, mtp_loss_scale=0.1)  # Megatron-Bridge's deepseek_v3.py; the reference never overrides them

# A 2-layer DeepSeek-V3 for CPU: MLA (a query bottleneck too), YaRN, one dense layer then one of 8 experts (top 2 of
# 2 groups, a shared expert, the expert bias update and the sequence aux loss), and the one MTP depth (an MoE block).
DEEPSEEK_TINY = DecoderConfig(
    vocab_size=128, seq_len=256, n_layer=2, n_head=4, n_kv_head=4, d_model=64, ffn_hidden=128, norm_eps=1e-6,
    rope_theta=10_000.0, rope_scaling=YarnScaling(factor=4.0, original_context=64), init_std=0.02, dense_layers=1,
    mla=MlaConfig(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    moe=MoeConfig(experts=8, top_k=2, hidden=32, score="sigmoid", groups=2, top_groups=1, routed_scale=2.5,
                  shared_experts=1, bias_update_rate=1e-3, aux_loss_coeff=1e-2),
    mtp_layers=1, mtp_loss_scale=0.1)


# The closed rules' learning rate (closed_deepseekv3_671b.yaml: opt_base_learning_rate == 2.4e-05 x (GBS / 16384)
# ** 0.5 within 1e-9; the reference README: "rounded to the 9th decimal place", as its configs' MAX_LR are), its
# smallest batch (global_batch_size >= 15360), the warmup and schedule length (warmup == 4, decay == 12000 - warmup).
DEEPSEEK_LR_AT_16384 = 2.4e-5
DEEPSEEK_MIN_BATCH = 15_360
DEEPSEEK_WARMUP_STEPS = 4
DEEPSEEK_MAX_STEPS = 12_000  # the RCP runs' MAX_STEPS, which Megatron's lr_decay_iters defaults to
DEEPSEEK_END_LR = 1e-8  # config_GB300_*.sh: MIN_LR=1e-8 (the RCP logs' opt_end_learning_rate)
# rcps_deepseekv3_671b.json: the batches the RCPs were measured at, each at the rule's LR and 4 warmup steps.
DEEPSEEK_RCP_BATCHES: dict[int, tuple[float, int]] = {
    batch: (round(DEEPSEEK_LR_AT_16384 * math.sqrt(batch / 16_384), 9), DEEPSEEK_WARMUP_STEPS * batch)
    for batch in (15_360, 16_384, 18_432)}


def deepseek_first_eval(global_batch: int) -> int:
    """The step of the first evaluation: floor(42 + 24,576 / GBS) (closed_deepseekv3_671b.yaml's FIRST_CHECK in
    6.1.0; the reference's START_EVAL_AT_ITER, config_GB300_*.sh), then one after every step."""
    return math.floor(42 + 24_576 / global_batch)


DEEPSEEK_PRESETS = {
    # MLPerf closed: DeepSeek-V3 671B from MLCommons' checkpoint (--init-checkpoint, converted from Hugging Face's
    # by workloads.decoder.convert) on the llama31_8b C4 files to validation log perplexity 3.6, at global batch
    # 16,384 (the RCP row at the rule's LR 2.4e-5). AdamW eps 1e-8 (the reference's adam_eps), no EOD mask
    # (eod_mask_loss=False), eval of 1,024 sequences in one batch (EVAL_BATCH_SIZE=1024) after every step.
    "full": PretrainConfig(
        model=DEEPSEEK_V3_671B, global_batch=16_384, base_lr=DEEPSEEK_RCP_BATCHES[16_384][0],
        warmup_samples=DEEPSEEK_RCP_BATCHES[16_384][1], end_lr_ratio=DEEPSEEK_END_LR / DEEPSEEK_LR_AT_16384,
        end_lr=DEEPSEEK_END_LR, max_steps=DEEPSEEK_MAX_STEPS, eval_interval=16_384, eval_sequences=EVAL_SEQUENCES,
        # eval_batch: sequences a data rank scores at once, at least the stages, so that they overlap (one micro batch
        # a sequence) rather than run one after another.
        target=3.6, adam_eps=1e-8, activation_checkpointing=True, eval_batch=16, framework="megatron",
        first_eval=deepseek_first_eval(16_384), decay_iters=DEEPSEEK_MAX_STEPS, validation_batch=EVAL_SEQUENCES,
        # On H100s (docs/benchmarks/deepseekv3_671b.md, "Layouts on H100"): 16 stages, the experts split over a node
        # (the all-to-all on NVLink), FSDP over 4 nodes of a stage; the reference's PP 4 x EP 64 fits a GB300 rack.
        pipeline_parallel=16, expert_parallel=8, shard_nodes=4),
    # The 2-layer DeepSeek (config.DEEPSEEK_TINY) in 2 pipeline stages, from a checkpoint the preset writes in
    # Hugging Face's DeepSeek-V3 layout and converts every run, on the llama31_8b tiny preset's generated text, to a
    # log perplexity its text allows; evaluations every 8 steps after the first 40 (the full preset's rule, one
    # eval after every step from step 43, costs a CPU more than its training).
    "tiny": PretrainConfig(
        model=DEEPSEEK_TINY, global_batch=8, base_lr=3e-3, warmup_samples=32, end_lr_ratio=0.1, max_steps=2_000,
        eval_interval=64, eval_sequences=32, target=0.9, adam_eps=1e-8, eval_batch=4, loader_workers=0,
        step_limit=400, framework="megatron", first_eval=40, decay_iters=2_000, micro_batch=2, pipeline_parallel=2),
}


# The pretraining benchmarks' presets and RCP tables (preset_config).
PRETRAINING = {"llama31_8b": (PRESETS, RCP_BATCHES), "gpt_oss_20b": (GPT_OSS_PRESETS, GPT_OSS_RCP_BATCHES),
               "deepseekv3_671b": (DEEPSEEK_PRESETS, DEEPSEEK_RCP_BATCHES)}


def preset_config(preset: str, global_batch: int | None = None, force: bool = False,
                  learning_rate: float | None = None, warmup_samples: int | None = None,
                  benchmark: str = "llama31_8b") -> PretrainConfig:
    """A pretraining benchmark's preset (llama31_8b's, or gpt_oss_20b's) at `global_batch` (default: its own), its
    peak LR and warmup from rcp_hyperparameters over the benchmark's RCP table for the full preset (a row's,
    interpolated between two rows, or given), given or the preset's for the tiny one."""
    presets, table = PRETRAINING[benchmark]
    cfg = presets[preset]
    batch = global_batch or cfg.global_batch
    if benchmark == "deepseekv3_671b" and preset == "full":
        chosen = deepseek_hyperparameters(batch, learning_rate, warmup_samples, force)
        return replace(cfg, global_batch=batch, base_lr=chosen.base_lr, warmup_samples=chosen.warmup_samples,
                       first_eval=deepseek_first_eval(batch), eval_interval=batch, hyperparameters=chosen)
    choose = rcp_hyperparameters if preset == "full" else open_hyperparameters
    extra = {"table": table, "force": force} if preset == "full" else {}
    chosen = choose(benchmark, global_batch=batch, preset=(cfg.base_lr, cfg.warmup_samples),
                    learning_rate=learning_rate, warmup_samples=warmup_samples, **extra)
    if cfg.end_lr is not None and chosen.base_lr < cfg.end_lr:
        raise ValueError(f"{benchmark}'s peak learning rate {chosen.base_lr:g} is below the schedule's floor "
                         f"{cfg.end_lr:g} (min_lr): the cosine would raise it; give --learning-rate of at least "
                         f"{cfg.end_lr:g}")
    return replace(cfg, global_batch=batch, base_lr=chosen.base_lr, warmup_samples=chosen.warmup_samples,
                   hyperparameters=chosen)


def deepseek_hyperparameters(global_batch: int, learning_rate: float | None = None,
                             warmup_samples: int | None = None, force: bool = False) -> BatchHyperparameters:
    """deepseekv3_671b's closed rules fix the LR for every batch (2.4e-5 x sqrt(GBS / 16,384)) and the warmup (4
    steps), and forbid a batch under 15,360 (closed_deepseekv3_671b.yaml): another LR, another warmup or a smaller
    batch is refused. A batch between the RCP rows is accepted (the RCP checker interpolates); above the largest
    it has no RCP, so --force-batch is needed."""
    if global_batch < DEEPSEEK_MIN_BATCH:
        raise ValueError(f"deepseekv3_671b's closed rules need a global batch of at least {DEEPSEEK_MIN_BATCH:,} "
                         f"(closed_deepseekv3_671b.yaml), got {global_batch:,}; choose an RCP row "
                         f"({', '.join(f'{b:,}' for b in DEEPSEEK_RCP_BATCHES)}) or a batch between two")
    rule = round(DEEPSEEK_LR_AT_16384 * math.sqrt(global_batch / 16_384), 9)
    if learning_rate is not None and abs(learning_rate - rule) >= 1e-9:
        raise ValueError(f"deepseekv3_671b's closed rules fix the peak LR at 2.4e-5 x sqrt(GBS / 16384) = {rule:g} "
                         f"for global batch {global_batch:,}, got --learning-rate {learning_rate:g}; leave it out")
    if warmup_samples is not None:
        raise ValueError("deepseekv3_671b's closed rules fix the warmup at 4 steps: leave --warmup-samples out")
    batches = tuple(DEEPSEEK_RCP_BATCHES)
    if global_batch > batches[-1] and not force:
        raise ValueError(f"deepseekv3_671b has no reference convergence point (RCP) above global batch "
                         f"{batches[-1]:,} (rows {', '.join(f'{b:,}' for b in batches)}): the RCP checker asks for a "
                         "new RCP; choose a batch from 15,360 to 18,432 (or add --force-batch)")
    below = [b for b in batches if b <= global_batch]
    above = [b for b in batches if b >= global_batch]
    rows = (global_batch,) if global_batch in batches else (below[-1], above[0]) if below and above else ()
    return BatchHyperparameters(benchmark="deepseekv3_671b", global_batch=global_batch, base_lr=rule,
                                warmup_samples=DEEPSEEK_WARMUP_STEPS * global_batch, rows=rows, lr_from="rule",
                                warmup_from="rule", table=batches)


# --- llama2_70b_lora: LoRA fine-tuning of Llama 2 70B on SCROLLS GovReport -----------------------------------

LORA_MAX_STEPS = 1024  # run_llama_70B_scrolls_r16.sh: --max_steps 1024 (every RCP row's max_steps too)
LORA_EVAL_INTERVAL = 384  # sequences: the reference's --eval_steps 48 at its batch of 8 (8 GPUs x 1 sequence)
LORA_EVAL_SEQUENCES = 173  # the GovReport validation set, whole (NVIDIA's v5.1 logs: eval_samples 173)
# rcps_llama2_70b_lora.json: global batch -> peak LR; every row: no warmup, clipping 0.3, rank 16, alpha 32.
LORA_RCP_BATCHES: dict[int, float] = {8: 4e-4, 16: 4e-4, 32: 4e-4, 128: 1e-3}


@dataclass(frozen=True)
class LoraConfig:
    """The adapters: rank, alpha (the update is scaled by alpha / rank) and dropout on their input, as peft's
    LoraConfig takes them (mlcommons/training `llama2_70b_lora/scripts/utils.py`)."""

    rank: int = 16
    alpha: int = 32
    dropout: float = 0.1

    def params(self, m: DecoderConfig) -> int:
        """Per block: qkv's adapter (one A of d x r, B rows for q, k and v) and o's (A of d x r, B of r x d)."""
        q_dim = m.n_head * m.head_dim
        return m.n_layer * self.rank * (m.d_model + q_dim + 2 * m.kv_dim + q_dim + m.d_model)


@dataclass(frozen=True)
class LoraFinetuneConfig:
    """A frozen pretrained Llama with trained adapters. The closed values are the reference's
    (`run_llama_70B_scrolls_r16.sh`): AdamW (torch's, HF's default betas and eps), weight decay 1e-4, clipping
    0.3, cosine decay to 0 over max_steps 1,024 without warmup (`--warmup_ratio 0`), LoRA on qkv_proj and
    o_proj; the target eval loss 0.925 is the rules' (`closed_llama2_70b_lora.yaml`)."""

    model: DecoderConfig
    lora: LoraConfig
    global_batch: int  # sequences per optimizer step
    base_lr: float
    max_steps: int  # the cosine's length
    eval_interval: int  # sequences between evaluations
    eval_sequences: int
    target: float  # eval loss that ends the run
    weight_decay: float = 1e-4
    adam_betas: tuple[float, float] = (0.9, 0.999)  # HF TrainingArguments' defaults (optim adamw_torch)
    adam_eps: float = 1e-8
    clip_norm: float = 0.3
    micro_batch: int = 1  # sequences per data rank per forward pass (--per_device_train_batch_size 1)
    eval_batch: int = 1
    tensor_parallel: int = 1
    shard_nodes: int = 1  # HSDP: FSDP within groups of this many nodes
    activation_checkpointing: bool = False
    loader_workers: int = 2
    step_limit: int | None = None  # stop after this many steps whatever the schedule
    hyperparameters: "BatchHyperparameters | None" = None  # how lora_preset_config chose base_lr

    @property
    def eval_every(self) -> int:
        """Steps between evaluations: ceil(384 / global batch), the reference's eval_steps at any batch."""
        return math.ceil(self.eval_interval / self.global_batch)

    @property
    def skipped_evals(self) -> int:
        """The evaluations not run at the start: the reference's eval_delay of int(0.125 x GBS + 2) x eval_steps
        (`scripts/train.py`), which NVIDIA's v5.1 logs follow too (GBS 64: the first eval after 66 steps)."""
        return int(0.125 * self.global_batch + 2)


LORA_PRESETS = {
    # MLPerf closed: Decoder 2 70B from MLCommons' checkpoint (--init-checkpoint), batch 8 on 8 x 8 GPUs: FSDP over
    # context 8 inside each node (the only split of batch 8 over 64 GPUs), as NVIDIA runs context 8 at 72 GPUs up.
    "full": LoraFinetuneConfig(
        model=LLAMA2_70B, lora=LoraConfig(rank=16, alpha=32, dropout=0.1), global_batch=8,
        base_lr=LORA_RCP_BATCHES[8], max_steps=LORA_MAX_STEPS, eval_interval=LORA_EVAL_INTERVAL,
        eval_sequences=LORA_EVAL_SEQUENCES, target=0.925, activation_checkpointing=True),
    # A 2-layer Llama 2 (RoPE theta 10,000 unscaled) warm-started from a checkpoint the harness pretrains once
    # (workloads/decoder/warm_start.py), then LoRA-tuned on generated prompt + summary sequences to an eval loss
    # on the summaries under the open rules' 1.0 (open_llama2_70b_lora.yaml).
    "tiny": LoraFinetuneConfig(
        model=DecoderConfig(vocab_size=128, seq_len=128, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                          ffn_hidden=192, rope_theta=10_000.0, rope_scaling=None),
        lora=LoraConfig(rank=16, alpha=32, dropout=0.1), global_batch=8, base_lr=2e-2, max_steps=200,
        eval_interval=32, eval_sequences=16, target=0.95, micro_batch=4, eval_batch=4, loader_workers=0),
}


def lora_preset_config(preset: str, global_batch: int | None = None, force: bool = False,
                       learning_rate: float | None = None, warmup_samples: int | None = None) -> LoraFinetuneConfig:
    """As preset_config, for llama2_70b_lora: the full preset's peak LR from rcp_hyperparameters over the
    llama2_70b_lora RCP table (rows carry no warmup: the reference runs none, so `warmup_samples` is refused)."""
    cfg = LORA_PRESETS[preset]
    batch = global_batch or cfg.global_batch
    choose = rcp_hyperparameters if preset == "full" else open_hyperparameters
    extra = {"table": LORA_RCP_BATCHES, "force": force} if preset == "full" else {}
    chosen = choose("llama2_70b_lora", global_batch=batch, preset=(cfg.base_lr, None), learning_rate=learning_rate,
                    warmup_samples=warmup_samples, **extra)
    return replace(cfg, global_batch=batch, base_lr=chosen.base_lr, hyperparameters=chosen)


# The batches each benchmark's RCPs were measured at, for those whose batch chooses its LR between RCP rows (the
# decoders', flux1's): --global-batch may be one of them or any batch between the smallest and the largest
# (rcp_hyperparameters) without --force-batch.
RCP_GLOBAL_BATCHES: dict[str, tuple[int, ...]] = {"llama31_8b": tuple(RCP_BATCHES),
                                                  "gpt_oss_20b": tuple(GPT_OSS_RCP_BATCHES),
                                                  "llama2_70b_lora": tuple(LORA_RCP_BATCHES),
                                                  "deepseekv3_671b": tuple(DEEPSEEK_RCP_BATCHES),
                                                  "flux1": tuple(flux.RCP_BATCHES)}
# The benchmarks whose RCP rows carry a warmup (--warmup-samples applies to them only), and why it does not apply to
# the others.
RCP_WARMUP_BENCHMARKS: tuple[str, ...] = ("llama31_8b", "gpt_oss_20b", "flux1")
FIXED_WARMUP = {"llama2_70b_lora": "runs none (its RCP rows carry a peak LR only): give --learning-rate alone",
                "deepseekv3_671b": "warms up 4 steps, which its closed rules fix"}


def rcp_batches_in_words(benchmark: str) -> str:
    """The batches --global-batch takes without --force-batch, e.g. "8 to 128 (rows 8, 16, 32, 128)"."""
    batches = RCP_GLOBAL_BATCHES[benchmark]
    return f"{batches[0]} to {batches[-1]} (rows {', '.join(map(str, batches))})"


# Where each benchmark's presets live: the config_filename the 6.1 rules ask each run to log.
PRESET_TABLES = {"llama31_8b": "PRESETS", "gpt_oss_20b": "GPT_OSS_PRESETS", "llama2_70b_lora": "LORA_PRESETS",
                 "deepseekv3_671b": "DEEPSEEK_PRESETS"}


def run_config(benchmark: str, preset: str, global_batch: int | None = None, force: bool = False,
               learning_rate: float | None = None, warmup_samples: int | None = None
               ) -> PretrainConfig | LoraFinetuneConfig:
    """A decoder benchmark's preset, by name."""
    if benchmark == "llama2_70b_lora":
        return lora_preset_config(preset, global_batch, force, learning_rate=learning_rate,
                                  warmup_samples=warmup_samples)
    return preset_config(preset, global_batch, force, learning_rate=learning_rate, warmup_samples=warmup_samples,
                         benchmark=benchmark)


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
    grad_accum: int  # micro batches per data rank per step (with a pipeline: the schedule's micro batches)
    expert: int = 1  # the ranks an MoE layer's experts are split over, inside an FSDP group
    pipeline: int = 1  # stages, the outermost dimension: world = pipeline x replicate x shard x context x tensor
    virtual: int = 1  # model chunks per pipeline rank (interleaved schedule when above 1)

    @property
    def expert_shard(self) -> int:
        """The ranks of an FSDP group that hold the same experts: FSDP shards those over them."""
        return self.fsdp // self.expert

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


def plan_layout(cfg: PretrainConfig | LoraFinetuneConfig, world: int, procs_per_node: int) -> Layout:
    """Pipeline stages first, on consecutive blocks of world / pipeline ranks (a node or group of nodes each);
    inside a stage: tensor parallel inside a node; context parallel when the batch leaves a data rank less than one
    sequence; FSDP within groups of `shard_nodes` nodes, replicated across groups (HSDP). With a pipeline,
    grad_accum is the schedule's micro batches per data rank."""
    m = cfg.model
    pipeline, virtual = _pipeline_stages(cfg, world)
    world //= pipeline  # one stage's ranks: everything below splits them
    tensor = min(cfg.tensor_parallel, procs_per_node, world)
    if m.moe and tensor > 1:
        raise ValueError("a model with experts runs at tensor parallel 1 (context parallel splits its sequences)")
    if world % tensor or m.n_kv_head % tensor or m.n_head % tensor:
        raise ValueError(f"tensor parallel {tensor} must divide the world size {world}"
                         + (f" (of a pipeline stage, {pipeline} stages)" if pipeline > 1 else "")
                         + f", the {m.n_head} attention heads and the {m.n_kv_head} key/value heads")
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
            stage = f" (a pipeline stage's, of {pipeline})" if pipeline > 1 else ""
            raise ValueError(f"global batch {cfg.global_batch} does not split evenly over {world} processes{stage} "
                             f"with tensor parallel {tensor} and micro batch {cfg.micro_batch} at any context parallel "
                             f"(a power of two up to {world // tensor}): the data ranks, {world} / (tensor x "
                             "context), must divide the global batch; use a process count of a power of two times "
                             "the tensor parallel, or another batch")
    if m.mtp_layers and (context > 1 or tensor > 1):  # parallelize.py does not split MTP's roll or its blocks
        raise ValueError(f"multi-token prediction runs at tensor and context parallel 1, as the reference does; this "
                         f"layout needs tensor {tensor} x context {context} (a data rank holds less than a sequence): "
                         "use fewer processes a pipeline stage, or a larger global batch")
    per_group = max(1, procs_per_node // (tensor * context)) * cfg.shard_nodes  # data ranks in one FSDP group
    shard = math.gcd(data, per_group)
    # Experts split over the most ranks of an FSDP group that divide their count, up to the preset's cap (a node).
    expert = math.gcd(shard * context, m.moe.experts, cfg.expert_parallel, procs_per_node) if m.moe else 1
    grad_accum = cfg.global_batch // (data * cfg.micro_batch)
    if grad_accum < pipeline:
        raise ValueError(f"pipeline parallel {pipeline} needs at least {pipeline} micro batches per data rank "
                         f"per step (1F1B keeps every stage busy only then), but global batch {cfg.global_batch} "
                         f"over {data} data ranks x micro batch {cfg.micro_batch} gives {grad_accum}: use a larger "
                         "global batch or fewer pipeline stages")
    rounds = max(1, grad_accum // pipeline)  # torch's ScheduleInterleaved1F1B runs its micro batches in rounds
    if virtual > 1 and grad_accum % rounds:
        raise ValueError(f"the interleaved 1F1B schedule runs the micro batches in {rounds} rounds (one micro "
                         f"batch per pipeline rank in each), and the {grad_accum} per data rank are not a multiple of "
                         f"{rounds}: use a global batch giving a multiple of {pipeline} micro batches per data rank")
    return Layout(world=world * pipeline, procs_per_node=procs_per_node, replicate=data // shard, shard=shard,
                  context=context, tensor=tensor, micro_batch=cfg.micro_batch, grad_accum=grad_accum, expert=expert,
                  pipeline=pipeline, virtual=virtual)


def _pipeline_stages(cfg: PretrainConfig | LoraFinetuneConfig, world: int) -> tuple[int, int]:
    """The pipeline's ranks and model chunks per rank, refused where they cannot split the world or the layers.
    LoRA fine-tuning has no pipeline: its adapters draw after every base weight, which a stage cannot replay."""
    pipeline, virtual = getattr(cfg, "pipeline_parallel", 1), getattr(cfg, "virtual_stages", 1)
    if pipeline < 1 or world % pipeline:
        raise ValueError(f"pipeline parallel {pipeline} must divide the world size {world} (each stage takes "
                         f"world / pipeline consecutive ranks): choose one of "
                         f"{', '.join(str(n) for n in range(1, world + 1) if world % n == 0)}")
    if virtual < 1 or virtual > 1 and pipeline == 1:
        raise ValueError(f"virtual stages {virtual}: 1, or with a pipeline (pipeline parallel above 1) more model "
                         "chunks per pipeline rank (the interleaved 1F1B schedule)")
    layer_chunks(cfg.model.n_layer, pipeline * virtual)  # refuses a split that leaves a stage no layer
    return pipeline, virtual


def layer_chunks(n_layer: int, chunks: int) -> list[range]:
    """The decoder layers of each of the pipeline's `chunks` model chunks (stages x virtual stages), as
    Megatron-Bridge splits DeepSeek-V3 (set_deepseek_v3_pipeline_model_parallel_layout): ceil(layers / chunks) each,
    the last chunk the rest (PP4: 16/16/16/13). One rule for what runs (workloads.decoder.pipeline) and what the
    memory arithmetic counts (pipeline_stages)."""
    if chunks == 1:  # no pipeline: the whole model (a proxy's may have no layer)
        return [range(n_layer)]
    size = -(-n_layer // chunks)
    if n_layer < chunks or size * (chunks - 1) >= n_layer:
        fits = [n for n in range(1, n_layer + 1) if -(-n_layer // n) * (n - 1) < n_layer]
        raise ValueError(f"{n_layer} layers do not fill {chunks} pipeline stages (x virtual stages): ceil({n_layer} / "
                         f"{chunks}) = {size} a stage leaves the last one empty; choose stages x virtual stages among "
                         f"{', '.join(map(str, fits))}")
    return [range(chunk * size, min((chunk + 1) * size, n_layer)) for chunk in range(chunks)]


@dataclass(frozen=True)
class Stage:
    """What one pipeline rank holds: its decoder layers (over its virtual chunks), and whether it has the input
    embedding (the first) or the output layer, final norm, MTP and the loss (the last)."""

    index: int
    layers: tuple[int, ...]
    embedding: bool
    output: bool


def pipeline_stages(m: DecoderConfig, pipeline: int, virtual: int = 1) -> list[Stage]:
    """Megatron-Bridge's DeepSeek-V3 split (set_deepseek_v3_pipeline_model_parallel_layout): the layers in
    pipeline x virtual chunks of ceil(layers / chunks) each, the last chunk the rest (PP4: 16/16/16/13), chunk c on
    rank c mod pipeline; the embedding on the first rank, the output layer, MTP and the loss on the last."""
    owned = [[] for _ in range(pipeline)]
    for chunk, layers in enumerate(layer_chunks(m.n_layer, pipeline * virtual)):
        owned[chunk % pipeline] += layers
    return [Stage(index=i, layers=tuple(layers), embedding=i == 0, output=i == pipeline - 1)
            for i, layers in enumerate(owned)]


@dataclass(frozen=True)
class StageParams:
    """One stage's parameters: `dense` (everything but the routed experts; `norms` of them, whole on every tensor
    rank), `experts` (the routed experts, which expert parallelism splits), `root` (embedding, output layer, MTP's
    projection: gathered once for the whole forward and backward) and its largest block's."""

    dense: float
    norms: float
    experts: float
    root: float
    block_dense: float
    block_experts: float


def stage_params(m: DecoderConfig, stage: Stage) -> StageParams:
    """The stage's layers, plus the embedding on the first; on the last the output layer, the final norm and each
    MTP module (Megatron-Core's multi_token_prediction: an MoE block, eh_proj of 2d x d, enorm, hnorm and its final
    norm; the embedding stays on the first stage, which embeds the tokens MTP reads: workloads.decoder.mtp)."""
    h, v = m.d_model, m.vocab_size
    layers = list(stage.layers) + (m.mtp_blocks() if stage.output else [])
    experts = sum(m.expert_params() for layer in layers if m.is_moe(layer))
    blocks = sum(m.block_params(layer) for layer in layers)
    root = (v * h if stage.embedding else 0) + (v * h + h if stage.output else 0)
    if stage.output and m.mtp_layers:
        root += m.mtp_layers * (2 * h * h + 3 * h)
    largest = max(layers, key=m.block_params) if layers else None
    block_experts = m.expert_params() if largest is not None and m.is_moe(largest) else 0
    return StageParams(dense=blocks - experts + root, norms=2 * h * len(layers) + (h if stage.output else 0),
                       experts=experts, root=root,
                       block_dense=(m.block_params(largest) if largest is not None else 0) - block_experts,
                       block_experts=block_experts)


def block_activation_bytes(m: DecoderConfig, layer: int, compute: int, tensor: int) -> float:
    """What autograd keeps for one block's backward, per position, in bytes (eager, bf16 compute; sequence
    parallel splits the norms' positions and tensor parallel the heads and the feed-forward, so all of it over
    `tensor`):
    - the two RMSNorms: each its input and its output (the next linear's input);
    - attention through scaled_dot_product_attention's flash kernel: its q, k and v after RoPE, its output (which
      the output projection keeps too: the same tensor), and the fp32 logsumexp per head; no seq^2 term. RoPE
      multiplies by constant tables, so it keeps nothing of its own. MLA (attention_activation_elements) also keeps
      its low-rank latents and the up-projected keys and values;
    - SwiGLU: w1's and w3's outputs, SiLU's output and their product (w2's input): four of ffn_hidden;
    - MoE: the router's fp32 input and fp32 scores for every expert; per top_k copy the expert's input (the copy,
      and its sorted copy after the all-to-all), its four SwiGLU intermediates, its output and that output in fp32
      (weighted by the fp32 router weights); the shared experts' four intermediates."""
    h = m.d_model
    norms = 4 * h * compute
    attention = attention_activation_elements(m) * compute + 4 * m.n_head
    if m.is_moe(layer):
        moe = m.moe
        ffn = 4 * h + 4 * moe.experts + moe.top_k * ((3 * h + 4 * moe.hidden) * compute + 4 * h) \
            + 4 * moe.hidden * moe.shared_experts * compute
    else:
        ffn = 4 * m.ffn_hidden * compute
    return (norms + attention + ffn) / tensor


def attention_activation_elements(m: DecoderConfig) -> float:
    """Attention's kept tensors per position, in elements: q and k after RoPE, v, the output. MLA: the query's
    down-projection and its norm's output (q_lora_rank each), q, the kv latent with the shared RoPE key and the
    latent's norm output, the kv up-projection's output (each head's nope key and value: v is a view of it), k
    assembled per head, the output."""
    if not m.mla:
        return 2 * m.q_dim + 2 * m.kv_dim
    a = m.mla
    q_low = 2 * a.q_lora_rank if a.q_lora_rank else 0
    latent = 2 * a.kv_lora_rank + a.qk_rope_head_dim
    return q_low + m.q_dim + latent + m.n_head * (a.qk_nope_head_dim + a.v_head_dim) + m.q_dim \
        + m.n_head * a.v_head_dim


def micro_batches_in_flight(layout: Layout, stage: int) -> float:
    """Micro batches whose activations a stage holds at once. One without a pipeline; under 1F1B stage i warms up
    with p - i forwards before its first backward, so min(p - i, m) (stage 0 holds the most); interleaved over v
    chunks, Korthikanti et al. (2022, "Reducing Activation Recomputation", section 4.2.3) give the first stage
    (1 + (p - 1) / (p v)) times that, in units of the stage's layers."""
    p, v, m = layout.pipeline, layout.virtual, layout.grad_accum
    held = min(p - stage, m)
    return min(m, held * (1 + (p - 1) / (p * v))) if v > 1 else held


def bubble_fraction(layout: Layout) -> float:
    """The pipeline's idle share of a step: (p - 1) / (v m + p - 1) for 1F1B (v = 1) and interleaved 1F1B
    (Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", section 2.2)."""
    p, v, m = layout.pipeline, layout.virtual, layout.grad_accum
    return (p - 1) / (v * m + p - 1)


def estimate_memory(cfg: PretrainConfig | LoraFinetuneConfig, layout: Layout, on_gpu: bool = True
                    ) -> MemoryEstimate:
    """Per-rank bytes at the step's peak, term by term, for the pipeline stage whose total is largest; bf16 compute
    on GPUs (2 bytes), fp32 on CPU (4). estimate_stage gives each term's reason."""
    stages = pipeline_stages(cfg.model, layout.pipeline, layout.virtual)
    return max((estimate_stage(cfg, layout, stage, on_gpu) for stage in stages), key=lambda e: e.total)


def estimate_stage(cfg: PretrainConfig | LoraFinetuneConfig, layout: Layout, stage: Stage, on_gpu: bool = True
                   ) -> MemoryEstimate:
    """One stage's peak, each term at the peak's moment (the loss's backward on the last stage, when every saved
    activation, the loss's tensors and the root's gathered weights coexist, before any block's gradient is made):

    - weights, optimizer: pretraining keeps fp32 master weights and two fp32 AdamW moments (the harness's AdamW;
      the reference's precision-aware optimizer keeps the moments in bf16, 4 bytes a parameter less) of the
      stage's FSDP shard; LoRA the frozen base in the compute dtype and 16 bytes per adapter parameter.
    - gradients: optimizer.zero_grad(set_to_none=True) frees them every step, and FSDP2 makes a block's sharded
      gradient only when its backward ends, after the peak: so none with one micro batch, the whole shard when
      micro batches accumulate (the earlier ones' sum is held).
    - gathered: without a pipeline FSDP2 keeps the root's (embedding, output) bf16 weights from forward to backward
      (the root is not resharded after forward), and during a block's backward that block's and the prefetched
      next one's, plus the block's unsharded gradient (bf16, then fp32 for the reduce-scatter). With a pipeline,
      torch.distributed.pipelining's stage (backward_maybe_with_nosync) turns off FSDP's resharding and gradient
      sync until the last micro batch, as torchtitan runs it: the stage's whole local share stays unsharded in
      bf16, its gradients accumulate unsharded in fp32 (FSDP2 accumulates in the reduce dtype).
    - activations: block_activation_bytes per position, for every block; with activation checkpointing each
      block's input in the compute dtype plus one block's full set, recomputed during its backward; times the
      micro batches in flight (micro_batches_in_flight); the last stage adds the final norm's input and output.
    - pipeline buffers: a received activation and a received gradient (s x b x d each, and the MTP depths' embedded
      tokens beside them) per virtual chunk.
    - logits: bf16 logits (the loop holds them), fp32 log-probabilities (log_softmax keeps its output), the nll
      loss's fp32 gradient and log_softmax's fp32 gradient, all alive during log_softmax's backward: compute +
      12 bytes per logit, for the loss and each MTP module's."""
    m, tp, cp = cfg.model, layout.tensor, layout.context
    s, b, h = m.seq_len // cp, layout.micro_batch, m.d_model
    compute = 2 if on_gpu else 4
    params = stage_params(m, stage)
    shard = (params.dense - params.norms) / (tp * layout.fsdp) + params.norms / layout.fsdp \
        + params.experts / layout.fsdp
    local = (params.dense - params.norms) / tp + params.norms + params.experts / layout.expert
    block = (params.block_dense - 2 * h) / tp + 2 * h + params.block_experts / layout.expert
    root = params.root / tp
    accumulating = layout.grad_accum > 1
    if isinstance(cfg, LoraFinetuneConfig):
        adapters = cfg.lora.params(m) / (tp * layout.fsdp)
        weights, trained = compute * shard + 4 * adapters, adapters
        gathered = compute * (2 * block + root)  # no gradient of a frozen block is ever whole
    else:
        weights, trained = 4 * shard, shard
        if layout.pipeline > 1:
            gathered = (compute + 4) * local
        else:
            gathered = fsdp_gathered(compute, block, root)
    blocks = list(stage.layers) + (m.mtp_blocks() if stage.output else [])  # MTP's block runs on the last stage
    per_block = [block_activation_bytes(m, layer, compute, tp) for layer in blocks]
    if cfg.activation_checkpointing:
        per_micro_batch = s * b * (len(per_block) * compute * h / tp)
        recomputed = s * b * max(per_block, default=0)
    else:
        per_micro_batch, recomputed = s * b * sum(per_block), 0
    if stage.output:
        per_micro_batch += s * b * 2 * h * compute / tp
    activations = per_micro_batch * micro_batches_in_flight(layout, stage.index) + recomputed
    # The hidden states and, with MTP, the embedded tokens ahead that travel beside them (workloads.decoder.mtp).
    buffers = 2 * layout.virtual * (1 + m.mtp_layers) * s * b * h / tp * compute if layout.pipeline > 1 else 0
    losses = (1 + m.mtp_layers) if stage.output else 0
    logits = losses * s * b * m.vocab_size / tp * (compute + 12)
    return MemoryEstimate(weights=weights, gradients=4 * trained if accumulating else 0, optimizer=8 * trained,
                          gathered=gathered, activations=activations, pipeline_buffers=buffers, logits=logits,
                          reserve=4 * GIB if on_gpu else 0, stage=stage.index)


def estimate_traffic(cfg: PretrainConfig | LoraFinetuneConfig, layout: Layout) -> Traffic:
    """The bytes each GPU sends per step (workloads.common.traffic), on the pipeline stage that sends most. For LoRA
    only the adapters' gradients are reduced: the frozen base's parameters are gathered, never its gradients."""
    stages = pipeline_stages(cfg.model, layout.pipeline, layout.virtual)
    return max((stage_traffic(cfg, layout, stage) for stage in stages), key=lambda t: t.nvlink + t.infiniband)


def stage_traffic(cfg: PretrainConfig | LoraFinetuneConfig, layout: Layout, stage: Stage) -> Traffic:
    """One stage's bytes per GPU per step: its own parameters gathered and reduced, its blocks' (and MTP's) sends."""
    m = cfg.model
    lora = isinstance(cfg, LoraFinetuneConfig)
    params = stage_params(m, stage)
    layers = list(stage.layers) + (m.mtp_blocks() if stage.output else [])
    return traffic.estimate_traffic(params=params.dense + params.experts, n_layer=len(layers), seq_len=m.seq_len,
                                    d_model=m.d_model, kv_dim=m.kv_dim, tensor=layout.tensor, context=layout.context,
                                    shard=layout.shard, replicate=layout.replicate, micro_batch=layout.micro_batch,
                                    grad_accum=layout.grad_accum, procs_per_node=layout.procs_per_node,
                                    recompute=cfg.activation_checkpointing,
                                    reduced_params=cfg.lora.params(m) if lora else None,
                                    expert_params=params.experts, expert=layout.expert,
                                    top_k=m.moe.top_k if m.moe else 0,
                                    moe_layers=sum(m.is_moe(layer) for layer in layers),
                                    pipeline=layout.pipeline, virtual=layout.virtual, carried=1 + m.mtp_layers)


def describe(benchmark: str, cfg: PretrainConfig | LoraFinetuneConfig, layout: Layout,
             gpu_memory_gib: float | None) -> list[str]:
    """The lines `--dry-run` shows: the model, the layout, memory per GPU term by term, traffic per GPU per step by
    link, the pipeline's bubble, and how the batch's peak LR (and warmup) were chosen: the RCP rows that bound it,
    interpolated or given (BatchHyperparameters.describe)."""
    m = cfg.model
    memory = estimate_memory(cfg, layout, on_gpu=bool(gpu_memory_gib))
    limit = f" of {gpu_memory_gib:g} GiB" if gpu_memory_gib else " (CPU: per process)"
    if isinstance(cfg, LoraFinetuneConfig):
        trains = (f"LoRA rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g} on qkv and o: {_count(cfg.lora.params(m))} "
                  f"trained, the base frozen")
        schedule = (f"peak LR {cfg.base_lr:g}, cosine over {cfg.max_steps} steps; eval every {cfg.eval_every} steps "
                    f"after the first {cfg.skipped_evals} skipped")
    else:
        trains, schedule = "every weight trained", f"peak LR {cfg.base_lr:g}, warmup {cfg.warmup_steps} steps"
    windowed = sum(m.windowed(layer) for layer in range(m.n_layer))
    attention = f"{m.n_head} heads of {m.head_dim} ({m.n_kv_head} key/value)" + (
        f", a {m.sliding_window}-key sliding window in {windowed} of {m.n_layer} layers" if windowed else "")
    ffn = (f"{m.moe.experts} experts of SwiGLU {m.moe.hidden}, top {m.moe.top_k} ({_count(m.active_params)} active)"
           if m.moe else f"SwiGLU {m.ffn_hidden}")
    experts = (f" x expert {layout.expert} (each rank holds {m.moe.experts // layout.expert} experts of each layer, "
               f"FSDP shards them over expert_shard {layout.expert_shard})") if m.moe else ""
    pipeline = (f"pipeline {layout.pipeline} (virtual {layout.virtual}: "
                f"{'/'.join(str(len(s.layers)) for s in pipeline_stages(m, layout.pipeline, layout.virtual))} "
                "layers per stage) x ") if layout.pipeline > 1 else ""
    return [
        f"{benchmark} model: {m.n_layer} layers, d_model {m.d_model}, {attention}, {ffn}, sequence {m.seq_len}, "
        f"{_count(m.params)} parameters; {trains}",
        f"{benchmark} layout: {layout.world} processes = {pipeline}replicate {layout.replicate} x shard {layout.shard} "
        f"(HSDP: FSDP over shard x context = {layout.fsdp}) x context {layout.context} x tensor {layout.tensor}"
        f"{experts}; global batch {layout.global_batch} = {layout.data} data ranks x micro batch {layout.micro_batch} "
        f"x {layout.grad_accum} {'pipeline micro batches' if layout.pipeline > 1 else 'accumulation steps'}; "
        f"{schedule}",
        f"{benchmark} memory per GPU{f' (stage {memory.stage})' if layout.pipeline > 1 else ''}: "
        f"{memory.describe(limit)}; activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}",
        f"{benchmark} traffic per GPU per step: {estimate_traffic(cfg, layout).describe()}",
        f"{benchmark} pipeline bubble: {bubble_fraction(layout):.1%} of a step ((p - 1) / (v m + p - 1) with p "
        f"{layout.pipeline}, v {layout.virtual}, m {layout.grad_accum})",
        *([f"{benchmark} hyperparameters: {cfg.hyperparameters.describe()}"] if cfg.hyperparameters else []),
    ]


def check_fits(benchmark: str, cfg: PretrainConfig | LoraFinetuneConfig, layout: Layout,
               gpu_memory_gib: float) -> None:
    """Refuse a layout whose estimate exceeds the GPU's memory, with the arithmetic: each term, the total and the
    limit, and what would shrink it."""
    memory = estimate_memory(cfg, layout)
    if memory.total / GIB > gpu_memory_gib:
        nodes = layout.world // layout.procs_per_node
        options = "; ".join(f"{what}: {estimate_memory(cfg, other).total / GIB:.1f} GiB"
                            for what, other in _larger_layouts(cfg, layout))
        raise ValueError(
            f"{benchmark} needs about {memory.describe()} per GPU on pipeline stage {memory.stage} with "
            f"{nodes} nodes x {layout.procs_per_node} GPUs = pipeline {layout.pipeline} x replicate "
            f"{layout.replicate} x FSDP {layout.fsdp} (expert {layout.expert}) x tensor {layout.tensor}, more than "
            f"the {gpu_memory_gib:g} GiB each has: use more nodes (more GPUs per FSDP group: the preset's "
            f"shard_nodes), more pipeline stages, a larger expert parallel, or activation checkpointing "
            f"({options or 'none planned'})")


def _larger_layouts(cfg: PretrainConfig | LoraFinetuneConfig, layout: Layout) -> list[tuple[str, Layout]]:
    """What check_fits offers instead: twice the nodes with FSDP over twice the ranks, and (same nodes) twice the
    pipeline stages, each where the batch and the layers split evenly."""
    offers = []
    if layout.grad_accum % 2 == 0:
        offers.append((f"{2 * layout.world // layout.procs_per_node} nodes with FSDP over {2 * layout.fsdp}",
                       replace(layout, world=2 * layout.world, shard=2 * layout.shard,
                               grad_accum=layout.grad_accum // 2)))
    halved = {"replicate": layout.replicate // 2} if layout.replicate % 2 == 0 else \
        {"shard": layout.shard // 2} if layout.shard % 2 == 0 else None
    stages = 2 * layout.pipeline * layout.virtual
    if halved and -(-cfg.model.n_layer // stages) * (stages - 1) < cfg.model.n_layer:
        fewer = replace(layout, pipeline=2 * layout.pipeline, grad_accum=2 * layout.grad_accum, **halved)
        offers.append((f"pipeline {fewer.pipeline}", replace(fewer, expert=math.gcd(fewer.expert, fewer.fsdp))))
    return offers


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
