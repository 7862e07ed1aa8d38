"""Llama 2 and 3.1: a decoder-only transformer, from the tiny presets up to 70B. Reads top to bottom.

Pre-norm blocks (RMSNorm) of grouped-query causal self-attention with rotary positions (RoPE, with
Llama 3.1's frequency scaling, or Llama 2's none) and a SwiGLU MLP; no biases, no dropout; the input
embedding and the output layer are separate matrices. With `lora`, the attention's projections carry
low-rank adapters beside their (frozen) weights, as llama2_70b_lora fine-tunes them. Every layer reads its head counts from the shapes it gets, so the
same code runs whole or split by tensor parallelism (see parallelize.py), and the attention's core is a
module of its own that context parallelism replaces with one that gathers keys and values across ranks.
Positions are an input: a context-parallel rank holds two chunks of the sequence, not a prefix of it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from workloads.decoder.config import DecoderConfig, LoraConfig, RopeScaling


def rope_frequencies(cfg: DecoderConfig) -> torch.Tensor:
    """The rotary frequency of each pair of head dimensions: theta^(-2i/d), then Llama 3.1's scaling (Meta's
    `apply_scaling`): wavelengths longer than original_context / low_freq_factor are slowed by `factor`,
    those shorter than original_context / high_freq_factor are kept, and those between are blended."""
    dim = cfg.head_dim
    freqs = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling: RopeScaling | None = cfg.rope_scaling
    if scaling is None:
        return freqs.float()
    wavelength = 2 * math.pi / freqs
    low_wavelength = scaling.original_context / scaling.low_freq_factor  # longer than this: slowed
    high_wavelength = scaling.original_context / scaling.high_freq_factor  # shorter than this: kept
    smooth = (scaling.original_context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelength > low_wavelength, freqs / scaling.factor,
                         torch.where(wavelength < high_wavelength, freqs, blended))
    return scaled.float()


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


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v over (batch, heads, seq, dim), each position seeing itself and earlier ones.

    Grouped-query: k and v have fewer heads, each shared by n_head / n_kv_head query heads (scaled dot-product
    attention's enable_gqa repeats them without copying). Positions are given but unused here: the sequence is
    whole and in order. parallelize.py swaps in ContextParallelAttention, which needs them."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


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
        self.a.reset_parameters()
        for b in self.b:
            nn.init.zeros_(b.weight)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        down = self.a(self.dropout(x))
        return [b(down) * self.scale for b in self.b]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, lora: LoraConfig | None = None):
        super().__init__()
        self.head_dim = cfg.head_dim
        q_dim = cfg.n_head * cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, q_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(q_dim, cfg.d_model, bias=False)
        self.core = CausalAttention()
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
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), positions)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        out = self.wo(y)
        if self.lora_o is not None:
            out = out + self.lora_o(y)[0]
        return out


class SwiGLU(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, lora: LoraConfig | None = None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attention = Attention(cfg, lora)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg)

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
        self.layers = nn.ModuleList(Block(cfg, lora) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied from tok_embeddings
        self.register_buffer("rope_freqs", rope_frequencies(cfg), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Megatron's initialisation, which the reference uses through NeMo: Normal(0, init_std) for every matrix
        (init_method_std 0.02), the residual projections (attention's wo, SwiGLU's w2) at init_std / sqrt(2 x
        layers) (its scaled output_layer_init_method), ones for the norms; called again after a model built on
        the meta device gets real storage."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        for layer in self.layers:
            for projection in (layer.attention.wo, layer.feed_forward.w2):
                nn.init.normal_(projection.weight, mean=0.0, std=self.cfg.init_std / math.sqrt(2 * self.cfg.n_layer))
        for module in self.modules():
            if isinstance(module, LoRA):
                module.reset_parameters()
        self.rope_freqs.copy_(rope_frequencies(self.cfg))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for each position: (batch, seq) token ids -> (batch, seq, vocab). `positions` are the
        tokens' places in the whole sequence (default 0..seq-1)."""
        if positions is None:
            positions = torch.arange(tokens.size(1), device=tokens.device)
        rope = rope_tables(self.rope_freqs, positions)
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            # Checkpointing keeps only each block's input and recomputes the rest in backward.
            x = checkpoint(layer, x, rope, positions, use_reentrant=False) \
                if self.activation_checkpointing and self.training else layer(x, rope, positions)
        return self.output(self.norm(x))
