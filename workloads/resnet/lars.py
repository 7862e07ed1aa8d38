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
        """The update above for a whole group at once, with torch's multi-tensor (`_foreach_`) kernels: a few
        launches per group instead of about ten per parameter, and no host read of any norm."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            decay = group["weight_decay"]
            if decay:
                weight_norms = torch.stack(torch._foreach_norm(params))
                grad_norms = torch.stack(torch._foreach_norm(grads))
                trust = group["trust_coefficient"] * weight_norms / (grad_norms + decay * weight_norms
                                                                     + group["epsilon"])
                scales = group["lr"] * torch.where((weight_norms > 0) & (grad_norms > 0), trust, 1.0)
                updates = torch._foreach_add(grads, params, alpha=decay)
                torch._foreach_mul_(updates, list(scales.unbind()))
            else:
                updates = torch._foreach_mul(grads, group["lr"])
            velocities = [self._velocity(p) for p in params]
            torch._foreach_mul_(velocities, group["momentum"])
            torch._foreach_add_(velocities, updates)
            torch._foreach_sub_(params, velocities)

    def _velocity(self, param: torch.Tensor) -> torch.Tensor:
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state["momentum_buffer"]
