"""One BERT run: build and load the starting checkpoint (untimed init), then pretrain until the masked-LM
accuracy on the eval set reaches the target (timed).

MLPerf shape: start from the reference checkpoint; LAMB with the hyperparameters of a reference
convergence point (see config.py); evaluate every FLOOR(0.05 x (230.23 x batch + 3,000,000), 25,000)
samples on 10,000 eval sequences; stop at the first evaluation at or above 0.720. Samples count
sequences, so a packed row of three sequences counts three; `epoch_num` is the samples trained, as
NVIDIA's logs have it. The global batch counts sequences too (rows x packing factor: see config.py).
"""

from __future__ import annotations

import itertools
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from mlperf_logging.mllog import constants as C
from torch.nn.parallel import DistributedDataParallel

from workloads.bert.config import PACKING_TOLERANCE, PRESETS, BertPreset, eval_interval, plan_batch
from workloads.bert.data import Row, TrainStream, collate, ensure_tiny_dataset, eval_batches, share, train_batches
from workloads.bert.lamb import Lamb
from workloads.bert.model import Bert, load_reference_state_dict, model_outputs, pretraining_loss
from workloads.bert.warm_start import ensure_tiny_init_checkpoint, tiny_init_root
from workloads.common.campaign import RunOptions, Workload
from workloads.common.data import data_errors
from workloads.common.loop import Target
from workloads.common.distributed import DistContext, all_sum
from workloads.common.param_groups import parameter_groups
from workloads.common.refusals import ConfigurationError
from workloads.common.resilience import Block

MAX_PREDICTIONS_PER_SEQ = "max_predictions_per_seq"  # logged by the reference and NVIDIA; not in mllog's constants
SYNTHETIC_EVAL_ROWS = 256


class BertWorkload(Workload):
    rate_shown = ("seq/s", "throughput")
    logs_trained_samples = True

    def __init__(self, opts: RunOptions, ctx: DistContext, seed: int):
        super().__init__(opts, ctx, seed)
        self.preset: BertPreset = PRESETS[opts.preset]
        try:
            self.plan = plan_batch(self.preset, ctx.world_size, opts.batch_size, opts.packing_factor)
        except ValueError as exc:  # the plan refuses the job's own numbers, the same on every node
            raise ConfigurationError(f"workloads: {exc}") from None
        h = self.plan.hyperparameters
        self.eval_every = eval_interval(self.preset, self.plan.global_batch)
        self.total_steps = min(opts.max_steps or math.inf, h.training_steps,
                               math.ceil(self.preset.max_samples / self.plan.global_batch))
        self.samples = 0  # sequences trained, over all ranks
        self.next_eval = self.eval_every  # samples at which the next evaluation is due
        self.target = Target("masked-LM accuracy", "mlm_acc", self.preset.target)

        model = Bert(self.preset.model).to(ctx.device)
        self._load_init_checkpoint(model)
        self.model = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda"
                                             else None, gradient_as_bucket_view=True)
        self.forward_model = torch.compile(self.model) if self.compiled else self.model
        self.optimizer = Lamb(parameter_groups(model, h.weight_decay), lr=h.base_lr, betas=(h.beta_1, h.beta_2),
                              eps=h.epsilon, weight_decay=h.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, h.lr_factor)
        self.stream = self.eval_set = None  # opened after run_start (open_data)
        self.packed = False

    # --- init (untimed) -------------------------------------------------------------------------

    def _load_init_checkpoint(self, model: Bert) -> None:
        """Start from the given checkpoint; the tiny preset's default is one the harness trains once.
        Synthetic throughput runs start from random weights."""
        path = self.opts.init_checkpoint
        if path is None and self.opts.synthetic:
            return
        if path is None:  # the tiny preset (workloads.registry.missing_inputs refuses the full one without)
            if self.ctx.local_rank == 0:
                ensure_tiny_init_checkpoint(self.preset)
            dist.barrier()
            path = tiny_init_root() / "model.pt"
        if not Path(path).is_file():
            raise SystemExit(f"workloads: the bert starting checkpoint {path} is not a file")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except OSError as exc:  # reading it failed: this node's I/O, not the file's content (retried if passing)
            raise SystemExit(f"workloads: the bert starting checkpoint {path}: {exc}") from None
        except Exception as exc:  # torch.load raises several kinds for content it cannot read: the shared file's
            raise ConfigurationError(f"workloads: the bert starting checkpoint {path} is not a PyTorch state dict "
                                     f"that torch.load(weights_only=True) reads ({type(exc).__name__})") from None
        if not isinstance(state, dict):
            raise ConfigurationError(f"workloads: the bert starting checkpoint {path} holds a "
                                     f"{type(state).__name__}, not a state dict")
        try:
            load_reference_state_dict(model, state.get("model", state))
        except ValueError as exc:
            raise ConfigurationError(f"workloads: {path}: {exc}") from None

    # --- the data (timed: opened after run_start) ----------------------------------------------------

    def open_data(self) -> dict[str, Any]:
        self.stream, (self.eval_set, eval_rows) = self._data()
        # Packed rows hold a varying number of sequences: those runs count them (one small all-reduce a step).
        self.packed = self.stream.packed
        factor = self.plan.packing_factor
        if self.packed and factor == 1:
            raise ConfigurationError("workloads: the bert training data is packed (rows of up to 3 sequences): "
                                     "give --packing-factor N, the sequences its rows hold on average (NVIDIA's "
                                     "packed data: 2), so that the global batch, and the RCP chosen by it, count "
                                     "sequences")
        if not self.packed and factor > 1:
            raise ConfigurationError(f"workloads: --packing-factor {factor} is for packed data, and this bert "
                                     "training data holds one sequence per row: leave it out")
        return {C.EVAL_SAMPLES: eval_rows}

    def _check_packing(self, step: int) -> None:
        """Stop a packed run whose rows hold other than the declared sequences on average: its logged batch and
        the RCP's hyperparameters chosen by it would not be the batch trained."""
        per_row = self.samples / (step * self.plan.rows)
        if abs(per_row / self.plan.packing_factor - 1) > PACKING_TOLERANCE:
            raise ConfigurationError(f"workloads: the packed bert rows hold {per_row:.3f} sequences on average "
                                     f"over {step} steps, not the {self.plan.packing_factor} that --packing-factor "
                                     f"declares (tolerance {PACKING_TOLERANCE:.0%}): the logged global batch "
                                     f"{self.plan.global_batch} would not be the batch trained")

    def _data(self):
        cfg, ctx, plan = self.preset, self.ctx, self.plan
        if self.opts.synthetic:
            rng = np.random.default_rng(self.seed + 1)
            rows = [synthetic_row(cfg, rng) for _ in range(SYNTHETIC_EVAL_ROWS)]
            return (SyntheticStream(cfg, self.seed, ctx.rank),
                    (share(rows, plan.micro_batch, cfg.model.max_seq_len, ctx.rank, ctx.world_size), len(rows)))
        root = self.opts.data
        if root is None:  # the tiny preset's generated data (the full one is refused without --data)
            if ctx.local_rank == 0:
                ensure_tiny_dataset(cfg.model.vocab_size, cfg.model.max_seq_len, cfg.max_predictions)
            dist.barrier()
            root = ensure_tiny_dataset(cfg.model.vocab_size, cfg.model.max_seq_len, cfg.max_predictions)
        for part in ("train", "eval"):
            if not Path(root, part).is_dir():
                raise SystemExit(f"workloads: {root} has no {part}/ folder: MLPerf's BERT data goes in DIR/train/*.hdf5 "
                                 "and DIR/eval/*.hdf5")
        with data_errors():
            return (TrainStream(Path(root, "train"), self.seed, ctx.rank, ctx.world_size),
                    eval_batches(Path(root, "eval"), plan.micro_batch, cfg.model.max_seq_len, cfg.eval_samples,
                                 ctx.rank, ctx.world_size))

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
        }

    # --- the timed run ----------------------------------------------------------------------------

    def position(self) -> dict[str, Any]:
        return {"samples": self.samples, "next_eval": self.next_eval}

    def load_position(self, position: dict[str, Any]) -> None:
        self.samples, self.next_eval = position["samples"], position["next_eval"]

    def batches(self, step: int) -> Iterator[dict[str, torch.Tensor]]:
        return train_batches(self.stream, self.plan.micro_batch, self.preset.model.max_seq_len,
                             skip_rows=step * self.plan.micro_batch * self.plan.grad_accum,
                             workers=self.preset.loader_workers, pin_memory=self.ctx.device.type == "cuda")

    def epoch_num(self, step: int) -> int:
        return self.samples

    def next_block(self, step: int) -> Block:
        if self.packed and step:
            self._check_packing(step)
        while self.next_eval <= self.samples:  # the evaluation that closed the last block is behind
            self.next_eval += self.eval_every
        return Block(self.samples, self.next_eval - self.samples)

    def block_ends(self, step: int) -> bool:
        return self.samples >= self.next_eval

    def _inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.ctx.device, non_blocking=True) for k, v in batch.items()}

    def _forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=self.ctx.device.type == "cuda"):
            return model_outputs(self.forward_model, batch)

    def train_step(self, batches: Iterator[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, int]:
        """One optimizer step over grad_accum micro batches: the mean loss and the sequences trained (over all
        ranks)."""
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
            trained = int(sequences.item())
        else:
            trained = self.plan.global_batch
        self.samples += trained
        return total, trained

    @torch.no_grad()
    def evaluate(self, batches=None) -> float:
        self.model.eval()
        correct = torch.zeros((), dtype=torch.int64, device=self.ctx.device)
        total = 0
        for batch in self.eval_set if batches is None else batches:
            batch = self._inputs(batch)
            mlm_logits, _ = self._forward(batch)
            correct += (mlm_logits.argmax(-1) == batch["mlm_labels"]).sum()
            total += batch["mlm_labels"].numel()
        correct, total = all_sum([correct.item(), total], self.ctx)
        return correct / total


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

    def batches(self, batch: int, max_seq_len: int, skip_rows: int = 0, part: int = 0, parts: int = 1
                ) -> Iterator[dict[str, torch.Tensor]]:
        """Batches part, part + parts, ... from row `skip_rows` on; each batch is seeded by its position."""
        for k in itertools.count(part, parts):
            rng = np.random.default_rng([self.seed, self.rank, skip_rows + k * batch])
            yield collate([synthetic_row(self.cfg, rng) for _ in range(batch)], max_seq_len)
