"""Every benchmark the harness trains, in one table: `harness run`'s choices, the spec's validation, the
workers' dispatch and parser (each benchmark's own options, declared with it) and the docs read it from here.
No torch: the CLI imports this to answer instantly.

Runs per result are MLPerf's own (mlperf-logging's get_result_file_counts, see harness.results.score).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


CHECKPOINT_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class Benchmark:
    name: str
    workload: str  # "module:Class", imported by the worker only
    presets: tuple[str, ...]  # the first is the default
    init_checkpoint: str | None = None  # the full preset starts from MLPerf's reference checkpoint, in this form
    fine_tunes: bool = False  # trains adapters on given weights: --init-checkpoint even on synthetic input
    presets_table: str | None = None  # "module:TABLE", torch-free, whose TABLE[preset].model.params counts the parameters
    # One closed run's GPU-minutes in a cited MLPerf result (score x accelerators, official-scores.json): what the
    # campaign plan divides by a job's GPUs for its expected time-to-train (harness.campaign_plan.run_minutes).
    gpu_minutes: float | None = None
    # Keys whose values the rules fix in every division at a scale no CPU trains (deepseekv3_671b's open rules too
    # ask for 15,360 sequences of 4,096 tokens a step): a tiny run's log can fail those checks and no other.
    scale_keys: tuple[str, ...] = ()
    # "module:FUNCTION", torch-free: FUNCTION(name) gives the worker options this benchmark takes that not every
    # benchmark does, {flag: argparse keywords}; the shared parser adds each once and refuses it to the others
    # (worker_options). Declared with the benchmark, so that no shared module imports one.
    options: str | None = None

    def checkpoint_bytes(self, preset: str) -> int | None:
        """One checkpoint of `preset`: fp32 weights and the optimizer's two fp32 moments, 12 bytes a parameter (the
        memory estimates' weights and optimizer terms; 2.1 TB for GPT-3 175B). None where no config counts them."""
        if self.presets_table is None:
            return None
        return CHECKPOINT_BYTES_PER_PARAM * self.preset_configs()[preset].model.params

    def preset_configs(self) -> dict:
        """The presets_table itself (a dict: preset name -> config)."""
        module, table = self.presets_table.split(":")
        return getattr(importlib.import_module(module), table)

    def own_options(self) -> dict[str, dict]:
        """This benchmark's own worker options, {flag: argparse keywords} (see `options`)."""
        if self.options is None:
            return {}
        module, function = self.options.split(":")
        return getattr(importlib.import_module(module), function)(self.name)

    def workload_class(self):
        module, name = self.workload.split(":")
        return getattr(importlib.import_module(module), name)


# The decoders' options (--learning-rate and --warmup-samples by their RCP tables, which flux1's rows join;
# --pipeline-parallel): one function for the benchmarks those tables name.
DECODER_OPTIONS = "workloads.decoder.stages:worker_options"

BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    # gpu_minutes: resnet v4.0 GigaComputing G593-SD1 (8 H100, 13.2 min); bert v5.0 ASUSTeK ESC_N8_E11 (8 H100,
    # 5.1 min); gpt3 v3.0 NVIDIA+CoreWeave n96 (768 H100, 45.6 min); llama31_8b v5.1 NVIDIA Theia (512 GB300,
    # 5.2 min: no H100 result is in the shared set); gpt_oss_20b v6.0 Cisco (128 H100, 34.0 min, docs/measured.md);
    # llama2_70b_lora v5.0 ASUSTeK twcc_n2 (16 H100, 13.3 min); deepseekv3_671b v6.0 NVIDIA theia_ngpu256 (256 GB300,
    # 34.1 min: the single log in the shared v6.0 set, run_stop - run_start; no official score is in the shared set);
    # flux1 v6.0 AMD 8xMI325X (8 nodes x 8 MI325X per its system file, 81.2 min: the single flux1 log in the shared
    # set, run_stop - run_start; no H100 result nor official score is in it).
    Benchmark("resnet", "workloads.resnet.train:ResNetWorkload", ("tiny", "full"), gpu_minutes=106,
              options="workloads.resnet.config:worker_options"),
    Benchmark("bert", "workloads.bert.train:BertWorkload", ("tiny", "full"),
              init_checkpoint="FILE (a PyTorch state dict)", presets_table="workloads.bert.config:PRESETS", gpu_minutes=41),
    Benchmark("gpt3", "workloads.gpt3.train:GPT3Workload", ("tiny", "full"),
              init_checkpoint="DIR (a torch.distributed.checkpoint folder)", presets_table="workloads.gpt3.config:PRESETS",
              gpu_minutes=35_025),
    Benchmark("llama31_8b", "workloads.decoder.pretrain:PretrainWorkload", ("tiny", "full"),
              presets_table="workloads.decoder.config:PRESETS", gpu_minutes=2_672, options=DECODER_OPTIONS),
    Benchmark("gpt_oss_20b", "workloads.decoder.pretrain:PretrainWorkload", ("tiny", "full"),
              presets_table="workloads.decoder.config:GPT_OSS_PRESETS", gpu_minutes=4_356,
              options=DECODER_OPTIONS),
    Benchmark("llama2_70b_lora", "workloads.decoder.lora:LlamaLoraWorkload", ("tiny", "full"),
              init_checkpoint="DIR (a checkpoint `python -m workloads.decoder.convert` wrote from Hugging Face's)",
              fine_tunes=True, gpu_minutes=213, options=DECODER_OPTIONS),
    Benchmark("deepseekv3_671b", "workloads.decoder.pretrain:PretrainWorkload", ("tiny", "full"),
              init_checkpoint="DIR (a checkpoint `python -m workloads.decoder.convert` wrote from Hugging Face's)",
              presets_table="workloads.decoder.config:DEEPSEEK_PRESETS", gpu_minutes=8_727,
              scale_keys=("global_batch_size", "max_sequence_length", "eval_samples"), options=DECODER_OPTIONS),
    Benchmark("flux1", "workloads.flux.train:FluxWorkload", ("tiny", "full"),
              presets_table="workloads.flux.config:PRESETS", gpu_minutes=5_194, options=DECODER_OPTIONS),
)}

def worker_options() -> dict[str, tuple[dict, tuple[str, ...]]]:
    """Every benchmark's own worker options: flag -> (argparse keywords, the benchmarks that take it, in this
    table's order). Imports the benchmarks' torch-free configs: for the workers' parser and the spec's checks."""
    options: dict[str, tuple[dict, tuple[str, ...]]] = {}
    for benchmark in BENCHMARKS.values():
        for flag, settings in benchmark.own_options().items():
            options[flag] = (settings, (*options.get(flag, (settings, ()))[1], benchmark.name))
    return options


# Presets that read a real dataset unless --synthetic is given (the tiny ones generate theirs).
DATASET_PRESETS = ("full",)


def missing_inputs(benchmark: str, preset: str, data, init_checkpoint, synthetic: bool) -> list[str]:
    """What a run of `preset` lacks before it can start, one line each. One place for both doors: `harness run`'s
    spec (a dry run shows them as notes) and the worker's own command line, so that a run started by hand
    (`python -m workloads ...`) stops before it builds a model or logs a line, and a full preset never trains on
    a tiny preset's generated input."""
    b = BENCHMARKS[benchmark]
    missing = []
    if preset in DATASET_PRESETS and data is None and not synthetic:
        missing.append(f"preset {preset!r} trains on the real dataset: give --data PATH, "
                       "or --synthetic to measure throughput on generated input")
    if init_checkpoint is None and b.init_checkpoint:
        if b.fine_tunes and synthetic:
            missing.append(f"{benchmark} fine-tunes pretrained weights: give --init-checkpoint {b.init_checkpoint}, "
                           "also with --synthetic")
        elif preset in DATASET_PRESETS and not synthetic:
            missing.append(f"{benchmark} starts from MLPerf's reference checkpoint: give --init-checkpoint "
                           f"{b.init_checkpoint}")
    return missing
