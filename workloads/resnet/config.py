"""ResNet presets as dataclasses: what the rules fix, and what we chose, in one place."""

from __future__ import annotations

from dataclasses import dataclass

from mlperf_logging.mllog import constants as C


@dataclass(frozen=True)
class Schedule:
    """What one run's optimizer and LR schedule take: a row of a LARS table, or SGD's linear scaling."""

    batch: int  # the global batch it was tuned at; a LARS row serves the batches above the previous row's up to it
    base_lr: float
    warmup_epochs: int
    epochs: int  # the poly decay reaches end_lr here and the run stops here (NVIDIA's NUMEPOCHS)
    momentum: float
    weight_decay: float
    source: str = ""


# The reference submissions' LARS hyperparameters by the global batch they trained, each from its config file
# (mlcommons/training_results_vX.Y, NVIDIA/benchmarks/resnet/implementations/...). Every row's epochs reach the
# RCP's minimum at its batch (mlperf-logging's rcp_checker/training_4.0.0/rcps_resnet.json, pruned, through its
# check_directory: tested), and that minimum grows with the batch, so a row also serves the batches below its own
# down to the previous row's, as NVIDIA's 316-node config takes the 49k-batch hyperparameters at 40,448 ("using
# hparams for 49k GBS"). The 4,096 row is the reference's own command.
REFERENCE_LARS = (
    Schedule(1600, 7.4, 2, 37, 0.9, 5e-05, "v4.0 l40s_n2_ngc24.04_mxnet/config_L40S_2x4x204.sh"),
    Schedule(3200, 11.0, 2, 37, 0.9, 5e-05, "v3.1 mxnet/config_DGXH100.sh; GigaComputing's v4.0 G593-SD1 logs"),
    Schedule(4096, 10.0, 5, 42, 0.9, 0.0002, "mlcommons/training image_classification/README_tensorflow2.md "
                                             "(TPU-v3-64; the RCP resnet_ref_4096)"),
    Schedule(35840, 21.9, 17, 60, 0.94, 2.5e-05, "v1.0 mxnet/config_DGXA100_multi_128x8x35_sharp.sh"),
    Schedule(40448, 19.4, 24, 70, 0.95, 0.0001, "v4.0 eos_n316_ngc24.04_mxnet/config_DGXH100_multi_316x8x16.sh"),
    Schedule(57344, 23.0, 32, 78, 0.95, 2.5e-05, "v4.0 coreweave_hgxh100_n448_ngc23.04_mxnet/"
                                                 "config_DGXH100_multi_448x8x16.sh (NVIDIA+CoreWeave's v3.0 run)"),
    Schedule(67456, 24.699, 31, 90, 0.951807, 0.0001, "v2.0 mxnet/config_DGXA100_multi_527x8x16xgbn2_larsv2.sh"),
)
# training_rules.adoc: lars_opt_momentum is "0.9 for batch<32k, otherwise arbitrary constant". A row with another
# momentum serves no batch below this, which leaves 4,097 to 32,767 without a row: no reference submission's
# hyperparameters cover them.
FREE_MOMENTUM_FROM = 32768
# LARS from this global batch up, SGD below it (--optimizer forces either). Below 4,096 linear scaling keeps SGD's
# LR at 1.6 or less; the v3.0+ submissions in the shared logs run LARS there too (1,536 to 3,200).
LARS_FROM_BATCH = 4096


@dataclass(frozen=True)
class ResNetConfig:
    arch: str  # "resnet50" (torchvision's v1.5) or "tiny"
    crop: int  # training/eval crop in pixels
    classes: int
    batch_size: int  # per process
    sgd_epochs: int  # SGD's schedule length and last epoch (LARS's come from its table)
    eval_every: int  # epochs between evaluations (MLPerf: 4)
    target: float  # top-1 accuracy that ends the run
    base_lr: float  # SGD's, at the global batch in `lr_batch`; scaled linearly with the real global batch
    lr_batch: int
    warmup_epochs: int  # SGD's
    lars: tuple[Schedule, ...] = REFERENCE_LARS  # LARS's hyperparameters by global batch, ascending
    end_lr: float = 0.0001  # MLPerf fixes the poly schedule's end LR (SGD and LARS)
    poly_power: float = 2.0
    momentum: float = 0.9  # SGD's (the closed rules fix it)
    weight_decay: float = 0.00005  # SGD's: a power-of-two multiple of 1e-4, as the closed rules require
    label_smoothing: float = 0.1
    workers: int = 8  # data-loader processes per rank
    # DDP's all-reduce bucket: ResNet-50's 100 MB of fp32 gradients in 4 buckets, the first of them ready
    # early in the backward pass (torch's default, not yet tuned on a GPU: bench/gpu_throughput.py measures it).
    bucket_mb: int = 25


PRESETS = {
    # MLPerf closed: ResNet-50 v1.5, 224 px, target 75.9% top-1, eval every 4 epochs.
    "full": ResNetConfig(arch="resnet50", crop=224, classes=1000, batch_size=256, sgd_epochs=41, eval_every=4,
                         target=0.759, base_lr=0.1, lr_batch=256, warmup_epochs=5),
    # A small ResNet on the generated 32 px, 10-class dataset: reaches its target in about half a minute on 2 CPU cores.
    "tiny": ResNetConfig(arch="tiny", crop=32, classes=10, batch_size=32, sgd_epochs=20, eval_every=1,
                         target=0.90, base_lr=0.2, lr_batch=64, warmup_epochs=1,
                         lars=(Schedule(4096, 10.0, 1, 20, 0.9, 5e-05, "the tiny preset's own (open division)"),),
                         workers=0),
}


def default_optimizer(global_batch: int) -> str:
    """The optimizer a run uses unless --optimizer forces one (see LARS_FROM_BATCH)."""
    return C.LARS if global_batch >= LARS_FROM_BATCH else C.SGD


def _served(rows: tuple[Schedule, ...]):
    """Each row with the lowest global batch it serves: the previous row's batch + 1, and none below 32,768 for a
    row whose momentum is not 0.9 (rows that serve nothing are left out)."""
    previous = 0
    for row in rows:
        lowest = previous + 1 if row.momentum == 0.9 else max(previous + 1, FREE_MOMENTUM_FROM)
        if lowest <= row.batch:
            yield lowest, row
        previous = row.batch


def lars_coverage(rows: tuple[Schedule, ...]) -> list[tuple[int, int]]:
    """The global batches the rows serve, as (lowest, highest) ranges, adjacent ones merged."""
    ranges: list[tuple[int, int]] = []
    for lowest, row in _served(rows):
        if ranges and ranges[-1][1] == lowest - 1:
            lowest = ranges.pop()[0]
        ranges.append((lowest, row.batch))
    return ranges


def lars_schedule(cfg: ResNetConfig, global_batch: int) -> Schedule:
    """The row that serves `global_batch`. A batch no row serves is refused in one line that names the batches
    the table covers."""
    for lowest, row in _served(cfg.lars):
        if lowest <= global_batch <= row.batch:
            return row
    covered = ", ".join(f"{low:,} to {high:,}" for low, high in lars_coverage(cfg.lars))
    raise SystemExit(f"resnet: no reference submission's LARS hyperparameters cover a global batch of "
                     f"{global_batch:,}; the table (workloads/resnet/config.py) covers {covered}")


def sgd_schedule(cfg: ResNetConfig, global_batch: int) -> Schedule:
    """SGD's LR scales linearly with the global batch, rounded to the 0.001 grid the closed rules require."""
    return Schedule(global_batch, max(0.001, round(cfg.base_lr * global_batch / cfg.lr_batch, 3)),
                    cfg.warmup_epochs, cfg.sgd_epochs, cfg.momentum, cfg.weight_decay, "linear scaling")


def schedule(cfg: ResNetConfig, optimizer: str, global_batch: int) -> Schedule:
    return lars_schedule(cfg, global_batch) if optimizer == C.LARS else sgd_schedule(cfg, global_batch)
