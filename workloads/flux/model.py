"""FLUX.1: a rectified-flow transformer over packed image latents and T5 text. Reads top to bottom.

Black Forest Labs' model (black-forest-labs/flux src/flux/model.py and src/flux/modules/layers.py, math.py), as
MLPerf flux1 runs it through torchtitan (pytorch/torchtitan torchtitan/experiments/flux/model/model.py, layers.py,
math.py). The submodules keep BFL's names (img_in, time_in.in_layer, double_blocks.N.img_attn.norm.query_norm.scale,
single_blocks.N.linear1, final_layer.adaLN_modulation.1, ...) so that a FLUX.1 checkpoint loads by name.

The image latents (B, L, 64) and the text (B, S, 4096) enter separate streams; the 19 double-stream blocks keep
separate weights per stream but attend jointly over [text, image]; the 38 single-stream blocks run on the
concatenation; the last layer maps the image tokens back to 64 channels. Every block is modulated (shift, scale,
gate) by `vec`: the timestep's embedding plus CLIP's pooled embedding `y`. Positions enter only through RoPE, over
3 axes per token (0, row, column; all zero for text).

Where BFL upcasts to float32 (the timestep embedding, RMSNorm, RoPE) this upcasts to float32 *at least*, so float64
stays float64 and the tests can compare tightly; in float32 and bfloat16 it is BFL's arithmetic (RoPE's with
float32 position ids, as torchtitan's trainer makes them; BFL computes RoPE in the ids' own dtype).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from workloads.common.whole_draws import draw_
from workloads.flux.config import TIME_EMBED_DIM, FluxConfig


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 if it is float64 (BFL's `.float()`)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10_000, time_factor: float = 1000.0):
    """Sinusoidal embedding (B,) -> (B, dim): [cos(1000 t f_i), sin(1000 t f_i)], f_i = max_period^(-i / half).
    t is in [0, 1]; the factor 1000 spreads it over the range DDPM-style embeddings were built for (BFL layers.py)."""
    t = time_factor * t
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=_wide(t).dtype, device=t.device) / half)
    args = _wide(t)[:, None] * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding.to(t) if torch.is_floating_point(t) else embedding


def rope(pos: torch.Tensor, dim: int, theta: int) -> torch.Tensor:
    """One axis's rotations: positions (B, L) -> (B, L, dim/2, 2, 2) matrices [[cos, -sin], [sin, cos]] of angle
    pos * theta^(-2i/dim) (BFL math.py)."""
    scale = torch.arange(0, dim, 2, dtype=_wide(pos).dtype, device=pos.device) / dim
    angle = _wide(pos)[..., None] * (1.0 / theta**scale)
    out = torch.stack([torch.cos(angle), -torch.sin(angle), torch.sin(angle), torch.cos(angle)], dim=-1)
    return out.view(*angle.shape, 2, 2)


class EmbedND(nn.Module):
    """RoPE over several position axes: each axis rotates its own slice of the head (axes_dim, e.g. 16 + 56 + 56
    = 128), so attention sees (index, row, column) offsets separately. (B, L, n_axes) -> (B, 1, L, head_dim/2, 2, 2),
    the 1 broadcasting over heads."""

    def __init__(self, theta: int, axes_dim: tuple[int, ...]):
        super().__init__()
        self.theta = theta
        self.axes_dim = axes_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        emb = torch.cat([rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(ids.shape[-1])], dim=-3)
        return emb.unsqueeze(1)


def apply_rope(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of q and k (B, H, L, D) by the matrices from EmbedND (BFL math.py)."""
    xq_ = _wide(xq).reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = _wide(xk).reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention with RoPE: (B, H, L, D) each -> (B, L, H * D). SDPA picks flash attention on GPUs."""
    q, k = apply_rope(q, k, pe)
    x = F.scaled_dot_product_attention(q, k, v)
    return x.transpose(1, 2).flatten(2)


def split_qkv(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, L, 3 * H * D) -> q, k, v of (B, H, L, D); einops' "B L (K H D) -> K B H L D" in BFL layers.py."""
    batch, length, _ = qkv.shape
    return qkv.view(batch, length, 3, num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


def _xavier(*linears: nn.Linear) -> None:
    """torchtitan's init for the blocks' and inputs' linears: xavier-uniform weights, zero biases. Each weight drawn
    whole (workloads.common.whole_draws), so that FSDP's shards hold the single-process model's values."""
    for linear in linears:
        draw_(linear.weight, nn.init.xavier_uniform_)
        if linear.bias is not None:
            nn.init.zeros_(linear.bias)


class MLPEmbedder(nn.Module):
    """Linear, SiLU, linear: the timestep's sinusoids and CLIP's pooled vector into the hidden width."""

    def __init__(self, in_dim: int, hidden_dim: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_dim, bias=True)
        self.silu = nn.SiLU()
        self.out_layer = nn.Linear(hidden_dim, hidden_dim, bias=True)

    def init_weights(self, init_std: float = 0.02) -> None:
        """Normal(0, 0.02) weights, zero biases (torchtitan layers.py MLPEmbedder.init_weights)."""
        for linear in (self.in_layer, self.out_layer):
            draw_(linear.weight, lambda whole: nn.init.normal_(whole, std=init_std))
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(self.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    """RMSNorm with eps 1e-6 and a learned `scale` (BFL's, not nn.RMSNorm: the checkpoint names it `scale`)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_wide = _wide(x)
        rrms = torch.rsqrt(torch.mean(x_wide**2, dim=-1, keepdim=True) + 1e-6)
        return (x_wide * rrms).to(x.dtype) * self.scale


class QKNorm(nn.Module):
    """RMSNorm on each head's queries and keys, which keeps the attention logits bounded (SD3, FLUX)."""

    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def init_weights(self) -> None:
        nn.init.ones_(self.query_norm.scale)
        nn.init.ones_(self.key_norm.scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.query_norm(q).to(v), self.key_norm(k).to(v)  # back to v's dtype: the scale may be wider


class SelfAttention(nn.Module):
    """The parameters of one stream's attention; DoubleStreamBlock runs them itself, jointly with the other
    stream, so this module has no forward of its own."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool):
        super().__init__()
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim)

    def init_weights(self) -> None:
        _xavier(self.qkv, self.proj)
        self.norm.init_weights()


class Modulation(nn.Module):
    """adaLN: SiLU(vec) -> (shift, scale, gate), once (single blocks) or twice (double blocks: attention and MLP),
    each (B, 1, hidden) to broadcast over tokens."""

    def __init__(self, dim: int, double: bool):
        super().__init__()
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim, bias=True)

    def init_weights(self) -> None:
        """Zero (torchtitan layers.py, DiT's adaLN-Zero): every gate starts at 0, so each block starts as the
        identity and the residual stream is the embedding until training opens the gates."""
        nn.init.zeros_(self.lin.weight)
        nn.init.zeros_(self.lin.bias)

    def forward(self, vec: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        out = self.lin(F.silu(vec))[:, None, :].chunk(self.multiplier, dim=-1)
        return [out[i:i + 3] for i in range(0, self.multiplier, 3)]


def _mlp(hidden: int, mlp_hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden, mlp_hidden), nn.GELU(approximate="tanh"), nn.Linear(mlp_hidden, hidden))


class DoubleStreamBlock(nn.Module):
    """MMDiT block: image and text each have their own modulation, qkv, projection and MLP, but one attention runs
    over the text tokens followed by the image tokens, so each stream reads the other (BFL layers.py)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, qkv_bias: bool):
        super().__init__()
        mlp_hidden = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.img_mod = Modulation(hidden_size, double=True)
        self.img_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_attn = SelfAttention(hidden_size, num_heads, qkv_bias)
        self.img_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_mlp = _mlp(hidden_size, mlp_hidden)
        self.txt_mod = Modulation(hidden_size, double=True)
        self.txt_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_attn = SelfAttention(hidden_size, num_heads, qkv_bias)
        self.txt_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_mlp = _mlp(hidden_size, mlp_hidden)

    def init_weights(self) -> None:
        """torchtitan layers.py DoubleStreamBlock.init_weights, in its order."""
        _xavier(self.img_mlp[0], self.img_mlp[2], self.txt_mlp[0], self.txt_mlp[2])
        for module in (self.img_attn, self.img_mod, self.txt_attn, self.txt_mod):
            module.init_weights()

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor):
        (img_shift1, img_scale1, img_gate1), (img_shift2, img_scale2, img_gate2) = self.img_mod(vec)
        (txt_shift1, txt_scale1, txt_gate1), (txt_shift2, txt_scale2, txt_gate2) = self.txt_mod(vec)

        img_q, img_k, img_v = split_qkv(self.img_attn.qkv((1 + img_scale1) * self.img_norm1(img) + img_shift1),
                                        self.num_heads)
        img_q, img_k = self.img_attn.norm(img_q, img_k, img_v)
        txt_q, txt_k, txt_v = split_qkv(self.txt_attn.qkv((1 + txt_scale1) * self.txt_norm1(txt) + txt_shift1),
                                        self.num_heads)
        txt_q, txt_k = self.txt_attn.norm(txt_q, txt_k, txt_v)

        # One attention over [txt, img]; pe holds the positions in that order too.
        attn = attention(torch.cat((txt_q, img_q), dim=2), torch.cat((txt_k, img_k), dim=2),
                         torch.cat((txt_v, img_v), dim=2), pe=pe)
        txt_attn, img_attn = attn[:, :txt.shape[1]], attn[:, txt.shape[1]:]

        img = img + img_gate1 * self.img_attn.proj(img_attn)
        img = img + img_gate2 * self.img_mlp((1 + img_scale2) * self.img_norm2(img) + img_shift2)
        txt = txt + txt_gate1 * self.txt_attn.proj(txt_attn)
        txt = txt + txt_gate2 * self.txt_mlp((1 + txt_scale2) * self.txt_norm2(txt) + txt_shift2)
        return img, txt


class SingleStreamBlock(nn.Module):
    """A parallel block (ViT-22B, arXiv 2302.05442) over the joint sequence: one linear makes qkv and the MLP's
    input, another takes the attention's output and the MLP's activation together, one gate (BFL layers.py)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.linear1 = nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim)  # qkv and mlp in
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size)  # proj and mlp out
        self.norm = QKNorm(hidden_size // num_heads)
        self.pre_norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = Modulation(hidden_size, double=False)

    def init_weights(self) -> None:
        """torchtitan layers.py SingleStreamBlock.init_weights."""
        _xavier(self.linear1, self.linear2)
        self.norm.init_weights()
        self.modulation.init_weights()

    def forward(self, x: torch.Tensor, vec: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
        [(shift, scale, gate)] = self.modulation(vec)
        qkv, mlp = torch.split(self.linear1((1 + scale) * self.pre_norm(x) + shift),
                               [3 * self.hidden_size, self.mlp_hidden_dim], dim=-1)
        q, k, v = split_qkv(qkv, self.num_heads)
        q, k = self.norm(q, k, v)
        attn = attention(q, k, v, pe=pe)
        return x + gate * self.linear2(torch.cat((attn, self.mlp_act(mlp)), dim=2))


class LastLayer(nn.Module):
    """adaLN (shift and scale, no gate) then a linear to the packed latent channels (BFL layers.py)."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def init_weights(self) -> None:
        """All zero (torchtitan layers.py LastLayer.init_weights, DiT's): the model starts by predicting 0."""
        for linear in (self.adaLN_modulation[-1], self.linear):
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)
        return self.linear((1 + scale[:, None, :]) * self.norm_final(x) + shift[:, None, :])


class Flux(nn.Module):
    """The flow transformer: predicts the velocity (noise - data) of the packed latents `img` at time `timesteps`.
    `checkpoint_blocks` recomputes each block's activations in backward (training only), keeping only its inputs."""

    def __init__(self, cfg: FluxConfig, checkpoint_blocks: bool = False):
        super().__init__()
        self.cfg = cfg
        self.checkpoint_blocks = checkpoint_blocks
        h = cfg.hidden_size
        self.pe_embedder = EmbedND(theta=cfg.theta, axes_dim=cfg.axes_dim)
        self.img_in = nn.Linear(cfg.in_channels, h, bias=True)
        self.time_in = MLPEmbedder(TIME_EMBED_DIM, h)
        self.vector_in = MLPEmbedder(cfg.vec_in_dim, h)
        self.guidance_in = MLPEmbedder(TIME_EMBED_DIM, h) if cfg.guidance_embed else nn.Identity()
        self.txt_in = nn.Linear(cfg.context_in_dim, h)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(h, cfg.num_heads, cfg.mlp_ratio, cfg.qkv_bias)
                                           for _ in range(cfg.depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(h, cfg.num_heads, cfg.mlp_ratio)
                                           for _ in range(cfg.depth_single_blocks))
        self.final_layer = LastLayer(h, 1, cfg.out_channels)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """torchtitan's init (torchtitan/experiments/flux/model/model.py FluxModel.init_weights, after DiT):
        xavier-uniform for img_in, txt_in and the blocks' linears, normal(0, 0.02) for the MLP embedders, zero
        biases, unit QK-norm scales, and zero modulations and final layer. Its order of draws, too (the single
        blocks before the double ones). Called again after a model built on the meta device gets storage.
        guidance_in (not in schnell, nor in torchtitan) is drawn as time_in is."""
        _xavier(self.img_in, self.txt_in)
        self.time_in.init_weights(init_std=0.02)
        self.vector_in.init_weights(init_std=0.02)
        if self.cfg.guidance_embed:
            self.guidance_in.init_weights(init_std=0.02)
        for block in (*self.single_blocks, *self.double_blocks):
            block.init_weights()
        self.final_layer.init_weights()

    def _run(self, block: nn.Module, *args: torch.Tensor):
        if self.checkpoint_blocks and self.training:
            return checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def forward(self, img: torch.Tensor, img_ids: torch.Tensor, txt: torch.Tensor, txt_ids: torch.Tensor,
                timesteps: torch.Tensor, y: torch.Tensor, guidance: torch.Tensor | None = None) -> torch.Tensor:
        """img (B, L, in_channels) packed latents; img_ids (B, L, 3); txt (B, S, context_in_dim) T5 states;
        txt_ids (B, S, 3), zeros; timesteps (B,) in [0, 1]; y (B, vec_in_dim) CLIP pooled; guidance (B,) only
        for a guidance-distilled model. Returns (B, L, out_channels)."""
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError("img and txt must have 3 dimensions")
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, TIME_EMBED_DIM))
        if self.cfg.guidance_embed:
            if guidance is None:
                raise ValueError("a guidance-distilled model needs the guidance strength")
            vec = vec + self.guidance_in(timestep_embedding(guidance, TIME_EMBED_DIM))
        vec = vec + self.vector_in(y)
        txt = self.txt_in(txt)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))

        for block in self.double_blocks:
            img, txt = self._run(block, img, txt, vec, pe)
        x = torch.cat((txt, img), dim=1)
        for block in self.single_blocks:
            x = self._run(block, x, vec, pe)
        return self.final_layer(x[:, txt.shape[1]:], vec)
