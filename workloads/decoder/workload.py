"""What the decoder benchmarks' workloads share: the preset at the asked batch, the layout and meshes decided from
it, the split of a batch over context ranks, the step count, inputs built once per node, and the parallelism the
6.1 rules ask every run to disclose. llama31_8b and gpt_oss_20b (pretrain.py) and llama2_70b_lora (lora.py) add
their model, data, optimizer and evaluation.
"""

from __future__ import annotations

import warnings
from abc import abstractmethod
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
from mlperf_logging.mllog import constants as C

from workloads.common.campaign import RunOptions, Workload
from workloads.common.data import data_errors
from workloads.common.distributed import DistContext
from workloads.common.language_model import DecoderSteps, Split, next_token_split
from workloads.common.megatron_data import TokenLoaders
from workloads.common.refusals import ConfigurationError
from workloads.common.resilience import Block, evaluation_block
from workloads.decoder.config import PRESET_TABLES, plan_layout, run_config
from workloads.decoder.parallelize import ContextSplit, build_expert_mesh, build_mesh
from workloads.decoder.stages import with_pipeline

# Weights are drawn on each shard locally, from the seed every rank shares: by design, so torch's warning
# about DTensor random operators on CPU is noise.
warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")


class DecoderWorkload(DecoderSteps, Workload):
    eval_count_key = C.SAMPLES_COUNT  # closed_llama31_8b.yaml, closed_llama2_70b_lora.yaml: in eval_accuracy's metadata

    def __init__(self, opts: RunOptions, ctx: DistContext, seed: int, whole: Split = next_token_split):
        super().__init__(opts, ctx, seed)
        try:
            cfg = with_pipeline(run_config(opts.benchmark, opts.preset, opts.global_batch, opts.force_batch,
                                           learning_rate=opts.learning_rate, warmup_samples=opts.warmup_samples),
                                opts.pipeline_parallel)
            self.layout = layout = plan_layout(cfg, ctx.world_size, ctx.local_world_size)
        except ValueError as exc:  # the plan refuses the job's own numbers, the same on every node
            raise ConfigurationError(f"workloads: {exc}") from None
        self.cfg = cfg
        self.clip_norm = cfg.clip_norm
        self.mesh = build_mesh(layout, ctx.device)
        self.expert_mesh = build_expert_mesh(layout, ctx.device) if cfg.model.moe else None
        self.total_steps = min(opts.max_steps or cfg.step_limit or cfg.max_steps, cfg.max_steps)
        self.split = self.split_over_context(whole)

    def split_over_context(self, whole: Split) -> Split:
        """`whole`'s split of a batch, cut into this rank's chunks under context parallelism."""
        context = self.mesh["context"]
        return ContextSplit(context.get_local_rank(), context.size(), whole) if context.size() > 1 else whole

    def eval_reading(self) -> tuple[int, int]:
        return self.cfg.eval_sequences, self.cfg.eval_batch

    def process_groups(self) -> list[dist.ProcessGroup]:
        experts = self.expert_mesh.get_all_groups() if self.expert_mesh is not None else []
        return self.mesh.get_all_groups() + experts

    def open_data(self) -> dict[str, Any]:
        """The loaders (loaders_for_run). Both benchmarks log eval_samples before run_start from the rules'
        constant (the preset's eval_sequences), as NVIDIA's v5.1 logs do; llama2_70b_lora logs train_samples there
        too, its training set's size (LlamaLoraWorkload.training_set_size), and llama31_8b when the run stops."""
        with data_errors():
            self.loaders = self.loaders_for_run()
        return {}

    @abstractmethod
    def loaders_for_run(self) -> TokenLoaders:
        """The run's loaders: its dataset's files (or a tiny preset's generated ones), or --synthetic's tokens."""

    def reading(self) -> tuple[int, int, dict[str, Any]]:
        """This rank's data rank, the training samples the run reads, and how its loaders read them."""
        cfg = self.cfg
        return (self.mesh["data"].get_local_rank(), self.total_steps * self.layout.global_batch,
                dict(workers=cfg.loader_workers, pin_memory=self.ctx.device.type == "cuda", eval_batch=cfg.eval_batch))

    def built_once(self, build: Callable[[], Path]) -> Path:
        """A tiny preset's generated input: built by each node's first rank while the others wait. (The full preset
        never comes here: it is refused without --data or --init-checkpoint, workloads.registry.missing_inputs.)"""
        if self.ctx.local_rank == 0:
            build()
        dist.barrier()
        return build()

    def shared_hyperparameters(self) -> dict[str, Any]:
        """The keys both log alike: the batch, sequence and eval set, AdamW and clipping, and the disclosures the 6.1
        rules ask of every run (compliance_checker/training_6.1.0/common.yaml), from the layout the run really
        uses."""
        cfg, layout = self.cfg, self.layout
        precision = "bfloat16" if self.ctx.device.type == "cuda" else "fp32"
        return {
            C.GLOBAL_BATCH_SIZE: layout.global_batch,
            C.GRADIENT_ACCUMULATION_STEPS: layout.grad_accum,
            C.MAX_SEQUENCE_LENGTH: cfg.model.seq_len,
            C.EVAL_SAMPLES: cfg.eval_sequences,
            C.OPT_NAME: C.ADAMW,
            C.OPT_BASE_LR: cfg.base_lr,
            C.OPT_ADAMW_BETA_1: cfg.adam_betas[0],
            C.OPT_ADAMW_BETA_2: cfg.adam_betas[1],
            C.OPT_ADAMW_EPSILON: cfg.adam_eps,
            C.OPT_ADAMW_WEIGHT_DECAY: cfg.weight_decay,
            C.OPT_GRADIENT_CLIP_NORM: cfg.clip_norm,
            C.LOWEST_NUMERICAL_PRECISION_IN_LINEAR: precision,
            C.LOWEST_NUMERICAL_PRECISION_IN_ATTN: precision,
            C.LOWEST_NUMERICAL_PRECISION_IN_COMM: precision,  # FSDP's gathers
            C.TENSOR_PARALLELISM: layout.tensor,
            C.PIPELINE_PARALLELISM: layout.pipeline,
            C.CONTEXT_PARALLELISM: layout.context,
            C.EXPERT_PARALLELISM: self.layout.expert,
            C.MICRO_BATCH_SIZE: layout.micro_batch,
            C.CONFIG_FILENAME: f"workloads/decoder/config.py:{PRESET_TABLES[self.opts.benchmark]}[{self.opts.preset!r}]",
        }

    def block_ends(self, step: int) -> bool:
        """An evaluation follows step `first_eval`, then every `eval_every` steps (both set by the workload)."""
        return step >= self.first_eval and (step - self.first_eval) % self.eval_every == 0

    def next_block(self, step: int) -> Block:
        """From the evaluation at or before `step` (or the start) to the next one; the first block runs to the first
        evaluation (llama2_70b_lora's skipped ones, deepseekv3_671b's step 43)."""
        return evaluation_block(step, self.eval_every, self.total_steps, self.layout.global_batch, self.first_eval)

    def epoch_num(self, step: int) -> int:
        return step * self.layout.global_batch  # sequences trained: the log's samples_count
