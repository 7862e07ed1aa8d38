"""Initial weights that do not depend on how a model is split.

A sharded parameter (a DTensor: FSDP's shards, tensor or expert parallel's parts) drawn in place draws only its
local piece, from the generator every rank seeded alike: on CPU every shard then holds the same values (DTensor's
offset-based random tracker exists for CUDA only), so FSDP's shards of a matrix repeat each other. Here every rank
draws each whole parameter, in the model's order, and keeps its own piece: the initial model is the one a single
process draws from the same seed, whatever the layout, on every backend. The cost is one whole parameter at a time
in memory and the draws of all of them on every rank: seconds on a GPU for billions of weights, untimed (init).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def draw_(param: torch.Tensor, fill: Callable[[torch.Tensor], object]) -> None:
    """Fill `param` as `fill` fills a whole tensor of its global shape, keeping this rank's piece."""
    if not isinstance(param, DTensor):
        fill(param)
        return
    whole = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
    fill(whole)
    mine = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
    param.to_local().copy_(mine.to_local())
