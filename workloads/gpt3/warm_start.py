"""The tiny preset's starting checkpoint, which the harness trains once and caches.

MLPerf's GPT-3 starts from a reference checkpoint that someone else trained; the tiny preset needs one
of its own, so it is trained here in one process with a fixed seed and saved as a DCP folder, the
format the workload loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from workloads.common.cache import all_cores, build_once, cache_root
from workloads.common.language_model import accumulate_gradients, rolled_split
from workloads.gpt3.config import INIT_INFO, GPT3Config
from workloads.gpt3.data import c4_loaders, ensure_tiny_corpus
from workloads.gpt3.model import GPT

# The tiny preset's starting checkpoint: a few hundred thousand tokens at a high LR, trained once in one
# process with a fixed seed, as MLPerf's reference checkpoint was trained once by someone else.
TINY_INIT_VERSION = 4  # 4: samples of 2,048 tokens, as the reference cuts them
TINY_INIT_LR = 3e-3


def tiny_init_root() -> Path:
    return cache_root() / f"tiny-gpt3-init-v{TINY_INIT_VERSION}"


def ensure_tiny_init_checkpoint(cfg: GPT3Config) -> Path:
    with all_cores():  # the node's other ranks wait for it
        return build_once(tiny_init_root(), lambda folder: _train_tiny_init(cfg, folder))


def _train_tiny_init(cfg: GPT3Config, folder: Path) -> None:
    torch.manual_seed(1234)
    model = GPT(cfg.model)
    loaders = c4_loaders(ensure_tiny_corpus(), cfg.model.seq_len, cfg.lr_batch,
                         train_samples=cfg.init_checkpoint_step * cfg.lr_batch, eval_sequences=0, seed=1234,
                         data_rank=0, data_world=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TINY_INIT_LR, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=cfg.weight_decay)
    for tokens in loaders.train:
        optimizer.zero_grad()
        accumulate_gradients(model, [tokens], 1, rolled_split)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder), no_dist=True)
    (folder / INIT_INFO).write_text(json.dumps({"step": cfg.init_checkpoint_step, "global_batch": cfg.lr_batch}) + "\n")
