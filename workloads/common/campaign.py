"""The benchmark-independent part of a campaign: K runs, each a complete MLPerf timed run.

For every run this module owns what the rules fix (dropping the page cache and cache_clear,
init_start/stop, the submission keys, the seed, run_start, run_stop with its status); the
workload owns its model, data, hyperparameters and step, and workloads.common.loop trains it.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import platform
import random
import re
import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from mlperf_logging.mllog import constants as C

from workloads.common.compiling import COMPILE_CHOICES, WARM_UP_CHOICES, compile_wanted, warm_up_wanted
from workloads.common.distributed import DistContext, broadcast_object, init_distributed, shutdown_distributed
from workloads.common.inprocess import RESTART_CHOICES
from workloads.common.loop import Target, train
from workloads.common.metrics_feed import FEED
from workloads.common.mlperf import ResultLog, division, logged_run, submission_keys
from workloads.common.page_cache import ALLOW_FLAG, clear_page_caches, refuse_unflushed
from workloads.common.progress import announce
from workloads.common.refusals import ConfigurationError
from workloads.common.resilience import Block, Resilience
from workloads.common.run_record import RunRecord, current_attempt, run_record_path
from workloads.common.system_facts import write_facts
from workloads.common.warm_up import WarmUpInputs, use_campaign_cache, warm_up
from workloads.registry import BENCHMARKS, missing_inputs, worker_options

log = logging.getLogger("workloads")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a refusal with its reason (SystemExit with the text, not argparse's usage
    and exit 2): workloads.__main__ records it for the node agent, whose cause is then that one line; the job's
    command, the same on every node (a ConfigurationError)."""

    def error(self, message: str):
        raise ConfigurationError(f"{self.prog}: error: {message}")


@dataclass(frozen=True)
class RunOptions:
    """The worker's command line, shared by every benchmark (see harness.spec.JobSpec.worker_args)."""

    benchmark: str
    preset: str
    out: Path
    runs: int
    seed: int | None
    submitter: str
    system: str | None
    data: Path | None
    synthetic: bool
    max_steps: int | None
    batch_size: int | None
    init_checkpoint: Path | None = None  # the starting weights (bert, gpt3)
    checkpoint_every: str | None = None  # "50" steps or "10m" (see resilience_options)
    keep_checkpoints: int = 2
    async_checkpoint: bool = False
    restart: str = "in-process"  # or "process" (workloads.common.inprocess)
    inject_failure: str | None = None  # RANK:STEP[:KIND]
    straggler_window: str = "60"  # seconds of training between straggler checks, or "20steps"; "0": none
    straggler_threshold: float = 0.75
    optimizer: str | None = None  # resnet: "sgd" or "lars" whatever the batch (default: the preset's choice)
    compile: str = "auto"  # torch.compile: see workloads.common.compiling
    warm_up: str = "auto"  # the warm-up before run_start: see workloads.common.compiling and warm_up
    global_batch: int | None = None  # llama31_8b, llama2_70b_lora: sequences per optimizer step (default: the preset's)
    force_batch: bool = False  # llama31_8b, llama2_70b_lora: accept a global batch outside the RCP table
    learning_rate: float | None = None  # llama31_8b, llama2_70b_lora: the peak LR (default: the RCP table's)
    warmup_samples: int | None = None  # llama31_8b: the LR warmup in samples (default: the RCP table's)
    pipeline_parallel: int | None = None  # the pretraining decoders: pipeline stages (default: the preset's)
    allow_unflushed_cache: bool = False  # a closed run goes ahead with cache_clear false (page_cache)
    last_run: int | None = None  # the last run (0-based) this launch does, any unfinished before it too (Slurm)
    packing_factor: int = 1  # bert: sequences per row of packed data, on average (1: unpacked)
    decode: str | None = None  # resnet: where its JPEGs are decoded, "workers" or "device" (default: the preset's)

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> "RunOptions":
        p = _Parser(prog="python -m workloads",
                    description="One rank of a benchmark campaign (started by `harness run`).")
        p.add_argument("benchmark", choices=BENCHMARKS)
        p.add_argument("--preset", default="tiny")
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--runs", type=int, default=1)
        p.add_argument("--seed", type=int)
        p.add_argument("--submitter", default="harness")
        p.add_argument("--system")
        p.add_argument("--data", type=Path)
        p.add_argument("--synthetic", action="store_true")
        p.add_argument("--max-steps", type=int)
        p.add_argument("--batch-size", type=int)
        p.add_argument("--init-checkpoint", type=Path)
        p.add_argument("--checkpoint-every")
        p.add_argument("--keep-checkpoints", type=int, default=2)
        p.add_argument("--async-checkpoint", action="store_true")
        p.add_argument("--restart", choices=RESTART_CHOICES, default="in-process")
        p.add_argument("--inject-failure")
        p.add_argument("--straggler-window", default="60")
        p.add_argument("--straggler-threshold", type=float, default=0.75)
        p.add_argument("--optimizer", choices=(C.SGD, C.LARS),
                       help="resnet only: this optimizer whatever the global batch (default: the preset's)")
        p.add_argument("--compile", choices=COMPILE_CHOICES, default="auto")
        p.add_argument("--warm-up", choices=WARM_UP_CHOICES, default="auto")
        p.add_argument("--global-batch", type=int)
        p.add_argument("--force-batch", action="store_true")
        p.add_argument(ALLOW_FLAG, action="store_true")
        # Not a prefix of any torchrun option (argparse would call `--run` ambiguous with torchrun's --run-path).
        p.add_argument("--last-run", type=int, help="do the runs up to this one (0-based; the finished ones are "
                       "skipped) and none after: Slurm's batch script gives each run its own step, after its own "
                       "cache flush")
        p.add_argument("--packing-factor", type=int, default=1)
        # The benchmarks' own options, each from its registry entry: dest -> (flag, the benchmarks taking it).
        owned = {p.add_argument(flag, **settings).dest: (flag, takers)
                 for flag, (settings, takers) in worker_options().items()}
        args = p.parse_args(argv)
        if args.optimizer and args.benchmark != "resnet":
            p.error(f"--optimizer applies to resnet only, not {args.benchmark}")
        for dest, (flag, takers) in owned.items():
            if getattr(args, dest) is not None and args.benchmark not in takers:
                p.error(f"{flag} applies to {', '.join(takers)} only, not {args.benchmark}")
        if args.packing_factor != 1 and args.benchmark != "bert":
            p.error(f"--packing-factor applies to bert only, not {args.benchmark}")
        if args.pipeline_parallel is not None and args.pipeline_parallel < 1:
            p.error(f"--pipeline-parallel counts pipeline stages: 1 or more, got {args.pipeline_parallel}")
        if args.last_run is not None and not 0 <= args.last_run < args.runs:
            p.error(f"--last-run {args.last_run} is not one of the campaign's runs: 0 to {args.runs - 1} "
                    f"(--runs {args.runs})")
        presets = BENCHMARKS[args.benchmark].presets
        if args.preset not in presets:
            p.error(f"unknown preset {args.preset!r} for {args.benchmark}; choose one of: {', '.join(presets)}")
        # Before any process group, model or log line (harness run refuses the same when it builds the spec).
        missing = missing_inputs(args.benchmark, args.preset, args.data, args.init_checkpoint, args.synthetic)
        if missing:
            p.error("; ".join(missing))
        return cls(**vars(args))

    @property
    def division(self) -> str:
        return division(self.preset)


class Workload(ABC):
    """One run of one benchmark: its model, data and step. Built during the untimed init phase; trained
    during the timed run by the one loop in workloads.common.loop, which asks the questions below.

    Subclasses set `model`, `optimizer` and `scheduler` (what a checkpoint saves), `total_steps`, and
    `target`, in the constructor or, where the dataset decides them (ResNet's steps per epoch), in open_data;
    `rate_shown` names the progress bar's rate and the tracked_stats key it shows.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    target: Target
    rate_shown: tuple[str, str] = ("samples/s", "throughput")
    logs_trained_samples = False  # log train_samples (the epoch_num trained) when the run stops
    checkpoint_frozen = True  # checkpoints hold the parameters that do not train too (False: LoRA's frozen base)
    # Ranks hold different parameters (pipeline stages): checkpoints key the optimizer's hyperparameters by parameter
    # name (DCP's flatten_optimizer_state_dict), since each stage's param_groups list other names under one key.
    ranks_hold_other_parameters = False
    eval_count_key = C.EPOCH_NUM  # the eval events' metadata key for epoch_num(step) (newer rules: samples_count)
    eval_also_logged_as: tuple[str, ...] = ()  # keys logged beside eval_accuracy, with its value and metadata

    def __init__(self, opts: RunOptions, ctx: DistContext, seed: int):
        self.opts, self.ctx, self.seed = opts, ctx, seed
        self.compiled = compile_wanted(opts.compile, ctx.device.type)

    @abstractmethod
    def hyperparameters(self) -> dict[str, Any]:
        """The keys the rules ask this benchmark to log, by mllog constant."""

    def open_data(self) -> dict[str, Any]:
        """Open the dataset, after run_start: "The clock must start before any part of the system touches the
        dataset" (training_rules.adoc), so the constructor (the untimed init) must not read it. Returns the
        keys to log that only the data can tell (such as eval_samples)."""
        return {}

    @abstractmethod
    def batches(self, step: int) -> Iterator[Any]:
        """The input of the steps after `step` (0: a fresh run; more: a resumed one continues there)."""

    @abstractmethod
    def train_step(self, batches: Iterator[Any]) -> tuple[torch.Tensor, int]:
        """One optimizer step: the loss (detached, on the device, not yet read) and the samples trained over
        all ranks."""

    @abstractmethod
    def evaluate(self, batches: Iterable[Any] | None = None) -> float:
        """The quality on the whole eval set, the same on every rank; on `batches` instead when given (the
        warm-up's)."""

    @abstractmethod
    def epoch_num(self, step: int) -> int:
        """The log's epoch_num after `step` steps."""

    @abstractmethod
    def next_block(self, step: int) -> Block:
        """The block that begins after `step`."""

    @abstractmethod
    def block_ends(self, step: int) -> bool:
        """Whether an evaluation is due after `step`."""

    def tracked_stats(self, samples_per_second: float) -> dict[str, float]:
        """What the log's tracked_stats records for a block trained at this rate."""
        return {"throughput": samples_per_second}

    def step_starts(self, step: int, mlog: ResultLog) -> None:
        """Before each step (ResNet logs its epochs here)."""

    def step_ended(self, step: int, mlog: ResultLog, last: bool) -> None:
        """After each step and its checkpoint, if one was due."""

    def warm_up_inputs(self) -> WarmUpInputs | None:
        """Synthetic batches of every shape the run will see, built without reading the dataset (see
        workloads.common.warm_up); None: no warm-up, the first steps compile on the clock."""
        return None

    def process_groups(self) -> list[dist.ProcessGroup]:
        """Every process group the run's collectives use, so the warm-up creates each one's communicator."""
        return [dist.group.WORLD]

    def position(self) -> dict[str, Any]:
        """Counters a checkpoint keeps beside the step (JSON), for workloads whose progress the step alone
        does not give, such as BERT's samples trained on packed data."""
        return {}

    def load_position(self, position: dict[str, Any]) -> None:
        """Take back what position() returned when the checkpoint was saved."""

    def close(self) -> None:
        """End the data loaders' worker processes now, by dropping the last reference to the loaders.

        Left to the garbage collector (a workload sits in reference cycles: its LR schedule holds a bound
        method), the loaders' multiprocessing queues are closed before the loaders' finalizer tells their
        workers to stop, and each persistent worker waits out a 5 s join timeout and is then killed."""
        vars(self).pop("loaders", None)


def default_platform(ctx: DistContext) -> str:
    """A system name such as `cpu_n1x2` or `nvidia_h100_80gb_hbm3_n448x8`."""
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    device = re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    return f"{device}_n{ctx.nodes}x{ctx.local_world_size}"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def freeze_init_objects() -> None:
    """Collect what the init left, then move every object still alive (torch's modules, the model, the data's
    lists: 350,000 in the tiny ResNet's process) out of the cyclic collector's reach for the run (gc.freeze).
    Left in, they are scanned by the run's first full collection, which the init's allocations have already
    made due: a pause of about 0.2 s of CPU time (the tiny ResNet's process, bench/loop_overhead.py) inside
    some step, at a moment no other rank shares, so every rank waits for it in the next all-reduce. Called in
    the untimed init (what open_data builds after run_start is frozen too, uncollected); the run's end
    unfreezes them."""
    gc.collect()
    gc.freeze()


def setup_logging(out: Path, rank: int) -> None:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / "logs" / f"rank_{rank}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def open_data(workload: Workload, mlog: ResultLog) -> dict[str, Any]:
    """The workload's open_data(), after run_start. A dataset it refuses (missing, malformed, or not what the
    options declare) ends the run there: run_stop with status aborted, so the log is whole and a restarted
    attempt does not start the run over, then the one-line reason. Other exceptions propagate unlogged, to the
    failure policy (a restart continues the run)."""
    try:
        return workload.open_data()
    except SystemExit:
        mlog.end(C.RUN_STOP, metadata={C.STATUS: C.ABORTED})
        mlog.close()
        raise


# The checker's limit on the init, from the first init_start to init_stop, by division: mlperf-logging's
# compliance_checker/training_6.1.0/common.yaml (`compile_time_mins`; tests/test_warm_up.py reads it there).
INIT_LIMIT_MINUTES = {C.CLOSED: 30, C.OPEN: 240}


def _warm_up(workload: Workload, ctx: DistContext, index: int, opts: RunOptions, init_began: float) -> None:
    """The workload's warm-up (workloads.common.warm_up), in the run record as part of the init, and said; an
    init past the checker's limit is said too (its log will fail the compliance check: the run goes on, since
    its throughput is still worth reading)."""
    wanted = warm_up_wanted(opts.warm_up, ctx.device.type, workload.compiled)
    done = warm_up(workload) if wanted else None
    record = RunRecord(run_record_path(opts.out, index) if ctx.is_main else None, current_attempt())
    now = time.time()
    if not wanted:
        record.moment("warm_up", skipped=f"--warm-up {opts.warm_up}")
    elif done is None:
        record.moment("warm_up", skipped=f"{opts.benchmark} has no warm-up inputs: its first steps compile on the clock")
    else:
        record.interval("warm_up", now - done.seconds, now, details=done.details())
        announce(f"run {index + 1}/{opts.runs}: warmed up before run_start: {done.train_steps} train steps, "
                 f"{done.eval_batches} eval batches, {done.groups} process groups in {done.seconds:.1f} s "
                 f"({done.compile_seconds:.1f} s compiling)", show=ctx.is_main)
    minutes, limit = (now - init_began) / 60, INIT_LIMIT_MINUTES[opts.division]
    if minutes >= limit:
        record.moment("init_over_limit", minutes=round(minutes, 2), limit_minutes=limit)
        announce(f"run {index + 1}/{opts.runs}: the init took {minutes:.1f} min, over the {limit}-minute limit the "
                 f"{opts.division} division's compliance check sets (init_start to init_stop): this log will fail "
                 f"it", show=ctx.is_main)


def run_campaign(workload_cls: type[Workload], opts: RunOptions) -> None:
    """Run opts.runs timed runs, each logged to its own result file.

    A restarted attempt skips the runs that already stopped and continues the one under
    way: same result file, same seed, from its newest checkpoint, without logging the
    untimed init again. A run whose init failed (before run_start) retries it in the same
    file, after what the failed init logged: its init_start stays the only one, so the
    rules' init limit (counted by the checker from the first init_start) sees every attempt.
    With opts.last_run it stops after that run, so that the next one can start after a flush of its own.
    """
    ctx = init_distributed()
    setup_logging(opts.out, ctx.rank)
    use_campaign_cache(opts.out)
    system = opts.system or default_platform(ctx)
    if ctx.is_main:
        write_facts(opts.out, ctx)
    log.info("rank %d/%d on %s (%s), %s, attempt %d, pid %d", ctx.rank, ctx.world_size, platform.node(), ctx.device,
             dist.get_backend(), current_attempt(), os.getpid())
    for index in range(opts.runs if opts.last_run is None else opts.last_run + 1):
        path = opts.out / f"result_{index}.txt"
        logged = broadcast_object(logged_run(path) if ctx.is_main else None, ctx)
        if logged.stopped:
            continue
        mlog = ResultLog(path if ctx.is_main else None)
        if logged.started:
            announce(f"run {index + 1}/{opts.runs}: continuing after a failure (attempt {current_attempt()})",
                     show=ctx.is_main)
        else:
            flushes = clear_page_caches(ctx, opts.out)
            not_dropped = [f"{f.node}: {f.problem}" for f in flushes if f.problem]
            cleared = not not_dropped
            mlog.event(C.CACHE_CLEAR, cleared)
            record = RunRecord(run_record_path(opts.out, index) if ctx.is_main else None, current_attempt())
            record.moment("cache_clear", cleared=cleared, by=sorted({f.by for f in flushes}), **(
                {} if cleared else {"why_not": not_dropped, "accepted": opts.allow_unflushed_cache}))
            if not cleared and opts.division == C.CLOSED and not opts.allow_unflushed_cache:
                raise SystemExit(refuse_unflushed(index, not_dropped))
            record.moment("input", synthetic=opts.synthetic)  # a synthetic run is kept out of scores
            if not logged.init_started:
                mlog.start(C.INIT_START)
            init_began = logged.init_start_ms / 1000 if logged.init_start_ms else time.time()
            mlog.events(submission_keys(opts.benchmark, opts.division, opts.submitter, system), logged.values)
        seed = logged.seed
        if seed is None:
            seed = opts.seed + index if opts.seed is not None else broadcast_object(secrets.randbelow(2**31), ctx)
            mlog.event(C.SEED, seed)
        seed_everything(seed + ctx.rank)
        FEED.run(index)
        workload = workload_cls(opts, ctx, seed)
        # The untimed init of a fresh run (a resumed attempt's clock has run since the first run_start).
        if not logged.started:
            _warm_up(workload, ctx, index, opts, init_began)
        freeze_init_objects()
        try:
            if not logged.started:
                mlog.events(workload.hyperparameters(), logged.values)
                dist.barrier()
                mlog.end(C.INIT_STOP)
                mlog.start(C.RUN_START)
            # Inside the timed run. What an attempt that failed after run_start logged is not logged twice, and
            # what it did not reach (it failed while the data opened) is logged now.
            data_keys = open_data(workload, mlog)
            mlog.events(data_keys, logged.values)
            gc.freeze()  # the data's objects too (ImageNet's list: 1.28M entries), with no collection in the run
            support = Resilience(workload, opts.out, index, opts.checkpoint_every, opts.keep_checkpoints,
                                 opts.async_checkpoint, opts.inject_failure, mlog, opts.straggler_window,
                                 opts.straggler_threshold)
            reached = train(workload, mlog, f"run {index + 1}/{opts.runs}", support)
            status = C.SUCCESS if reached else C.ABORTED
            mlog.end(C.RUN_STOP, metadata={C.STATUS: status})
            mlog.close()
            FEED.state("stopped")
            support.finish()  # after run_stop: a failure in between must not make the run start over
            announce(f"run {index + 1}/{opts.runs}: {status} -> {path}", show=ctx.is_main)
            # The loaders' workers end with the run; the rest of the workload (in reference cycles) is collected
            # now instead of piling up over the campaign.
            workload.close()
            del workload, support
        finally:
            gc.unfreeze()  # frozen cycles are never freed: the collect below would leave the run's workload
        gc.collect()
        dist.barrier()
    shutdown_distributed()
