"""BERT presets and the batch plan. No torch here: `harness run --dry-run` imports this to show the plan.

The closed benchmark fixes the hyperparameters by global batch: a submission must use those of one
of MLPerf's reference convergence points (RCPs). They are read from the RCP file mlperf-logging
ships (rcp_checker/training_5.0.0/rcps_bert.json), never copied here, and the global batch is the
RCP batch that best matches the processes and per-process batch at hand.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources

RCP_RULESET = "training_5.0.0"
# MLPerf's rule for BERT: evaluate every FLOOR(0.05 x (230.23 x global batch + 3,000,000), 25,000) samples.
EVAL_EVERY_BASE, EVAL_EVERY_PER_BATCH, EVAL_EVERY_ROUND = 3_000_000, 230.23, 25_000


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
    micro_batch: int  # sequences per process per forward pass (at most; the plan may use fewer)
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
    micro_batch: int
    grad_accum: int
    hyperparameters: Hyperparameters
    source: str  # where the hyperparameters come from (an RCP's name, or the preset)

    @property
    def global_batch(self) -> int:
        return self.world * self.micro_batch * self.grad_accum


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


def plan_batch(preset: BertPreset, world: int, micro_batch: int | None = None) -> BatchPlan:
    """The tiny preset's own batch; for the closed preset, the RCP batch nearest world x micro batch that
    the world divides. Refuses, naming the RCP batches, when none does."""
    micro = micro_batch or preset.micro_batch
    if preset.hyperparameters is not None:
        split = _split(preset.global_batch, world, micro)
        if split is None:
            raise ValueError(f"bert's tiny preset trains a global batch of {preset.global_batch}, which {world} "
                             "processes cannot share evenly")
        return BatchPlan(world, *split, preset.hyperparameters, source="tiny preset")
    points = reference_points()
    usable = [batch for batch in points if _split(batch, world, micro)]
    if not usable:
        raise ValueError(f"no MLPerf BERT reference batch ({', '.join(map(str, sorted(points)))}) splits evenly over "
                         f"{world} processes: use a process count that divides one of them")
    batch = min(usable, key=lambda b: (abs(math.log(b / (world * micro))), b))
    name, hyperparameters = points[batch]
    return BatchPlan(world, *_split(batch, world, micro), hyperparameters, source=f"MLPerf RCP {name}")


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
            f"{plan.grad_accum} accumulation steps ({plan.source}); eval every "
            f"{eval_interval(preset, plan.global_batch)} samples"]
