"""One BERT run: build and load the starting checkpoint (untimed init), then pretrain until the masked-LM
accuracy on the eval set reaches the target (timed).

MLPerf shape: start from the reference checkpoint; LAMB with the hyperparameters of a reference
convergence point (see config.py); evaluate every FLOOR(0.05 x (230.23 x batch + 3,000,000), 25,000)
samples on 10,000 eval sequences; stop at the first evaluation at or above 0.720. Samples count
sequences, so a packed row of three sequences counts three; `epoch_num` is the samples trained, as
NVIDIA's logs have it.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mlperf_logging.mllog import constants as C
from torch.nn.parallel import DistributedDataParallel

from workloads.bert.config import PRESETS, BertPreset, eval_interval, plan_batch
from workloads.bert.data import Row, TrainStream, collate, ensure_tiny_dataset, eval_batches, share
from workloads.bert.lamb import Lamb
from workloads.bert.model import Bert, load_reference_state_dict
from workloads.common import mlperf as K
from workloads.common.cache import build_once, cache_root
from workloads.common.campaign import RunOptions, Workload
from workloads.common.distributed import DistContext, all_sum
from workloads.common.param_groups import parameter_groups
from workloads.common.progress import Progress
from workloads.common.resilience import Resilience

MAX_PREDICTIONS_PER_SEQ = "max_predictions_per_seq"  # logged by the reference and NVIDIA; not in mllog's constants
SYNTHETIC_EVAL_ROWS = 256


class BertWorkload(Workload):
    def __init__(self, opts: RunOptions, ctx: DistContext, seed: int):
        super().__init__(opts, ctx, seed)
        self.preset: BertPreset = PRESETS[opts.preset]
        try:
            self.plan = plan_batch(self.preset, ctx.world_size, opts.batch_size)
        except ValueError as exc:
            raise SystemExit(f"workloads: {exc}") from None
        h = self.plan.hyperparameters
        self.eval_every = eval_interval(self.preset, self.plan.global_batch)
        self.total_steps = min(opts.max_steps or math.inf, h.training_steps,
                               math.ceil(self.preset.max_samples / self.plan.global_batch))
        self.samples = 0  # sequences trained, over all ranks
        self.next_eval = self.eval_every  # samples at which the next evaluation is due
        self.block_first = 0  # samples when the current block (of training between evaluations) began

        model = Bert(self.preset.model).to(ctx.device)
        self._load_init_checkpoint(model)
        self.model = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda"
                                             else None)
        self.optimizer = Lamb(parameter_groups(model, h.weight_decay), lr=h.base_lr, betas=(h.beta_1, h.beta_2),
                              eps=h.epsilon, weight_decay=h.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, h.lr_factor)
        self.stream, (self.eval_set, self.eval_rows) = self._data()
        # Packed rows hold a varying number of sequences: those runs count them (one small all-reduce a step).
        self.packed = self.stream.packed

    # --- init (untimed) -------------------------------------------------------------------------

    def _load_init_checkpoint(self, model: Bert) -> None:
        """Start from the given checkpoint; the tiny preset's default is one the harness trains once.
        Synthetic throughput runs start from random weights."""
        path = self.opts.init_checkpoint
        if path is None and self.opts.synthetic:
            return
        if path is None:
            if self.opts.preset != "tiny":
                raise SystemExit("workloads: bert starts from MLPerf's reference checkpoint: give --init-checkpoint "
                                 "FILE (a PyTorch state dict, e.g. the converted model.ckpt-28252.pt)")
            if self.ctx.local_rank == 0:
                ensure_tiny_init_checkpoint(self.preset)
            dist.barrier()
            path = tiny_init_root() / "model.pt"
        if not Path(path).is_file():
            raise SystemExit(f"workloads: the bert starting checkpoint {path} is not a file")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch.load raises several kinds for a file it cannot read
            raise SystemExit(f"workloads: the bert starting checkpoint {path} is not a PyTorch state dict that "
                             f"torch.load(weights_only=True) reads ({type(exc).__name__})") from None
        if not isinstance(state, dict):
            raise SystemExit(f"workloads: the bert starting checkpoint {path} holds a {type(state).__name__}, not a "
                             "state dict")
        try:
            load_reference_state_dict(model, state.get("model", state))
        except ValueError as exc:
            raise SystemExit(f"workloads: {path}: {exc}") from None

    def _data(self):
        cfg, ctx, plan = self.preset, self.ctx, self.plan
        if self.opts.synthetic:
            rng = np.random.default_rng(self.seed + 1)
            rows = [synthetic_row(cfg, rng) for _ in range(SYNTHETIC_EVAL_ROWS)]
            return (SyntheticStream(cfg, self.seed, ctx.rank),
                    (share(rows, plan.micro_batch, cfg.model.max_seq_len, ctx.rank, ctx.world_size), len(rows)))
        root = self.opts.data
        if root is None:
            if self.opts.preset != "tiny":
                raise SystemExit("workloads: bert's full preset reads MLPerf's BERT data: give --data DIR (with "
                                 "train/*.hdf5 and eval/*.hdf5), or --synthetic")
            if ctx.local_rank == 0:
                ensure_tiny_dataset(cfg.model.vocab_size, cfg.model.max_seq_len, cfg.max_predictions)
            dist.barrier()
            root = ensure_tiny_dataset(cfg.model.vocab_size, cfg.model.max_seq_len, cfg.max_predictions)
        for part in ("train", "eval"):
            if not Path(root, part).is_dir():
                raise SystemExit(f"workloads: {root} has no {part}/ folder: MLPerf's BERT data goes in DIR/train/*.hdf5 "
                                 "and DIR/eval/*.hdf5")
        try:
            return (TrainStream(Path(root, "train"), self.seed, ctx.rank, ctx.world_size),
                    eval_batches(Path(root, "eval"), plan.micro_batch, cfg.model.max_seq_len, cfg.eval_samples,
                                 ctx.rank, ctx.world_size))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"workloads: {exc}") from None

    def hyperparameters(self) -> dict[str, Any]:
        h, plan = self.plan.hyperparameters, self.plan
        return {
            C.GLOBAL_BATCH_SIZE: plan.global_batch,
            C.GRADIENT_ACCUMULATION_STEPS: plan.grad_accum,
            C.MAX_SEQUENCE_LENGTH: self.preset.model.max_seq_len,
            MAX_PREDICTIONS_PER_SEQ: self.preset.max_predictions,
            C.OPT_NAME: C.LAMB,
            C.OPT_BASE_LR: h.base_lr,
            C.OPT_LAMB_EPSILON: h.epsilon,
            C.OPT_LR_TRAINING_STEPS: h.training_steps,
            C.OPT_LR_WARMUP_STEPS: h.warmup_steps,
            C.NUM_WARMUP_STEPS: h.warmup_steps,
            C.START_WARMUP_STEP: h.start_warmup_step,
            C.OPT_LAMB_BETA_1: h.beta_1,
            C.OPT_LAMB_BETA_2: h.beta_2,
            C.OPT_LAMB_WEIGHT_DECAY: h.weight_decay,
            C.OPT_LAMB_LR_DECAY_POLY_POWER: h.poly_power,
            C.EVAL_SAMPLES: self.eval_rows,
        }

    # --- the timed run ----------------------------------------------------------------------------

    def position(self) -> dict[str, Any]:
        return {"samples": self.samples, "next_eval": self.next_eval, "block_first": self.block_first}

    def load_position(self, position: dict[str, Any]) -> None:
        self.samples, self.next_eval, self.block_first = (position["samples"], position["next_eval"],
                                                          position["block_first"])

    def train(self, mlog: K.ResultLog, progress_desc: str, support: Resilience) -> bool:
        plan, ctx = self.plan, self.ctx
        resumed = support.restore()
        batches = self.stream.batches(plan.micro_batch, self.preset.model.max_seq_len,
                                      skip_rows=resumed * plan.micro_batch * plan.grad_accum)
        progress = Progress(self.total_steps, progress_desc, show=ctx.is_main, initial=resumed)
        reached, step = False, resumed
        # A run resumed inside a block continues it: its block_start is logged already.
        block_open, block_samples, started = resumed > 0, self.samples, time.perf_counter()
        try:
            if self.samples >= self.next_eval:  # resumed after the step that ends a block, before its eval
                reached = self._end_block(mlog, resumed, None, support, progress, progress_desc)
                block_open = False
            for step in range(resumed + 1, self.total_steps + 1) if not reached else ():
                if not block_open:
                    self.block_first, block_samples, started = self.samples, self.samples, time.perf_counter()
                    mlog.start(C.BLOCK_START, metadata={C.FIRST_EPOCH_NUM: self.block_first,
                                                        C.EPOCH_COUNT: self.next_eval - self.block_first})
                    block_open = True
                loss, sequences = self._train_step(batches)
                self.samples += sequences
                progress.advance(1, loss=loss)
                support.after_step(step, loss)
                if self.samples < self.next_eval and step != self.total_steps:
                    continue
                throughput = (self.samples - block_samples) / (time.perf_counter() - started)
                reached = self._end_block(mlog, step, throughput, support, progress, progress_desc)
                block_open = False
                if reached:
                    break
        finally:
            progress.close()
        mlog.event(C.TRAIN_SAMPLES, self.samples)
        return reached

    def _end_block(self, mlog: K.ResultLog, step: int, throughput: float | None, support: Resilience,
                   progress: Progress, progress_desc: str) -> bool:
        """Close the block, evaluate; True if the target is reached."""
        mlog.end(C.BLOCK_STOP, metadata={C.FIRST_EPOCH_NUM: self.block_first})
        if throughput is not None:
            mlog.event(K.TRACKED_STATS, {"throughput": throughput}, metadata={"step": self.samples})
        while self.next_eval <= self.samples:
            self.next_eval += self.eval_every
        with support.phase("eval", step):
            accuracy = self._evaluate(mlog)
        rate = f", {throughput:.1f} seq/s" if throughput else ""
        progress.set(mlm_acc=accuracy, **({"seq/s": throughput} if throughput else {}))
        progress.message(f"{progress_desc} step {step} ({self.samples} samples): eval masked-LM accuracy "
                         f"{accuracy:.4f} (target {self.preset.target}){rate}")
        return accuracy >= self.preset.target

    def _inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.ctx.device, non_blocking=True) for k, v in batch.items()}

    def _forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.ctx.device.type == "cuda"):
            return model_outputs(self.model, batch)

    def _train_step(self, batches: Iterator[dict[str, torch.Tensor]]) -> tuple[float, int]:
        """One optimizer step over grad_accum micro batches; returns the mean loss and the sequences trained
        (over all ranks)."""
        self.model.train()
        accum = self.plan.grad_accum
        total = torch.zeros((), device=self.ctx.device)
        sequences = torch.zeros((), dtype=torch.int64, device=self.ctx.device)
        for micro in range(accum):
            batch = self._inputs(next(batches))
            # Gradients are reduced across ranks only after the last micro batch.
            with self.model.no_sync() if micro < accum - 1 else nullcontext():
                loss = pretraining_loss(*self._forward(batch), batch) / accum
                loss.backward()
            total += loss.detach()
            sequences += batch["nsp_labels"].numel()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.packed:
            dist.all_reduce(sequences)
            return total.item(), int(sequences.item())
        return total.item(), self.plan.global_batch

    @torch.no_grad()
    def _evaluate(self, mlog: K.ResultLog) -> float:
        mlog.start(C.EVAL_START, metadata={C.EPOCH_NUM: self.samples})
        self.model.eval()
        correct = torch.zeros((), dtype=torch.int64, device=self.ctx.device)
        total = 0
        for batch in self.eval_set:
            batch = self._inputs(batch)
            mlm_logits, _ = self._forward(batch)
            correct += (mlm_logits.argmax(-1) == batch["mlm_labels"]).sum()
            total += batch["mlm_labels"].numel()
        correct, total = all_sum([correct.item(), total], self.ctx)
        accuracy = correct / total
        mlog.event(C.EVAL_ACCURACY, accuracy, metadata={C.EPOCH_NUM: self.samples})
        mlog.end(C.EVAL_STOP, metadata={C.EPOCH_NUM: self.samples})
        return accuracy


def model_outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's MLM and NSP logits for a collated batch."""
    return model(batch["input_ids"], batch["segment_ids"], batch["position_ids"], batch["sequence_ids"],
                 batch["mlm_positions"], batch["cls_positions"])


def pretraining_loss(mlm_logits: torch.Tensor, nsp_logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Masked-LM plus next-sentence cross entropy, as the reference sums them."""
    return (F.cross_entropy(mlm_logits.float(), batch["mlm_labels"]) +
            F.cross_entropy(nsp_logits.float(), batch["nsp_labels"]))


def synthetic_row(cfg: BertPreset, rng: np.random.Generator) -> Row:
    """A full-length sequence of random tokens with random masked positions: input for throughput runs."""
    length, masked = cfg.model.max_seq_len, cfg.max_predictions
    positions = np.sort(rng.choice(np.arange(1, length), masked, replace=False))
    return Row(input_ids=rng.integers(0, cfg.model.vocab_size, length), segment_ids=(np.arange(length) >= length // 2
                                                                                     ).astype(np.int64),
               lengths=np.array([length]), mlm_positions=positions, mlm_ids=rng.integers(0, cfg.model.vocab_size,
                                                                                          masked),
               nsp_labels=rng.integers(0, 2, 1))


class SyntheticStream:
    """Random rows in place of TrainStream (--synthetic): same interface, no dataset."""

    packed = False

    def __init__(self, cfg: BertPreset, seed: int, rank: int):
        self.cfg, self.seed, self.rank = cfg, seed, rank

    def batches(self, batch: int, max_seq_len: int, skip_rows: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        rng = np.random.default_rng([self.seed, self.rank, skip_rows])
        while True:
            yield collate([synthetic_row(self.cfg, rng) for _ in range(batch)], max_seq_len)


# The tiny preset's starting checkpoint: a short run from random weights, trained once in one process with a
# fixed seed, as MLPerf's reference checkpoint was trained once by someone else. Like that checkpoint (masked-LM
# accuracy about 0.35), it has left the first plateau but is far from the target.
TINY_INIT_VERSION = 1
TINY_INIT_STEPS = 650
TINY_INIT_WARMUP = 100  # post-LayerNorm BERT needs a warmup from random weights
TINY_INIT_LR = 1e-2


def tiny_init_root() -> Path:
    return cache_root() / f"tiny-bert-init-v{TINY_INIT_VERSION}"


def ensure_tiny_init_checkpoint(preset: BertPreset) -> Path:
    return build_once(tiny_init_root(), lambda folder: _train_tiny_init(preset, folder))


def _train_tiny_init(preset: BertPreset, folder: Path) -> None:
    torch.manual_seed(1234)
    cfg = preset.model
    model = Bert(cfg)
    optimizer = Lamb(parameter_groups(model, 0.01), lr=TINY_INIT_LR, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    data = ensure_tiny_dataset(cfg.vocab_size, cfg.max_seq_len, preset.max_predictions)
    batches = TrainStream(data / "train", seed=1234, rank=0, world=1).batches(preset.global_batch, cfg.max_seq_len)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / TINY_INIT_WARMUP))
    for _ in range(TINY_INIT_STEPS):
        batch = next(batches)
        loss = pretraining_loss(*model_outputs(model, batch), batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    torch.save({"model": model.state_dict()}, folder / "model.pt")
