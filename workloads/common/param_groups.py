"""The two parameter groups the layer-wise optimizers (LAMB for BERT, LARS for ResNet) use."""

from __future__ import annotations

import torch


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay (and trust-ratio adaptation) for weight matrices, convolutions and embeddings; none for biases and
    norm layers (BatchNorm, LayerNorm), as both references exclude them."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    plain = [p for p in model.parameters() if p.ndim < 2]  # biases and norm scales are vectors
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
