"""The parameter groups that decide which parameters decay: one place for LAMB (BERT), LARS and SGD (ResNet)."""

from __future__ import annotations

import torch
from torch import nn

NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)


def parameter_groups(model: torch.nn.Module, weight_decay: float, decay_biases: bool = False) -> list[dict]:
    """Decay (and, for the layer-wise optimizers, trust-ratio adaptation) for weight matrices, convolutions and
    embeddings; none for norm layers (BatchNorm, LayerNorm), as every reference excludes them.

    Biases decay only with `decay_biases`: BERT's reference excludes them from LAMB ("bias" in its exclude list)
    and ResNet's LARS reference from LARS (skip_list ['batch_normalization', 'bias', 'bn'] in
    mlcommons/training image_classification/tensorflow2/common.py), but ResNet's SGD reference filters out
    batch norm alone ('bn' not in v.name, tensorflow2/resnet_runnable.py; 'batch_normalization' not in name in
    the TF1 resnet_run_loop.py), so its one bias, the classifier's, decays."""
    norms = {id(p) for m in model.modules() if isinstance(m, NORM_LAYERS) for p in m.parameters(recurse=False)}
    decays = [p.ndim >= 2 or (decay_biases and id(p) not in norms) for p in model.parameters()]
    return [{"params": [p for p, d in zip(model.parameters(), decays) if d], "weight_decay": weight_decay},
            {"params": [p for p, d in zip(model.parameters(), decays) if not d], "weight_decay": 0.0}]
