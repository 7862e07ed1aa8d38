"""The Mixture-of-Experts feed-forward: a router, stacked SwiGLU experts, and the exchange of tokens between the
ranks that hold different experts (expert parallelism). Reads top to bottom: route, sort by expert, send each token
to the rank holding its expert, run the experts, send the results back, weight and sum them.

- Router (gpt-oss): Megatron-Core's with `moe_router_score_function: softmax` and `moe_router_pre_softmax: false`
  (megatron/core/transformer/moe/moe_utils.py, `topk_routing_with_score_function`): the top k of the raw logits,
  then a softmax over those k, all in fp32 (`moe_router_dtype: fp32`). No load-balancing loss, no expert bias,
  no capacity: every token reaches its k experts.
- SigmoidRouter (DeepSeek-V3): sigmoid scores, an expert bias for the choice only, group-limited top k
  (grouped_top_k); its bias moves after each step toward balance (update_expert_bias), and a
  sequence-level balance loss adds its gradient in backward (sequence_aux_loss, AuxLossScaler). Shared experts,
  one SwiGLU every token passes through, are added to the routed ones' sum.
- Experts: `experts` SwiGLU MLPs as three stacked tensors, so that expert parallelism splits them along their
  first dimension and FSDP shards what each rank keeps. On CUDA in bf16 a rank runs its experts as one grouped
  GEMM (torch._grouped_mm, over the tokens sorted by expert); elsewhere one matmul per expert, the reference the
  tests hold the grouped GEMM to.
- Expert parallelism: with a group set (parallelize.py), the rank p of P holds experts [p E/P, (p+1) E/P). Each
  rank sends every token copy to its expert's rank with one all_to_all_single of uneven splits, and gets the
  results back with another; both are autograd functions, so backward sends the gradients the other way. An
  expert or a whole rank that receives no token still runs its (empty) matmuls: its gradient is zero, and every
  rank makes the same collective calls, so none waits on another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from workloads.decoder.config import MoeConfig


class Router(nn.Module):
    def __init__(self, d_model: int, moe: MoeConfig):
        super().__init__()
        self.gate = nn.Linear(d_model, moe.experts, bias=False)
        self.top_k = moe.top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, d) -> the weights (tokens, k) of each token's k experts, and their ids (tokens, k)."""
        logits = F.linear(x.float(), self.gate.weight.float())
        top_logits, experts = logits.topk(self.top_k, dim=-1)
        return top_logits.softmax(dim=-1), experts


class SigmoidRouter(nn.Module):
    """DeepSeek-V3's router (transformers' modeling_deepseek_v3.py `DeepseekV3TopkRouter`; Megatron-LM's
    moe_utils.py `topk_routing_with_score_function` with score_function "sigmoid" and `group_limited_topk`), in fp32:

    - scores: sigmoid of the logits;
    - choice: by score + `expert_bias` (a persistent buffer, so that checkpoints keep it: Hugging Face's
      `e_score_correction_bias`), only among the `top_groups` groups whose two best biased scores sum highest;
    - weights: the chosen experts' unbiased scores, normalized to sum 1 (norm_topk_prob), times `routed_scale`.

    In training it counts the token copies each expert gets (`tokens_per_expert`, summed over the step's micro
    batches) for update_expert_bias. Activation checkpointing runs the forward twice, doubling every count of the
    step alike: the update reads only each count's side of the mean, which doubling keeps."""

    def __init__(self, d_model: int, moe: MoeConfig):
        super().__init__()
        if moe.experts % moe.groups or moe.top_groups > moe.groups:
            raise ValueError(f"{moe.experts} experts do not split into {moe.groups} groups of which the best "
                             f"{moe.top_groups} are kept")
        self.gate = nn.Linear(d_model, moe.experts, bias=False)
        self.top_k, self.groups, self.top_groups = moe.top_k, moe.groups, moe.top_groups
        self.routed_scale = moe.routed_scale
        self.register_buffer("expert_bias", torch.zeros(moe.experts))
        self.register_buffer("tokens_per_expert", torch.zeros(moe.experts), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, d) -> the weights (tokens, k), the expert ids (tokens, k), and every expert's sigmoid score
        (tokens, experts; for the balance loss)."""
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        experts = grouped_top_k(scores.detach() + self.expert_bias, self.top_k, self.groups, self.top_groups)
        weights = scores.gather(-1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scale
        if self.training:
            self.tokens_per_expert += torch.bincount(experts.flatten(), minlength=self.tokens_per_expert.numel())
        return weights, experts, scores


def grouped_top_k(biased: torch.Tensor, k: int, groups: int, top_groups: int) -> torch.Tensor:
    """The k highest of `biased` (tokens, experts) among the `top_groups` groups of consecutive experts whose two
    highest sum most (Megatron-LM's moe_utils.py `group_limited_topk`; transformers' DeepseekV3TopkRouter)."""
    by_group = biased.unflatten(-1, (groups, -1))
    group_scores = by_group.topk(min(2, by_group.size(-1)), dim=-1).values.sum(-1)
    kept = group_scores.topk(top_groups, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, kept, True)
    masked = by_group.masked_fill(~allowed[..., None], float("-inf")).flatten(-2)
    return masked.topk(k, dim=-1).indices


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """After an optimizer step: every SigmoidRouter's expert bias moves by rate x sign(mean load - load), up for an
    expert that got fewer token copies than the mean, down for one that got more (Megatron-LM's moe_utils.py
    `get_updated_expert_bias`), the loads summed over `group` (the ranks that saw different tokens: data x context;
    one all-reduce for every layer); then the counts restart."""
    moes = [m for m in model.modules() if isinstance(m, MoE) and isinstance(m.router, SigmoidRouter)
            and m.bias_update_rate]
    if not moes:
        return
    loads = torch.stack([m.router.tokens_per_expert for m in moes])
    if group is not None:
        dist.all_reduce(loads, group=group)
    for moe, load in zip(moes, loads):
        moe.router.expert_bias += moe.bias_update_rate * torch.sign(load.mean() - load)
        moe.router.tokens_per_expert.zero_()


def sequence_aux_loss(scores: torch.Tensor, top_k: int, sequences: int, coeff: float,
                      context_group: DeviceMesh | None = None) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss, as Megatron-LM computes it (router.py
    `_apply_seq_aux_loss`, moe_utils.py `compute_routing_scores_for_aux_loss` and `switch_load_balancing_loss_func`):
    each token's sigmoid scores normalized over every expert (p); per sequence of T tokens, f_i = E / (k T) x the
    tokens whose top k of p (no bias, no groups) holds expert i, P_i = the mean of p_i; the loss is coeff x
    sum_i f_i P_i, averaged over the sequences. Under context parallelism a rank holds an equal part of each
    sequence: f counts over the context ranks (Megatron's tp_cp group), P is the mean over this rank's tokens, so
    that the mean of the ranks' losses, which FSDP's gradient average over them takes (as it does for their
    cross-entropy), is the whole sequence's loss."""
    experts = scores.size(-1)
    p = (scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)).view(sequences, -1, experts)
    chosen = torch.zeros_like(p).scatter(-1, p.detach().topk(top_k, dim=-1).indices, 1.0)
    counts, tokens = chosen.sum(1), p.size(1)
    if context_group is not None:
        counts = funcol.all_reduce(counts, "sum", context_group)
        tokens *= context_group.size()
    f = counts * experts / (top_k * tokens)
    return coeff * (f * p.mean(1)).sum(-1).mean()


class AuxLossScaler(torch.autograd.Function):
    """The identity on a layer's output, whose backward also starts the gradient of `aux` (d aux = `scale`), as
    Megatron-LM's moe_utils.py `MoEAuxLossAutoScaler` does: the loss reaches backward without a change to any
    forward's signature, so it works wherever the layer runs (a pipeline stage too). `scale` is what the main loss
    is scaled by: 1 / the micro batches of a step (accumulate_gradients divides each micro batch's loss by them;
    Megatron's loss_scale / num_microbatches)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): the dense feed-forward, and DeepSeek-V3's shared experts."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _ScaledGradient(torch.autograd.Function):
    """The identity, whose gradient is multiplied by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class Experts(nn.Module):
    """`experts` SwiGLU MLPs, stacked: w1 (gate) and w3 (up) are (experts, hidden, d), w2 (down) (experts, d, hidden).
    Under expert parallelism each is a DTensor split along the experts; a rank computes with its own part.

    An expert's gradient sums what every rank of the expert group sent it, where a dense weight's gradient is this
    rank's alone, and FSDP then averages both over the same data ranks: `gradient_scale` (1 / the expert group's
    size, set by parallelize.py) brings the experts' to the same mean over every data rank (a scale in autograd,
    not FSDP's divide factor, which gloo cannot apply)."""

    def __init__(self, d_model: int, moe: MoeConfig):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(moe.experts, moe.hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(moe.experts, moe.hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(moe.experts, d_model, moe.hidden))
        self.gradient_scale = 1.0

    def forward(self, x: torch.Tensor, counts: list[int], grouped: bool | None = None) -> torch.Tensor:
        """x: (tokens, d), sorted by expert, counts[e] of them for this rank's expert e."""
        w1, w3, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2))
        if self.gradient_scale != 1.0:
            w1, w3, w2 = (_ScaledGradient.apply(w, self.gradient_scale) for w in (w1, w3, w2))
        if grouped if grouped is not None else (x.is_cuda and x.dtype == torch.bfloat16):
            ends = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            up = lambda t, w: torch._grouped_mm(t, w.transpose(-2, -1), offs=ends)  # noqa: E731
            return up(F.silu(up(x, w1)) * up(x, w3), w2)
        return torch.cat([F.linear(F.silu(F.linear(part, w1[e])) * F.linear(part, w3[e]), w2[e])
                          for e, part in enumerate(x.split(counts))])


class MoE(nn.Module):
    def __init__(self, d_model: int, moe: MoeConfig):
        super().__init__()
        self.router = SigmoidRouter(d_model, moe) if moe.score == "sigmoid" else Router(d_model, moe)
        self.experts = Experts(d_model, moe)
        self.shared_experts = SwiGLU(d_model, moe.shared_experts * moe.hidden) if moe.shared_experts else None
        self.n_experts, self.top_k = moe.experts, moe.top_k
        self.bias_update_rate, self.aux_loss_coeff = moe.bias_update_rate, moe.aux_loss_coeff
        self.aux_loss_scale = 1.0  # the main loss's scale (AuxLossScaler): the workload sets 1 / micro batches
        self.aux_loss: torch.Tensor | None = None  # the last training forward's balance loss, for logging
        self.expert_group: DeviceMesh | None = None  # set by parallelize.py: the ranks that split the experts
        self.context_group: DeviceMesh | None = None  # set by parallelize.py: the ranks that split a sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._routed(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts, *scores = self.router(tokens)
        # One copy of a token per chosen expert, in expert order.
        order = experts.flatten().argsort(stable=True)
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts)
        routed = tokens[order // self.top_k]
        outputs = self._run_experts(routed, counts) if self.expert_group is not None \
            else self.experts(routed, counts.tolist())
        # Weighted by the fp32 router weights and summed in fp32, then back to the stream's dtype, as Megatron's
        # unpermute does with fp32 probabilities.
        weighted = outputs.float() * weights.flatten()[order, None]
        combined = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        out = combined.index_add(0, order // self.top_k, weighted).to(tokens.dtype).view(shape)
        if scores and self.aux_loss_coeff and self.training and torch.is_grad_enabled():
            aux = sequence_aux_loss(scores[0], self.top_k, shape[0], self.aux_loss_coeff, self.context_group)
            self.aux_loss = aux.detach()
            out = AuxLossScaler.apply(out, aux, self.aux_loss_scale)
        return out

    def _run_experts(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert parallel: send each copy to its expert's rank, run this rank's experts on what arrives, send the
        results back in the order the copies left."""
        group = self.expert_group
        ranks = group.size()
        local = self.n_experts // ranks
        # received[p, e]: copies rank p sends to this rank's expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group.get_group())
        received = received.view(ranks, local)
        send = counts.view(ranks, local).sum(1).tolist()
        arrive = received.sum(1).tolist()
        inbound = funcol.all_to_all_single_autograd(routed, arrive, send, group)
        # What arrives is grouped by sender, then expert; the experts want it grouped by expert.
        expert_of = torch.arange(local, device=counts.device).repeat(ranks).repeat_interleave(received.flatten())
        by_expert = expert_of.argsort(stable=True)
        outputs = self.experts(inbound[by_expert], received.sum(0).tolist())
        back = outputs[by_expert.argsort()]
        return funcol.all_to_all_single_autograd(back, send, arrive, group)
