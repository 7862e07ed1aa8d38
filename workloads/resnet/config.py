"""ResNet presets as dataclasses: what the rules fix, and what we chose, in one place."""

from __future__ import annotations

from dataclasses import dataclass

from mlperf_logging.mllog import constants as C


@dataclass(frozen=True)
class LarsStep:
    """LARS's base LR and warmup epochs for global batches from `from_batch` up."""

    from_batch: int
    base_lr: float
    warmup_epochs: int


# The MLPerf reference's table (tensorflow2/lars_util.py, PolynomialDecayWithWarmup).
REFERENCE_LARS = (LarsStep(0, 10.0, 5), LarsStep(16384, 25.0, 5), LarsStep(32768, 31.2, 25))
# LARS from this global batch up, SGD below it. NVIDIA's submissions use LARS from one DGX node
# (3,264 images) up; below 4,096 linear scaling keeps SGD's LR at 1.6 or less, where it still trains well.
LARS_FROM_BATCH = 4096


@dataclass(frozen=True)
class ResNetConfig:
    arch: str  # "resnet50" (torchvision's v1.5) or "tiny"
    crop: int  # training/eval crop in pixels
    classes: int
    batch_size: int  # per process
    max_epochs: int
    eval_every: int  # epochs between evaluations (MLPerf: 4)
    target: float  # top-1 accuracy that ends the run
    base_lr: float  # SGD's, at the global batch in `lr_batch`; scaled linearly with the real global batch
    lr_batch: int
    warmup_epochs: int  # SGD's
    lars: tuple[LarsStep, ...] = REFERENCE_LARS  # LARS's LR and warmup by global batch
    end_lr: float = 0.0001  # MLPerf fixes the poly schedule's end LR (SGD and LARS)
    poly_power: float = 2.0
    momentum: float = 0.9
    weight_decay: float = 0.00005  # a power-of-two multiple of 1e-4, as the closed rules require
    label_smoothing: float = 0.1
    workers: int = 8  # data-loader processes per rank
    # DDP's all-reduce bucket: ResNet-50's 100 MB of fp32 gradients in 4 buckets, the first of them ready
    # early in the backward pass (torch's default, not yet tuned on a GPU: bench/gpu_throughput.py measures it).
    bucket_mb: int = 25


PRESETS = {
    # MLPerf closed: ResNet-50 v1.5, 224 px, target 75.9% top-1, eval every 4 epochs.
    "full": ResNetConfig(arch="resnet50", crop=224, classes=1000, batch_size=256, max_epochs=41, eval_every=4,
                         target=0.759, base_lr=0.1, lr_batch=256, warmup_epochs=5),
    # A small ResNet on the generated 32 px, 10-class dataset: reaches its target in about half a minute on 2 CPU cores.
    "tiny": ResNetConfig(arch="tiny", crop=32, classes=10, batch_size=32, max_epochs=20, eval_every=1,
                         target=0.90, base_lr=0.2, lr_batch=64, warmup_epochs=1, lars=(LarsStep(0, 10.0, 1),),
                         workers=0),
}


def default_optimizer(global_batch: int) -> str:
    """The optimizer a run uses unless --optimizer forces one (see LARS_FROM_BATCH)."""
    return C.LARS if global_batch >= LARS_FROM_BATCH else C.SGD


def lars_step(cfg: ResNetConfig, global_batch: int) -> LarsStep:
    """The row of the preset's LARS table that covers `global_batch`."""
    return max((step for step in cfg.lars if step.from_batch <= global_batch), key=lambda step: step.from_batch)
