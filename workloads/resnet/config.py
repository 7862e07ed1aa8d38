"""ResNet presets as dataclasses: what the rules fix, and what we chose, in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResNetConfig:
    arch: str  # "resnet50" (torchvision's v1.5) or "tiny"
    crop: int  # training/eval crop in pixels
    classes: int
    batch_size: int  # per process
    max_epochs: int
    eval_every: int  # epochs between evaluations (MLPerf: 4)
    target: float  # top-1 accuracy that ends the run
    base_lr: float  # at the global batch in `lr_batch`; scaled linearly with the real global batch
    lr_batch: int
    warmup_epochs: int
    end_lr: float = 0.0001  # MLPerf fixes the poly schedule's end LR
    poly_power: float = 2.0
    momentum: float = 0.9
    weight_decay: float = 0.00005  # a power-of-two multiple of 1e-4, as the closed rules require
    label_smoothing: float = 0.1
    workers: int = 8  # data-loader processes per rank


PRESETS = {
    # MLPerf closed: ResNet-50 v1.5, 224 px, target 75.9% top-1, eval every 4 epochs.
    "full": ResNetConfig(arch="resnet50", crop=224, classes=1000, batch_size=256, max_epochs=41, eval_every=4,
                         target=0.759, base_lr=0.1, lr_batch=256, warmup_epochs=5),
    # A small ResNet on the generated 32 px, 10-class dataset: reaches its target in about a minute on 2 CPU cores.
    "tiny": ResNetConfig(arch="tiny", crop=32, classes=10, batch_size=32, max_epochs=20, eval_every=1,
                         target=0.90, base_lr=0.2, lr_batch=64, warmup_epochs=1, workers=0),
}
