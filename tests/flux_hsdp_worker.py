"""One rank of tests/test_flux.py's HSDP test, started by torchrun with 4 processes: FLUX_TINY under FSDP2 on a
replicate 2 x shard 2 mesh (workloads.flux.train.build_model, every block checkpointed), two steps of 2 micro batches
each through the workload's own accumulate (each micro batch reduce-scattered in its FSDP group, the replicas
all-reduced only with the last), its clipping and AdamW; against the whole model in this process trained on every
rank's micro batches at once. The initial weights, each step's loss and every parameter after each step must be
the whole model's: replicas that skipped or repeated an all-reduce would drift apart from it. Prints "hsdp ok"."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing import assert_close

from tests.gpt3_parallel_worker import full, say
from workloads.common.language_model import clip_grad_norm_
from workloads.flux.config import ADAM_BETAS, ADAM_EPS, CLIP_NORM, FLUX_TINY, PRESETS, WEIGHT_DECAY
from workloads.flux.model import Flux
from workloads.flux.train import Draws, accumulate, build_model, rectified_flow_loss

SEED, MICRO, ACCUMULATE, STEPS, LR = 5, 2, 2, 2, 1e-2
CPU = torch.device("cpu")
SHAPE = PRESETS["tiny"].sample_shape


def micro_batch(rank: int, step: int, micro: int) -> dict[str, torch.Tensor]:
    """A rank's micro batch, with its timesteps and draws, the same whoever builds it."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)

    def normal(*shape) -> torch.Tensor:
        return torch.randn(MICRO, *shape, generator=generator)

    return {"t5_encodings": normal(*SHAPE.text), "clip_encodings": normal(SHAPE.pooled),
            "mean": normal(*SHAPE.latent), "logvar": normal(*SHAPE.latent) - 3,
            "t": torch.rand(MICRO, generator=generator), "latent": normal(*SHAPE.latent),
            "noise": normal(*SHAPE.latent), "dropped": torch.tensor([micro == 1, False])}


def draw(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Draws]:
    return batch["t"], Draws(batch["latent"], batch["noise"], batch["dropped"])


def optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = build_model(FLUX_TINY, mesh, CPU, SEED, checkpoint_blocks=True)
    reference = Flux(FLUX_TINY)
    torch.manual_seed(SEED)
    reference.init_weights()
    for (name, param), wanted in zip(model.named_parameters(), reference.parameters()):
        assert_close(full(param.detach()), wanted.detach(), rtol=0, atol=0, msg=lambda text, n=name: f"{n}: {text}")
    empty = {"t5_encodings": torch.zeros(SHAPE.text), "clip_encodings": torch.zeros(SHAPE.pooled)}
    sharded_adam, whole_adam = optimizer(model), optimizer(reference)
    for step in range(STEPS):
        mine = iter([micro_batch(rank, step, micro) for micro in range(ACCUMULATE)])
        loss = accumulate(model, mine, ACCUMULATE, empty, draw)
        clip_grad_norm_(model.parameters(), CLIP_NORM)
        sharded_adam.step()
        sharded_adam.zero_grad(set_to_none=True)
        # The whole model: the mean loss over every rank's micro batches, as FSDP averages the ranks' gradients.
        whole = sum(rectified_flow_loss(reference, batch, empty, *draw(batch))
                    for batch in (micro_batch(r, step, m) for r in range(world) for m in range(ACCUMULATE)))
        (whole / (world * ACCUMULATE)).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP_NORM)
        whole_adam.step()
        whole_adam.zero_grad(set_to_none=True)
        losses = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(losses, loss)
        assert_close(sum(losses) / world, whole.detach() / (world * ACCUMULATE), rtol=1e-5, atol=1e-6)
        for (name, param), wanted in zip(model.named_parameters(), reference.parameters()):
            assert_close(full(param.detach()), wanted.detach(), rtol=1e-4, atol=1e-6,
                         msg=lambda text, n=name, s=step: f"step {s}, {n}: {text}")
    say("hsdp ok")
    dist.destroy_process_group()
