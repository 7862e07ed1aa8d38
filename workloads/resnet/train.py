"""One ResNet run: build (untimed init), then train and evaluate until the target (timed).

MLPerf shape: blocks of `eval_every` epochs, each followed by an evaluation of
top-1 accuracy on the whole eval set; the run stops at the first evaluation
that reaches the target. The optimizer follows the global batch, as the closed
rules allow: the preset names the global batch from which LARS is used, SGD with
momentum and a linearly scaled LR below it (config.default_optimizer; the full preset runs LARS at
every batch, as every RCP and reference submission does); --optimizer forces either. LARS takes its
LR, warmup, epochs, momentum and decay by global batch from the RCPs' and reference submissions' table
(config.REFERENCE_LARS). Both warm up linearly, then decay polynomially to
`end_lr` at the schedule's last epoch, where the run stops.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import torch
from mlperf_logging.mllog import constants as C
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workloads.common import mlperf as K
from workloads.common.campaign import RunOptions, Workload
from workloads.common.data import data_errors
from workloads.common.loop import Target
from workloads.common.distributed import DistContext, all_sum
from workloads.common.param_groups import parameter_groups
from workloads.common.refusals import ConfigurationError
from workloads.common.resilience import Block
from workloads.common.warm_up import WarmUpInputs, eval_batch_sizes
from workloads.resnet.config import PRESETS, ResNetConfig, Schedule, plan_run
from workloads.resnet.data import (Loaders, ensure_tiny_dataset, image_folder_loaders,
                                   shared_image_list, synthetic_loaders, tiny_dataset_root, to_model_input)
from workloads.resnet.lars import EPSILON, Lars
from workloads.resnet.model import build_model


def optimizer_hyperparameters(cfg: ResNetConfig, optimizer: str, chosen: Schedule) -> dict[str, Any]:
    """What a run logs of its optimizer and schedule: the keys of closed_resnet_lars.yaml or closed_resnet_sgd.yaml.
    A function of the preset, the optimizer and the chosen schedule alone, so a batch's logged values can be read
    without building a run (tests/test_resnet_fidelity.py compares them with the RCPs')."""
    # The decay "steps" are the schedule's epochs: the rules define the key as "num_epochs in reference", and
    # NVIDIA's fit.py logs args.num_epochs under it (the LR reaches end_lr after epochs x steps per epoch).
    if optimizer == C.LARS:
        return {C.OPT_NAME: optimizer,
                C.LARS_OPT_BASE_LEARNING_RATE: chosen.base_lr,
                C.LARS_OPT_END_LR: cfg.end_lr,
                C.LARS_OPT_LR_DECAY_POLY_POWER: cfg.poly_power,
                C.LARS_OPT_LR_DECAY_STEPS: chosen.epochs,
                C.LARS_OPT_LEARNING_RATE_WARMUP_EPOCHS: chosen.warmup_epochs,
                C.LARS_OPT_MOMENTUM: chosen.momentum,
                C.LARS_OPT_WEIGHT_DECAY: chosen.weight_decay,
                C.LARS_EPSILON: EPSILON}
    return {C.OPT_NAME: optimizer,
            K.SGD_OPT_BASE_LR: chosen.base_lr,
            K.SGD_OPT_END_LR: cfg.end_lr,
            K.SGD_OPT_LR_DECAY_POLY_POWER: cfg.poly_power,
            K.SGD_OPT_LR_DECAY_STEPS: chosen.epochs,
            K.SGD_OPT_WEIGHT_DECAY: chosen.weight_decay,
            K.SGD_OPT_MOMENTUM: chosen.momentum,
            C.OPT_LR_WARMUP_EPOCHS: chosen.warmup_epochs}


class ResNetWorkload(Workload):
    rate_shown = ("img/s", "throughput")

    def __init__(self, opts: RunOptions, ctx: DistContext, seed: int):
        super().__init__(opts, ctx, seed)
        cfg = PRESETS[opts.preset]
        if opts.batch_size:
            cfg = replace(cfg, batch_size=opts.batch_size)
        if opts.decode:
            cfg = replace(cfg, decode=opts.decode)
        self.cfg: ResNetConfig = cfg
        # The optimizer, and its LR, warmup, length, momentum and decay at this global batch (config.plan_run),
        # decided first: a batch the LARS table does not cover is refused before the model is built (`harness run`
        # refuses it earlier still, when it renders the request).
        try:
            plan = plan_run(cfg, ctx.world_size, opts.optimizer)
        except ValueError as exc:  # the plan refuses the job's own numbers, the same on every node
            raise ConfigurationError(f"workloads: {exc}") from None
        self.global_batch, self.optimizer_name, self.schedule = plan.global_batch, plan.optimizer, plan.schedule
        self.epochs = self.schedule.epochs
        self.target = Target("top-1", "top1", cfg.target)

        model = build_model(cfg.arch, cfg.classes).to(ctx.device, memory_format=torch.channels_last)
        # Gradients live in DDP's buckets (no copy into them before each all-reduce).
        self.model = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda"
                                             else None, gradient_as_bucket_view=True, bucket_cap_mb=cfg.bucket_mb)
        # Compiling the DDP module lets torch split the graph at the buckets, so all-reduces still overlap.
        self.forward = torch.compile(self.model) if self.compiled else self.model
        lr, momentum, decay = self.schedule.base_lr, self.schedule.momentum, self.schedule.weight_decay
        if self.optimizer_name == C.LARS:
            self.optimizer = Lars(parameter_groups(self.model, decay), lr=lr, momentum=momentum, weight_decay=decay)
        else:
            # Batch norm's scale and shift do not decay; the classifier's bias does, as in the SGD reference.
            self.optimizer = torch.optim.SGD(parameter_groups(self.model, decay, decay_biases=True), lr=lr,
                                             momentum=momentum, fused=True)
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    # --- the data (timed: opened after run_start) ----------------------------------------------------

    def open_data(self) -> dict[str, Any]:
        """The loaders, and what the image count decides: the steps per epoch, so the LR schedule's length and
        warmup in steps. NVIDIA's v3.0 logs train_samples and eval_samples after run_start too, from its loader."""
        self.loaders = self._loaders()
        self.steps_per_epoch = len(self.loaders.train)
        self.schedule_steps = self.steps_per_epoch * self.epochs  # the LR schedule's length
        self.total_steps = min(self.opts.max_steps or self.schedule_steps, self.schedule_steps)
        self.warmup_steps = self.steps_per_epoch * self.schedule.warmup_epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        return {C.TRAIN_SAMPLES: self.loaders.train_samples, C.EVAL_SAMPLES: self.loaders.eval_samples}

    def _loaders(self) -> Loaders:
        cfg, opts, ctx = self.cfg, self.opts, self.ctx
        if opts.synthetic:
            return synthetic_loaders(cfg.crop, cfg.batch_size, cfg.classes, ctx)
        if opts.data is not None:
            root = opts.data
        else:
            root = ensure_tiny_dataset(tiny_dataset_root()) if ctx.local_rank == 0 else tiny_dataset_root()
            torch.distributed.barrier()  # the other ranks wait until the dataset exists
        with data_errors():
            images = shared_image_list(root / "train", ctx), shared_image_list(root / "val", ctx)
        return image_folder_loaders(root, *images, cfg.crop, cfg.batch_size, cfg.workers, ctx, self.seed,
                                    cfg.decode)

    def _lr_factor(self, step: int) -> float:
        """Linear warmup to base_lr, then (1 - progress)^power decay down to end_lr."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.schedule_steps - self.warmup_steps)
        remaining = max(0.0, 1 - (step - self.warmup_steps) / decay_steps)
        end = self.cfg.end_lr / self.schedule.base_lr
        return end + (1 - end) * remaining ** self.cfg.poly_power

    def hyperparameters(self) -> dict[str, Any]:
        return {
            C.GLOBAL_BATCH_SIZE: self.global_batch,
            C.GRADIENT_ACCUMULATION_STEPS: 1,
            C.MODEL_BN_SPAN: self.cfg.batch_size,  # batch norm statistics are per process
            **optimizer_hyperparameters(self.cfg, self.optimizer_name, self.schedule),
        }

    # --- the training loop's questions (workloads.common.loop) ---------------------------------

    def batches(self, step: int):
        done_epochs, offset = divmod(step, self.steps_per_epoch)
        for epoch in range(done_epochs + 1, self.epochs + 1):
            # A resumed run continues its epoch after the batches it trained.
            yield from self._epoch_batches(epoch, offset if epoch == done_epochs + 1 else 0)

    def epoch_num(self, step: int) -> int:
        return -(-step // self.steps_per_epoch)  # the epoch the step belongs to (1-based)

    def next_block(self, step: int) -> Block:
        first = step // self.steps_per_epoch + 1
        return Block(first, min(self.cfg.eval_every, self.epochs - first + 1))

    def block_ends(self, step: int) -> bool:
        epochs, offset = divmod(step, self.steps_per_epoch)
        return offset == 0 and epochs % self.cfg.eval_every == 0

    def step_starts(self, step: int, mlog: K.ResultLog) -> None:
        if (step - 1) % self.steps_per_epoch == 0:
            mlog.start(C.EPOCH_START, metadata={C.EPOCH_NUM: self.epoch_num(step)})

    def step_ended(self, step: int, mlog: K.ResultLog, last: bool) -> None:
        if step % self.steps_per_epoch == 0 or last:
            mlog.end(C.EPOCH_STOP, metadata={C.EPOCH_NUM: self.epoch_num(step)})

    def _epoch_batches(self, epoch: int, skip: int):
        """The epoch's batches after the first `skip` (a resumed run's position)."""
        if self.loaders.sampler is not None:
            self.loaders.sampler.set_epoch(epoch)
            self.loaders.sampler.skip = skip * self.cfg.batch_size
            batches = iter(self.loaders.train)
        else:
            batches = itertools.islice(self.loaders.train, skip, None)
        for images, labels in batches:
            yield to_model_input(images, self.ctx.device), labels.to(self.ctx.device, non_blocking=True)

    def train_step(self, batches) -> tuple[torch.Tensor, int]:
        images, labels = next(batches)
        self.model.train()
        with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.ctx.device.type == "cuda"):
            loss = self.loss_fn(self.forward(images), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return loss.detach(), self.global_batch

    def warm_up_inputs(self) -> WarmUpInputs:
        """Two steps of the training batch (every one is whole: drop_last) and one eval batch of each size this rank
        reads: its slice of the preset's eval images (--synthetic's: one batch), the last shorter batch included.
        Random uint8 images, as the loaders give them."""
        cfg, ctx = self.cfg, self.ctx
        generator = torch.Generator().manual_seed(0)

        def batch(count: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.randint(0, 256, (count, 3, cfg.crop, cfg.crop), dtype=torch.uint8, generator=generator),
                    torch.randint(0, cfg.classes, (count,), generator=generator))

        shard = cfg.batch_size if self.opts.synthetic else len(range(ctx.rank, cfg.eval_images, ctx.world_size))
        train = [(to_model_input(images, ctx.device), labels.to(ctx.device))
                 for images, labels in (batch(cfg.batch_size) for _ in range(2))]
        return WarmUpInputs(train=train, steps=2, eval=[batch(n) for n in eval_batch_sizes(shard, cfg.batch_size)])

    @torch.no_grad()
    def evaluate(self, batches=None) -> float:
        self.model.eval()
        correct, total = torch.zeros((), dtype=torch.int64, device=self.ctx.device), 0
        for images, labels in self.loaders.eval if batches is None else batches:
            images, labels = to_model_input(images, self.ctx.device), labels.to(self.ctx.device, non_blocking=True)
            with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.ctx.device.type == "cuda"):
                logits = self.forward(images)
            correct += (logits.argmax(1) == labels).sum()  # read once, after the last batch
            total += labels.numel()
        correct, total = all_sum([correct.item(), total], self.ctx)
        return correct / total
