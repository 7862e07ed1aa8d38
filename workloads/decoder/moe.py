"""The Mixture-of-Experts feed-forward: a router, stacked SwiGLU experts, and the exchange of tokens between the
ranks that hold different experts (expert parallelism). Reads top to bottom: route, sort by expert, send each token
to the rank holding its expert, run the experts, send the results back, weight and sum them.

- Router: Megatron-Core's with `moe_router_score_function: softmax` and `moe_router_pre_softmax: false`
  (megatron/core/transformer/moe/moe_utils.py, `topk_routing_with_score_function`): the top k of the raw logits,
  then a softmax over those k, all in fp32 (`moe_router_dtype: fp32`). No load-balancing loss, no expert bias,
  no capacity: every token reaches its k experts.
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
        self.router = Router(d_model, moe)
        self.experts = Experts(d_model, moe)
        self.n_experts, self.top_k = moe.experts, moe.top_k
        self.expert_group: DeviceMesh | None = None  # set by parallelize.py: the ranks that split the experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts = self.router(tokens)
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
        return combined.index_add(0, order // self.top_k, weighted).to(tokens.dtype).view(shape)

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
