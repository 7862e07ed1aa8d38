"""One GPT-3 run: build and load the starting checkpoint (untimed init), then train until the eval
log perplexity reaches the target (timed).

MLPerf shape: training starts from a checkpoint (the reference's, at step 4000 of batch 1536;
the tiny preset's is trained once by the harness), evaluates every 24,576 sequences (rounded
up to whole steps) on the validation subset, and stops at the first evaluation at or below
the target. Adam (0.9, 0.95, 1e-8), weight decay 0.1 on every parameter, the base LR the rules'
table gives the global batch, linear warmup then cosine decay to 10% of it over samples (as Megatron's
schedule counts them), continued from the starting checkpoint's samples, gradient clipping at 1.0.
`epoch_num` counts tokens, as NVIDIA's logs do.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mlperf_logging.mllog import constants as C
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, \
    set_model_state_dict, set_optimizer_state_dict

from workloads.common.campaign import RunOptions, Workload
from workloads.common.data import data_errors
from workloads.common.distributed import DistContext
from workloads.common.language_model import DecoderSteps, optimizer_groups, rolled_split
from workloads.common.loop import Target
from workloads.common.refusals import ConfigurationError
from workloads.common.resilience import Block, evaluation_block
from workloads.gpt3.config import INIT_INFO, PRESETS, GPT3Config, base_lr, plan_layout
from workloads.gpt3.data import c4_loaders, ensure_tiny_corpus, synthetic_loaders
from workloads.gpt3.parallel import build_mesh, parallelize
from workloads.gpt3.pipeline import GPT3Pipeline, optimizer_names, stage_model
from workloads.gpt3.warm_start import ensure_tiny_init_checkpoint, tiny_init_root

# Initial weights are drawn on each shard locally (then replaced by the starting checkpoint), and the tiny
# preset's checkpoint is saved from one process: both by design, so torch's warnings about them are noise.
warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class GPT3Workload(DecoderSteps, Workload):
    clip_norm = 1.0

    def __init__(self, opts: RunOptions, ctx: DistContext, seed: int):
        super().__init__(opts, ctx, seed)
        cfg: GPT3Config = PRESETS[opts.preset]
        if opts.batch_size:
            cfg = replace(cfg, micro_batch=opts.batch_size)
        self.cfg = cfg
        # `harness run` refuses a layout or batch that does not fit when it renders the request; a worker started by
        # hand says the same in one line, not a traceback.
        try:
            self.layout = layout = plan_layout(cfg, ctx.world_size, ctx.local_world_size)
        except ValueError as exc:  # the job's own layout, refused the same on every node
            raise ConfigurationError(f"workloads: {exc}") from None
        self.mesh = build_mesh(layout, ctx.device)
        batch = layout.global_batch
        self.base_lr = base_lr(cfg, batch)
        # The reference's schedule counts samples (run_gpt3.sh: --lr-warmup-samples, --lr-decay-samples, the
        # preset's steps at lr_batch); the steps logged are those samples over this batch, rounded down, as
        # NVIDIA's logs show them (at 3072: 132 and 54300).
        self.warmup_samples, self.decay_samples = cfg.warmup_steps * cfg.lr_batch, cfg.decay_steps * cfg.lr_batch
        self.warmup_steps, self.decay_steps = self.warmup_samples // batch, self.decay_samples // batch
        self.eval_every = max(1, math.ceil(cfg.eval_interval / batch))  # steps
        self.total_steps = min(opts.max_steps or cfg.max_steps, math.ceil(self.decay_samples / batch))
        self.tokens_per_step = layout.global_batch * cfg.model.seq_len
        self.target = Target("log perplexity", "log_ppl", cfg.target, higher_is_better=False)
        self.split = rolled_split  # samples of 2,048 tokens, the last target unscored, as the reference

        # Built without storage, cut to this rank's pipeline stage, split, then given only this rank's shards: a 175B
        # model never exists whole.
        model = stage_model(cfg, layout, self.mesh["pipeline"].get_local_rank())
        parallelize(model, self.mesh, ctx.device, self.compiled)
        model.to_empty(device=ctx.device)
        model.init_weights()
        self.model = model
        if layout.pipeline > 1:
            self.pipeline = GPT3Pipeline(model, self.mesh, layout, ctx.device)
        # Every parameter decays: the reference passes --do-layernorm-bias-weight-decay
        # (mlcommons/training retired_benchmarks/gpt3/megatron-lm/run_gpt3.sh).
        self.optimizer = torch.optim.AdamW(optimizer_groups(model, cfg.weight_decay, decay_vectors=True), lr=self.base_lr,
                                           betas=(0.9, 0.95), eps=1e-8, fused=True)
        self.init_step = self._load_init_checkpoint()
        # The schedule continues from the samples the starting checkpoint trained (past warmup, into the decay), as
        # the reference does (run_gpt3.sh: --ext-lr-steps 4000 x 1536 samples).
        self.start_samples = 0 if self.init_step is None else self.init_step * cfg.lr_batch
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    # --- the data (timed: opened after run_start) ----------------------------------------------------

    extra_token = 0  # samples of seq_len tokens (rolled_split)

    def eval_reading(self) -> tuple[int, int]:
        return self.cfg.eval_sequences or self.layout.data, self.cfg.micro_batch  # as open_data reads them

    def open_data(self) -> dict[str, Any]:
        """The loaders, and eval_samples: the validation tokens the eval reads, which only the index tells (NVIDIA's
        v3.0 logs put it before run_start, as a number their config knows; the checker does not place it)."""
        cfg, layout, opts = self.cfg, self.layout, self.opts
        data_rank = self.mesh["data"].get_local_rank()
        samples = self.total_steps * layout.global_batch
        reading = dict(workers=cfg.loader_workers, pin_memory=self.ctx.device.type == "cuda")
        if opts.synthetic:
            self.loaders = synthetic_loaders(cfg.model.vocab_size, cfg.model.seq_len, cfg.micro_batch, samples,
                                             cfg.eval_sequences or layout.data, self.seed, data_rank, layout.data,
                                             **reading)
        else:
            with data_errors():
                self.loaders = c4_loaders(opts.data or self._tiny_corpus(), cfg.model.seq_len, cfg.micro_batch,
                                          train_samples=samples, eval_sequences=cfg.eval_sequences, seed=self.seed,
                                          data_rank=data_rank, data_world=layout.data, **reading)
        return {C.EVAL_SAMPLES: self.loaders.eval_tokens}  # the validation tokens, as NVIDIA's logs count them

    def _tiny_corpus(self) -> Path:
        if self.ctx.local_rank == 0:
            ensure_tiny_corpus()
        dist.barrier()
        return ensure_tiny_corpus()

    def _load_init_checkpoint(self) -> int | None:
        """Load the starting weights (a DCP folder); returns the step it was trained to, at the reference batch.
        Synthetic throughput runs start from random weights and return None (and log no init_checkpoint_step)."""
        path = self.opts.init_checkpoint
        if path is None and self.opts.synthetic:
            return None
        if path is None:  # the tiny preset (workloads.registry.missing_inputs refuses the full one without)
            if self.ctx.local_rank == 0:
                ensure_tiny_init_checkpoint(self.cfg)
            dist.barrier()
            path = tiny_init_root()
        state = {"model": get_model_state_dict(self.model)}
        with_moments = any(key.startswith("optimizer.state.")
                           for key in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        if with_moments:
            optimizer = get_optimizer_state_dict(self.model, self.optimizer)
            # Adam's moments (the hyperparameters stay ours), under the whole model's names
            state["optimizer"] = {"state": optimizer_names(optimizer["state"], self.model)}
        elif self.opts.preset == "full":
            raise ConfigurationError(f"workloads: {path} holds no optimizer state: MLPerf's GPT-3 starts from the "
                                     "reference checkpoint's weights and Adam moments; convert it with python -m "
                                     "workloads.gpt3.convert_reference")
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(self.model, state["model"])
        if with_moments:
            set_optimizer_state_dict(self.model, self.optimizer, optimizer)
        info = Path(path, INIT_INFO)
        if info.is_file():
            return int(json.loads(info.read_text())["step"])
        return self.cfg.init_checkpoint_step

    def _lr_factor(self, step: int) -> float:
        """Megatron's AnnealingLR over samples (megatron/learning_rates.py): linear warmup from 0, then cosine
        decay to end_lr_ratio x base LR, counted from the starting checkpoint's samples."""
        samples = self.start_samples + step * self.layout.global_batch
        if samples <= self.warmup_samples:
            return samples / self.warmup_samples
        progress = min(1.0, (samples - self.warmup_samples) / (self.decay_samples - self.warmup_samples))
        end = self.cfg.end_lr_ratio
        return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * progress))

    def hyperparameters(self) -> dict[str, Any]:
        cfg, layout = self.cfg, self.layout
        return {
            C.GLOBAL_BATCH_SIZE: layout.global_batch,
            C.GRADIENT_ACCUMULATION_STEPS: layout.grad_accum,
            C.MAX_SEQUENCE_LENGTH: cfg.model.seq_len,
            C.OPT_NAME: C.ADAM,
            C.OPT_BASE_LR: self.base_lr,
            # In decimal, as the reference's MIN_LR=2.0e-6 is written (in binary, 2e-5 x 0.1 is 2.0000000000000003e-6).
            C.OPT_END_LR: float(Decimal(repr(self.base_lr)) * Decimal(repr(cfg.end_lr_ratio))),
            C.OPT_LR_WARMUP_STEPS: self.warmup_steps,
            C.OPT_LR_DECAY_STEPS: self.decay_steps,
            C.OPT_LR_DECAY_SCHEDULE: "cosine with linear warmup",
            C.OPT_ADAM_BETA_1: 0.9,
            C.OPT_ADAM_BETA_2: 0.95,
            C.OPT_ADAM_EPSILON: 1e-8,
            C.OPT_WEIGHT_DECAY: cfg.weight_decay,
            C.OPT_GRADIENT_CLIP_NORM: self.clip_norm,
            # The starting samples in steps of this batch, rounded up, as NVIDIA logs them (2286 at 2688).
            **({C.INIT_CHECKPOINT_STEP: math.ceil(self.start_samples / layout.global_batch)}
               if self.init_step is not None else {}),
            "tensor_model_parallel_size": layout.tensor,
            "pipeline_model_parallel_size": layout.pipeline,
        }

    # --- the training loop's questions (workloads.common.loop) ---------------------------------

    def epoch_num(self, step: int) -> int:
        return step * self.tokens_per_step  # tokens trained, as NVIDIA's logs count them

    def next_block(self, step: int) -> Block:
        return evaluation_block(step, self.eval_every, self.total_steps, self.tokens_per_step)
