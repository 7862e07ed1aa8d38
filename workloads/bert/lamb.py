"""LAMB as MLPerf's BERT reference defines it (You et al., 2019; the reference's optimization.py).

torch ships no LAMB, and the closed benchmark needs this exact variant:
  m, v       Adam moments, bias-corrected;
  update     m / (sqrt(v) + eps), plus weight_decay x param for parameters that decay;
  trust      ||param|| / ||update|| (1 where either is 0), only for parameters that decay;
  param     -= lr x trust x update.
Biases and LayerNorm parameters neither decay nor adapt (the reference's exclude list;
workloads.common.param_groups makes the two groups). The
gradients are clipped to a global norm of 1.0 before the step (clip_grad_norm_, done by the caller).
"""

from __future__ import annotations

import torch


class Lamb(torch.optim.Optimizer):
    """The update above for a whole parameter group at once, with torch's multi-tensor (`_foreach_`) kernels:
    a handful of launches per group instead of about 15 per tensor over BERT-large's ~400 tensors."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def _state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)  # on the CPU: reading it never waits for the GPU
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            states = [self._state(p) for p in params]
            grads = [p.grad for p in params]
            m, v = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            steps = []
            for state in states:
                state["step"] += 1
                steps.append(state["step"].item())
            torch._foreach_mul_(m, beta1)
            torch._foreach_add_(m, grads, alpha=1 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
            update = torch._foreach_div(m, [1 - beta1 ** step for step in steps])
            denominator = torch._foreach_div(v, [1 - beta2 ** step for step in steps])
            torch._foreach_sqrt_(denominator)
            torch._foreach_add_(denominator, group["eps"])
            torch._foreach_div_(update, denominator)
            if group["weight_decay"]:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
                param_norms = torch.stack(torch._foreach_norm(params))
                update_norms = torch.stack(torch._foreach_norm(update))
                trust = torch.where((param_norms > 0) & (update_norms > 0), param_norms / update_norms, 1.0)
                torch._foreach_mul_(update, list((trust * group["lr"]).unbind()))
                torch._foreach_sub_(params, update)
            else:
                torch._foreach_add_(params, update, alpha=-group["lr"])

