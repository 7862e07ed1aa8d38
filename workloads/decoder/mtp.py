"""DeepSeek-V3's multi-token prediction (MTP), as Megatron-Core trains it for the deepseekv3_671b reference. Reads top
to bottom: one depth, the roll that lines its inputs and targets up, the loss of all depths.

The reference is Megatron-Bridge's recipe `deepseek_v3.py` (`mtp_num_layers = 1`, `mtp_loss_scaling_factor = 0.1`,
never overridden by mlcommons/training's `pretrain_deepseek_v3_671b.py`); the code is Megatron-Core's
`megatron/core/transformer/multi_token_prediction.py` and `megatron/core/models/gpt/gpt_model.py` (0.16.1, the
version the tests pin):

- Depth k (from 1) reads, at position i, the hidden state h^{k-1}_i of the depth before it (k = 1: the main decoder's
  output AFTER its final RMSNorm: Megatron's TransformerBlock applies `final_layernorm` before GPTModel hands its
  output to `self.mtp(...)`) and the embedding of token t_{i+k}, through the model's own embedding (shared, not a
  copy). Each is RMSNormed (enorm, hnorm), the two are concatenated EMBEDDING FIRST (`torch.cat((decoder_input,
  hidden_states), -1)`; the DeepSeek-V3 paper's eq. 21 writes [h; emb], but the Hugging Face checkpoint's eh_proj is
  laid out as Megatron reads it: Megatron-Bridge maps `model.layers.61.eh_proj.weight` to `mtp.layers.0.eh_proj.weight`
  unchanged, and vLLM's DeepSeek MTP concatenates `[inputs_embeds, previous_hidden_states]` too), projected from 2d
  to d by eh_proj, passed through one transformer block (the decoder's last layer's kind: an MoE block in DeepSeek),
  and RMSNormed again (`final_layernorm`; Hugging Face's `shared_head.norm`). That output is h^k: the next depth's
  input and, through the model's output layer (shared), the logits that predict t_{i+k+1}.
- The tokens come from Megatron's `roll_tensor(input_ids, shifts=-1)` once per depth: everything one place left, the
  vacated last place 0. The targets and the loss mask roll alike, so depth k scores positions 0..n-1-k only; its loss
  is the mean cross entropy over the positions left (`mtp_loss * loss_mask / num_tokens`, num_tokens the rolled mask's
  sum), like the main loss. The same RoPE positions as the main decoder's (Megatron passes the same rotary_pos_emb).
- The loss of all depths is `mtp_loss_scaling_factor / mtp_num_layers` times the sum of theirs (DeepSeek's eq. 25,
  lambda / D). Megatron adds it to the backward through MTPLossAutoScaler, whose gradient is the main loss's scale
  (`MTPLossAutoScaler.set_loss_scale(loss_scale / num_microbatches)` in its schedules). Here the model returns it
  beside the logits and the caller adds it to the main loss before dividing by the micro batches (workloads.common.
  language_model.accumulate_gradients): both are then scaled alike by whatever scales the main loss (gradient
  accumulation, or a pipeline schedule's loss function on the last stage), with no global scale to set per step.
  Evaluation scores the main loss only (the reference's eval_accuracy is its "lm loss").

This is Megatron's default loss (calculate_per_token_loss False: each micro batch's mean, as the main loss here);
that the reference keeps that default is read from the recipe, which does not set it. Not covered: context
parallelism (Megatron's roll_tensor swaps the boundary tokens between context ranks) and tensor parallelism (the
depths' blocks and vocabulary-sharded logits): parallelize.py refuses both; the reference runs context and tensor
parallel 1.

Under pipeline parallelism the depths live on the last stage with the output layer, and the embedding on the first:
the first stage embeds the tokens each depth reads (tokens_ahead) and the stages pass them on beside the hidden
states, so the embedding stays one parameter whose gradient comes back through the pipeline. (Megatron keeps a copy
of the embedding on the last stage instead and all-reduces the two copies' gradients; sending the embedded tokens
costs s x d x depths more bytes per micro batch per stage boundary and needs no copy to keep equal.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from workloads.common.language_model import IGNORED
from workloads.decoder.config import DecoderConfig


class MultiTokenPrediction(nn.Module):
    """One MTP depth (Megatron's MultiTokenPredictionLayer):
    h^k = norm(block(eh_proj([enorm(emb); hnorm(h^{k-1})]))). `block` is the decoder's Block for layer n_layer + k - 1,
    built by the Decoder (an MoE block where the model has experts)."""

    def __init__(self, cfg: DecoderConfig, block: nn.Module):
        super().__init__()
        self.enorm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.hnorm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                positions: torch.Tensor) -> torch.Tensor:
        """hidden: h^{k-1} (batch, seq, d); embedded: the embedding of each position's token k places ahead."""
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        return self.norm(self.block(x, rope, positions))


def roll_left(x: torch.Tensor, fill: int) -> torch.Tensor:
    """Each row one place left, `fill` in the vacated last place (Megatron's roll_tensor(shifts=-1) without context
    parallelism, which fills 0: the token ids' fill; a target's is IGNORED, which is its loss mask's 0)."""
    return torch.cat((x[:, 1:], x.new_full((x.size(0), 1), fill)), dim=1)


def tokens_ahead(embedding: nn.Embedding, tokens: torch.Tensor, depths: int) -> torch.Tensor:
    """The embeddings of the tokens 1..depths places ahead of each position (roll_left once per depth, 0 in the
    vacated places), side by side: (batch, seq, depths x d), what mtp_loss reads."""
    rolled = []
    for _ in range(depths):
        tokens = roll_left(tokens, 0)
        rolled.append(embedding(tokens))
    return torch.cat(rolled, dim=-1)


def mtp_loss(depths: nn.ModuleList, output: nn.Linear, hidden: torch.Tensor, ahead: torch.Tensor,
             targets: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, scale: float,
             checkpointed: bool = False) -> torch.Tensor:
    """The MTP loss of a micro batch, weighted: scale / depths x the sum over the depths of each one's mean cross
    entropy over the positions it scores. hidden: the main decoder's output after its final norm; ahead: the
    embedded tokens each depth reads (tokens_ahead); targets: the next-token targets (IGNORED where not scored).
    `checkpointed`: keep only each depth's inputs and recompute the rest in backward, as the decoder's blocks do
    (Megatron's MTP layer recomputes eh_proj, its block and its norm under full recompute)."""
    losses = []
    for depth, embedded in zip(depths, ahead.chunk(len(depths), dim=-1)):
        targets = roll_left(targets, IGNORED)
        hidden = checkpoint(depth, hidden, embedded, rope, positions, use_reentrant=False) if checkpointed \
            else depth(hidden, embedded, rope, positions)
        logits = output(hidden)
        summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORED,
                                 reduction="sum")
        losses.append(summed / (targets != IGNORED).sum().clamp(min=1))
    return torch.stack(losses).sum() * (scale / len(losses))
