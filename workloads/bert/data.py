"""BERT input: MLPerf's preprocessed Wikipedia in HDF5 shards, in each of the layouts it comes in.

  fixed      the reference's: 2-D `input_ids`, `input_mask`, `segment_ids` (rows of max_seq_len),
             `masked_lm_positions`, `masked_lm_ids` (rows of max_predictions, 0-padded) and
             `next_sentence_labels`;
  varlength  NVIDIA's: the same keys as variable-length rows, without `input_mask`;
  packed     NVIDIA's packed data: each row holds up to 3 sequences back to back, with
             `packed_input_len` (their lengths), `packed_masked_lm_len`, and one next-sentence
             label per sequence; masked positions count from the start of the row.

Every row becomes the same thing, a pack of one or more sequences, so one model and one loop
serve all three. A folder holds `train/*.hdf5` and `eval/*.hdf5`. Each data rank reads its own
shards (or its own slice of each shard when there are fewer shards than ranks), one at a time,
in an order that depends only on the seed, the epoch and the rank: a restarted run skips
exactly the rows it had trained.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from workloads.common import tiny_text
from workloads.common.cache import build_once, cache_root

LAYOUTS = ("fixed", "varlength", "packed")
FIXED_KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
              "next_sentence_labels")


@dataclass
class Row:
    """One training row: a pack of sequences (one, unless the data is packed)."""

    input_ids: np.ndarray
    segment_ids: np.ndarray
    lengths: np.ndarray  # tokens of each sequence, in order
    mlm_positions: np.ndarray  # from the start of the row
    mlm_ids: np.ndarray
    nsp_labels: np.ndarray  # one per sequence: 0 = B follows A, 1 = B is random


def _layout(f: h5py.File, path: Path) -> str:
    missing = [k for k in FIXED_KEYS if k != "input_mask" and k not in f]
    if missing:
        raise ValueError(f"{path} is not an MLPerf BERT shard: it lacks {', '.join(missing)} (has "
                         f"{', '.join(sorted(f.keys())) or 'nothing'})")
    if "packed_input_len" in f:
        return "packed"
    return "fixed" if f["input_ids"].ndim == 2 else "varlength"


class ShardSlice:
    """Rows [start, stop) of one shard, in any of the three layouts: the arrays are read in one go, and a row
    is built only when asked for, so a loader worker that trains on every n-th batch builds only its own."""

    def __init__(self, path: Path, start: int = 0, stop: int | None = None):
        with h5py.File(path, "r") as f:
            layout = _layout(f, path)
            part = slice(start, stop)
            self.ids, self.segments = f["input_ids"][part], f["segment_ids"][part]
            self.positions, self.masked = f["masked_lm_positions"][part], f["masked_lm_ids"][part]
            self.nsp = f["next_sentence_labels"][part]
            if layout == "fixed":
                mask = f["input_mask"][part] if "input_mask" in f else self.ids != 0
                self.lengths = [np.array([int(n)]) for n in mask.sum(axis=1)]
            elif layout == "varlength":
                self.lengths = [np.array([len(i)]) for i in self.ids]
            else:
                self.lengths = [np.asarray(n, dtype=np.int64) for n in f["packed_input_len"][part]]

    def __len__(self) -> int:
        return len(self.lengths)

    def row(self, i: int) -> Row:
        n = self.lengths[i]
        total = int(n.sum())
        keep = self.positions[i] > 0  # position 0 is [CLS], never masked: a 0 is padding
        return Row(input_ids=np.asarray(self.ids[i][:total], np.int64),
                   segment_ids=np.asarray(self.segments[i][:total], np.int64), lengths=n,
                   mlm_positions=np.asarray(self.positions[i][keep], np.int64),
                   mlm_ids=np.asarray(self.masked[i][keep], np.int64),
                   nsp_labels=np.atleast_1d(np.asarray(self.nsp[i], np.int64)))


def read_rows(path: Path, start: int = 0, stop: int | None = None) -> list[Row]:
    """Rows [start, stop) of one shard, in any of the three layouts."""
    rows = ShardSlice(path, start, stop)
    return [rows.row(i) for i in range(len(rows))]


def shard_length(path: Path) -> int:
    with h5py.File(path, "r") as f:
        _layout(f, path)
        return len(f["next_sentence_labels"])


def write_shard(path: Path, rows: list[Row], layout: str, max_seq_len: int, max_predictions: int) -> None:
    """Write rows in one of MLPerf's layouts (fixed and varlength rows must hold one sequence each)."""
    with h5py.File(path, "w") as f:
        if layout == "fixed":
            n = len(rows)
            arrays = {key: np.zeros((n, width), np.int32) for key, width in (
                ("input_ids", max_seq_len), ("input_mask", max_seq_len), ("segment_ids", max_seq_len),
                ("masked_lm_positions", max_predictions), ("masked_lm_ids", max_predictions))}
            for i, row in enumerate(rows):
                length, masked = len(row.input_ids), len(row.mlm_positions)
                arrays["input_ids"][i, :length] = row.input_ids
                arrays["input_mask"][i, :length] = 1
                arrays["segment_ids"][i, :length] = row.segment_ids
                arrays["masked_lm_positions"][i, :masked] = row.mlm_positions
                arrays["masked_lm_ids"][i, :masked] = row.mlm_ids
            for key, array in arrays.items():
                f.create_dataset(key, data=array)
            f.create_dataset("next_sentence_labels", data=np.array([r.nsp_labels[0] for r in rows], np.int32))
            return
        fields = {"input_ids": ("input_ids", "int16"), "segment_ids": ("segment_ids", "int8"),
                  "masked_lm_positions": ("mlm_positions", "int16"), "masked_lm_ids": ("mlm_ids", "int16")}
        if layout == "packed":
            fields |= {"next_sentence_labels": ("nsp_labels", "int8"), "packed_input_len": ("lengths", "int16")}
        for key, (attr, dtype) in fields.items():
            data = f.create_dataset(key, (len(rows),), dtype=h5py.vlen_dtype(np.dtype(dtype)))
            for i, row in enumerate(rows):
                data[i] = getattr(row, attr).astype(dtype)
        if layout == "packed":
            data = f.create_dataset("packed_masked_lm_len", (len(rows),), dtype=h5py.vlen_dtype(np.dtype("int16")))
            for i, row in enumerate(rows):
                starts = np.concatenate([[0], np.cumsum(row.lengths)])
                data[i] = np.histogram(row.mlm_positions, bins=starts)[0].astype("int16")
        else:
            f.create_dataset("next_sentence_labels", data=np.array([r.nsp_labels[0] for r in rows], np.int8))


def padded_width(longest: int, max_seq_len: int) -> int:
    """The narrowest of four widths (quarters of max_seq_len, in multiples of 8) that holds `longest`: short
    batches cost less than full ones, and a compiled model sees only four sequence widths. (The number of
    masked positions still varies by batch: dynamo makes that one size dynamic after its second shape.)"""
    for quarter in range(1, 5):
        width = min(max_seq_len, -(-max_seq_len * quarter // 32) * 8)
        if width >= longest:
            return width
    raise ValueError(f"a row of {longest} tokens is longer than max_seq_len {max_seq_len}")


def collate(rows: list[Row], max_seq_len: int) -> dict[str, torch.Tensor]:
    """Rows -> the model's tensors, padded to padded_width() rather than always to max_seq_len."""
    width = padded_width(max(len(r.input_ids) for r in rows), max_seq_len)
    batch = len(rows)
    input_ids = np.zeros((batch, width), np.int64)
    segment_ids = np.zeros((batch, width), np.int64)
    position_ids = np.zeros((batch, width), np.int64)
    sequence_ids = np.zeros((batch, width), np.int64)
    mlm_positions, mlm_labels, cls_positions, nsp_labels = [], [], [], []
    for b, row in enumerate(rows):
        total = len(row.input_ids)
        input_ids[b, :total], segment_ids[b, :total] = row.input_ids, row.segment_ids
        start = 0
        for s, length in enumerate(row.lengths):
            position_ids[b, start:start + length] = np.arange(length)
            sequence_ids[b, start:start + length] = s + 1
            cls_positions.append(b * width + start)
            start += length
        mlm_positions.append(b * width + row.mlm_positions)
        mlm_labels.append(row.mlm_ids)
        nsp_labels.append(row.nsp_labels)
    return {"input_ids": torch.from_numpy(input_ids), "segment_ids": torch.from_numpy(segment_ids),
            "position_ids": torch.from_numpy(position_ids), "sequence_ids": torch.from_numpy(sequence_ids),
            "mlm_positions": torch.from_numpy(np.concatenate(mlm_positions)),
            "mlm_labels": torch.from_numpy(np.concatenate(mlm_labels)),
            "cls_positions": torch.tensor(cls_positions, dtype=torch.int64),
            "nsp_labels": torch.from_numpy(np.concatenate(nsp_labels))}


def _shards(folder: Path) -> list[Path]:
    shards = sorted(p for p in folder.glob("*") if p.is_file() and p.suffix in (".hdf5", ".h5", "") and
                    h5py.is_hdf5(p))
    if not shards:
        raise FileNotFoundError(f"{folder} holds no HDF5 shards (MLPerf's BERT data: DATA/train/*.hdf5 and "
                                "DATA/eval/*.hdf5)")
    return shards


class TrainStream:
    """This data rank's endless stream of training rows.

    The shards are cut into units (whole shards, or slices when there are fewer shards than
    ranks) dealt round-robin to the ranks. Each epoch visits this rank's units in a seeded
    order and each unit's rows in a seeded order; only one unit is in memory at a time.
    """

    def __init__(self, folder: Path, seed: int, rank: int, world: int):
        units = []
        shards = _shards(folder)
        parts = math.ceil(world / len(shards))
        for shard in shards:
            rows = shard_length(shard)
            bounds = np.linspace(0, rows, parts + 1).astype(int)
            units += [(shard, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        self.units = units[rank::world]
        self.rows_per_epoch = sum(b - a for _, a, b in self.units)
        if self.rows_per_epoch == 0:
            raise ValueError(f"{folder}: data rank {rank} of {world} has no training rows")
        self.seed, self.rank = seed, rank
        with h5py.File(shards[0], "r") as f:
            self.packed = _layout(f, shards[0]) == "packed"  # rows of several sequences

    def order(self, skip: int = 0) -> Iterator[tuple[int, int]]:
        """(unit, row within the unit) of every row from position `skip` of the stream on: the order alone,
        with nothing read."""
        epoch, skip = divmod(skip, self.rows_per_epoch)
        while True:
            rng = np.random.default_rng([self.seed, epoch, self.rank])
            for u in rng.permutation(len(self.units)):
                shard, start, stop = self.units[u]
                order = rng.permutation(stop - start)
                if skip >= len(order):
                    skip -= len(order)
                    continue
                for i in order[skip:]:
                    yield int(u), int(i)
                skip = 0
            epoch += 1

    def batches(self, batch: int, max_seq_len: int, skip_rows: int = 0, part: int = 0, parts: int = 1
                ) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of `batch` rows from row `skip_rows` on; of those, only batches part, part + parts, ...
        (one loader worker's share: the DataLoader takes its workers' batches in turn, which restores the
        sequence). A unit is read only if one of this part's batches takes a row of it."""
        order = self.order(skip_rows)
        unit, rows = -1, None  # the unit in memory
        for k in itertools.count():
            picks = list(itertools.islice(order, batch))
            if k % parts != part:
                continue
            chosen = []
            for u, i in picks:
                if u != unit:
                    unit, rows = u, ShardSlice(*self.units[u])
                chosen.append(rows.row(i))
            yield collate(chosen, max_seq_len)


# Batches each loader worker keeps ready. A unit switch makes every worker read at once; 4 workers x 8 batches
# of 32 sequences hold about 1.8 s of input at 580 sequences/s (issue 14's goal per GPU) while they read.
PREFETCH_PER_WORKER = 8


class _StreamBatches(IterableDataset):
    """A stream's batches from `skip_rows` on, each loader worker making its share (see TrainStream.batches)."""

    def __init__(self, stream, batch: int, max_seq_len: int, skip_rows: int):
        self.stream, self.batch, self.max_seq_len, self.skip_rows = stream, batch, max_seq_len, skip_rows

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker = get_worker_info()
        part, parts = (worker.id, worker.num_workers) if worker else (0, 1)
        return self.stream.batches(self.batch, self.max_seq_len, self.skip_rows, part, parts)


def train_batches(stream, batch: int, max_seq_len: int, skip_rows: int, workers: int, pin_memory: bool
                  ) -> Iterator[dict[str, torch.Tensor]]:
    """The stream's batches from `skip_rows` on, exactly as stream.batches() gives them, read and collated by
    `workers` loader processes (0: on this thread) into pinned memory when asked, ahead of the training step.
    `stream` is a TrainStream, or anything with its batches(batch, max_seq_len, skip_rows, part, parts)."""
    loader = DataLoader(_StreamBatches(stream, batch, max_seq_len, skip_rows), batch_size=None, num_workers=workers,
                        pin_memory=pin_memory, prefetch_factor=PREFETCH_PER_WORKER if workers else None)
    return iter(loader)


def eval_batches(folder: Path, batch: int, max_seq_len: int, samples: int | None, rank: int, world: int
                 ) -> tuple[list[dict[str, torch.Tensor]], int]:
    """This rank's share (every world-th row) of the first `samples` eval rows, collated once and kept;
    returns the batches and the number of sequences evaluated over all ranks (MLPerf's eval set holds one
    a row; a packed one, such as the tiny packed data's, more)."""
    rows = [row for shard in _shards(folder) for row in read_rows(shard)]
    if samples is not None:
        if len(rows) < samples:
            raise ValueError(f"{folder} holds {len(rows)} eval rows; MLPerf evaluates {samples}")
        rows = rows[:samples]
    return share(rows, batch, max_seq_len, rank, world), sum(len(row.lengths) for row in rows)


def share(rows: list[Row], batch: int, max_seq_len: int, rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """Every world-th row from `rank` on, collated in batches."""
    mine = rows[rank::world]
    return [collate(mine[i:i + batch], max_seq_len) for i in range(0, len(mine), batch)]


# The tiny preset's data: sentence pairs from a Markov chain over 128 tokens (ids 0-3 are [PAD], [CLS],
# [SEP] and [MASK]), masked as BERT masks (15% of tokens: 80% [MASK], 10% random, 10% kept), written in
# the reference's fixed layout. With 8 likely successors per token, a masked token is nearly determined
# by its two neighbours (the best accuracy is about 0.95), yet a guess from token frequencies gets
# under 0.05: reaching 0.72 takes real learning.
TINY_VERSION = 1
PAD, CLS, SEP, MASK, FIRST_WORD = 0, 1, 2, 3, 4
TINY_SUCCESSORS = 8
TINY_SHARDS, TINY_SHARD_ROWS, TINY_EVAL_ROWS = 4, 4096, 512


def tiny_pair(table: np.ndarray, max_seq_len: int, max_predictions: int, rng: np.random.Generator) -> Row:
    """One masked sentence pair: [CLS] A [SEP] B [SEP], B following A half the time."""
    vocab = len(table)
    words = int(rng.integers(max_seq_len // 2, max_seq_len - 2))  # A and B together
    first = int(rng.integers(4, words - 4))
    is_random = int(rng.random() < 0.5)
    text = tiny_text.walk(table, int(rng.integers(FIRST_WORD, vocab)), words, rng)
    if is_random:
        text[first:] = tiny_text.walk(table, int(rng.integers(FIRST_WORD, vocab)), words - first, rng)
    tokens = np.concatenate([[CLS], text[:first], [SEP], text[first:], [SEP]])
    segments = np.concatenate([np.zeros(first + 2, np.int64), np.ones(words - first + 1, np.int64)])
    candidates = np.flatnonzero(tokens >= FIRST_WORD)
    count = min(max_predictions, max(1, round(0.15 * len(candidates))))
    positions = np.sort(rng.choice(candidates, count, replace=False))
    labels = tokens[positions].copy()
    for p, u in zip(positions, rng.random(count)):
        tokens[p] = MASK if u < 0.8 else int(rng.integers(FIRST_WORD, vocab)) if u < 0.9 else tokens[p]
    return Row(input_ids=tokens, segment_ids=segments, lengths=np.array([len(tokens)]), mlm_positions=positions,
               mlm_ids=labels, nsp_labels=np.array([is_random]))


def write_tiny_dataset(folder: Path, vocab: int, max_seq_len: int, max_predictions: int, layout: str = "fixed",
                       shards: int = TINY_SHARDS, shard_rows: int = TINY_SHARD_ROWS, eval_rows: int = TINY_EVAL_ROWS,
                       ) -> None:
    """The tiny dataset in MLPerf's layout: `train/part-*.hdf5` and `eval/eval.hdf5` (tests use small counts)."""
    table = tiny_text.transitions(vocab, TINY_SUCCESSORS, first=FIRST_WORD)
    pair_len = max_seq_len // 2 if layout == "packed" else max_seq_len  # short pairs, so that 2 or 3 fit a row
    for name, count, seed in [*((f"train/part-{i:05d}-of-{shards:05d}.hdf5", shard_rows, i) for i in range(shards)),
                              ("eval/eval.hdf5", eval_rows, 10_000)]:
        rng = np.random.default_rng(seed)
        rows = [tiny_pair(table, pair_len, max_predictions, rng) for _ in range(count)]
        if layout == "packed":
            rows = pack(rows, max_seq_len)
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        write_shard(folder / name, rows, layout, max_seq_len, max_predictions)


def pack(rows: list[Row], max_seq_len: int, per_row: int = 3) -> list[Row]:
    """Pack consecutive single-sequence rows, up to `per_row` of them while they fit (first fit in order)."""
    packs: list[list[Row]] = []
    for row in rows:
        last = packs[-1] if packs else None
        if last and len(last) < per_row and sum(len(r.input_ids) for r in last) + len(row.input_ids) <= max_seq_len:
            last.append(row)
        else:
            packs.append([row])
    out = []
    for group in packs:
        offsets = np.cumsum([0] + [len(r.input_ids) for r in group[:-1]])
        out.append(Row(input_ids=np.concatenate([r.input_ids for r in group]),
                       segment_ids=np.concatenate([r.segment_ids for r in group]),
                       lengths=np.concatenate([r.lengths for r in group]),
                       mlm_positions=np.concatenate([r.mlm_positions + o for r, o in zip(group, offsets)]),
                       mlm_ids=np.concatenate([r.mlm_ids for r in group]),
                       nsp_labels=np.concatenate([r.nsp_labels for r in group])))
    return out


def tiny_dataset_root() -> Path:
    return cache_root() / f"tiny-bert-v{TINY_VERSION}"


def ensure_tiny_dataset(vocab: int, max_seq_len: int, max_predictions: int) -> Path:
    return build_once(tiny_dataset_root(),
                      lambda folder: write_tiny_dataset(folder, vocab, max_seq_len, max_predictions))
