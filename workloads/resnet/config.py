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


# LARS's hyperparameters by the global batch they were tuned at: the reference convergence points (RCPs) of
# mlperf-logging's rcp_checker/training_4.0.0/rcps_resnet.json (resnet's ruleset; the same batches since 2.0.0),
# each with that file's own LR, warmup, momentum and weight decay, and the reference submissions' configs
# (mlcommons/training_results_vX.Y, NVIDIA/benchmarks/resnet/implementations/...) and logs. A row serves the batches
# above the previous row's up to its own, as NVIDIA's 316-node config takes the 49k-batch hyperparameters at
# 40,448 ("using hparams for 49k GBS"): the RCP's minimum epochs grow with the batch, so a row whose last epoch
# reaches the minimum at its own batch reaches it below too (mlperf-logging's check_directory, pruned RCPs: tested
# at every row's edges). Below 1,536 (no RCP, no submission) the first row serves: the checker judges a batch below
# its smallest RCP against that RCP (1,632), which a run converging at the row's 37th epoch passes.
#
# An RCP row's epochs (where its decay ends and the run stops) come from the RCP's `opt_learning_rate_decay_steps`:
# D = steps x batch / 1,281,167 (ImageNet's training images), rounded. The RCPs count those steps either from the
# first step (4,096: 13,137 steps = the reference README's --train_epochs=42) or after warmup (the TF2 reference's
# lars_util.py logs train_steps - warmup_steps + 1), and their own runs converged within their schedule, so a row
# takes D where D reaches the RCP's slowest run, and D + warmup where it does not (8,192: D 39, runs to 44 epochs:
# 44; 65,536: D 58, runs to 86: 89, against the 90 NVIDIA's v2.0 config gives the same hyperparameters at 67,456).
RCP = "mlperf-logging rcp_checker/training_4.0.0/rcps_resnet.json"
REFERENCE_LARS = (
    Schedule(1536, 7.2, 2, 37, 0.9, 0.0002, "tinycorp's v4.0 closed logs (tinybox green and red, RCP passed)"),
    Schedule(1600, 7.4, 2, 37, 0.9, 5e-05, "v4.0 l40s_n2_ngc24.04_mxnet/config_L40S_2x4x204.sh"),
    Schedule(1632, 7.4, 2, 37, 0.9, 5e-05, f"{RCP} resnet_ref_1632 (27,476 steps: D 35, runs to 37)"),
    Schedule(3200, 11.0, 2, 37, 0.9, 5e-05, "v3.1 mxnet/config_DGXH100.sh; GigaComputing's v4.0 G593-SD1 logs"),
    Schedule(3264, 10.5, 2, 37, 0.9, 5e-05, f"{RCP} resnet_ref_3264 (14,523 steps: D 37, runs to 37)"),
    Schedule(4096, 10.0, 5, 42, 0.9, 0.0002, f"{RCP} resnet_ref_4096 (13,137 steps: D 42, runs to 42); mlcommons/"
                                             "training image_classification/README_tensorflow2.md (TPU-v3-64)"),
    Schedule(8192, 17.0, 5, 44, 0.9, 0.0002, f"{RCP} resnet_ref_8192 (6,095 steps: D 39, runs to 44)"),
    Schedule(13056, 12.8, 9, 48, 0.9, 2.5e-05, f"{RCP} resnet_ref_13056 (4,710 steps: D 48, runs to 46)"),
    Schedule(32768, 21.2, 16, 58, 0.94, 2.5e-05, f"{RCP} resnet_ref_32768 (2,267 steps: D 58, runs to 57)"),
    Schedule(35840, 21.9, 17, 60, 0.94, 2.5e-05, "v1.0 mxnet/config_DGXA100_multi_128x8x35_sharp.sh"),
    Schedule(40448, 19.4, 24, 70, 0.95, 0.0001, "v4.0 eos_n316_ngc24.04_mxnet/config_DGXH100_multi_316x8x16.sh"),
    Schedule(49152, 19.405, 24, 71, 0.951807, 0.0001, f"{RCP} resnet_ref_49152 (1,846 steps: D 71, runs to 69)"),
    Schedule(57344, 23.0, 32, 78, 0.95, 2.5e-05, "v4.0 coreweave_hgxh100_n448_ngc23.04_mxnet/"
                                                 "config_DGXH100_multi_448x8x16.sh (NVIDIA+CoreWeave's v3.0 run)"),
    Schedule(58880, 23.246, 29, 82, 0.951807, 0.0001, f"{RCP} resnet_ref_58880 (1,785 steps: D 82, runs to 81)"),
    Schedule(65536, 24.699, 31, 89, 0.951807, 0.0001, f"{RCP} resnet_ref_65536 (1,133 steps: D 58, runs to 86)"),
    Schedule(67456, 24.699, 31, 90, 0.951807, 0.0001, "v2.0 mxnet/config_DGXA100_multi_527x8x16xgbn2_larsv2.sh"),
    Schedule(67840, 24.699, 31, 91, 0.951807, 0.0001, f"{RCP} resnet_ref_67840 (1,133 steps: D 60, runs to 87)"),
)
# training_rules.adoc (the ResNet rows of its hyperparameter table): lars_opt_momentum is "0.9 for batch<32k,
# otherwise arbitrary constant". A row with another momentum serves no batch below this, which leaves 13,057 to
# 32,767 without a row: no RCP or reference submission gives momentum-0.9 hyperparameters there. The 13,056 row
# cannot stretch up: its 48 epochs fall below the pruned RCPs' minimum from a batch of about 22,400 (55.4 epochs
# at 32,768), and below that no run shows it converging at a batch larger than its own, so those batches are
# refused rather than run on another batch's schedule. Above 67,840, the largest RCP, the RCP checker itself
# fails every run ("Missing RCP").
FREE_MOMENTUM_FROM = 32768

# Where the training and eval JPEGs are decoded (see workloads/resnet/data.py): "workers", in the DataLoader's
# worker processes (libjpeg-turbo); "device", in one batched call on the run's device (nvjpeg on CUDA), the
# workers only reading the files and drawing each sample's crop and flip.
DECODE_CHOICES = ("workers", "device")


def worker_options(benchmark: str) -> dict[str, dict]:
    """The worker options resnet takes and the other benchmarks refuse (workloads.registry.Benchmark.options)."""
    return {"--decode": {"choices": DECODE_CHOICES,
                         "help": "resnet only: decode the JPEGs in the loader workers or on the run's device"}}


@dataclass(frozen=True)
class ResNetConfig:
    arch: str  # "resnet50" (torchvision's v1.5) or "tiny"
    crop: int  # training/eval crop in pixels
    classes: int
    batch_size: int  # per process
    sgd_epochs: int  # SGD's schedule length and last epoch (LARS's come from its table)
    lars_from_batch: int  # LARS from this global batch up, SGD below it, unless --optimizer forces either
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
    decode: str = "workers"  # one of DECODE_CHOICES; --decode on `harness run`
    # DDP's all-reduce bucket: ResNet-50's 100 MB of fp32 gradients in 4 buckets, the first of them ready
    # early in the backward pass (torch's default, not yet tuned on a GPU: bench/gpu_throughput.py measures it).
    bucket_mb: int = 25
    # The eval set's images, which decide the eval's last batch: ImageNet's validation set (data.IMAGENET_EVAL_SAMPLES).
    # The warm-up compiles for that batch before run_start, when the dataset may not be read yet.
    eval_images: int = 50_000


PRESETS = {
    # MLPerf closed: ResNet-50 v1.5, 224 px, target 75.9% top-1, eval every 4 epochs.
    # LARS at every global batch: every RCP (1,632 up) and every v3.0+ submission in the shared logs (1,536 up)
    # runs it. No RCP or submission runs SGD under the rules' poly schedule, so SGD (forced) and its 41 epochs
    # follow no reference.
    "full": ResNetConfig(arch="resnet50", crop=224, classes=1000, batch_size=256, sgd_epochs=41, lars_from_batch=1,
                         eval_every=4, target=0.759, base_lr=0.1, lr_batch=256, warmup_epochs=5),
    # A small ResNet on the generated 32 px, 10-class dataset: reaches its target in about half a minute on 2 CPU cores.
    "tiny": ResNetConfig(arch="tiny", crop=32, classes=10, batch_size=32, sgd_epochs=20, lars_from_batch=4096,
                         eval_every=1, target=0.90, base_lr=0.2, lr_batch=64, warmup_epochs=1,
                         lars=(Schedule(4096, 10.0, 1, 20, 0.9, 5e-05, "the tiny preset's own (open division)"),),
                         workers=0, eval_images=1_000),  # data.TINY_EVAL_PER_CLASS x TINY_CLASSES (tests/test_warm_up.py)
}


def default_optimizer(cfg: ResNetConfig, global_batch: int) -> str:
    """The optimizer a run uses unless --optimizer forces one (the preset's lars_from_batch)."""
    return C.LARS if global_batch >= cfg.lars_from_batch else C.SGD


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
    """The row that serves `global_batch`. A batch no row serves is refused (ValueError) in one line that names
    the batches the table covers."""
    for lowest, row in _served(cfg.lars):
        if lowest <= global_batch <= row.batch:
            return row
    covered = ", ".join(f"{low:,} to {high:,}" for low, high in lars_coverage(cfg.lars))
    raise ValueError(f"resnet: no reference point's LARS hyperparameters cover a global batch of "
                     f"{global_batch:,}; the table (workloads/resnet/config.py) covers {covered}")


def sgd_schedule(cfg: ResNetConfig, global_batch: int) -> Schedule:
    """SGD's LR scales linearly with the global batch, rounded to the 0.001 grid the closed rules require."""
    return Schedule(global_batch, max(0.001, round(cfg.base_lr * global_batch / cfg.lr_batch, 3)),
                    cfg.warmup_epochs, cfg.sgd_epochs, cfg.momentum, cfg.weight_decay, "linear scaling")


def schedule(cfg: ResNetConfig, optimizer: str, global_batch: int) -> Schedule:
    return lars_schedule(cfg, global_batch) if optimizer == C.LARS else sgd_schedule(cfg, global_batch)


@dataclass(frozen=True)
class Plan:
    """What one run trains with on `world` processes: decided the same way by the worker and by the dry run."""

    world: int
    batch_size: int  # per process
    optimizer: str  # mllog's constants.LARS or constants.SGD
    schedule: Schedule

    @property
    def global_batch(self) -> int:
        return self.world * self.batch_size


def plan_run(cfg: ResNetConfig, world: int, optimizer: str | None = None) -> Plan:
    """The global batch, the optimizer (`optimizer`, else the preset's choice for that batch) and its schedule.
    A global batch the LARS table does not cover raises ValueError naming the covered batches, so that `harness
    run` refuses it when it renders the request (harness.launchers.base.workload_plan), before any process starts,
    and a worker started some other way refuses it before the model is built."""
    global_batch = world * cfg.batch_size
    chosen = optimizer or default_optimizer(cfg, global_batch)
    try:
        return Plan(world, cfg.batch_size, chosen, schedule(cfg, chosen, global_batch))
    except ValueError as exc:
        raise ValueError(f"{exc}: choose the processes ({world} now) and --batch-size ({cfg.batch_size} now) "
                         "for a global batch it covers") from None


def describe(plan: Plan) -> list[str]:
    """The line `--dry-run` shows."""
    s = plan.schedule
    return [f"resnet batch: global {plan.global_batch:,} = {plan.world} processes x {plan.batch_size}; "
            f"{plan.optimizer} at base LR {s.base_lr:g}, {s.warmup_epochs} warmup epochs of {s.epochs}, "
            f"momentum {s.momentum:g}, weight decay {s.weight_decay:g} ({s.source})"]
