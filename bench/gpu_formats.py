"""The benchmarks' real on-disk input, written small for bench/gpu_throughput.py.

A throughput run on synthetic batches measures the model; one on files measures the input
pipeline too, so these are the formats the workloads read from MLPerf's data: ImageNet as a JPEG
ImageFolder, BERT's HDF5 shards, GPT-3's Megatron `.idx`/`.bin` pairs (uint16), llama31_8b's
(int32, under the names MLCommons gives its C4 for Llama 3.1) and flux1's preprocessed embeddings
(Hugging Face save_to_disk folders). Each writer makes just enough for the steps a run times, so
that no epoch restarts inside the measurement. The BERT, Megatron and flux1 writers are the
workloads' own (`write_shard`, `write_indexed_dataset`, `write_embedding_set`).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

# ImageNet's typical training image: 500x375, about 110 KB (its 1.28M files take 140 GB); the grain
# below brings these to about 100 KB. Distinct encodings are a small pool written under many names:
# reading and decoding cost the same, writing costs far less.
IMAGENET_LIKE_SIZE = (500, 375)
JPEG_QUALITY = 90
GRAIN = 32
DISTINCT_IMAGES = 64
IMAGE_CLASSES = 10
DISTINCT_EMBEDDINGS = 16  # flux1's rows, likewise


def write_image_folder(root: Path, train_images: int, size: tuple[int, int], seed: int) -> Path:
    """ImageNet's layout, root/train/<class>/*.JPEG and root/val/<class>/*.JPEG (one per class)."""
    rng = np.random.default_rng(seed)
    pool = [jpeg_image(rng, size) for _ in range(DISTINCT_IMAGES)]
    for split, count in (("train", train_images), ("val", IMAGE_CLASSES)):
        for c in range(IMAGE_CLASSES):
            (root / split / f"n{c:08d}").mkdir(parents=True)
        for i in range(count):
            path = root / split / f"n{i % IMAGE_CLASSES:08d}" / f"{split}_{i:08d}.JPEG"
            path.write_bytes(pool[i % len(pool)])
    return root


def jpeg_image(rng: np.random.Generator, size: tuple[int, int], grain: int = GRAIN) -> bytes:
    """A smooth random colour field with grain: compresses like a photograph, unlike pure noise (more grain, more
    bytes: 32 gives about 96 KiB at 500x375, 68 about 130 KiB)."""
    width, height = size
    coarse = Image.fromarray(rng.integers(0, 256, (max(2, height // 32), max(2, width // 32), 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize(size, Image.BICUBIC), dtype=np.int16)
    noise = rng.integers(-grain, grain + 1, smooth.shape, dtype=np.int16)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(smooth + noise, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def write_bert_shards(root: Path, preset, train_rows: int, eval_rows: int, shards: int, seed: int) -> Path:
    """root/train/part-*.hdf5 and root/eval/eval.hdf5 in MLPerf's fixed layout: full-length random rows."""
    from workloads.bert.data import write_shard
    from workloads.bert.train import synthetic_row

    rng = np.random.default_rng(seed)
    seq_len, predictions = preset.model.max_seq_len, preset.max_predictions
    bounds = np.linspace(0, train_rows, shards + 1).astype(int)
    files = [(root / "train" / f"part-{i:05d}-of-{shards:05d}.hdf5", int(b - a))
             for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    for path, rows in [*files, (root / "eval" / "eval.hdf5", eval_rows)]:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_shard(path, [synthetic_row(preset, rng) for _ in range(rows)], "fixed", seq_len, predictions)
    return root


def write_megatron_corpus(root: Path, vocab_size: int, seq_len: int, train_samples: int, eval_samples: int,
                          seed: int) -> Path:
    """MLPerf's C4 layout for GPT-3: its two training shards (each holding train_samples samples of seq_len tokens,
    as the reference cuts them, so the 0.5/0.5 blend never wraps) and the validation subset, in uint16."""
    from workloads.gpt3.data import C4_EVAL, C4_TRAIN, EOD

    return _random_corpus(root, [(C4_TRAIN[0], train_samples), (C4_TRAIN[1], train_samples), (C4_EVAL, eval_samples)],
                          vocab_size, seq_len, EOD, np.uint16, seed, extra_token=False)


def write_llama_corpus(root: Path, vocab_size: int, seq_len: int, train_samples: int, eval_samples: int,
                       seed: int) -> Path:
    """MLCommons' C4 for Llama 3.1: the training file (train_samples windows of seq_len + 1 tokens, so that the
    run never cycles it) and the validation file (eval_samples windows: the eval reads its first ones), in int32
    (token ids reach 128,255)."""
    from workloads.decoder.data import EOD, TRAIN, VALIDATION

    return _random_corpus(root, [(TRAIN, train_samples), (VALIDATION, eval_samples)], vocab_size, seq_len, EOD,
                          np.int32, seed)


def _random_corpus(root: Path, files: list[tuple[str, int]], vocab_size: int, seq_len: int, eod: int, dtype,
                   seed: int, extra_token: bool = True) -> Path:
    """Each (prefix, samples) as samples * seq_len tokens, + 1 for windows of seq_len + 1 (`extra_token`, as
    workloads.common.megatron_data.SequenceSamples): documents of seq_len random tokens ending in EOD."""
    from workloads.common.megatron_data import write_indexed_dataset

    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for prefix, samples in files:
        tokens = samples * seq_len + int(extra_token)
        documents = [np.append(rng.integers(eod + 1, vocab_size, min(seq_len, tokens - start) - 1), eod)
                     for start in range(0, tokens, seq_len)]
        write_indexed_dataset(root / prefix, [d.astype(dtype) for d in documents if len(d)], dtype)
    return root


def write_flux_embeddings(root: Path, shape, train_samples: int, eval_samples: int, seed: int) -> Path:
    """MLCommons' preprocessed flux1 set: root/cc12m_preprocessed/ (train_samples rows), root/coco_preprocessed/
    (eval_samples rows with their timesteps 0..7) and root/empty_encodings/, each tensor of `shape` (the config's
    SampleShape) as .npy bytes of bf16. Distinct rows are a small pool written many times, as the JPEGs: a row at
    schnell's shapes is 2 MiB of T5 states, and reading and decoding it cost the same either way."""
    from workloads.flux.data import (EMPTY_FOLDER, EVAL_FOLDER, TIMESTEP, TRAIN_FOLDER, write_embedding_set,
                                     write_empty_encodings)

    rng = np.random.default_rng(seed)
    expected = shape.expected()
    pool = [{column: rng.standard_normal(dims, dtype=np.float32) for column, dims in expected.items()}
            for _ in range(DISTINCT_EMBEDDINGS)]

    def rows(count: int) -> dict[str, list]:
        return {column: [pool[i % len(pool)][column] for i in range(count)] for column in expected}

    write_embedding_set(root / TRAIN_FOLDER, rows(train_samples))
    write_embedding_set(root / EVAL_FOLDER, {**rows(eval_samples), TIMESTEP: [i % 8 for i in range(eval_samples)]})
    write_empty_encodings(root / EMPTY_FOLDER, np.zeros(shape.text), np.zeros(shape.pooled))
    return root
