"""The full ResNet preset against the closed rules and the references: what decays, the initialisation, the
LARS table by global batch, and the hyperparameters NVIDIA's submissions logged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from workloads.common.campaign import RunOptions
from workloads.resnet.model import build_model
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


def test_resnet50_starts_from_the_references_distributions():
    """Convolutions N(0, 2 / fan_in) (he_normal), the classifier N(0, 0.01) with a zero bias, batch norm 1 and 0
    (the last of each block too). Checked on the convolutions whose fan-in and fan-out differ, where
    torchvision's default (fan-out) draws another spread."""
    torch.manual_seed(0)
    model = build_model("resnet50", 1000)
    checked = 0
    for name, conv in model.named_modules():
        if isinstance(conv, nn.Conv2d):
            fan_in, fan_out = (conv.weight[0].numel(), conv.weight[:, 0].numel())
            if fan_in != fan_out and conv.weight.numel() >= 16384:
                assert conv.weight.std().item() == pytest.approx((2 / fan_in) ** 0.5, rel=0.05), name
                assert abs(conv.weight.mean().item()) < 0.05 * (2 / fan_in) ** 0.5, name
                checked += 1
    assert checked >= 20
    assert model.fc.weight.std().item() == pytest.approx(0.01, rel=0.02)
    assert torch.count_nonzero(model.fc.bias) == 0
    for block in (*model.layer1, *model.layer2, *model.layer3, *model.layer4):
        for bn in (block.bn1, block.bn2, block.bn3):
            assert torch.all(bn.weight == 1) and torch.all(bn.bias == 0)
