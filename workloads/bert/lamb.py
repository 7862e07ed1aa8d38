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
    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                step = state["step"].item()
                m, v, grad = state["exp_avg"], state["exp_avg_sq"], param.grad
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt_().add_(group["eps"]))
                trust = 1.0
                if group["weight_decay"]:
                    update.add_(param, alpha=group["weight_decay"])
                    param_norm, update_norm = param.norm(), update.norm()
                    trust = torch.where((param_norm > 0) & (update_norm > 0), param_norm / update_norm, 1.0)
                param.sub_(update * (group["lr"] * trust))

