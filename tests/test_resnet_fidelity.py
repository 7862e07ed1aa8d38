"""The full ResNet preset against the closed rules and the references: what decays, the initialisation, the
LARS table by global batch, and the hyperparameters NVIDIA's submissions logged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from workloads.common.campaign import RunOptions
from workloads.resnet.train import ResNetWorkload


def full_workload(ctx, tmp_path: Path, optimizer: str) -> ResNetWorkload:
    """The full preset at a global batch of 2 (one process), synthetic input: the real model and optimizer."""
    options = RunOptions(benchmark="resnet", preset="full", out=tmp_path, runs=1, seed=0, submitter="test",
                         system=None, data=None, synthetic=True, max_steps=1, batch_size=2, optimizer=optimizer)
    return ResNetWorkload(options, ctx, seed=0)


def test_sgd_decays_neither_batch_norm_but_the_classifier_bias_as_the_reference(one_rank_world, tmp_path):
    """The SGD reference adds L2 for every variable but batch norm's ('bn' not in v.name): convolutions and the
    classifier (weight and bias) decay, batch norm's scale and shift do not."""
    workload = full_workload(one_rank_world, tmp_path, "sgd")
    decay = {id(p): group["weight_decay"] for group in workload.optimizer.param_groups for p in group["params"]}
    model = workload.model.module
    assert len(decay) == len(list(model.parameters()))
    for module in model.modules():
        for param in module.parameters(recurse=False):
            expected = 0.0 if isinstance(module, nn.BatchNorm2d) else workload.cfg.weight_decay
            assert decay[id(param)] == expected, (module, param.shape)
    assert decay[id(model.fc.bias)] == workload.cfg.weight_decay > 0
