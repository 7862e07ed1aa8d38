"""GPT-3's pipeline stages, run by the decoders' Pipeline (workloads.decoder.pipeline: PipelineStage, 1F1B, the loss
on the last stage, the pipelined eval); what is GPT-3's own is the split of its model and its tied output layer.

- Stages: the whole model built on the meta device, each stage keeping its blocks under their numbers in the whole
  model (StageLayers: "blocks.N...." as unsplit, for DCP checkpoints), the embeddings on the first stage, the final
  LayerNorm and the output layer on the last; the blocks split by the decoders' one rule (layer_chunks). A stage's
  initial weights are the whole model's (GPT.init_weights replays the whole model's draws).
- The tied output layer: the first stage needs the token embedding, the last the output layer, which shares its
  weight. As Megatron does, the last stage keeps a copy, drawn (and loaded) equal; after each step's backward the
  two copies' gradients are summed between the first and last stage (so each holds the whole model's gradient),
  the clipping norm counts the copy once (Pipeline.copies), and the same AdamW update keeps the copies equal.
  Checkpoints hold both names, as the whole model's state dict does ("wte.weight" and "lm_head.weight"), and one
  optimizer state, under "wte.weight" (optimizer_names).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from workloads.common.language_model import rolled_split
from workloads.decoder.config import layer_chunks
from workloads.decoder.pipeline import Pipeline, StageLayers
from workloads.gpt3.config import GPT3Config, Layout
from workloads.gpt3.model import GPT

TIED_COPY, TIED = "lm_head.weight", "wte.weight"


def stage_model(cfg: GPT3Config, layout: Layout, pipeline_rank: int) -> GPT:
    """This pipeline rank's stage of the model on the meta device (the whole model without a pipeline): parallelize
    it, then materialize it and init_weights."""
    with torch.device("meta"):
        model = GPT(cfg.model, activation_checkpointing=cfg.activation_checkpointing)
    if layout.pipeline == 1:
        return model
    blocks = layer_chunks(cfg.model.n_layer, layout.pipeline)[pipeline_rank]
    model.blocks = StageLayers({number: model.blocks[number] for number in blocks})
    if pipeline_rank > 0:
        model.wte = model.wpe = None  # the last stage's output layer keeps its own reference: the copy
    if pipeline_rank < layout.pipeline - 1:
        model.ln_f = model.lm_head = None
    return model


class GPT3Pipeline(Pipeline):
    """The decoders' Pipeline over this rank's GPT-3 stage, plus the tied output layer's gradient sum."""

    def __init__(self, model: GPT, mesh: DeviceMesh, layout: Layout, device: torch.device):
        super().__init__([model], mesh, layout, device, rolled_split)
        self.ends = _ends_group(mesh)
        self.tied = model.wte.weight if self.is_first else model.lm_head.weight if self.is_last else None
        self.copies = (model.lm_head.weight,) if self.is_last else ()

    def train_step(self, micro_batches: Iterable[torch.Tensor]) -> torch.Tensor:
        loss = super().train_step(micro_batches)
        if self.tied is not None:  # both copies' local shards: split the same way over the same (data, tensor) mesh
            grad = self.tied.grad
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.ends)
        return loss


def _ends_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The first and the last stage's ranks at this rank's (data, tensor) place, a pair; None on a middle stage.
    Every rank makes every pair (new_subgroups_by_enumeration), as creating a process group needs."""
    ranks = mesh.mesh
    pairs = torch.stack([ranks[0], ranks[-1]], dim=-1).reshape(-1, 2).tolist()
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def optimizer_names(state: dict[str, object], model: nn.Module) -> dict[str, object]:
    """An optimizer state dict (get_optimizer_state_dict's "state") under the whole model's names: a last stage's
    copy of the tied weight has its state under the embedding's name, as the whole model (which holds it once) and
    convert_reference save it (dcp.load fills the same tensors, under either dict)."""
    if getattr(model, "wte", None) is not None:
        return state
    swap = {TIED_COPY: TIED, TIED: TIED_COPY}
    return {swap.get(name, name): value for name, value in state.items()}
