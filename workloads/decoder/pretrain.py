"""One pretraining run of a decoder benchmark, llama31_8b or gpt_oss_20b from scratch, deepseekv3_671b from MLCommons'
checkpoint: build (and load) the model (untimed init), then train until the validation log perplexity reaches the
target (timed).

llama31_8b (mlcommons/training `small_llm_pretraining/nemo/pretrain_llama31.py` under the 6.1.0 rules): AdamW
(0.9, 0.95, eps 1e-5, weight decay 0.1, none on the norms), gradient clipping at 1.0; NeMo's CosineAnnealing: linear
warmup from peak / (warmup + 1) to the peak, then cosine decay to 0.1 x peak at max_steps 1,200,000; the global
batch's peak LR and warmup from the RCP table (workloads.decoder.config). Target 3.3.

gpt_oss_20b (mlcommons/training `small_llm_moe_pretraining/primus/conf/gpt_oss_20B-pretrain.yaml`, Megatron-LM
through Primus): the same AdamW and clipping; Megatron's OptimizerParamScheduler: linear warmup from 0 (peak x
step / warmup), then cosine decay to min_lr 4e-5 over lr_decay_iters = max_steps - warmup; the EOD loss mask; the
experts split over the expert mesh. Target 3.34.

deepseekv3_671b (mlcommons/training `llm_moe_pretraining/nemo/pretrain_deepseek_v3_671b.py`, Megatron-Bridge):
from the converted checkpoint at step 0 (no optimizer state); AdamW eps 1e-8; Megatron's schedule from 0 over 4
warmup steps, the cosine down to 1e-8 at lr_decay_iters 12,000; no EOD mask; an evaluation after every step from
step floor(42 + 24,576 / GBS). Target 3.6.

llama31_8b and gpt_oss_20b evaluate every 12,288 sequences (in whole steps, rounded as each reference rounds:
config.steps_per); all three score 1,024 validation sequences and stop at the first evaluation at or below the
target. `samples_count` counts sequences.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from mlperf_logging.mllog import constants as C

from workloads.common.campaign import RunOptions
from workloads.common.distributed import DistContext
from workloads.common.language_model import eod_masked_split, optimizer_groups
from workloads.common.loop import Target
from workloads.common.megatron_data import RandomTokens, token_loaders
from workloads.decoder.convert import convert, load_base
from workloads.decoder.data import c4_loaders, ensure_tiny_corpus, reference_validation_samples
from workloads.decoder.moe import MoE, update_expert_bias
from workloads.decoder.parallelize import parallelize
from workloads.decoder.pipeline import Pipeline, draw_weights, rank_model, stage_models
from workloads.decoder.workload import DecoderWorkload
from workloads.registry import BENCHMARKS

def lr_factor(step: int, warmup: int, max_steps: int, end_ratio: float) -> float:
    """NeMo's CosineAnnealing with constant_steps 0, as a fraction of the peak (step: optimizer steps done)."""
    if step <= warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / (max_steps - warmup))
    return end_ratio + (1 - end_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def megatron_lr_factor(step: int, warmup: int, decay_steps: int, end_ratio: float) -> float:
    """Megatron-Core's OptimizerParamScheduler.get_lr (megatron/core/optimizer_param_scheduler.py) with init_lr 0 and
    lr_decay_style cosine, as a fraction of the peak: peak x step / warmup up to the warmup (the first step at 0: the
    scheduler is built at step 0, and stepped after each optimizer step), then min + (peak - min) x (1 + cos(pi x
    (step - warmup) / (decay_steps - warmup))) / 2, and min past decay_steps (lr_decay_iters)."""
    if warmup > 0 and step <= warmup:
        return step / warmup
    if step > decay_steps:
        return end_ratio
    progress = (step - warmup) / (decay_steps - warmup)
    return end_ratio + (1 - end_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class PretrainWorkload(DecoderWorkload):
    def __init__(self, opts: RunOptions, ctx: DistContext, seed: int):
        super().__init__(opts, ctx, seed)
        cfg = self.cfg
        if cfg.eod_mask_loss:
            self.split = self.split_over_context(eod_masked_split(cfg.eod_token))
        self.eval_every, self.first_eval = cfg.eval_every, cfg.first_eval_step  # steps
        self.target = Target("log perplexity", "log_ppl", cfg.target, higher_is_better=False)

        # Built without storage (this rank's pipeline stage of it), split, then given only this rank's shards, drawn
        # from the seed every rank shares, so that HSDP's replicas start identical and the stages hold the whole
        # model's values.
        # From a checkpoint nothing is drawn: its weights replace every one (a late stage of DeepSeek-V3 would
        # otherwise replay 57 blocks' draws, 45 GB of experts each in fp32, beside its own share).
        start = self.starting_checkpoint()
        chunks = stage_models(cfg.model, self.layout, self.mesh["pipeline"].get_local_rank(),
                              activation_checkpointing=cfg.activation_checkpointing)
        with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
            for chunk in chunks:
                parallelize(chunk, self.mesh, ctx.device, self.compiled, self.expert_mesh)
                chunk.to_empty(device=ctx.device)
                if start is None:
                    torch.manual_seed(seed)
                    draw_weights(chunk, ctx.device)
                else:
                    chunk.init_buffers()
        self.model = model = rank_model(chunks)
        if self.layout.pipeline > 1:
            self.pipeline = Pipeline(chunks, self.mesh, self.layout, ctx.device, self.split)
        if start is not None:
            load_base(model, start)
        self.balance_group = self._expert_balance(model)
        self.optimizer = torch.optim.AdamW(optimizer_groups(model, cfg.weight_decay), lr=cfg.base_lr,
                                           betas=cfg.adam_betas, eps=cfg.adam_eps, fused=True)
        end_ratio = cfg.floor_lr / cfg.base_lr
        schedule = (lambda step: megatron_lr_factor(step, cfg.warmup_steps, cfg.schedule_decay_iters, end_ratio)) \
            if cfg.framework == "megatron" else (lambda step: lr_factor(step, cfg.warmup_steps, cfg.max_steps, end_ratio))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)

    def _expert_balance(self, model: torch.nn.Module):
        """DeepSeek-V3's balance terms: each MoE layer's sequence loss scaled as the main loss is (AuxLossScaler: 1 /
        the micro batches a step accumulates, where accumulate_gradients divides each micro batch's loss; 1 under a
        pipeline, whose schedule divides every gradient by them after backward), and the process group over which
        the expert loads are summed for the bias update (every rank of this stage that saw different tokens:
        replicate x shard x context), None where no layer moves a bias."""
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            moe.aux_loss_scale = 1 / self.layout.grad_accum if self.layout.pipeline == 1 else 1.0
        moe = self.cfg.model.moe
        if not (moe and moe.bias_update_rate):
            return None
        # Decided from the config, so that every rank makes the group: a pipeline stage may hold no MoE layer.
        return self.mesh["replicate", "shard", "context"]._flatten("expert_balance").get_group()

    def process_groups(self) -> list[dist.ProcessGroup]:
        """The meshes' groups and the expert balance's, whose all-reduce runs after every step: the warm-up makes
        each one's communicator before the clock."""
        return super().process_groups() + ([self.balance_group] if self.balance_group is not None else [])

    def train_step(self, batches) -> tuple[torch.Tensor, int]:
        """DecoderSteps' step, then the expert bias update from the step's loads (moe.update_expert_bias), as
        Megatron-LM updates it after each optimizer step."""
        result = super().train_step(batches)
        if self.balance_group is not None:
            update_expert_bias(self.model, self.balance_group)
        return result

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
                                                  cfg.eval_sequences, cfg.framework, cfg.validation_batch)
        return c4_loaders(root, cfg.model.seq_len, cfg.micro_batch, samples, cfg.eval_sequences, seed, data_rank,
                          layout.data, **reading, validation_samples=validation)

    def starting_checkpoint(self) -> Path | None:
        """Where the weights start: --init-checkpoint; for a benchmark that starts from MLCommons' checkpoint
        (deepseekv3_671b), its tiny preset's own: written once in Hugging Face's layout (workloads.decoder.start)
        and converted into the run's folder by rank 0 at each run's init; else None (from scratch, or --synthetic's
        throughput runs)."""
        if self.opts.init_checkpoint:
            return self.opts.init_checkpoint
        if not BENCHMARKS[self.opts.benchmark].init_checkpoint or self.opts.synthetic:
            return None
        from workloads.decoder.start import ensure_tiny_hugging_face

        hugging_face = self.built_once(lambda: ensure_tiny_hugging_face(self.cfg.model))
        converted = self.opts.out / "start_checkpoint"
        if self.ctx.rank == 0:
            convert(hugging_face, converted, self.cfg.model)
        dist.barrier()
        return converted

    def hyperparameters(self) -> dict[str, Any]:
        cfg = self.cfg
        moe = cfg.model.moe
        return {
            **self.shared_hyperparameters(),
            **({C.MOE_AUX_LOSS_COEFF: moe.aux_loss_coeff} if moe and moe.aux_loss_coeff else {}),
            C.INIT_CHECKPOINT_STEP: 0,  # from scratch, or a start checkpoint's step 0 (the reference's ckpt_step 0)
            C.OPT_END_LR: cfg.floor_lr,
            C.OPT_LR_WARMUP_STEPS: cfg.warmup_steps,
            C.OPT_LR_DECAY_STEPS: cfg.decay_steps,
            C.OPT_LR_DECAY_SCHEDULE: "cosine with linear warmup",
            C.MAX_STEPS: cfg.max_steps,
        }
