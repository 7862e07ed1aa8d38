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

from dataclasses import dataclass

TIME_EMBED_DIM = 256  # the sinusoidal timestep (and guidance) embedding's width (BFL model.py: time_in in_dim=256)


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
