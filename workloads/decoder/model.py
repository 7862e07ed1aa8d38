"""The decoder family: Llama 2 and 3.1, gpt-oss and DeepSeek-V3, from the tiny presets up to 671B. Reads top to
bottom.

Pre-norm blocks (RMSNorm) of causal self-attention with rotary positions (RoPE, with Llama 3.1's frequency scaling,
YaRN's, or none) and a feed-forward; no biases, no dropout; the input embedding and the output layer are separate
matrices. The config chooses the parts: grouped-query attention over the whole causal prefix or, in some layers, a
sliding window of the last keys (gpt-oss), or multi-head latent attention (DeepSeek-V3); a dense SwiGLU or a
Mixture of Experts (workloads.decoder.moe), the first `dense_layers` dense (DeepSeek-V3). With
`lora`, the attention's projections carry low-rank adapters beside their (frozen) weights, as llama2_70b_lora
fine-tunes them. Every layer reads its head counts from the shapes it gets, so the same code runs whole or split
by tensor parallelism (see parallelize.py), and the attention's core is a module of its own that context
parallelism replaces with one that gathers keys and values across ranks. Positions are an input: a
context-parallel rank holds two chunks of the sequence, not a prefix of it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from workloads.common.whole_draws import draw_
from workloads.decoder.config import DecoderConfig, LoraConfig, MlaConfig, RopeScaling, YarnScaling
from workloads.decoder.moe import MoE, SwiGLU
from workloads.decoder.mtp import MultiTokenPrediction, mtp_loss, tokens_ahead


def rope_frequencies(cfg: DecoderConfig) -> torch.Tensor:
    """The rotary frequency of each pair of the rotated head dimensions (all of a head's, or MLA's
    qk_rope_head_dim): theta^(-2i/d), then YaRN's scaling (yarn_frequencies) or Llama 3.1's (Meta's
    `apply_scaling`): wavelengths longer than original_context / low_freq_factor are slowed by `factor`,
    those shorter than original_context / high_freq_factor are kept, and those between are blended."""
    dim = cfg.mla.qk_rope_head_dim if cfg.mla else cfg.head_dim
    freqs = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling: RopeScaling | YarnScaling | None = cfg.rope_scaling
    if scaling is None:
        return freqs.float()
    if isinstance(scaling, YarnScaling):
        return yarn_frequencies(freqs, cfg.rope_theta, scaling).float()
    wavelength = 2 * math.pi / freqs
    low_wavelength = scaling.original_context / scaling.low_freq_factor  # longer than this: slowed
    high_wavelength = scaling.original_context / scaling.high_freq_factor  # shorter than this: kept
    smooth = (scaling.original_context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelength > low_wavelength, freqs / scaling.factor,
                         torch.where(wavelength < high_wavelength, freqs, blended))
    return scaled.float()


def yarn_frequencies(freqs: torch.Tensor, theta: float, yarn: YarnScaling) -> torch.Tensor:
    """YaRN (transformers' modeling_rope_utils.py `_compute_yarn_parameters`, DeepSeek-V3's `yarn_find_correction_range`
    and `yarn_linear_ramp_mask`; Megatron-LM's yarn_rotary_pos_embedding.py): the pair index where a frequency turns
    `beta` times over the original context is dim ln(context / (2 pi beta)) / (2 ln theta); pairs below the
    beta_fast index (floored) keep their frequency, pairs above the beta_slow index (ceiled) are divided by
    `factor`, with a linear ramp between."""
    dim = 2 * freqs.numel()

    def pair_index(rotations: float) -> float:
        return dim * math.log(yarn.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_index(yarn.beta_fast)), 0)
    high = min(math.ceil(pair_index(yarn.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    return freqs / yarn.factor * ramp + freqs * (1 - ramp)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature: 0.1 mscale ln(factor) + 1, and 1 where the context is not stretched
    (transformers' modeling_deepseek_v3.py `yarn_get_mscale`)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_tables(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles: (positions, head_dim / 2)."""
    angles = positions.float()[:, None] * freqs.to(positions.device)[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of every head by its position's angle; x is (batch, seq, heads, dim),
    pairs interleaved as in Meta's reference (view_as_complex)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def visible(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query attends to: itself and earlier positions, and with a window only the last `window`
    of those before it (Megatron's window_size (window, 0): keys from position - window to position)."""
    behind = query_positions[:, None] - key_positions[None, :]
    return (behind >= 0) & (behind <= window) if window is not None else behind >= 0


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                       scale: float | None = None) -> torch.Tensor:
    """Sliding-window causal attention over (batch, heads, seq, dim), a block of `window` queries at a time against
    that block's keys and the previous block's: each query sees itself and the `window` keys before it, in
    O(seq x window) rather than the seq^2 of a masked full attention (what `visible` says, computed by blocks).
    The blocks go into the batch dimension, so attention stays 4-D (the shape CUDA's fused kernels take)."""
    batch, heads, seq, _ = q.shape
    pad = -seq % window
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))  # whole blocks; the padding is after every real key
    blocks = (seq + pad) // window
    # The keys and values of block b are positions b w - w .. b w + w - 1 (w zeros before the first block).
    k, v = (F.pad(t, (0, 0, window, 0)).unfold(2, 2 * window, window).transpose(-1, -2) for t in (k, v))
    q = q.unflatten(2, (blocks, window))
    # (batch x blocks, heads, positions, dim)
    q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (q, k, v))
    query, key = torch.arange(window, device=q.device), torch.arange(2 * window, device=q.device)
    mask = visible(query + window, key, window).expand(blocks, window, 2 * window).clone()
    mask[0, :, :window] = False  # the first block's keys before position 0 are padding
    mask = mask[None, :, None].expand(batch, -1, -1, -1, -1).flatten(0, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
    return out.unflatten(0, (batch, blocks)).transpose(1, 2).flatten(2, 3)[:, :, :seq]


class CausalAttention(nn.Module):
    """softmax(q k^T x scale) v over (batch, heads, seq, dim), each position seeing itself and earlier ones, or
    with `window` only the last `window` positions before it (windowed_attention). `scale`: 1 / sqrt(q's dim) by
    default; YaRN's MLA raises it (LatentAttention). v may be narrower or wider than q and k (MLA's v_head_dim).

    Grouped-query: k and v have fewer heads, each shared by n_head / n_kv_head query heads (scaled dot-product
    attention's enable_gqa repeats them without copying). Positions are given but unused here: the sequence is
    whole and in order. parallelize.py swaps in ContextParallelAttention, which needs them."""

    def __init__(self, window: int | None = None, scale: float | None = None):
        super().__init__()
        self.window, self.scale = window, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=self.scale)
        return windowed_attention(q, k, v, self.window, self.scale)


class LoRA(nn.Module):
    """A low-rank update beside a frozen linear layer (Hu et al., 2021), computed as peft computes it:
    B(A(dropout(x))) x alpha / rank, with A drawn as nn.Linear draws it and B zero, so training starts from the
    base model exactly. One A may feed several B: the reference adapts Llama's fused qkv_proj with one adapter,
    whose B rows are the q, k and v parts side by side (kept as three B here, so tensor parallelism splits each
    by heads as it splits wq, wk and wv)."""

    def __init__(self, d_in: int, d_outs: tuple[int, ...], cfg: LoraConfig):
        super().__init__()
        self.dropout = nn.Dropout(cfg.dropout)
        self.a = nn.Linear(d_in, cfg.rank, bias=False)
        self.b = nn.ModuleList(nn.Linear(cfg.rank, d_out, bias=False) for d_out in d_outs)
        self.scale = cfg.alpha / cfg.rank

    @torch.no_grad()
    def reset_parameters(self) -> None:
        draw_(self.a.weight, lambda whole: nn.init.kaiming_uniform_(whole, a=math.sqrt(5)))  # nn.Linear's draw
        for b in self.b:
            nn.init.zeros_(b.weight)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        down = self.a(self.dropout(x))
        return [b(down) * self.scale for b in self.b]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, window: int | None = None, lora: LoraConfig | None = None):
        super().__init__()
        self.head_dim = cfg.head_dim
        q_dim = cfg.q_dim
        self.wq = nn.Linear(cfg.d_model, q_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(q_dim, cfg.d_model, bias=False)
        self.core = CausalAttention(window)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        # The reference's LoRA targets (--lora_target_modules "qkv_proj,o_proj"): the fused qkv and the output.
        self.lora_qkv = LoRA(cfg.d_model, (q_dim, cfg.kv_dim, cfg.kv_dim), lora) if lora else None
        self.lora_o = LoRA(q_dim, (cfg.d_model,), lora) if lora else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor
                ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.lora_qkv is not None:
            dq, dk, dv = self.lora_qkv(x)
            q, k, v = q + dq, k + dk, v + dv
        # (batch, seq, heads * dim) -> (batch, seq, heads, dim); heads are this rank's share under TP.
        q, k, v = (t.view(batch, seq, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        out = self.wo(y)
        if self.lora_o is not None:
            out = out + self.lora_o(y)[0]
        return out


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3; transformers' modeling_deepseek_v3.py `DeepseekV3Attention`,
    Megatron-LM's multi_latent_attention.py; torchtitan's names): queries through a low-rank bottleneck (wq_a,
    its RMSNorm q_norm, wq_b; or one wq), keys and values from one latent (wkv_a's first kv_lora_rank outputs,
    RMSNorm-ed by kv_norm, expanded per head by wkv_b into a key part without positions and the value) and one
    RoPE key part (wkv_a's last qk_rope_head_dim outputs) that every head shares. Each head's query and key are
    [nope part, rope part]; RoPE (interleaved pairs, as DeepSeek's checkpoints lay them out: rope_interleave) turns
    the rope parts only, its cos and sin scaled by YaRN's mscale(factor, mscale) / mscale(factor, mscale_all_dim),
    and the softmax scale is qk_head_dim^-0.5 x mscale(factor, mscale_all_dim)^2. The core is the same
    CausalAttention module as Attention's, so context parallelism swaps it alike."""

    def __init__(self, cfg: DecoderConfig, window: int | None = None):
        super().__init__()
        mla: MlaConfig = cfg.mla
        self.mla = mla
        heads, d = cfg.n_head, cfg.d_model
        if mla.q_lora_rank:
            self.wq, self.wq_a = None, nn.Linear(d, mla.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(mla.q_lora_rank, eps=cfg.norm_eps)
            self.wq_b = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(d, heads * mla.qk_head_dim, bias=False)
            self.wq_a, self.q_norm, self.wq_b = None, None, None
        self.wkv_a = nn.Linear(d, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(mla.kv_lora_rank, eps=cfg.norm_eps)
        self.wkv_b = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * mla.v_head_dim, d, bias=False)
        yarn = cfg.rope_scaling if isinstance(cfg.rope_scaling, YarnScaling) else None
        softmax_gain = yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2 if yarn else 1.0
        self.rope_gain = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim) \
            if yarn else 1.0
        self.core = CausalAttention(window, scale=mla.qk_head_dim ** -0.5 * softmax_gain)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor
                ) -> torch.Tensor:
        batch, seq, _ = x.shape
        mla = self.mla
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(batch, seq, -1, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, mla.qk_nope_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        cos, sin = rope
        if self.rope_gain != 1.0:
            cos, sin = cos * self.rope_gain, sin * self.rope_gain
        q = torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin).expand(-1, -1, k_nope.size(2), -1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        y = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, lora: LoraConfig | None = None):
        super().__init__()
        window = cfg.sliding_window if cfg.windowed(layer) else None
        if cfg.mla and lora:
            raise ValueError("LoRA adapts grouped-query attention's projections; this model's attention is MLA")
        self.attention_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attention = LatentAttention(cfg, window) if cfg.mla else Attention(cfg, window, lora)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.feed_forward = MoE(cfg.d_model, cfg.moe) if cfg.is_moe(layer) else SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor
                ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, positions)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig, activation_checkpointing: bool = False, lora: LoraConfig | None = None):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = activation_checkpointing
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, layer, lora) for layer in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied from tok_embeddings
        # DeepSeek-V3's multi-token prediction depths (workloads.decoder.mtp), each around a block after the last one;
        # they share tok_embeddings and output. Empty (no parameter, nothing run) where cfg.mtp_layers is 0.
        self.mtp = nn.ModuleList(MultiTokenPrediction(cfg, Block(cfg, cfg.n_layer + k)) for k in range(cfg.mtp_layers))
        self.register_buffer("rope_freqs", rope_frequencies(cfg), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Megatron's initialisation, which the references use (through NeMo for llama31_8b, Primus for gpt_oss_20b):
        Normal(0, init_std) for every matrix, the router's and the experts' too; the residual projections
        (attention's wo, SwiGLU's, each expert's and the shared experts' w2) at init_std / sqrt(2 x layers) (its
        scaled output_layer_init_method); ones for the norms; zeros for the routers' expert bias and load counts
        (Megatron-LM's router.py: `expert_bias` starts at zero). Each parameter is drawn whole, in the same order on
        every rank, and split after (workloads.common.whole_draws), so the initial model does not depend on the
        layout. Called again after a model built on the meta device gets real storage."""
        blocks = [*self.layers, *(depth.block for depth in self.mtp)]  # the MTP depths' blocks too
        residual = {id(p) for layer in blocks for p in (layer.attention.wo.weight, *self._down(layer))}
        scaled_std = self.cfg.init_std / math.sqrt(2 * max(self.cfg.n_layer, 1))  # (a proxy may have no block)
        for name, param in self.named_parameters():
            if ".lora_" in name:
                continue
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            else:
                std = scaled_std if id(param) in residual else self.cfg.init_std
                draw_(param, lambda whole, std=std: nn.init.normal_(whole, mean=0.0, std=std))
        for module in self.modules():
            if isinstance(module, LoRA):
                module.reset_parameters()
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The buffers' starting values (the routers' expert bias and load counts zero, the RoPE frequencies): what a
        model whose weights all come from a checkpoint still needs after it gets real storage."""
        for name, buffer in self.named_buffers():
            if name.endswith(("expert_bias", "tokens_per_expert")):
                buffer.zero_()
        self.rope_freqs.copy_(rope_frequencies(self.cfg))

    @staticmethod
    def _down(layer: Block) -> list[nn.Parameter]:
        """A block's feed-forward projections back into the residual stream."""
        ffn = layer.feed_forward
        if not isinstance(ffn, MoE):
            return [ffn.w2.weight]
        return [ffn.experts.w2] + ([ffn.shared_experts.w2.weight] if ffn.shared_experts is not None else [])

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, targets: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits for each position: (batch, seq) token ids -> (batch, seq, vocab). `positions` are the tokens'
        places in the whole sequence (default 0..seq-1). With the next-token `targets` (training a model with MTP
        depths): the logits and the weighted MTP loss (workloads.decoder.mtp), for the caller to add to its loss.

        A pipeline stage (workloads.decoder.pipeline) without the embedding reads the previous stage's hidden states
        (batch, seq, d_model) instead of tokens, and one without the output layer returns its hidden states (the
        pipeline gives every stage the positions and, with MTP, the targets). With MTP, the embedded tokens the
        depths read (mtp.tokens_ahead) are made where the embedding is and travel between stages beside the hidden
        states, concatenated along the features (one tensor a stage boundary, as the schedule sends)."""
        if positions is None:
            positions = torch.arange(tokens.size(1), device=tokens.device)
        rope = rope_tables(self.rope_freqs, positions)
        predicting = targets is not None and self.cfg.mtp_layers > 0
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(tokens)
            ahead = tokens_ahead(self.tok_embeddings, tokens, self.cfg.mtp_layers) if predicting else None
        elif predicting:
            x, ahead = tokens.split([self.cfg.d_model, self.cfg.mtp_layers * self.cfg.d_model], dim=-1)
        else:
            x = tokens
        for layer in self.layers:
            # Checkpointing keeps only each block's input and recomputes the rest in backward.
            x = checkpoint(layer, x, rope, positions, use_reentrant=False) \
                if self.activation_checkpointing and self.training else layer(x, rope, positions)
        if self.output is None:
            return torch.cat((x, ahead), dim=-1) if predicting else x
        hidden = self.norm(x)
        logits = self.output(hidden)
        if not predicting:
            return logits
        return logits, mtp_loss(self.mtp, self.output, hidden, ahead, targets, rope, positions,
                                self.cfg.mtp_loss_scale, self.activation_checkpointing and self.training)
