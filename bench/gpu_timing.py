"""One rank of bench/gpu_throughput.py: build a workload, warm it up, time it, and report.

The workload is driven through the interface the training loop uses (workloads.common.loop):
`batches(0)` then `train_step(batches)`, so whatever a workload does inside its step (compiled
graphs, fused optimizers, loader workers) is what gets measured. Per data kind:

- warm-up steps, untimed (compilation, cuDNN autotuning, loader workers starting);
- a window of steps between two device synchronisations: the throughput (the loss stays on the
  device, as the loop leaves it);
- then steps with a synchronisation after each: the step-time spread.

The workloads are the harness's own (workloads/registry.py). A benchmark whose full preset starts
from MLPerf's reference checkpoint (the registry's `init_checkpoint`: BERT, a state dict; GPT-3, a
DCP folder) refuses to train a non-tiny preset from nothing, so its run on files starts from the
synthetic run's weights, saved in that form; ResNet-50, llama31_8b, gpt_oss_20b and flux1 train from
scratch, so theirs needs none.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from workloads.registry import BENCHMARKS


def config_module(workload: str):
    """The workload's config module (workloads/<package>/config.py, beside its registered class): its memory
    estimate and layout (the presets themselves: the registry's preset_configs)."""
    package = BENCHMARKS[workload].workload.split(":")[0].rsplit(".", 1)[0]
    return importlib.import_module(f"{package}.config")


@dataclass(frozen=True)
class Steps:
    warmup: int
    timed: int
    spread: int
    profiled: int = 0  # last, under torch.profiler: where a step's time goes

    @property
    def total(self) -> int:
        return self.warmup + self.timed + self.spread + self.profiled


@dataclass(frozen=True)
class Job:
    """What every rank runs for one workload."""

    workload: str
    preset: str
    steps: Steps
    files: Path  # the real-format data bench/gpu_formats.py wrote
    scratch: Path  # run folders and the starting checkpoint
    result: Path  # rank 0 writes the figures here (JSON)
    profiles: Path | None = None  # and, when steps are profiled, a table per data kind here (<stem>-<data>.txt)
    seed: int = 0
    # A preset the workload's config does not have (GPT-3's and llama31_8b's single-GPU models): registered in
    # each rank.
    extra_preset: object | None = None


def run_rank(local_rank: int, world: int, port: int, job: Job) -> None:
    """torch.multiprocessing.spawn's entry: one process per GPU (one on CPU), rendezvous on localhost."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    if "OMP_NUM_THREADS" not in os.environ and (world > 1 or not torch.cuda.is_available()):
        # One intra-op thread per rank, as torchrun gives the harness's ranks (its CPU runs have two): on a
        # shared CPU, OpenMP threads that spin waiting for a busy core slowed tiny BERT fifteen-fold here.
        torch.set_num_threads(1)
    from workloads.common.distributed import init_distributed, shutdown_distributed

    ctx = init_distributed()
    if job.extra_preset is not None:
        BENCHMARKS[job.workload].preset_configs()[job.preset] = job.extra_preset
    workload_cls = BENCHMARKS[job.workload].workload_class()
    figures = {}
    start_weights = None
    for data in ("synthetic", "files"):
        figures[data], start_weights = _measure_kind(workload_cls, job, ctx, data, start_weights)
    if ctx.is_main:
        job.result.write_text(json.dumps(figures))
    shutdown_distributed()


def _measure_kind(workload_cls, job: Job, ctx, data: str, start_weights: Path | None) -> tuple[dict, Path | None]:
    from workloads.common.campaign import RunOptions

    synthetic = data == "synthetic"
    opts = RunOptions(benchmark=job.workload, preset=job.preset, out=job.scratch / data, runs=1, seed=job.seed,
                      submitter="bench", system=None, data=None if synthetic else job.files, synthetic=synthetic,
                      max_steps=job.steps.total + 1, batch_size=None,
                      init_checkpoint=None if synthetic else start_weights)
    torch.manual_seed(job.seed + ctx.rank)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    workload = workload_cls(opts, ctx, job.seed)
    workload.open_data()  # what a run does at run_start
    batches = workload.batches(0)  # one stream for every phase: a new one would restart the loader's workers
    figures = _time_steps(workload, batches, job.steps, ctx)
    if job.steps.profiled:
        table = _profile_steps(workload, batches, job.steps.profiled, ctx)
        if ctx.is_main:
            Path(f"{job.profiles}-{data}.txt").write_text(table)
    starts_from = BENCHMARKS[job.workload].init_checkpoint  # None: trains from scratch, needs no weights
    if synthetic and starts_from:
        start_weights = _save_start_weights(starts_from, workload.model, job.scratch / "start", ctx)
    del workload, batches
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return figures, start_weights


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(workload, batches, steps: Steps, ctx) -> dict:
    for _ in range(steps.warmup):
        workload.train_step(batches)
    _sync(ctx.device)
    samples = 0
    started = time.perf_counter()
    for _ in range(steps.timed):
        loss, trained = workload.train_step(batches)
        samples += trained
    _sync(ctx.device)
    window = time.perf_counter() - started
    step_times = []
    for _ in range(steps.spread):
        started = time.perf_counter()
        loss, _ = workload.train_step(batches)
        _sync(ctx.device)
        step_times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
    # The slowest rank sets the pace; the largest peak is the one that must fit.
    worst = torch.tensor([window, float(peak)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    window, peak = worst.tolist()
    return {"samples": samples, "window_s": window, "step_times_s": step_times,
            "peak_memory_bytes": int(peak) if ctx.device.type == "cuda" else None, "last_loss": float(loss)}


def _profile_steps(workload, batches, steps: int, ctx) -> str:
    """torch.profiler's operator table over `steps` more steps, by time on the device (CPU time on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = ctx.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]) as prof:
        for _ in range(steps):
            workload.train_step(batches)
        _sync(ctx.device)
    return prof.key_averages().table(sort_by="self_device_time_total" if on_gpu else "self_cpu_time_total",
                                     row_limit=30)


def _save_start_weights(form: str, model: torch.nn.Module, path: Path, ctx) -> Path:
    """The model's weights where the workload's --init-checkpoint reads them, in the registry's form: "DIR (...)"
    a DCP folder, "FILE (...)" a state dict. get_model_state_dict names them as the bare model does, whatever
    wraps it (DDP, FSDP, torch.compile)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)
    if form.startswith("DIR"):
        dcp.save({"model": state}, checkpoint_id=str(path))
    else:
        path = path.with_suffix(".pt")
        if ctx.is_main:
            torch.save(state, path)
    dist.barrier()
    return path


def spread(step_times: list[float]) -> dict[str, float] | None:
    """Median, p10, p90, min and max of per-step seconds (None when no step was timed alone)."""
    if not step_times:
        return None
    ordered = sorted(step_times)
    deciles = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) > 1 else ordered * 9
    return {"median": statistics.median(ordered), "p10": deciles[0], "p90": deciles[-1], "min": ordered[0],
            "max": ordered[-1]}
