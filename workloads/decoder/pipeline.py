"""Pipeline parallelism for the decoders (torch.distributed.pipelining), the torchtitan way: each pipeline rank
keeps a contiguous range of the model's blocks (the first stage the embedding too, the last the final norm and the
output layer), and a 1F1B schedule runs the step's micro batches through the stages, the loss on the last one
(with virtual stages, several non-adjacent ranges a rank and the interleaved 1F1B schedule).

- Stages: the whole model is built on the meta device and each stage drops what it does not own (StageLayers keeps
  its blocks under their numbers in the whole model, so every parameter's name, "layers.N....", is the unsplit
  model's: DCP checkpoints and the Hugging Face converter see the same names). The blocks split by config.layer_chunks
  (Megatron-Bridge's DeepSeek-V3 split), the rule the memory arithmetic counts with too.
- Within a stage everything else applies as without a pipeline, on the stage's slice of the meshes
  (workloads.decoder.parallelize): FSDP2/HSDP, expert parallel, tensor parallel (the hidden states travel between
  stages as this rank's sequence shard, as between blocks; the loss runs under loss_parallel) and context parallel
  (each stage gets its chunks' positions as a keyword: a stage after the first reads hidden states, which do not
  say where in the sequence they lie).
- Initial weights: a stage draws exactly what the whole model draws for its parameters (draw_weights replays the
  draws of every parameter before its own), so the model does not depend on the layout.
- The step: the loss is the harness's per-token mean cross-entropy of each micro batch, and the schedule divides
  the gradients by the micro batches (scale_grads), as accumulate_gradients divides each loss; the step's loss,
  which only the last stage has, is summed over the pipeline group so that every rank (rank 0 is on the first stage)
  logs it. Evaluation runs forward only through the stages, the scored sums on the last stage.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor.parallel import loss_parallel

from workloads.common.language_model import IGNORED, Split, _local, token_loss
from workloads.decoder.config import DecoderConfig, Layout, layer_chunks
from workloads.decoder.model import Decoder
from workloads.decoder.stages import rank_stages


class StageLayers(nn.ModuleList):
    """Some of a decoder's blocks, under their numbers in the whole model ("layers.5." stays "layers.5."). Iterates
    in order, as the nn.ModuleList it replaces does; `layers[n]` is block n of the whole model."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for number, block in blocks.items():
            self.add_module(str(number), block)

    def __getitem__(self, number: int) -> nn.Module:
        return self._modules[str(number)]

    __repr__ = nn.Module.__repr__  # ModuleList's numbers its children by position


def keep_stage(model: Decoder, blocks: range, first: bool, last: bool) -> Decoder:
    """`model` (the whole decoder, on the meta device) cut down in place to one stage: its blocks, the embedding
    on the first stage, the final norm, output layer and MTP depths on the last."""
    model.layers = StageLayers({number: model.layers[number] for number in blocks})
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = model.output = None
        model.mtp = nn.ModuleList()
    return model


def stage_models(cfg: DecoderConfig, layout: Layout, pipeline_rank: int, activation_checkpointing: bool = False
                 ) -> list[Decoder]:
    """This pipeline rank's stages of the decoder (rank_stages: one, or one per virtual stage; the whole decoder
    without a pipeline), each on the meta device: parallelize each, then materialize it and draw_weights."""
    stages = layout.pipeline * layout.virtual
    models = []
    for stage in rank_stages(layout, pipeline_rank):
        with torch.device("meta"):
            model = Decoder(cfg, activation_checkpointing=activation_checkpointing)
        if stages > 1:
            keep_stage(model, layer_chunks(cfg.n_layer, stages)[stage], stage == 0, stage == stages - 1)
        models.append(model)
    return models


class StageChunks(nn.Module):
    """A rank's virtual stages as one module for the training loop, the optimizer and checkpoints: their parts
    under the whole model's names (the chunks keep running their own forward, through the Pipeline), and
    train()/eval() reaching each chunk."""

    def __init__(self, chunks: list[Decoder]):
        super().__init__()
        self.__dict__["chunks"] = chunks  # not registered: the parts are, under their own names
        for chunk in chunks:
            for name in ("tok_embeddings", "norm", "output"):
                if getattr(chunk, name) is not None:
                    setattr(self, name, getattr(chunk, name))
            if len(chunk.mtp):  # the last stage's MTP depths
                self.mtp = chunk.mtp
        self.layers = StageLayers({int(number): block for chunk in chunks
                                   for number, block in chunk.layers._modules.items()})

    def train(self, mode: bool = True) -> StageChunks:
        super().train(mode)
        for chunk in self.chunks:
            chunk.train(mode)
        return self

    def forward(self, *args, **kwargs):
        raise TypeError("a rank's virtual stages run through their Pipeline's schedule, not as one module")

    def register_forward_pre_hook(self, hook, **kwargs) -> _Handles:
        """On each chunk: the forward passes that run (the stragglers' timing, a slow fault's delay)."""
        return _Handles([chunk.register_forward_pre_hook(hook, **kwargs) for chunk in self.chunks])

    def register_forward_hook(self, hook, **kwargs) -> _Handles:
        return _Handles([chunk.register_forward_hook(hook, **kwargs) for chunk in self.chunks])


class _Handles:
    """Hooks on several modules, removed together as one hook's handle is."""

    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def rank_model(chunks: list[Decoder]) -> nn.Module:
    """What the loop, the optimizer and checkpoints see of this rank's stages: the stage itself, or StageChunks."""
    return chunks[0] if len(chunks) == 1 else StageChunks(chunks)


@torch.no_grad()
def draw_weights(model: Decoder, device: torch.device) -> None:
    """Draw `model`'s weights (the whole decoder's, or a stage's) as the whole model draws them from the generator's
    state (Decoder.init_weights: each parameter whole, in the model's order): for a stage after the first, draw and
    drop first, one part at a time, every parameter the whole model draws before the stage's own (the embedding,
    then each earlier block); then the stage's. What follows the stage draws nothing it needs."""
    if model.tok_embeddings is None:
        with torch.device("meta"):
            skeleton = Decoder(model.cfg)
        blocks, embedding = skeleton.layers, skeleton.tok_embeddings
        keep_stage(skeleton, range(0), first=False, last=False)  # nothing that draws: a frame for one part
        first_owned = int(next(iter(model.layers._modules)))
        parts = [embedding] + [blocks[number] for number in range(first_owned)]
        del blocks, embedding
        while parts:
            part, piece = parts.pop(0), copy.deepcopy(skeleton)
            if isinstance(part, nn.Embedding):
                piece.tok_embeddings = part
            else:
                piece.layers = StageLayers({0: part})
            piece.to_empty(device=device)  # this part alone, whole: one block at a time in memory
            piece.init_weights()
    model.init_weights()


def _mean_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return token_loss(logits, targets)


class _WithPrediction:
    """The loss of a last stage with MTP depths, whose output is (logits, weighted MTP loss): the next-token loss
    plus the MTP loss, as accumulate_gradients adds them; each micro batch's next-token loss is kept for the log
    (the step's loss is the next-token one, as without a pipeline)."""

    def __init__(self):
        self.next_token: list[torch.Tensor] = []

    def __call__(self, output: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        logits, mtp_loss = output
        loss = token_loss(logits, targets)
        self.next_token.append(loss.detach())
        return loss + mtp_loss


def _summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return token_loss(logits, targets, reduction="sum")


class Pipeline:
    """This rank's stages and their schedules: train_step (1F1B, or interleaved 1F1B with virtual stages, over the
    step's micro batches) and scored_loss_sum (forward only), for DecoderSteps. The chunks are any modules whose
    forward takes the tokens (or hidden states) and a `positions` keyword (GPT-3's too: workloads.gpt3.pipeline)."""

    copies: tuple[nn.Parameter, ...] = ()  # parameters another stage holds too (GPT-3's tied output layer): counted once

    def __init__(self, chunks: list[nn.Module], mesh: DeviceMesh, layout: Layout, device: torch.device, split: Split):
        self.chunks, self.device, self.split = chunks, device, split
        # Vocabulary-sharded logits (tensor parallel) need loss_parallel around the loss and its backward, which
        # the schedule runs inside its step.
        self.loss_context = loss_parallel if mesh["tensor"].size() > 1 else nullcontext
        self.group = mesh["pipeline"].get_group()
        self.stage_indices = rank_stages(layout, mesh["pipeline"].get_local_rank())
        self.ranks, self.stages = layout.pipeline, layout.pipeline * layout.virtual
        self.is_first, self.is_last = self.stage_indices[0] == 0, self.stage_indices[-1] == self.stages - 1
        # With MTP depths every stage gets the targets (the first embeds the tokens ahead, the last scores them).
        self.predicting = getattr(chunks[0].cfg, "mtp_layers", 0) > 0  # GPT-3 has none
        self.train_loss = _WithPrediction() if self.predicting else _mean_loss
        self.train = self._schedule(layout.grad_accum, self.train_loss, training=True)
        self._eval: dict[tuple[int, ...], object] = {}  # by batch shape: a stage's buffers have one shape

    def _schedule(self, micro_batches: int, loss_fn, training: bool = False):
        """A schedule over new PipelineStages of this rank's chunks, the gradients divided by the micro batches
        (1F1B needs at least one micro batch per stage: the eval's one goes through GPipe's order)."""
        stages = [PipelineStage(chunk, index, self.stages, self.device, group=self.group)
                  for chunk, index in zip(self.chunks, self.stage_indices)]
        if len(stages) > 1:
            return ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=loss_fn, scale_grads=True)
        return (Schedule1F1B if training else ScheduleGPipe)(stages[0], micro_batches, loss_fn=loss_fn,
                                                             scale_grads=True)

    def _inputs(self, tokens: torch.Tensor) -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
        """One micro batch's inputs as the schedule takes them: the tokens (for the first stage), the positions as
        a keyword every stage gets (a stage after the first reads hidden states, which do not say where in the
        sequence they lie: a context rank holds two chunks of it), and the targets (for the last stage)."""
        (tokens, *positions), targets = self.split(tokens)
        positions = positions[0] if positions else torch.arange(tokens.size(1), device=tokens.device)
        return (tokens,), {"positions": positions}, targets

    def train_step(self, micro_batches: Iterable[torch.Tensor]) -> torch.Tensor:
        """Forward and backward over the step's micro batches through every stage; the mean loss, on every rank."""
        inputs, keywords, targets = zip(*(self._inputs(tokens) for tokens in micro_batches))
        if self.predicting:
            keywords = [{**words, "targets": target} for words, target in zip(keywords, targets)]
            self.train_loss.next_token.clear()
        losses: list[torch.Tensor] = []
        with self.loss_context():
            self.train.step(arg_mbs=list(inputs) if self.is_first else None, kwarg_mbs=list(keywords),
                            target_mbs=list(targets) if self.is_last else None,
                            losses=losses if self.is_last else None, return_outputs=False)
        if self.predicting:
            # the micro batches' own: the schedule's first step also runs the loss once to infer the stage's shapes
            losses = self.train_loss.next_token[-len(losses):]
        loss = _local(torch.stack([_local(loss) for loss in losses]).mean().detach()) if self.is_last \
            else torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.group)  # only the last stage's is not zero
        return loss

    @torch.no_grad()
    def scored_loss_sum(self, tokens: torch.Tensor, counted: torch.Tensor) -> tuple[torch.Tensor, int]:
        """As workloads.common.language_model.scored_loss_sum, through the stages, each sequence a micro batch so
        that the stages overlap: the sum and its token count on the last stage, zero on the others (so a sum over
        the world counts each scored token once)."""
        micro_batches = self._eval_micro_batches(len(tokens))
        inputs, keywords, targets = (list(part) for part in zip(*map(self._inputs, tokens.chunk(micro_batches))))
        targets = [target.masked_fill(~flags.bool().to(target.device)[:, None], IGNORED)
                   for target, flags in zip(targets, counted.chunk(micro_batches))]
        schedule = self._eval.get(tuple(tokens.shape))
        if schedule is None:
            schedule = self._eval[tuple(tokens.shape)] = self._schedule(micro_batches, _summed_loss)
        losses: list[torch.Tensor] = []
        with self.loss_context():
            schedule.eval(arg_mbs=inputs if self.is_first else None, kwarg_mbs=keywords,
                          target_mbs=targets if self.is_last else None, losses=losses if self.is_last else None)
        if not self.is_last:
            return torch.zeros((), dtype=torch.float64, device=self.device), 0
        return (sum(_local(loss).double() for loss in losses),
                sum(int((target != IGNORED).sum()) for target in targets))

    def _eval_micro_batches(self, sequences: int) -> int:
        """One micro batch a sequence, where the schedule takes that many (the interleaved one runs them in rounds
        of one per pipeline rank, which must divide them); else the batch as one."""
        rounds = max(1, sequences // self.ranks)
        return sequences if len(self.chunks) == 1 or sequences % rounds == 0 else 1
