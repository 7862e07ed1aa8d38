"""The steps every language model here shares: the next-token loss accumulated over micro batches, the
scored loss of an eval batch, and gradient clipping, for whole models and for DTensor-parallel ones alike.

AdamW's parameter groups are Megatron's for both references. A `split` turns a batch of samples into the model's
inputs and the targets this rank scores: the whole shifted sequence of seq_len + 1 tokens (the default), GPT-3's
samples of seq_len tokens with the last target unscored (rolled_split), or a context-parallel rank's chunks with
their positions (workloads.decoder.parallelize).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from workloads.common.distributed import all_sum
from workloads.common.gpu_peaks import mfu
from workloads.common.megatron_data import PAD
from workloads.common.warm_up import WarmUpInputs, eval_batch_sizes

IGNORED = -100  # cross_entropy's ignore_index: a target position that is not scored

Split = Callable[[torch.Tensor], tuple[tuple[torch.Tensor, ...], torch.Tensor]]


def next_token_split(tokens: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The model reads tokens 0..n-1 and predicts 1..n."""
    return (tokens[:, :-1],), tokens[:, 1:]


def rolled_split(tokens: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Samples of seq_len tokens (MLPerf's GPT-3 reference, `--no-seq-len-plus-one-tokens`: pretrain_gpt.py's
    get_batch): the model reads all n, position i predicts token i + 1, and the last position, like any target
    that is padding (megatron_data.PAD), is not scored; padding is read as token 0."""
    targets = torch.roll(tokens, -1, dims=1)
    targets[:, -1] = PAD
    return (tokens.masked_fill(tokens == PAD, 0),), targets.masked_fill(targets == PAD, IGNORED)


def eod_masked_split(eod: int, whole: Split = next_token_split) -> Split:
    """Megatron's eod_mask_loss (megatron/core/datasets/gpt_dataset.py, `_get_ltor_masks_and_position_ids`: the
    loss mask is 0 where the input token is the end-of-document token): the target after an EOD, the next document's
    first token, is not scored, since nothing before it in the sample belongs to its document."""
    def split(tokens: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        (inputs,), targets = whole(tokens)
        return (inputs,), targets.masked_fill(inputs == eod, IGNORED)
    return split


def _loss_context(logits: torch.Tensor):
    """Vocabulary-sharded logits (tensor parallel) need loss_parallel around the loss and its backward."""
    return loss_parallel() if isinstance(logits, DTensor) else nullcontext()


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The next-token cross-entropy of (batch, sequence, vocab) logits, in fp32: the mean over the scored targets
    (training) or their sum (evaluation); targets of IGNORED are not scored."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction,
                           ignore_index=IGNORED)


def accumulate_gradients(model: torch.nn.Module, micro_batches: Iterable[torch.Tensor], count: int,
                         split: Split = next_token_split) -> torch.Tensor:
    """Forward and backward over `count` micro batches of (batch, sequence + 1) tokens; returns the mean loss
    (of this rank's targets). A model with multi-token prediction depths (workloads.decoder.mtp) returns their
    weighted loss beside the logits: it joins each micro batch's backward, scaled as the main loss is, but not the
    loss returned, which stays the next-token one that evaluation scores.

    FSDP2 reduce-scatters each micro batch's gradients into the sharded ones as backward ends.
    Turning that sync off between micro batches (set_requires_gradient_sync(False)) would
    save communication but keep every unsharded fp32 gradient on every rank until the last
    micro batch: 4 bytes x 175B / tensor parallel, about 90 GB per GPU for GPT-3.
    """
    total = torch.zeros((), device=next(model.parameters()).device)
    for tokens in micro_batches:
        inputs, targets = split(tokens)
        if getattr(model, "mtp", None):  # DeepSeek-V3's multi-token prediction: its loss comes with the logits
            logits, mtp_loss = model(*inputs, targets=targets)
        else:
            logits, mtp_loss = model(*inputs), 0.0
        with _loss_context(logits):
            loss = token_loss(logits, targets) / count
            (loss + mtp_loss / count).backward()
        total += _local(loss.detach())
    return total


@torch.no_grad()
def scored_loss_sum(model: torch.nn.Module, tokens: torch.Tensor, counted: torch.Tensor,
                    split: Split = next_token_split) -> tuple[torch.Tensor, int]:
    """The summed next-token loss over this rank's targets in the sequences of `tokens` whose `counted` flag is
    set, and how many tokens that sums. Uncounted sequences (an eval shard's padding) still run, so that every
    data rank makes the same collective calls."""
    inputs, targets = split(tokens)
    targets = targets.masked_fill(~counted.bool().to(tokens.device)[:, None], IGNORED)
    logits = model(*inputs)
    with _loss_context(logits):
        loss = token_loss(logits, targets, reduction="sum")
    return _local(loss).double(), int((targets != IGNORED).sum())


def optimizer_groups(model: nn.Module, weight_decay: float, decay_vectors: bool = False) -> list[dict]:
    """AdamW parameter groups as Megatron builds them: by default (llama31_8b's reference, through NeMo) no
    weight decay on biases and norm parameters (every one-dimensional parameter), decay on the weight matrices
    and embeddings; with `decay_vectors` (Megatron's --do-layernorm-bias-weight-decay, which MLPerf's GPT-3
    reference passes) one group that decays every parameter."""
    if decay_vectors:
        return [{"params": list(model.parameters()), "weight_decay": weight_decay}]
    decayed, exempt = [], []
    for param in model.parameters():
        (decayed if param.ndim > 1 else exempt).append(param)
    return [{"params": decayed, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float,
                    pipeline_group: dist.ProcessGroup | None = None,
                    copies: Iterable[torch.nn.Parameter] = ()) -> torch.Tensor:
    """Clip the global gradient norm in place and return it (torchtitan's approach for DTensor gradients).

    The gradients of one mesh have one norm, a partial DTensor that full_tensor() reduces over that mesh
    (replicated pieces, the norms, count once); a model with experts has two meshes (workloads.decoder.parallelize),
    whose norms add as squares. With a pipeline, each stage holds other parameters: the squares add over
    `pipeline_group` too; `copies`, parameters another stage holds as well (GPT-3's tied output layer, whose
    gradient both stages hold whole), are clipped but not counted again."""
    by_mesh: dict[object, list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    copied = {id(p) for p in copies}
    counted = [[p.grad for p in group if id(p) not in copied] for group in by_mesh.values()]
    norms = [_local(torch.nn.utils.get_total_norm(grads, 2.0)) for grads in counted if grads]
    total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if pipeline_group is not None:
        squares = total.square()
        dist.all_reduce(squares, group=pipeline_group)
        total = squares.sqrt()
    for group in by_mesh.values():  # one mesh at a time: DTensor's foreach operations take one
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


class DecoderSteps:
    """The training loop's questions (workloads.common.loop) that GPT-3 and llama31_8b answer alike, for a
    workload that sets `model`, `optimizer`, `scheduler`, `loaders` (workloads.common.megatron_data),
    `layout` (grad_accum, global_batch, data), `cfg` (micro_batch, eval_sequences, model.seq_len, model.vocab_size,
    model.flops_per_token()), `mesh`, `eval_every` (steps), `split` and `clip_norm`; a pipelined decoder sets
    `pipeline` (workloads.decoder.pipeline.Pipeline: its step and eval run through the stages)."""

    pipeline = None

    @property
    def ranks_hold_other_parameters(self) -> bool:
        """A pipeline's stages hold different parameters: checkpoints key the optimizer state by parameter name
        (Workload.ranks_hold_other_parameters)."""
        return self.pipeline is not None

    rate_shown = ("tok/s", "tokens_per_second")
    logs_trained_samples = True
    extra_token = 1  # a sample's tokens beyond seq_len: the next-token target of the last position (GPT-3's: none)

    def sample_shape(self) -> tuple[int, ...]:
        """One sample's shape, as the loaders give it."""
        return (self.cfg.model.seq_len + self.extra_token,)

    def eval_reading(self) -> tuple[int, int]:
        """The eval set's sequences, and how many of them one eval batch holds."""
        return self.cfg.eval_sequences, self.cfg.micro_batch

    def warm_up_inputs(self) -> WarmUpInputs:
        """Two steps of random-token micro batches, and one eval batch of each size this data rank reads: its share
        of the eval set (EvalShard: the same count on every rank) in full batches, then the rest."""
        generator = torch.Generator().manual_seed(0)

        def tokens(count: int) -> torch.Tensor:
            return torch.randint(0, self.cfg.model.vocab_size, (count, *self.sample_shape()), generator=generator)

        sequences, batch = self.eval_reading()
        shard = -(-sequences // self.layout.data)
        return WarmUpInputs(train=[tokens(self.cfg.micro_batch) for _ in range(2 * self.layout.grad_accum)], steps=2,
                            eval=[(tokens(n), torch.ones(n, dtype=torch.bool)) for n in eval_batch_sizes(shard, batch)])

    def process_groups(self) -> list:
        return self.mesh.get_all_groups()

    def batches(self, step: int):
        self.loaders.sampler.skip = step * self.layout.grad_accum * self.cfg.micro_batch
        return iter(self.loaders.train)

    def block_ends(self, step: int) -> bool:
        return step % self.eval_every == 0

    def train_step(self, batches) -> tuple[torch.Tensor, int]:
        """One optimizer step over grad_accum micro batches: the mean loss and the sequences trained."""
        self.model.train()
        micro_batches = (next(batches).to(self.ctx.device, non_blocking=True) for _ in range(self.layout.grad_accum))
        if self.pipeline is not None:
            loss = self.pipeline.train_step(micro_batches)
        else:
            loss = accumulate_gradients(self.model, micro_batches, self.layout.grad_accum, self.split)
        clip_grad_norm_(self.model.parameters(), self.clip_norm, self.pipeline.group if self.pipeline else None,
                        self.pipeline.copies if self.pipeline else ())
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), self.layout.global_batch

    def tracked_stats(self, samples_per_second: float) -> dict[str, float]:
        tokens_per_second = samples_per_second * self.cfg.model.seq_len
        stats = {"throughput": samples_per_second, "tokens_per_second": tokens_per_second}
        if self.ctx.device.type == "cuda":
            utilisation = mfu(self.cfg.model.flops_per_token(), tokens_per_second, self.ctx.world_size,
                              torch.cuda.get_device_name(self.ctx.device))
            if utilisation is not None:
                stats["mfu"] = utilisation
        return stats

    @torch.no_grad()
    def evaluate(self, batches: Iterable | None = None) -> float:
        self.model.eval()
        loss_sum, count = torch.zeros((), dtype=torch.float64, device=self.ctx.device), 0
        for tokens, counted in self.loaders.eval if batches is None else batches:
            tokens = tokens.to(self.ctx.device, non_blocking=True)
            batch_sum, batch_count = self.pipeline.scored_loss_sum(tokens, counted) if self.pipeline is not None \
                else scored_loss_sum(self.model, tokens, counted, self.split)
            loss_sum, count = loss_sum + batch_sum, count + batch_count
        # Each sequence is scored on one data rank (its tokens split over the context ranks, if any); every tensor
        # rank of them holds the same sums, so the ratio over the whole world is the mean over the tokens (with a
        # pipeline, only the last stage's ranks hold sums).
        loss_sum, count = all_sum([loss_sum.item(), count], self.ctx)
        return loss_sum / count
