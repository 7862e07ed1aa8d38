"""One llama2_70b_lora run: load the pretrained Llama 2 (untimed init), freeze it, and train LoRA adapters on
its attention until the eval loss reaches the target (timed).

MLPerf shape (mlcommons/training `llama2_70b_lora/`: `run_llama_70B_scrolls_r16.sh`, `scripts/train.py`,
`scripts/utils.py`, `scripts/mlperf_logging_utils.py`, under the 6.1.0 rules and RCPs): adapters of rank 16,
alpha 32, dropout 0.1 on the fused qkv and the output projection (workloads.decoder.model.LoRA); AdamW (weight
decay 1e-4), gradient clipping 0.3, cosine decay from the batch's RCP learning rate to 0 over 1,024 steps,
no warmup. Evaluations every 384 sequences (rounded up to whole steps), none in the first
int(0.125 x GBS + 2) of them (the reference's eval_delay); the eval loss is the mean over the 173 validation
sequences of each one's mean loss over its summary tokens (the reference's Trainer evaluates one sequence per
batch and averages the batches), logged as eval_accuracy; the run stops at the first at or below 0.925.

Checkpoints (the shared loop's) hold the adapters and their optimizer state only: a restart loads the frozen
base from the converted weights again, then the adapters from the checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from mlperf_logging.mllog import constants as C

from workloads.common import mlperf as K
from workloads.common.campaign import RunOptions
from workloads.common.distributed import DistContext, all_sum
from workloads.common.language_model import scored_loss_sum
from workloads.common.loop import Target
from workloads.common.megatron_data import token_loaders
from workloads.decoder.convert import load_base
from workloads.decoder.govreport import TRAIN, PackedSamples, Sequences, count_sequences, ensure_tiny_govreport, \
    govreport_loaders, labelled_split
from workloads.decoder.model import Decoder
from workloads.decoder.parallelize import parallelize
from workloads.decoder.workload import DecoderWorkload


def cosine_factor(step: int, max_steps: int) -> float:
    """Hugging Face's cosine schedule without warmup (lr_scheduler_type cosine, warmup_ratio 0): the peak at step
    0, half a cosine down to 0 at max_steps."""
    return 0.5 * (1 + math.cos(math.pi * min(step, max_steps) / max_steps))


def freeze_base(model: torch.nn.Module) -> None:
    """Only the adapters train."""
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)


class LlamaLoraWorkload(DecoderWorkload):
    rate_shown = ("seq/s", "throughput")
    checkpoint_frozen = False  # checkpoints keep the adapters and their optimizer state, not the frozen base
    logs_trained_samples = False  # train_samples is the training set's size, logged before run_start (hyperparameters)

    def __init__(self, opts: RunOptions, ctx: DistContext, seed: int):
        super().__init__(opts, ctx, seed, whole=labelled_split)
        cfg = self.cfg
        self.eval_every = cfg.eval_every
        self.first_eval = (cfg.skipped_evals + 1) * cfg.eval_every  # steps
        self.target = Target("eval loss", "loss", cfg.target, higher_is_better=False)
        base = self._base_checkpoint()
        self.train_sequences = self.training_set_size()

        with torch.device("meta"):
            model = Decoder(cfg.model, activation_checkpointing=cfg.activation_checkpointing, lora=cfg.lora)
        if ctx.device.type == "cuda":  # the frozen base is held in bf16, as the reference loads it
            for name, param in model.named_parameters():
                if ".lora_" not in name:
                    param.data = param.data.to(torch.bfloat16)
        parallelize(model, self.mesh, ctx.device, self.compiled)
        freeze_base(model)  # after tensor parallelism, whose styles register new parameters (trainable ones)
        model.to_empty(device=ctx.device)
        with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
            torch.manual_seed(seed)
            model.init_weights()  # the adapters: A drawn from the seed, B zero; the base is overwritten next
        load_base(model, base)
        self.model = model
        adapters = [param for param in model.parameters() if param.requires_grad]
        self.optimizer = torch.optim.AdamW(adapters, lr=cfg.base_lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                                           weight_decay=cfg.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda step: cosine_factor(step, cfg.max_steps))

    def loaders_for_run(self):
        cfg, layout, seed = self.cfg, self.layout, self.seed
        data_rank, samples, reading = self.reading()
        if self.opts.synthetic:
            m = cfg.model
            random = torch.Generator().manual_seed(seed)
            tokens = torch.randint(0, m.vocab_size, (cfg.eval_sequences, m.seq_len), generator=random)
            sequences = torch.stack((tokens, tokens), dim=1).numpy()  # labels: the inputs
            return token_loaders(PackedSamples(sequences, samples, seed), Sequences(sequences), cfg.micro_batch,
                                 data_rank, layout.data, **reading)
        root = self.opts.data or self.built_once(lambda: ensure_tiny_govreport(cfg.model.seq_len))
        return govreport_loaders(root, cfg.model.seq_len, cfg.micro_batch, samples, cfg.eval_sequences, seed,
                                 data_rank, layout.data, **reading)

    def training_set_size(self) -> int | None:
        """The sequences in the training set this run reads, logged as train_samples before run_start, as the
        reference logs len(train_dataset) (mlcommons/training `llama2_70b_lora/scripts/mlperf_logging_utils.py`,
        MLPerfCallback.on_train_begin, with the init and run_start events) and NVIDIA's v5.1 logs 3,901 (the
        GovReport training split) between init_start and run_start, whatever the samples a run trains on. With
        --data: the training file's row count from its parquet footer (no sequence is read before the clock);
        None if the file cannot be read, so the run logs none and stops when it opens its data, with the
        reason. The tiny preset's generated set (built here, in the untimed init, once per node) logs its own
        size; --synthetic's generated sequences theirs."""
        if self.opts.synthetic:
            return self.cfg.eval_sequences  # loaders_for_run's generated sequences: as many as the eval set's
        root = self.opts.data or self.built_once(lambda: ensure_tiny_govreport(self.cfg.model.seq_len))
        return count_sequences(Path(root, TRAIN))

    def _base_checkpoint(self) -> Path:
        if self.opts.init_checkpoint:
            return self.opts.init_checkpoint
        from workloads.decoder.warm_start import ensure_tiny_base

        # The tiny preset's base (workloads.registry.missing_inputs refuses the others, synthetic ones too)
        return self.built_once(lambda: ensure_tiny_base(self.cfg.model))

    def hyperparameters(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            **self.shared_hyperparameters(),
            **({C.TRAIN_SAMPLES: self.train_sequences} if self.train_sequences is not None else {}),
            C.OPT_LR_WARMUP_FACTOR: 0.0,
            C.OPT_LR_TRAINING_STEPS: cfg.max_steps,
            C.OPT_LR_DECAY_SCHEDULE: "cosine",
            K.LORA_RANK: cfg.lora.rank,
            C.LORA_ALPHA: cfg.lora.alpha,
        }

    # --- the training loop's questions (workloads.common.loop) ---------------------------------

    def sample_shape(self) -> tuple[int, ...]:
        return 2, self.cfg.model.seq_len  # the input ids and the labels (govreport.read_split)

    @torch.no_grad()
    def evaluate(self, batches: Iterable | None = None) -> float:
        """The mean over the eval sequences of each one's mean loss over its scored (summary) tokens."""
        self.model.eval()
        context = self.mesh["context"]
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        sequences = 0
        for samples, counted in self.loaders.eval if batches is None else batches:
            samples = samples.to(self.ctx.device, non_blocking=True)
            for row in range(len(samples)):
                loss_sum, count = scored_loss_sum(self.model, samples[row:row + 1], counted[row:row + 1], self.split)
                per_sequence = torch.stack((loss_sum, torch.tensor(float(count), dtype=torch.float64,
                                                                   device=loss_sum.device)))
                if context.size() > 1:  # the sequence's tokens lie on every context rank
                    dist.all_reduce(per_sequence, group=context.get_group())
                if per_sequence[1] > 0:
                    total += per_sequence[0] / per_sequence[1]
                    sequences += 1
        # Every tensor and context rank of a data rank holds the same sums, so the ratio over the world is the mean.
        total, sequences = all_sum([total.item(), sequences], self.ctx)
        return total / sequences
