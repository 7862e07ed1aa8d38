"""Training throughput of ResNet-50, BERT-large, a GPT-3-shaped, a Llama-3.1-shaped and a gpt-oss-shaped decoder
and a FLUX.1-shaped transformer per GPU, against issue 14's goals and, for llama31_8b, gpt_oss_20b and flux1, MLPerf
figures per GPU (flux1's an MI325X's: see GOALS).

    python bench/gpu_throughput.py [--workloads resnet,bert,gpt3,llama31_8b,gpt_oss_20b,flux1] [--out-dir results/bench]
    bench/gpu_throughput.sh [same options]     # on a GPU machine with only torch, pandas, matplotlib, pytest

On all visible GPUs (one process each, NCCL, rendezvous on localhost), each workload trains on
synthetic batches and then on files in its real on-disk format written to a temporary folder
(bench/gpu_formats.py); bench/gpu_timing.py times each. Reported per device: samples/s (and
tokens/s and MFU for the decoders, MFU for flux1) over a window after warm-up, peak memory (beside the harness's
estimate of it for the decoders and flux1, and their ratio: docs/measured.md), the spread of
single steps, and the ratio to the goal (ResNet 4,200 img/s, BERT 580 seq/s, GPT MFU 45% per H100;
llama31_8b the model FLOP/s of NVIDIA's v5.1 closed result per Blackwell GPU (GB200 per its log): its
11,980 tokens/s of the whole 8B model times that model's FLOPs per token, against the bench model's
tokens/s times its own, since one GPU holds only a smaller Llama; gpt_oss_20b likewise against Cisco's v6.0 H100
result).
Writes results/bench/gpu-<device>.json (e.g. gpu-nvidia-h100-80gb-hbm3.json) and prints a table;
with --profile-steps N, torch.profiler's operator table of N more steps per workload and data too.

Sizes: on GPUs the full benchmarks' per-GPU shapes (ResNet-50 at batch 256, BERT-large at micro
batch 32 and sequence 512, and for GPT-3, whose 175B model needs many nodes, a GPT-3 XL-shaped
1.3B decoder at sequence 2048, and for llama31_8b, whose 8B model with AdamW needs more than one
GPU's memory, Llama 3.2 1B's shape (16 layers, d_model 2048, 32 heads, 8 key/value heads, SwiGLU
8192, Llama 3's 128,256-token vocabulary) at sequence 8192, micro batch 1; for gpt_oss_20b a half-width 8-layer
gpt-oss; for flux1, whose 11.9B FLUX.1-schnell with fp32 master weights and AdamW needs about 190 GB, FLUX.1's
blocks at schnell's width (hidden 3072, 24 heads) in 4 double-stream and 8 single-stream blocks, 2.55B parameters,
at the real sequence (256 image + 256 text tokens, T5 context 4096, CLIP vector 768) with the reference's micro
batch 16 and activation checkpointing: 42.5 GiB allocated at the peak by the harness's estimate_memory on one
GPU, 46.5 with its reserve); on CPU the tiny presets for a few steps, written to gpu-cpu.json and labelled as no
GPU figure (no goal applies, so no ratio).
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

from gpu_formats import IMAGENET_LIKE_SIZE, write_bert_shards, write_flux_embeddings, write_image_folder, \
    write_llama_corpus, write_megatron_corpus
from gpu_timing import Job, Steps, config_module, run_rank, spread
from summary import machine  # bench/summary.py, beside this script
from workloads.decoder.config import GPT_OSS_20B, LLAMA31_8B  # torch-free
from workloads.flux.config import PRESETS as FLUX_PRESETS  # torch-free

WORKLOADS = ("resnet", "bert", "gpt3", "llama31_8b", "gpt_oss_20b", "flux1")
DECODERS = ("gpt3", "llama31_8b", "gpt_oss_20b")  # rated in tokens/s and MFU too (MFU over active parameters)
DEFAULT_STEPS = {"cuda": Steps(warmup=20, timed=50, spread=20), "cpu": Steps(warmup=2, timed=4, spread=3)}
CPU_NOTE = "CPU tiny mode: not a GPU figure"
GIB = 2**30


@dataclass(frozen=True)
class Goal:
    """A goal per GPU: a rate (samples/s or tokens/s) or an MFU. Issue 14's for one H100 SXM; for llama31_8b,
    NVIDIA's MLPerf figure per GPU (a GB200: no H100 llama31_8b result is in the shared results); for gpt_oss_20b,
    Cisco's (H100)."""

    metric: str  # "samples_per_s", "model_tflops_per_s" (tokens/s x the model's training FLOPs per token) or "mfu"
    value: float
    unit: str
    yardstick: str


# NVIDIA's v5.1 llama31_8b tokens per second per GPU (tests/test_gpu_throughput_bench.py derives it again).
NVIDIA_V51_LLAMA_TOKENS_PER_GPU = 11_980.0
# Cisco's v6.0 gpt_oss_20b on 16 x 8 H100: 294,912 sequences of 8,192 tokens to the target in 34.03 minutes (its
# run_start to run_stop, evaluations included), per GPU.
CISCO_V60_GPT_OSS_TOKENS_PER_GPU = 294_912 * 8192 / (34.03 * 60) / 128
# AMD's v6.0 flux1 on 8 x 8 MI325X: 9,961,472 samples to the target in 4,869 s (run_start to run_stop), per GPU.
AMD_V60_FLUX_SAMPLES_PER_GPU = 9_961_472 / 4_869 / 64
GOALS = {
    "resnet": Goal("samples_per_s", 4200.0, "img/s", "60% of NVIDIA's MLPerf v3.0 7,010 img/s per H100 (MXNet + DALI)"),
    "bert": Goal("samples_per_s", 580.0, "seq/s", "60% of NVIDIA's MLPerf v3.0 970 seq/s per H100 (PyTorch)"),
    "gpt3": Goal("mfu", 0.45, "MFU", "45% MFU (MegaScale 55.2% on 12,288 GPUs; Llama 3 38 to 43%)"),
    # tests/test_gpu_throughput_bench.py derives it again from the result file when ../shared holds it.
    "llama31_8b": Goal("model_tflops_per_s", NVIDIA_V51_LLAMA_TOKENS_PER_GPU * LLAMA31_8B.flops_per_token() / 1e12,
                       "model TFLOP/s",
                       "NVIDIA's MLPerf Training v5.1 closed llama31_8b (the whole Llama 3.1 8B): "
                       "training_v5.1/NVIDIA/results/theia_ngpu512_ngc25.09_nemo/llama31_8b/result_0.txt, global "
                       "batch 64 x 8,192 tokens / median train_step_time 0.0855 s / 512 GPUs = 11,980 tok/s per GPU, "
                       "times the 8B model's training FLOPs per token: the model FLOP/s each GPU sustained, which "
                       "the bench's smaller model can be compared with (its own FLOPs per token times its tokens/s). "
                       "A GB200 figure (its log's submission_platform: 128xNVIDIA GB200; the system description "
                       "systems/theia_ngpu512_ngc25.09_nemo.json names GB300, 4 per node on 128 nodes), not an H100 "
                       "one: no H100 llama31_8b result is in the shared results"),
    "gpt_oss_20b": Goal("model_tflops_per_s", CISCO_V60_GPT_OSS_TOKENS_PER_GPU * GPT_OSS_20B.flops_per_token() / 1e12,
                        "model TFLOP/s",
                        "Cisco's MLPerf Training v6.0 closed gpt_oss_20b on 16 x 8 H100 SXM: "
                        "training_v6.0/Cisco/results/Zeus_16xH100_SXM_80GB/gpt_oss_20b/result_1.txt, 294,912 "
                        "sequences of 8,192 tokens from run_start to run_stop in 34.03 minutes (evaluations "
                        "included, so a lower bound on its training rate) / 128 GPUs, times gpt-oss 20B's "
                        "training FLOPs per token over its 3.77B active parameters"),
    # tests/test_gpu_throughput_bench.py derives it again from the result and system files when ../shared holds them.
    "flux1": Goal("model_tflops_per_s", AMD_V60_FLUX_SAMPLES_PER_GPU * FLUX_PRESETS["full"].flops_per_sample() / 1e12,
                  "model TFLOP/s",
                  "AMD's MLPerf Training v6.0 closed flux1: training_v6.0/AMD/results/8xMI325X_EPYC_9575F_pytorch/"
                  "flux1/result_0.txt, 9,961,472 samples from run_start to run_stop in 4,869 s (evaluations "
                  "included) / 64 GPUs (systems/8xMI325X_EPYC_9575F_pytorch.json: 8 nodes x 8; the platform name "
                  "8xMI325X names a node) = 32.0 samples/s per GPU, times FLUX.1-schnell's training FLOPs per "
                  "sample: an MI325X figure with fp8 linear layers (its lowest_numerical_precision_in_linear), not "
                  "an H100 one: no H100 flux1 result is in the shared results"),
}
UNITS = {"resnet": "img/s", "bert": "seq/s", "gpt3": "seq/s", "llama31_8b": "seq/s", "gpt_oss_20b": "seq/s",
         "flux1": "samples/s"}
# An H100 SXM's 80 GB: the bench's llama31_8b model turns activation checkpointing on only when the harness's
# estimate of its memory per GPU without it exceeds this.
H100_MEMORY_GIB = 80e9 / GIB


def gpt3_bench_preset(on_gpu: bool):
    """GPT-3 as one GPU can hold it: GPT-3 XL's shape (24 layers, d_model 2048, 1.3B parameters; 16 heads of
    128) at sequence 2048 and the 175B preset's optimizer. On CPU the tiny preset. One micro batch per
    step and process (no accumulation), so a step's time is one forward and backward."""
    from workloads.gpt3.config import PRESETS, REFERENCE_BATCH, GPTConfig, base_lr

    if on_gpu:  # the LR of the reference batch: the closed table has none for a batch of 4
        return replace(PRESETS["full"], model=GPTConfig(vocab_size=50_304, seq_len=2048, n_layer=24, n_head=16,
                                                        d_model=2048),
                       global_batch=4, micro_batch=4, tensor_parallel=1, pipeline_parallel=1,
                       activation_checkpointing=False,
                       eval_sequences=8, base_lr=base_lr(PRESETS["full"], REFERENCE_BATCH))
    tiny = PRESETS["tiny"]
    return replace(tiny, global_batch=tiny.micro_batch)


def llama_bench_preset(on_gpu: bool, world: int):
    """llama31_8b as one GPU holds it with AdamW: Decoder 3.2 1B's shape (Llama 3.1's blocks: GQA, SwiGLU, RoPE
    with 3.1's scaling, RMSNorm; untied embeddings, so 1.5B parameters) at sequence 8192 and the full preset's
    optimizer, activation checkpointing only if the estimate without it exceeds an H100's memory. On CPU the
    tiny preset. Micro batch 1 and global batch = world: no accumulation, a step is one forward and backward."""
    from workloads.decoder.config import PRESETS, DecoderConfig, estimate_memory, plan_layout

    if not on_gpu:
        tiny = PRESETS["tiny"]
        return replace(tiny, global_batch=world * tiny.micro_batch)
    cfg = replace(PRESETS["full"], model=DecoderConfig(vocab_size=128_256, seq_len=8192, n_layer=16, n_head=32,
                                                     n_kv_head=8, d_model=2048, ffn_hidden=8192),
                  global_batch=world, micro_batch=1, tensor_parallel=1, activation_checkpointing=False,
                  eval_sequences=8)
    needs = estimate_memory(cfg, plan_layout(cfg, world, world)).total / GIB
    return cfg if needs <= H100_MEMORY_GIB else replace(cfg, activation_checkpointing=True)


def gpt_oss_bench_preset(on_gpu: bool, world: int):
    """gpt_oss_20b as one GPU holds it with AdamW: its blocks (32 experts, top 4, the sliding window, QK norm, RoPE
    150,000) at half its width (d_model 1,440, experts of 1,440, 32 heads of 64, 4 key/value) and 8 layers (2.0B
    parameters with the 128,256-token vocabulary, 0.6B active), at sequence 8192, micro batch 1, the full preset's
    optimizer. On CPU the tiny preset. Global batch = world, as for llama31_8b."""
    from workloads.decoder.config import GPT_OSS_PRESETS, MoeConfig

    if not on_gpu:
        return replace(GPT_OSS_PRESETS["tiny"], global_batch=world)
    model = replace(GPT_OSS_20B, n_layer=8, d_model=1440, n_head=32, n_kv_head=4,
                    moe=MoeConfig(experts=32, top_k=4, hidden=1440))
    return replace(GPT_OSS_PRESETS["full"], model=model, global_batch=world, micro_batch=1,
                   activation_checkpointing=False, eval_sequences=8)


def flux_bench_preset(on_gpu: bool, world: int, steps: Steps):
    """flux1 as one GPU holds it with AdamW: FLUX.1's blocks at schnell's width (hidden 3072, 24 heads of 128, MLP
    12,288, RoPE axes 16 + 56 + 56, the T5 context 4096 and CLIP vector 768) in 4 double-stream and 8 single-stream
    blocks (schnell's 19 and 38 cut to the same 1:2; 2.55B parameters), at the real 256 image + 256
    text tokens, the reference's micro batch 16 and activation checkpointing, the full preset's optimizer: 42.5 GiB
    allocated at the peak by the harness's estimate_memory on one GPU. On CPU the tiny preset. Global batch = world
    x micro batch (no accumulation); the training set is the rows bench/gpu_formats.py writes for the run's steps
    (the workload checks the set's size) and the validation set one sample per timestep."""
    from workloads.flux.config import EVAL_TIMESTEPS, PRESETS

    base = PRESETS["full" if on_gpu else "tiny"]
    model = replace(base.model, depth=4, depth_single_blocks=8) if on_gpu else base.model
    batch = world * base.max_micro_batch
    return replace(base, model=model, global_batch=batch, train_samples=batch * (steps.total + 2),
                   eval_samples=EVAL_TIMESTEPS)


BENCH_PRESETS = {"gpt3": lambda on_gpu, world: gpt3_bench_preset(on_gpu), "llama31_8b": llama_bench_preset,
                 "gpt_oss_20b": gpt_oss_bench_preset}


@dataclass(frozen=True)
class Plan:
    """One workload's run: its preset, what it measures in words, and the preset to register when the
    workload's config has none that fits (the decoders)."""

    preset: str
    measured: str
    extra_preset: object | None = None
    estimate_gib: float | None = None  # the decoders, flux1: the harness's peak estimate less its reserve, in GiB:
    #                                    what torch.cuda.max_memory_allocated measures (GPUs only)


def jpeg_size(on_gpu: bool) -> tuple[int, int]:
    """ImageNet-like JPEGs for ResNet-50; small ones for the tiny ResNet's 32 px crops."""
    return IMAGENET_LIKE_SIZE if on_gpu else (40, 40)


def plan_for(workload: str, on_gpu: bool, world: int, steps: Steps | None = None) -> Plan:
    """`steps`: the run's (default: the device's defaults), which size flux1's training set."""
    if workload == "resnet":
        from workloads.resnet.config import PRESETS

        preset = "full" if on_gpu else "tiny"
        cfg, (width, height) = PRESETS[preset], jpeg_size(on_gpu)
        return Plan(preset, f"ResNet ({cfg.arch}), {cfg.crop} px, batch {cfg.batch_size} per process; files: "
                            f"{width}x{height} JPEGs, {cfg.workers} loader workers per process")
    if workload == "bert":
        from workloads.bert.config import PRESETS, plan_batch

        preset = "full" if on_gpu else "tiny"
        cfg, batch = PRESETS[preset], plan_batch(PRESETS[preset], world)
        m = cfg.model
        return Plan(preset, f"BERT ({m.n_layer} layers, hidden {m.d_model}, {m.params / 1e6:,.1f}M parameters), "
                            f"sequence {m.max_seq_len}, micro batch {batch.micro_batch} x {batch.grad_accum} "
                            f"accumulation per process, global batch {batch.global_batch} ({batch.source})")
    if workload == "flux1":
        from workloads.flux.config import estimate_memory, plan_layout

        cfg = flux_bench_preset(on_gpu, world, steps or DEFAULT_STEPS["cuda" if on_gpu else "cpu"])
        m = cfg.model
        memory = estimate_memory(cfg, plan_layout(cfg, world, world), on_gpu)
        return Plan("bench-gpu" if on_gpu else "bench-cpu",
                    f"FLUX.1-shaped transformer ({m.depth} double-stream and {m.depth_single_blocks} single-stream "
                    f"blocks, hidden {m.hidden_size}, {m.num_heads} heads, {m.params / 1e6:,.1f}M parameters), "
                    f"{cfg.image_tokens} image + {cfg.text_tokens} text tokens, micro batch {cfg.max_micro_batch} per "
                    f"process, no accumulation, activation checkpointing "
                    f"{'on' if cfg.activation_checkpointing else 'off'}, FSDP over {world}"
                    + (estimate_words(memory) if on_gpu else ""),
                    extra_preset=cfg, estimate_gib=memory.allocated / GIB if on_gpu else None)
    config = config_module(workload)  # the decoders: their own memory estimate and layout
    cfg = BENCH_PRESETS[workload](on_gpu, world)
    m = cfg.model
    memory = config.estimate_memory(cfg, config.plan_layout(cfg, world, world))
    if workload == "gpt3":
        shape = f"GPT-3-shaped decoder ({m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads"
    elif m.moe:
        shape = (f"gpt-oss-shaped decoder ({m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads ({m.n_kv_head} "
                 f"key/value), {m.moe.experts} experts of {m.moe.hidden}, top {m.moe.top_k}, "
                 f"{m.active_params / 1e6:,.1f}M active")
    else:
        shape = (f"Llama-3.1-shaped decoder ({m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads ({m.n_kv_head} "
                 f"key/value), SwiGLU {m.ffn_hidden}, vocabulary {m.vocab_size:,}")
    return Plan("bench-gpu" if on_gpu else "bench-cpu",
                f"{shape}, {m.params / 1e6:,.1f}M parameters), sequence {m.seq_len}, micro batch {cfg.micro_batch} "
                f"per process, no accumulation, activation checkpointing "
                f"{'on' if cfg.activation_checkpointing else 'off'}, FSDP over {world}"
                + (estimate_words(memory) if on_gpu else ""),
                extra_preset=cfg, estimate_gib=memory.allocated / GIB if on_gpu else None)


def estimate_words(memory) -> str:
    return (f"; the harness's estimate of its GPU memory: {memory.allocated / GIB:.1f} GiB allocated at the peak, "
            f"{memory.total / GIB:.1f} GiB with the {memory.reserve / GIB:.0f} GiB reserve")


def write_files(workload: str, plan_: Plan, root: Path, on_gpu: bool, world: int, steps: Steps) -> Path:
    """Enough real-format data for every step of the run, in one epoch."""
    steps_needed = steps.total + 2
    if workload == "resnet":
        from workloads.resnet.config import PRESETS

        cfg = PRESETS[plan_.preset]
        return write_image_folder(root, cfg.batch_size * world * steps_needed, jpeg_size(on_gpu), seed=1)
    if workload == "bert":
        from workloads.bert.config import PRESETS, plan_batch

        cfg = PRESETS[plan_.preset]
        rows = plan_batch(cfg, world).global_batch * steps_needed
        return write_bert_shards(root, cfg, rows, cfg.eval_samples or 64, shards=world, seed=1)
    cfg = plan_.extra_preset
    if workload == "flux1":  # the preset's training set holds steps_needed global batches
        return write_flux_embeddings(root, cfg.sample_shape, cfg.train_samples, cfg.eval_samples, seed=1)
    if workload in ("llama31_8b", "gpt_oss_20b"):  # global batch = world: the global batch's windows per step
        return write_llama_corpus(root, cfg.model.vocab_size, cfg.model.seq_len, cfg.global_batch * steps_needed,
                                  cfg.eval_sequences, seed=1)
    return write_megatron_corpus(root, cfg.model.vocab_size, cfg.model.seq_len, cfg.global_batch * world * steps_needed,
                                 cfg.eval_sequences, seed=1)


def resnet_problem() -> str | None:
    """Why ResNet cannot run here (torchvision missing, or built for another torch), or None."""
    try:
        from torchvision.ops import nms

        nms(torch.zeros(1, 4), torch.zeros(1), 0.5)  # its compiled ops load only against the torch they were built for
    except Exception as exc:  # a mismatched build fails in several ways: ImportError, RuntimeError, OSError
        return (f"resnet skipped: torchvision does not work with torch {torch.__version__} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); install the torchvision "
                "built for this torch (bench/wheelhouse.py fill --torch VERSION --torchvision VERSION)")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(workload: str, on_gpu: bool, world: int, steps: Steps, tmp: Path,
            profiles: Path | None) -> tuple[Plan, dict, float]:
    """Write the workload's files, spawn its ranks, and return rank 0's figures for both data kinds (and,
    when steps are profiled, leave the tables at `profiles`-<data>.txt)."""
    plan_ = plan_for(workload, on_gpu, world, steps)
    started = time.perf_counter()
    files = write_files(workload, plan_, tmp / workload / "files", on_gpu, world, steps)
    written_s = time.perf_counter() - started
    job = Job(workload=workload, preset=plan_.preset, steps=steps, files=files, scratch=tmp / workload,
              result=tmp / workload / "figures.json", profiles=profiles, extra_preset=plan_.extra_preset)
    mp.spawn(run_rank, args=(world, free_port(), job), nprocs=world, join=True)
    return plan_, json.loads(job.result.read_text()), written_s


def row(workload: str, data: str, plan_: Plan, figures: dict, device_name: str | None, world: int) -> dict:
    """One table row: per-device rate, tokens/s and MFU (the decoders; flux1 MFU alone; MFU on a GPU the peak table
    knows), memory, spread, and the ratio to the goal (GPUs only: no goal applies to a CPU)."""
    from workloads.common.gpu_peaks import mfu

    goal = GOALS.get(workload)
    per_device = figures["samples"] / figures["window_s"] / world
    tokens, utilisation = None, None
    if workload in DECODERS:
        model = plan_.extra_preset.model
        tokens = per_device * model.seq_len
        utilisation = mfu(model.flops_per_token(), tokens * world, world, device_name) if device_name else None
    elif workload == "flux1" and device_name:
        utilisation = mfu(plan_.extra_preset.flops_per_sample(), per_device * world, world, device_name)
    model_tflops = tokens * plan_.extra_preset.model.flops_per_token() / 1e12 if tokens is not None else \
        per_device * plan_.extra_preset.flops_per_sample() / 1e12 if workload == "flux1" else None
    achieved = {"samples_per_s": per_device, "model_tflops_per_s": model_tflops, "mfu": utilisation}.get(
        goal.metric if goal else None)
    step_times = spread(figures["step_times_s"])
    peak = figures["peak_memory_bytes"]
    estimate = plan_.estimate_gib
    return {"workload": workload, "data": data, "measured": plan_.measured, "preset": plan_.preset,
            "samples_per_s_per_device": round(per_device, 2), "unit": UNITS[workload],
            "tokens_per_s_per_device": round(tokens, 1) if tokens is not None else None,
            "mfu": round(utilisation, 4) if utilisation is not None else None,
            "goal": goal.value if device_name and goal else None, "goal_metric": goal.metric if goal else None,
            "ratio": round(achieved / goal.value, 3) if device_name and achieved is not None else None,
            "peak_memory_gib": round(peak / GIB, 2) if peak is not None else None,
            "estimated_memory_gib": round(estimate, 2) if estimate is not None else None,
            "peak_over_estimate": round(peak / GIB / estimate, 3) if peak is not None and estimate else None,
            "step_time_s": {k: round(v, 4) for k, v in step_times.items()} if step_times else None,
            "window_s": round(figures["window_s"], 3), "samples_in_window": figures["samples"],
            "last_loss": round(figures["last_loss"], 4)}


def table(rows: list[dict], not_run: dict[str, str]) -> str:
    """The printed summary: one line per workload and data kind."""
    head = ("workload", "data", "rate per device", "goal", "ratio", "MFU", "peak mem (estimate, peak / estimate)",
            "step s: median [p10, p90]")
    lines = [head]
    for r in rows:
        steps = r["step_time_s"]
        lines.append((r["workload"], r["data"], f"{r['samples_per_s_per_device']:,.1f} {r['unit']}"
                      + (f" ({r['tokens_per_s_per_device']:,.0f} tok/s)" if r["tokens_per_s_per_device"] else ""),
                      "-" if r["goal"] is None else (f"{r['goal']:.0%} MFU" if r["goal_metric"] == "mfu"
                                                     else f"{r['goal']:,.0f} {GOALS[r['workload']].unit}"),
                      "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
                      "-" if r["mfu"] is None else f"{r['mfu']:.1%}",
                      memory_cell(r),
                      "-" if steps is None else f"{steps['median']:.3f} [{steps['p10']:.3f}, {steps['p90']:.3f}]"))
    lines += [(workload, "-", why, "", "", "", "", "") for workload, why in not_run.items()]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def memory_cell(r: dict) -> str:
    """The measured peak beside the harness's estimate of it and their ratio, so that every GPU run checks the
    memory model again (docs/measured.md)."""
    peak, estimate = r["peak_memory_gib"], r.get("estimated_memory_gib")
    measured = "-" if peak is None else f"{peak:.1f} GiB"
    if estimate is None:
        return measured
    ratio = f", {r['peak_over_estimate']:.2f}" if r.get("peak_over_estimate") is not None else ""
    return f"{measured} (estimate {estimate:.1f} GiB{ratio})"


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def versions(on_gpu: bool) -> dict:
    nccl = torch.cuda.nccl.version() if on_gpu else None  # a tuple such as (2, 27, 3)
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent.parent / "results" / "bench",
                        help="where gpu-<device>.json goes (default: results/bench)")
    for name, what in (("warmup", "untimed steps first"), ("timed", "steps in the throughput window"),
                       ("spread", "steps timed one by one, for the spread")):
        parser.add_argument(f"--{name}-steps", type=int,
                            help=f"{what} (default: {DEFAULT_STEPS['cuda'].__dict__[name]} on GPUs, "
                                 f"{DEFAULT_STEPS['cpu'].__dict__[name]} on CPU)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="then this many steps under torch.profiler: its operator table per workload and data "
                             "goes beside the JSON, as gpu-<device>-profile-<workload>-<data>.txt (default: 0, none)")
    args = parser.parse_args(argv)
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in chosen if w not in WORKLOADS]
    if unknown or not chosen:
        parser.error(f"--workloads: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(WORKLOADS)}")
    args.workloads = [w for w in WORKLOADS if w in chosen]
    for name, least in (("warmup", 0), ("timed", 1), ("spread", 1), ("profile", 0)):
        value = getattr(args, f"{name}_steps")
        if value is not None and value < least:
            parser.error(f"--{name}-steps must be {least} or more, not {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    world = torch.cuda.device_count() if on_gpu else 1
    default = DEFAULT_STEPS["cuda" if on_gpu else "cpu"]
    steps = Steps(*(getattr(args, f"{n}_steps") if getattr(args, f"{n}_steps") is not None else getattr(default, n)
                    for n in ("warmup", "timed", "spread")), profiled=args.profile_steps)
    device_name = torch.cuda.get_device_name(0) if on_gpu else None
    stem = f"gpu-{device_slug(device_name) if device_name else 'cpu'}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows, skipped, failed = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        for workload in args.workloads:
            problem = resnet_problem() if workload == "resnet" else None
            if problem:
                skipped[workload] = problem
                print(problem, file=sys.stderr)
                continue
            try:
                profiles = args.out_dir / f"{stem}-profile-{workload}" if steps.profiled else None
                plan_, figures, written_s = measure(workload, on_gpu, world, steps, Path(tmp), profiles)
            except mp.ProcessRaisedException as exc:  # a rank failed: report it, go on with the next workload
                failed[workload] = f"failed: {str(exc).strip().splitlines()[-1]}"
                print(f"gpu_throughput: {workload} failed on a rank:\n{exc}", file=sys.stderr)
                continue
            except mp.ProcessExitedException as exc:  # killed (out of memory) or a SystemExit, printed above
                failed[workload] = f"failed: a rank exited with code {exc.exit_code} (see its message above)"
                continue
            except ValueError as exc:  # the workload's plan refuses this GPU count (BERT's reference batches)
                failed[workload] = f"failed: {exc}"
                continue
            rows += [{**row(workload, data, plan_, f, device_name, world),
                      "profile": f"{profiles.name}-{data}.txt" if profiles else None} for data, f in figures.items()]
            print(f"gpu_throughput: {workload} done (its files took {written_s:.1f} s to write)", file=sys.stderr)
    report = {
        "device": device_name or "cpu",
        **({} if on_gpu else {"note": CPU_NOTE}),
        "devices": world,
        "machine": machine(),
        **versions(on_gpu),
        "steps": {"warmup": steps.warmup, "timed": steps.timed, "spread": steps.spread, "profiled": steps.profiled},
        "how": "per device = samples over all ranks / the slowest rank's window / devices; the window runs between "
               "two device synchronisations after the warm-up; step_time_s is from steps synchronised one by one",
        "goals": {w: {"metric": g.metric, "value": g.value, "unit": g.unit, "yardstick": g.yardstick}
                  for w, g in GOALS.items()},
        "results": rows,
        "skipped": skipped,
        "failed": failed,
    }
    path = args.out_dir / f"{stem}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(table(rows, {**skipped, **failed}))
    print(f"wrote {path}" + ("" if on_gpu else f" ({CPU_NOTE})"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
