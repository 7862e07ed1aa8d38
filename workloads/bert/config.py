"""BERT presets and the batch plan. No torch here: `harness run --dry-run` imports this to show the plan.

The closed benchmark fixes the hyperparameters by global batch: a submission must use those of one
of MLPerf's reference convergence points (RCPs). They are read from the RCP file mlperf-logging
ships (rcp_checker/training_5.0.0/rcps_bert.json), never copied here, and the global batch is the
RCP batch that best matches the processes and per-process batch at hand.

The global batch counts sequences, as the rules and the RCPs do. The user gives rows: the micro
batch is rows per process per forward pass, and on packed data (rows of up to 3 sequences) the
packing factor says how many sequences a row holds on average. One optimizer step trains
world x micro batch x accumulation rows, that is that many times the packing factor sequences:
the global batch that is logged, that picks the RCP, and that sets the eval interval. This is
NVIDIA's convention: their packed runs set BATCHSIZE (rows per GPU, logged as d_batch_size) and
PACKING_FACTOR=2 (their packer's rows hold 1.999 sequences on average), and log
global_batch_size = rows x 2 (12,288 at 2 rows per GPU on 3,072 GPUs in NVIDIA+CoreWeave's v3.0
BERT logs; mlcommons/training_results_v3.1 NVIDIA/benchmarks/bert/implementations/pytorch/
config_DGXH100_*_pack*.sh and input_preprocessing/packed_data/README.md). The sequences each step
really trains are counted (samples, epoch_num), and a run whose data strays from the declared
factor stops (see PACKING_TOLERANCE).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources

RCP_RULESET = "training_5.0.0"
# MLPerf's rule for BERT: evaluate every FLOOR(0.05 x (230.23 x global batch + 3,000,000), 25,000) samples.
EVAL_EVERY_BASE, EVAL_EVERY_PER_BATCH, EVAL_EVERY_ROUND = 3_000_000, 230.23, 25_000
# How far the sequences per row measured over a packed run may stray from the declared packing factor before the
# run stops: beyond it the logged batch, and the RCP's hyperparameters chosen by it, are not the batch trained.
PACKING_TOLERANCE = 0.05


@dataclass(frozen=True)
class BertConfig:
    """The model's shape."""

    vocab_size: int
    max_seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int
    type_vocab_size: int = 2
    dropout: float = 0.1

    @property
    def params(self) -> int:
        d = self.d_model
        embeddings = (self.vocab_size + self.max_seq_len + self.type_vocab_size) * d + 2 * d
        layer = 4 * d * d + 4 * d + 2 * d * self.d_ff + self.d_ff + d + 4 * d
        heads = d * d + d + 2 * d + self.vocab_size + d * d + d + 2 * d + 2  # MLM transform + bias, pooler, NSP
        return embeddings + self.n_layer * layer + heads


@dataclass(frozen=True)
class Hyperparameters:
    """LAMB and its schedule, under the names the closed rules log them by."""

    base_lr: float
    training_steps: int  # the polynomial decay reaches 0 here
    warmup_steps: int
    start_warmup_step: int  # warmup is measured from this step (negative: already under way at step 0)
    beta_1: float
    beta_2: float
    weight_decay: float
    epsilon: float = 1e-6
    poly_power: float = 1.0

    def lr_factor(self, step: int) -> float:
        """The reference's schedule, as a multiple of base_lr after `step` optimizer steps: linear warmup
        counted from start_warmup_step, then polynomial decay to 0 at training_steps."""
        if self.warmup_steps and step - self.start_warmup_step < self.warmup_steps:
            return (step - self.start_warmup_step) / self.warmup_steps
        return max(0.0, 1 - step / self.training_steps) ** self.poly_power


@dataclass(frozen=True)
class BertPreset:
    model: BertConfig
    micro_batch: int  # rows per process per forward pass (at most; the plan may use fewer)
    max_predictions: int  # masked positions per sequence (MLPerf: 76)
    target: float  # masked-LM accuracy that ends the run
    eval_samples: int | None  # sequences evaluated (MLPerf: 10,000); None: the whole eval set
    # The tiny preset's own batch and schedule; None for the closed preset, which takes an RCP's.
    global_batch: int | None = None
    hyperparameters: Hyperparameters | None = None
    eval_every: int | None = None  # samples between evaluations; None: MLPerf's rule
    max_samples: int = 14_000_000  # give up here (NVIDIA's limit); the tiny preset's is small
    loader_workers: int = 4  # processes per rank that read and collate the training batches (0: the training thread)


PRESETS = {
    # MLPerf closed: BERT-large, sequence 512, masked LM + NSP from the reference checkpoint, target 0.720.
    "full": BertPreset(model=BertConfig(vocab_size=30_522, max_seq_len=512, n_layer=24, n_head=16, d_model=1024,
                                        d_ff=4096),
                       micro_batch=32, max_predictions=76, target=0.720, eval_samples=10_000),
    # A 2-layer BERT on generated Markov-chain sentence pairs, from a checkpoint the harness trains once.
    "tiny": BertPreset(model=BertConfig(vocab_size=128, max_seq_len=64, n_layer=2, n_head=4, d_model=128, d_ff=512,
                                        dropout=0.0),
                       micro_batch=16, max_predictions=10, target=0.720, eval_samples=None, global_batch=32,
                       hyperparameters=Hyperparameters(base_lr=8e-3, training_steps=1200, warmup_steps=0,
                                                       start_warmup_step=0, beta_1=0.9, beta_2=0.999,
                                                       weight_decay=0.01),
                       # The tiny rows are read in microseconds: on a laptop's few cores a loader process would only
                       # compete with the ranks (tests/test_bert.py runs the worker loader itself).
                       eval_every=2048, max_samples=38_400, loader_workers=0),
}


@dataclass(frozen=True)
class BatchPlan:
    """How `world` processes make one optimizer step of `global_batch` sequences."""

    world: int
    micro_batch: int  # rows per process per forward pass
    grad_accum: int
    hyperparameters: Hyperparameters
    source: str  # where the hyperparameters come from (an RCP's name, or the preset)
    packing_factor: int = 1  # sequences per row, on average (1: unpacked data)

    @property
    def rows(self) -> int:
        """Rows per optimizer step, over all processes."""
        return self.world * self.micro_batch * self.grad_accum

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: what the rules call the batch."""
        return self.rows * self.packing_factor


def reference_points() -> dict[int, tuple[str, Hyperparameters]]:
    """MLPerf's BERT RCPs by global batch, from the file the RCP checker itself reads."""
    path = resources.files("mlperf_logging") / "rcp_checker" / RCP_RULESET / "rcps_bert.json"
    points = {}
    for name, rcp in json.loads(path.read_text()).items():
        h = rcp["Hyperparams"]
        points[int(rcp["BS"])] = (name, Hyperparameters(
            base_lr=h["opt_base_learning_rate"], training_steps=int(h["opt_learning_rate_training_steps"]),
            warmup_steps=int(h["num_warmup_steps"]), start_warmup_step=int(h["start_warmup_step"]),
            beta_1=h["opt_lamb_beta_1"], beta_2=h["opt_lamb_beta_2"], weight_decay=h["opt_lamb_weight_decay_rate"],
            epsilon=h["opt_epsilon"]))
    return points


def _split(global_batch: int, world: int, micro_batch: int) -> tuple[int, int] | None:
    """(micro batch, accumulation steps) with micro x accumulation = global / world and micro <= the asked one."""
    if global_batch % world:
        return None
    per_process = global_batch // world
    accum = math.ceil(per_process / micro_batch)
    while per_process % accum:
        accum += 1
    return per_process // accum, accum


def _rows_split(sequences: int, packing_factor: int, world: int, micro: int) -> tuple[int, int] | None:
    """(micro batch, accumulation steps) in rows for a global batch of `sequences`, or None if it does not split."""
    if sequences % packing_factor:
        return None
    return _split(sequences // packing_factor, world, micro)


def plan_batch(preset: BertPreset, world: int, micro_batch: int | None = None, packing_factor: int = 1
               ) -> BatchPlan:
    """The tiny preset's own batch; for the closed preset, the RCP batch nearest world x micro batch x packing
    factor (sequences) that the world's rows divide. Refuses, naming the RCP batches, when none does."""
    micro = micro_batch or preset.micro_batch
    if packing_factor < 1:
        raise ValueError(f"a packing factor counts sequences per row: 1 (unpacked data) or more, not {packing_factor}")
    if preset.hyperparameters is not None:
        split = _rows_split(preset.global_batch, packing_factor, world, micro)
        if split is None:
            raise ValueError(f"bert's tiny preset trains a global batch of {preset.global_batch} sequences, which "
                             f"{world} processes cannot share evenly in rows of {packing_factor}")
        return BatchPlan(world, *split, preset.hyperparameters, source="tiny preset", packing_factor=packing_factor)
    points = reference_points()
    usable = [batch for batch in points if _rows_split(batch, packing_factor, world, micro)]
    if not usable:
        rows = f" in rows of {packing_factor} sequences" if packing_factor > 1 else ""
        raise ValueError(f"no MLPerf BERT reference batch ({', '.join(map(str, sorted(points)))}) splits evenly over "
                         f"{world} processes{rows}: use a process count that divides one of them")
    batch = min(usable, key=lambda b: (abs(math.log(b / (world * micro * packing_factor))), b))
    name, hyperparameters = points[batch]
    return BatchPlan(world, *_rows_split(batch, packing_factor, world, micro), hyperparameters,
                     source=f"MLPerf RCP {name}", packing_factor=packing_factor)


def eval_interval(preset: BertPreset, global_batch: int) -> int:
    """Samples between evaluations."""
    if preset.eval_every:
        return preset.eval_every
    every = EVAL_EVERY_PER_BATCH * global_batch + EVAL_EVERY_BASE
    return int(0.05 * every // EVAL_EVERY_ROUND * EVAL_EVERY_ROUND)


def describe(preset: BertPreset, plan: BatchPlan) -> list[str]:
    """The lines `--dry-run` shows."""
    m = preset.model
    return [f"bert model: {m.n_layer} layers, hidden {m.d_model}, {m.n_head} heads, sequence {m.max_seq_len}, "
            f"{m.params / 1e6:.1f}M parameters",
            f"bert batch: global {plan.global_batch} = {plan.world} processes x micro batch {plan.micro_batch} x "
            f"{plan.grad_accum} accumulation steps"
            + (f" x {plan.packing_factor} sequences per packed row" if plan.packing_factor > 1 else "")
            + f" ({plan.source}); eval every {eval_interval(preset, plan.global_batch)} samples"]
