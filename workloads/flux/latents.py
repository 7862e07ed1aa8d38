"""The training step's inputs besides the model: latents packed into 2x2 patches and the tokens' positions, as
torchtitan builds them (pytorch/torchtitan torchtitan/experiments/flux/utils.py: pack_latents, unpack_latents,
create_position_encoding_for_latents; train.py: the text's positions are zeros)."""

from __future__ import annotations

import torch

PATCH = 2  # latent pixels per patch side: 16 channels x 2 x 2 = the model's 64 input channels
POSITION_DIM = 3  # (index, row, column): the axes of the model's RoPE


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, C * 4), patches in row-major order, each's features (c, ph, pw);
    einops' "b c (h ph) (w pw) -> b (h w) (c ph pw)"."""
    b, c, height, width = x.shape
    x = x.reshape(b, c, height // PATCH, PATCH, width // PATCH, PATCH)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (height // PATCH) * (width // PATCH), c * PATCH * PATCH)


def unpack_latents(x: torch.Tensor, latent_height: int, latent_width: int) -> torch.Tensor:
    """The inverse of pack_latents: (B, H/2 * W/2, C * 4) -> (B, C, H, W)."""
    b, _, features = x.shape
    h, w, c = latent_height // PATCH, latent_width // PATCH, features // (PATCH * PATCH)
    x = x.reshape(b, h, w, c, PATCH, PATCH)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, h * PATCH, w * PATCH)


def image_position_ids(batch: int, latent_height: int, latent_width: int,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """(B, H/2 * W/2, 3) float positions of the packed patches: (0, row, column), in pack_latents' order."""
    h, w = latent_height // PATCH, latent_width // PATCH
    ids = torch.zeros(h, w, POSITION_DIM, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.view(1, h * w, POSITION_DIM).repeat(batch, 1, 1)


def text_position_ids(batch: int, seq: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(B, S, 3) zeros: every text token sits at position 0, so RoPE leaves text-text attention unrotated and the
    text's order reaches the model only through T5's states."""
    return torch.zeros(batch, seq, POSITION_DIM, device=device)
