"""deepseekv3_671b's tiny preset starts, as the benchmark does, from a checkpoint in Hugging Face's DeepSeek-V3 layout:
a tiny DeepSeek drawn once from a fixed seed and written as safetensors shards with their index and a config.json
(workloads.decoder.convert.write_hugging_face), then converted by the converter the full preset's 1.4 TB checkpoint
goes through, at every run's init, so that every tiny run takes that path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workloads.common.cache import build_once, cache_root
from workloads.decoder.config import DecoderConfig
from workloads.decoder.convert import write_hugging_face
from workloads.decoder.model import Decoder

TINY_START_VERSION = 1
TINY_START_SEED = 4321
TINY_SHARD_BYTES = 64 * 1024  # several shards, as the real checkpoint has (163 of them), so the index is read


def ensure_tiny_hugging_face(cfg: DecoderConfig) -> Path:
    """The tiny start in Hugging Face's layout, written once per machine."""
    return build_once(cache_root() / f"tiny-deepseek-hf-v{TINY_START_VERSION}", lambda folder: _write(cfg, folder))


def _write(cfg: DecoderConfig, folder: Path) -> None:
    torch.manual_seed(TINY_START_SEED)
    write_hugging_face(Decoder(cfg), cfg, folder, max_shard_bytes=TINY_SHARD_BYTES)
