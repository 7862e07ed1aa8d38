"""One ResNet run: build (untimed init), then train and evaluate until the target (timed).

MLPerf shape: blocks of `eval_every` epochs, each followed by an evaluation of
top-1 accuracy on the whole eval set; the run stops at the first evaluation
that reaches the target. SGD with momentum, linear warmup, then polynomial decay
to `end_lr` (the closed rules' SGD schedule).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
from mlperf_logging.mllog import constants as C
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workloads.common import mlperf as K
from workloads.common.campaign import RunOptions, Workload
from workloads.common.distributed import DistContext, all_sum
from workloads.common.progress import Progress
from workloads.resnet.config import PRESETS, ResNetConfig
from workloads.resnet.data import (Loaders, ensure_tiny_dataset, image_folder_loaders, synthetic_loaders,
                                   tiny_dataset_root)
from workloads.resnet.model import build_model


class ResNetWorkload(Workload):
    def __init__(self, opts: RunOptions, ctx: DistContext, seed: int):
        super().__init__(opts, ctx, seed)
        cfg = PRESETS[opts.preset]
        if opts.batch_size:
            cfg = replace(cfg, batch_size=opts.batch_size)
        self.cfg: ResNetConfig = cfg
        self.loaders = self._loaders()
        self.global_batch = cfg.batch_size * ctx.world_size
        # Linear LR scaling, rounded to the 0.001 grid the closed rules require.
        self.base_lr = max(0.001, round(cfg.base_lr * self.global_batch / cfg.lr_batch, 3))
        self.steps_per_epoch = len(self.loaders.train)
        self.total_steps = self.steps_per_epoch * cfg.max_epochs
        self.warmup_steps = self.steps_per_epoch * cfg.warmup_epochs

        model = build_model(cfg.arch, cfg.classes).to(ctx.device, memory_format=torch.channels_last)
        self.model = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda"
                                             else None)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.base_lr, momentum=cfg.momentum,
                                         weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)

    def _loaders(self) -> Loaders:
        cfg, opts, ctx = self.cfg, self.opts, self.ctx
        if opts.synthetic:
            return synthetic_loaders(cfg.crop, cfg.batch_size, cfg.classes, ctx)
        if opts.data is not None:
            root = opts.data
        else:
            root = ensure_tiny_dataset(tiny_dataset_root()) if ctx.local_rank == 0 else tiny_dataset_root()
            torch.distributed.barrier()  # the other ranks wait until the dataset exists
        return image_folder_loaders(root, cfg.crop, cfg.batch_size, cfg.workers, ctx)

    def _lr_factor(self, step: int) -> float:
        """Linear warmup to base_lr, then (1 - progress)^power decay down to end_lr."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        remaining = max(0.0, 1 - (step - self.warmup_steps) / decay_steps)
        end = self.cfg.end_lr / self.base_lr
        return end + (1 - end) * remaining ** self.cfg.poly_power

    def hyperparameters(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            C.GLOBAL_BATCH_SIZE: self.global_batch,
            C.GRADIENT_ACCUMULATION_STEPS: 1,
            C.OPT_NAME: "sgd",
            K.SGD_OPT_BASE_LR: self.base_lr,
            K.SGD_OPT_END_LR: cfg.end_lr,
            K.SGD_OPT_LR_DECAY_POLY_POWER: cfg.poly_power,
            K.SGD_OPT_LR_DECAY_STEPS: self.total_steps - self.warmup_steps,
            K.SGD_OPT_WEIGHT_DECAY: cfg.weight_decay,
            K.SGD_OPT_MOMENTUM: cfg.momentum,
            C.OPT_LR_WARMUP_EPOCHS: cfg.warmup_epochs,
            C.MODEL_BN_SPAN: cfg.batch_size,  # batch norm statistics are per process
            C.TRAIN_SAMPLES: self.loaders.train_samples,
            C.EVAL_SAMPLES: self.loaders.eval_samples,
        }

    def train(self, mlog: K.ResultLog, progress_desc: str) -> bool:
        cfg, ctx = self.cfg, self.ctx
        max_steps = self.opts.max_steps or self.total_steps
        progress = Progress(min(max_steps, self.total_steps), progress_desc, show=ctx.is_main)
        step = 0
        try:
            for epoch in range(1, cfg.max_epochs + 1):
                if (epoch - 1) % cfg.eval_every == 0:
                    block_epochs = min(cfg.eval_every, cfg.max_epochs - epoch + 1)
                    mlog.start(C.BLOCK_START, metadata={C.FIRST_EPOCH_NUM: epoch, C.EPOCH_COUNT: block_epochs})
                    block_first = epoch
                mlog.start(C.EPOCH_START, metadata={C.EPOCH_NUM: epoch})
                progress.set(epoch=f"{epoch}/{cfg.max_epochs}")
                started, epoch_steps = time.perf_counter(), 0
                for images, labels in self._epoch_batches(epoch):
                    loss = self._train_step(images, labels)
                    step += 1
                    epoch_steps += 1
                    # .item() waits for the device, so read the loss only every 10 steps.
                    progress.advance(1, **({"loss": loss.item()} if step % 10 == 0 else {}))
                    if step >= max_steps:
                        break
                seconds = time.perf_counter() - started
                mlog.end(C.EPOCH_STOP, metadata={C.EPOCH_NUM: epoch})
                throughput = epoch_steps * self.global_batch / seconds
                mlog.event(K.TRACKED_STATS, {"throughput": throughput}, metadata={"step": epoch})
                progress.set(**{"img/s": throughput})
                progress.line()
                stopping = step >= max_steps or epoch == cfg.max_epochs
                if epoch % cfg.eval_every == 0 or stopping:
                    mlog.end(C.BLOCK_STOP, metadata={C.FIRST_EPOCH_NUM: block_first})
                    accuracy = self._evaluate(mlog, epoch)
                    progress.set(top1=accuracy)
                    progress.message(f"{progress_desc} epoch {epoch}: eval top-1 {accuracy:.4f} "
                                     f"(target {cfg.target}), {throughput:.1f} img/s")
                    if accuracy >= cfg.target:
                        return True
                if stopping:
                    return False
            return False
        finally:
            progress.close()

    def _epoch_batches(self, epoch: int):
        if self.loaders.sampler is not None:
            self.loaders.sampler.set_epoch(epoch)
        for images, labels in self.loaders.train:
            yield (images.to(self.ctx.device, non_blocking=True, memory_format=torch.channels_last),
                   labels.to(self.ctx.device, non_blocking=True))

    def _train_step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.model.train()
        with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.ctx.device.type == "cuda"):
            loss = self.loss_fn(self.model(images), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return loss.detach()

    @torch.no_grad()
    def _evaluate(self, mlog: K.ResultLog, epoch: int) -> float:
        mlog.start(C.EVAL_START, metadata={C.EPOCH_NUM: epoch})
        self.model.eval()
        correct = total = 0
        for images, labels in self.loaders.eval:
            images = images.to(self.ctx.device, non_blocking=True, memory_format=torch.channels_last)
            labels = labels.to(self.ctx.device, non_blocking=True)
            with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.ctx.device.type == "cuda"):
                logits = self.model(images)
            correct += (logits.argmax(1) == labels).sum().item()
            total += labels.numel()
        correct, total = all_sum([correct, total], self.ctx)
        accuracy = correct / total
        mlog.event(C.EVAL_ACCURACY, accuracy, metadata={C.EPOCH_NUM: epoch})
        mlog.end(C.EVAL_STOP, metadata={C.EPOCH_NUM: epoch})
        return accuracy
