"""One llama31_8b run: build the model from scratch (untimed init), then train until the validation log
perplexity reaches the target (timed).

MLPerf shape (mlcommons/training `small_llm_pretraining/nemo/pretrain_llama31.py` under the 6.1.0 rules):
AdamW (0.9, 0.95, eps 1e-5, weight decay 0.1, none on the norms), gradient clipping at 1.0; NeMo's
CosineAnnealing: linear warmup from peak / (warmup + 1) to the peak, then cosine decay to 0.1 x peak at
max_steps 1,200,000; the global batch's peak LR and warmup from the RCP table (workloads.decoder.config).
Evaluates every 12,288 sequences (rounded up to whole steps) on the first 1,024 validation sequences;
the run stops at the first evaluation at or below 3.3. `samples_count` counts sequences.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from mlperf_logging.mllog import constants as C

from workloads.common.campaign import RunOptions
from workloads.common.distributed import DistContext
from workloads.common.language_model import optimizer_groups
from workloads.common.loop import Target
from workloads.common.megatron_data import RandomTokens, token_loaders
from workloads.common.resilience import Block
from workloads.decoder.data import c4_loaders, ensure_tiny_corpus, reference_validation_samples
from workloads.decoder.model import Decoder
from workloads.decoder.parallelize import parallelize
from workloads.decoder.workload import LlamaWorkload

def lr_factor(step: int, warmup: int, max_steps: int, end_ratio: float) -> float:
    """NeMo's CosineAnnealing with constant_steps 0, as a fraction of the peak (step: optimizer steps done)."""
    if step <= warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / (max_steps - warmup))
    return end_ratio + (1 - end_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LlamaPretrainWorkload(LlamaWorkload):
    def __init__(self, opts: RunOptions, ctx: DistContext, seed: int):
        super().__init__(opts, ctx, seed)
        cfg, layout = self.cfg, self.layout
        self.eval_every = max(1, math.ceil(cfg.eval_interval / layout.global_batch))  # steps
        self.target = Target("log perplexity", "log_ppl", cfg.target, higher_is_better=False)

        # Built without storage, split, then given only this rank's shards, drawn from the seed every rank
        # shares, so that HSDP's replicas start identical.
        with torch.device("meta"):
            model = Decoder(cfg.model, activation_checkpointing=cfg.activation_checkpointing)
        parallelize(model, self.mesh, ctx.device, self.compiled)
        model.to_empty(device=ctx.device)
        with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
            torch.manual_seed(seed)
            model.init_weights()
        self.model = model
        self.optimizer = torch.optim.AdamW(optimizer_groups(model, cfg.weight_decay), lr=cfg.base_lr,
                                           betas=cfg.adam_betas, eps=cfg.adam_eps, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, cfg.warmup_steps, cfg.max_steps, cfg.end_lr_ratio))

    def loaders_for_run(self):
        cfg, layout, seed = self.cfg, self.layout, self.seed
        data_rank, samples, reading = self.reading()
        if self.opts.synthetic:
            m = cfg.model
            return token_loaders(RandomTokens(m.vocab_size, m.seq_len, samples, seed),
                                 RandomTokens(m.vocab_size, m.seq_len, cfg.eval_sequences, seed + 1),
                                 cfg.micro_batch, data_rank, layout.data, **reading)
        root = self.opts.data or self.built_once(ensure_tiny_corpus)
        validation = reference_validation_samples(cfg.global_batch, cfg.max_steps, cfg.eval_interval,
                                                  cfg.eval_sequences)
        return c4_loaders(root, cfg.model.seq_len, cfg.micro_batch, samples, cfg.eval_sequences, seed, data_rank,
                          layout.data, **reading, validation_samples=validation)

    def hyperparameters(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            **self.shared_hyperparameters("PRESETS"),
            C.INIT_CHECKPOINT_STEP: 0,  # from scratch
            C.OPT_END_LR: cfg.base_lr * cfg.end_lr_ratio,
            C.OPT_LR_WARMUP_STEPS: cfg.warmup_steps,
            C.OPT_LR_DECAY_STEPS: cfg.max_steps - cfg.warmup_steps,
            C.OPT_LR_DECAY_SCHEDULE: "cosine with linear warmup",
            C.MAX_STEPS: cfg.max_steps,
        }

    # --- the training loop's questions (workloads.common.loop) ---------------------------------

    def next_block(self, step: int) -> Block:
        first = step - step % self.eval_every
        batch = self.layout.global_batch
        return Block(first * batch, min(self.eval_every, self.total_steps - first) * batch)
