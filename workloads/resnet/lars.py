"""LARS as MLPerf's ResNet reference defines it (You et al., 2017; the reference's lars_optimizer.py).

Large global batches (the closed rules' closed_resnet_lars.yaml) need a learning rate no
single value fits: linear scaling makes it 51.2 at 512 GPUs x 256. LARS scales each
layer's step by how large its weights are against its gradient:
  trust   eta x ||w|| / (||g|| + weight_decay x ||w|| + epsilon)   (1 where ||w|| or ||g|| is 0)
  g      += weight_decay x w
  v       = momentum x v + lr x trust x g;   w -= v               (the LR inside the velocity)
Batch-norm parameters and biases neither adapt nor decay (the reference's skip list); they
take plain momentum SGD at the scheduled LR. As in LAMB, the group that decays is the group
that adapts (workloads.common.param_groups makes the two groups).
"""

from __future__ import annotations

import torch

TRUST_COEFFICIENT = 0.001  # the reference's eeta
EPSILON = 0.0  # closed_resnet_lars.yaml requires lars_epsilon == 0.0


class Lars(torch.optim.Optimizer):
    def __init__(self, params, lr: float, momentum: float, weight_decay: float,
                 trust_coefficient: float = TRUST_COEFFICIENT, epsilon: float = EPSILON):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "trust_coefficient": trust_coefficient, "epsilon": epsilon})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            decay = group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, scale = param.grad, group["lr"]
                if decay:
                    weight_norm, grad_norm = param.norm(), grad.norm()
                    trust = group["trust_coefficient"] * weight_norm / (grad_norm + decay * weight_norm
                                                                        + group["epsilon"])
                    scale = scale * torch.where((weight_norm > 0) & (grad_norm > 0), trust, 1.0)
                    grad = grad.add(param, alpha=decay)
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                velocity = state["momentum_buffer"]
                velocity.mul_(group["momentum"]).add_(grad * scale)
                param.sub_(velocity)
