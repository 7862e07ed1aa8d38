"""llama2_70b_lora's tiny preset starts, as the benchmark does, from a pretrained model: a small Llama 2 trained
here once, in one process with a fixed seed, and cached as the same kind of checkpoint the converter writes from
Hugging Face's weights (workloads.decoder.convert).

Its text is the tiny reports, each after its subject's token as a title: the model knows every word the
fine-tuning uses, but has never seen a separator or a summary, nor named a subject after reading a report.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from workloads.common.cache import build_once, cache_root
from workloads.decoder.config import DecoderConfig
from workloads.decoder.convert import write_checkpoint
from workloads.decoder.govreport import EOS, SUBJECT_FIRST, SUBJECTS, tiny_report
from workloads.decoder.model import Decoder

TINY_BASE_VERSION = 4
TINY_BASE_STEPS = 100
TINY_BASE_BATCH = 8
TINY_BASE_LR = 1e-2


def ensure_tiny_base(cfg: DecoderConfig) -> Path:
    return build_once(cache_root() / f"tiny-llama2-base-v{TINY_BASE_VERSION}", lambda folder: _pretrain(cfg, folder))


def report_stream(seq_len: int, batch: int, seed: int):
    """Batches of (batch, seq_len + 1) tokens cut from titled reports back to back, each ended by EOS."""
    rng = np.random.default_rng(seed)
    buffer: list[int] = []
    while True:
        while len(buffer) < batch * (seq_len + 1):
            subject = int(rng.integers(SUBJECTS))
            buffer.extend([SUBJECT_FIRST + subject, *tiny_report(rng, subject, int(rng.integers(20, 121))).tolist(),
                           EOS])
        chunk, buffer = buffer[:batch * (seq_len + 1)], buffer[batch * (seq_len + 1):]
        yield torch.tensor(chunk).view(batch, seq_len + 1)


def _pretrain(cfg: DecoderConfig, folder: Path) -> None:
    torch.manual_seed(1234)
    model = Decoder(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TINY_BASE_LR, weight_decay=0.01)
    batches = report_stream(cfg.seq_len, TINY_BASE_BATCH, seed=1234)
    for _ in range(TINY_BASE_STEPS):
        tokens = next(batches)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    write_checkpoint(model.state_dict(), folder)
