"""The tiny preset's starting checkpoint, which the harness trains once and caches.

MLPerf's BERT starts from a reference checkpoint that someone else trained; the tiny preset needs one
of its own, so it is trained here from random weights, in one process with a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workloads.bert.config import BertPreset
from workloads.bert.data import TrainStream, ensure_tiny_dataset
from workloads.bert.lamb import Lamb
from workloads.bert.model import Bert, model_outputs, pretraining_loss
from workloads.common.cache import all_cores, build_once, cache_root
from workloads.common.param_groups import parameter_groups

# The tiny preset's starting checkpoint: a short run from random weights, trained once in one process with a
# fixed seed, as MLPerf's reference checkpoint was trained once by someone else. Like that checkpoint (masked-LM
# accuracy about 0.35), it has left the first plateau but is far from the target.
TINY_INIT_VERSION = 1
TINY_INIT_STEPS = 650
TINY_INIT_WARMUP = 100  # post-LayerNorm BERT needs a warmup from random weights
TINY_INIT_LR = 1e-2


def tiny_init_root() -> Path:
    return cache_root() / f"tiny-bert-init-v{TINY_INIT_VERSION}"


def ensure_tiny_init_checkpoint(preset: BertPreset) -> Path:
    with all_cores():  # the node's other ranks wait for it
        return build_once(tiny_init_root(), lambda folder: _train_tiny_init(preset, folder))


def _train_tiny_init(preset: BertPreset, folder: Path) -> None:
    torch.manual_seed(1234)
    cfg = preset.model
    model = Bert(cfg)
    optimizer = Lamb(parameter_groups(model, 0.01), lr=TINY_INIT_LR, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    data = ensure_tiny_dataset(cfg.vocab_size, cfg.max_seq_len, preset.max_predictions)
    batches = TrainStream(data / "train", seed=1234, rank=0, world=1).batches(preset.global_batch, cfg.max_seq_len)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / TINY_INIT_WARMUP))
    for _ in range(TINY_INIT_STEPS):
        batch = next(batches)
        loss = pretraining_loss(*model_outputs(model, batch), batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    torch.save({"model": model.state_dict()}, folder / "model.pt")
