"""Megatron's indexed datasets (the `.bin`/`.idx` pairs MLPerf's C4 comes in, for GPT-3 and llama31_8b),
next-token samples over them, and the data-parallel loaders both benchmarks read them through.

The `.idx` file (Megatron's MMIDIDX format, version 1): a 9-byte magic, the version
(<Q), a dtype code (<B), the sequence count (<Q) and the document count (<Q); then
int32 sizes and int64 byte pointers, one per sequence, and int64 document indices.
The `.bin` file holds the token ids back to back, in the dtype the index declares (uint16 for
GPT-3's 50k vocabulary, int32 for Llama 3.1's 128k). Samples are cut from the concatenated stream in
document order (documents end in an EOD token, and attention runs across their boundaries, as the references
train), and shuffled by a seed, as Megatron's GPTDataset does (its `_build_doc_idx` leaves the documents in
order: "Disabled document shuffling", mlcommons/training large_language_model/megatron-lm/megatron/data/
gpt_dataset.py; its `shuffle_idx` shuffles the samples). Llama 3.1's reference cuts windows of seq_len + 1
tokens (Megatron's default); GPT-3's passes `--no-seq-len-plus-one-tokens`: disjoint samples of seq_len.
Megatron-Core's GPTDataset, which NeMo (llama31_8b's reference) and today's Megatron-LM (gpt_oss_20b's) read
through, shuffles the documents as well, over as many epochs as the samples asked of it need:
gpt_dataset_indices follows it, and megatron_eval_samples gives the sequences an eval built on it scores.
The tiny presets write their generated text in the same format, so they run through this very reader.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from workloads.common import tiny_text
from workloads.common.cache import build_once, cache_root
from workloads.common.data import ResumableSampler, eval_row

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}


class IndexedDataset:
    """One `.bin`/`.idx` pair, memory-mapped."""

    def __init__(self, prefix: Path):
        idx, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for path in (idx, bin_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: a Megatron indexed dataset is a .bin/.idx pair")
        with open(idx, "rb") as f:
            magic = f.read(len(MAGIC))
            if magic != MAGIC:
                raise ValueError(f"{idx} is not a Megatron MMIDIDX index (magic {magic!r})")
            version, code = struct.unpack("<QB", f.read(9))
            if version != VERSION or code not in DTYPES:
                raise ValueError(f"{idx}: unsupported index version {version} or dtype code {code}")
            sequences, documents = struct.unpack("<QQ", f.read(16))
            offset = f.tell()
        self.dtype = np.dtype(DTYPES[code])
        index = np.memmap(idx, mode="r", order="C")
        self.sizes = np.frombuffer(index, np.int32, sequences, offset)
        self.pointers = np.frombuffer(index, np.int64, sequences, offset + self.sizes.nbytes)
        self.document_indices = np.frombuffer(index, np.int64, documents,
                                              offset + self.sizes.nbytes + self.pointers.nbytes)
        self.tokens = np.memmap(bin_path, dtype=self.dtype, mode="r")
        if sequences and int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize > self.tokens.nbytes:
            raise ValueError(f"{bin_path} is shorter than its index says: truncated?")

    def __len__(self) -> int:
        return len(self.sizes)

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.pointers[i] // self.dtype.itemsize:][: self.sizes[i]]


def require_datasets(root: Path, prefixes: tuple[str, ...], what: str) -> None:
    """Refuse a data folder that lacks any of these `.bin`/`.idx` pairs, naming each missing file (as
    `prefix.{bin,idx}` when both are: the message must fit the one-line cause the node agent keeps), what the
    benchmark reads, and the indexes the folder does hold."""
    missing = []
    for prefix in prefixes:
        absent = [suffix for suffix in ("bin", "idx") if not Path(root, f"{prefix}.{suffix}").is_file()]
        if absent:
            missing.append(f"{prefix}.{{{','.join(absent)}}}" if len(absent) == 2 else f"{prefix}.{absent[0]}")
    if missing:
        found = sorted(p.name for p in Path(root).glob("*.idx")) if Path(root).is_dir() else []
        raise FileNotFoundError(f"{root} lacks {', '.join(missing)} ({what}); found: "
                                f"{', '.join(found) or 'no .idx files'}")


def write_indexed_dataset(prefix: Path, documents: list[np.ndarray], dtype=np.uint16) -> None:
    """Write documents in Megatron's format (one sequence per document), as its preprocessing tool does."""
    code = next(c for c, t in DTYPES.items() if np.dtype(t) == np.dtype(dtype))
    sizes = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)]).astype(np.int64) * np.dtype(dtype).itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            f.write(np.asarray(doc, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QB", VERSION, code) + struct.pack("<QQ", len(sizes), len(sizes) + 1))
        f.write(sizes.tobytes() + pointers.tobytes() + np.arange(len(sizes) + 1, dtype=np.int64).tobytes())


PAD = -1  # Megatron's filler after the last token of a whole-set eval: read as token 0, never scored


class SequenceSamples(Dataset):
    """Samples over one dataset's token stream, shuffled by `seed` (None: in stream order).

    With `extra_token` (Megatron's default), windows of seq_len + 1 tokens, each sharing its last token with the
    next one's first: input and shifted target. Without (GPT-3's reference), disjoint samples of seq_len tokens,
    whose last position has no target (workloads.common.language_model.rolled_split). `keep_last` keeps the
    stream's final, shorter sample, padded with PAD, as Megatron does for an eval over the whole set."""

    def __init__(self, data: IndexedDataset, seq_len: int, seed: int | None, extra_token: bool = True,
                 keep_last: bool = False):
        self.data, self.seq_len, self.extra = data, seq_len, int(extra_token)
        usable = len(data.tokens) - self.extra
        count = -(-usable // seq_len) if keep_last else usable // seq_len
        if count < 1:
            raise ValueError(f"a dataset of {len(data.tokens)} tokens holds no sample of {seq_len + self.extra} "
                             "tokens")
        self.order = np.random.default_rng(seed).permutation(count) if seed is not None else np.arange(count)

    def __len__(self) -> int:
        return len(self.order)

    def tokens_in(self, count: int) -> int:
        """The dataset tokens the first `count` samples in stream order hold (the padding not counted)."""
        return min(count * self.seq_len + self.extra, len(self.data.tokens)) if count else 0

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.order[i]) * self.seq_len
        sample = self.data.tokens[start:start + self.seq_len + self.extra].astype(np.int64)
        return torch.from_numpy(np.pad(sample, (0, self.seq_len + self.extra - len(sample)), constant_values=PAD))


# Megatron-Core's GPTDataset (megatron/core/datasets/gpt_dataset.py, with helpers.cpp's build_sample_idx): the
# order NeMo's PreTrainingDataModule and Megatron-LM's pretrain_gpt.py read a split in. Its three indices: the
# document index (every document once per epoch, all epochs shuffled together by numpy's legacy RandomState(seed)),
# the sample index (where each seq_len (+1) window starts in the documents laid end to end in that order), and the
# shuffle index (a permutation of the samples, from the same RandomState, drawn after the document shuffle).
# Dataset item i is sample shuffle_index[i]. The epochs depend on how many samples the caller asks the split for,
# so the same file gives other windows for another requested count, and another seed.

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80  # gpt_dataset.py, GPTDataset._build_document_sample_shuffle_indices


def gpt_num_epochs(tokens_per_epoch: int, num_samples: int | None, seq_len: int, extra_token: bool = True) -> int:
    """GPTDataset._get_num_epochs (megatron/core/datasets/gpt_dataset.py): the fewest epochs whose tokens hold
    `num_samples` windows of seq_len + extra_token tokens (1 when no count is asked for)."""
    if num_samples is None:
        return 1
    requested = num_samples * seq_len + int(extra_token)
    return max(1, -(-requested // tokens_per_epoch))


def gpt_separate_final_epoch(tokens_per_epoch: int, num_epochs: int, num_samples: int, seq_len: int,
                             extra_token: bool = True) -> tuple[bool, int]:
    """GPTDataset._build_document_sample_shuffle_indices: with several epochs, the last one is shuffled on its own
    (documents and samples) when the samples taken from it are fewer than 80% of an epoch's. Returns (separate,
    the samples before the final epoch)."""
    if num_epochs == 1:
        return False, 0
    extra = int(extra_token)
    before_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_len
    from_final = num_samples - before_final
    per_epoch = (tokens_per_epoch - extra) // seq_len
    assert 0 <= from_final <= per_epoch + 1
    return from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch), before_final


def gpt_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                       separate_final_epoch: bool) -> np.ndarray:
    """gpt_dataset.py, _build_document_index: the documents repeated num_epochs times (epoch-major) as int32, shuffled
    in place by `rng`; with separate_final_epoch, the first num_epochs - 1 epochs shuffled together, then the last."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents), num_epochs).astype(np.int32)
        rng.shuffle(index)
        return index
    first = gpt_document_index(documents, num_epochs - 1, rng, False)
    return np.concatenate((first, gpt_document_index(documents, 1, rng, False)))


def gpt_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """gpt_dataset.py, _build_shuffle_index: [0, num_samples) shuffled, then [num_samples, total_size) shuffled
    after it (uint32 unless the size needs int64)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def gpt_sample_count(tokens_per_epoch: int, num_epochs: int, seq_len: int, extra_token: bool = True,
                     drop_last_partial: bool = True) -> int:
    """helpers.cpp, build_sample_idx: the samples the document index holds (the sample index has one row more).
    Without drop_last_partial, the last, shorter one counts too (computed in single precision, as there)."""
    usable = num_epochs * tokens_per_epoch - int(extra_token)
    if drop_last_partial:
        return usable // seq_len
    return int(np.ceil(np.float32(usable) / np.float32(seq_len)))


# Documents per step when the document index is laid end to end: bounds the memory of the running token count
# (the real validation index runs to billions of entries).
_CHUNK = 1 << 24


def gpt_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_len: int, num_epochs: int,
                     tokens_per_epoch: int, extra_token: bool = True, drop_last_partial: bool = True,
                     rows: np.ndarray | None = None) -> np.ndarray:
    """helpers.cpp, build_sample_idx (megatron/core/datasets): row k = (position in the document index, token
    offset in that document) where sample k starts, i.e. token k x seq_len of the documents laid end to end in the
    document index's order. A sample is seq_len + extra_token tokens, so with the extra token consecutive samples
    share one token and a row never points at a document's end (the loop there stops in the document that holds
    the sample's last token). Without drop_last_partial the final row is (last position, its size - extra_token).

    The loop there walks every document; this finds the same rows from a running token count, only for `rows`
    (sample index rows, default all of them), a chunk of the document index at a time."""
    extra = int(extra_token)
    count = gpt_sample_count(tokens_per_epoch, num_epochs, seq_len, extra_token, drop_last_partial)
    rows = np.arange(count + 1, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    out = np.zeros((len(rows), 2), dtype=np.int64)
    total = num_epochs * tokens_per_epoch
    partial = rows * seq_len + extra > total  # only the final row of a set that keeps its last partial sample
    if partial.any():
        out[partial] = (len(document_index) - 1, int(sizes[document_index[-1]]) - extra)
    # Row k's document holds token k x seq_len + extra - 1 (the one before the sample's end); row 0 is (0, 0).
    order = np.argsort(rows, kind="stable")
    wanted = order[(rows[order] > 0) & ~partial[order]]
    targets = rows[wanted] * seq_len + extra - 1
    base, done = 0, 0
    for start in range(0, len(document_index), _CHUNK):
        if done == len(wanted):
            break
        lengths = sizes[document_index[start:start + _CHUNK]].astype(np.int64)
        ends = base + np.cumsum(lengths)
        stop = done + int(np.searchsorted(targets[done:], ends[-1] if len(ends) else base, side="left"))
        if stop > done:
            at = np.searchsorted(ends, targets[done:stop], side="right")
            begins = ends[at] - lengths[at]
            out[wanted[done:stop], 0] = start + at
            out[wanted[done:stop], 1] = rows[wanted[done:stop]] * seq_len - begins
            done = stop
        base = int(ends[-1]) if len(ends) else base
    if done != len(wanted):
        raise ValueError(f"the document index holds {base} tokens, too few for sample {rows[wanted[done]]}")
    return out


@dataclass
class GPTIndices:
    """What GPTDataset builds for one split: the document index, the sample index rows of the samples it serves
    (`starts[i]`, `ends[i]`: sample `shuffle[i]`'s first and next rows), and the figures behind them."""
    document: np.ndarray
    shuffle: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    epochs: int
    tokens_per_epoch: int
    separate_final_epoch: bool


def gpt_dataset_indices(sizes: np.ndarray, seq_len: int, num_samples: int | None, seed: int,
                        documents: np.ndarray | None = None, extra_token: bool = True, drop_last_partial: bool = True,
                        first: int | None = None) -> GPTIndices:
    """GPTDataset._build_document_sample_shuffle_indices (megatron/core/datasets/gpt_dataset.py) for a split of
    `documents` (default all of them, as a split given its own file gets: blended_megatron_dataset_builder.py,
    `blend_per_split`), asked for `num_samples` samples (None: one epoch). One numpy RandomState(seed) shuffles
    the document index, then the samples. `first`: keep only the sample rows of dataset items 0..first-1 (the
    document and shuffle indices are built whole: each depends on every draw before it)."""
    sizes = np.asarray(sizes)
    documents = np.arange(len(sizes), dtype=np.int32) if documents is None else np.asarray(documents)
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    epochs = gpt_num_epochs(tokens_per_epoch, num_samples, seq_len, extra_token)
    separate, before_final = gpt_separate_final_epoch(tokens_per_epoch, epochs, num_samples, seq_len, extra_token) \
        if epochs > 1 else (False, 0)
    rng = np.random.RandomState(seed)
    document = gpt_document_index(documents, epochs, rng, separate)
    count = gpt_sample_count(tokens_per_epoch, epochs, seq_len, extra_token, drop_last_partial)
    shuffle = gpt_shuffle_index(before_final if separate else count, count, rng)
    served = shuffle if first is None else shuffle[:first]
    rows = gpt_sample_index(sizes, document, seq_len, epochs, tokens_per_epoch, extra_token, drop_last_partial,
                            rows=np.concatenate((served, served + 1)).astype(np.int64))
    return GPTIndices(document, shuffle, rows[:len(served)], rows[len(served):], epochs, tokens_per_epoch, separate)


class GPTSamples(Dataset):
    """Dataset items 0..count-1 of Megatron-Core's GPTDataset over `data`, each a window of seq_len + 1 tokens
    (seq_len without extra_token), as GPTDataset._query_document_sample_shuffle_indices cuts them: from the
    first row's document and offset to the next row's, across the documents between them. A window the last
    partial sample leaves short is padded with PAD. Keeps only each window's document ids and ends (`windows`:
    (document ids, offset in the first, end in the last)), not the (possibly billions long) document index."""

    def __init__(self, data: IndexedDataset, windows: list[tuple[np.ndarray, int, int]], length: int):
        self.data, self.samples, self.length = data, windows, length

    @classmethod
    def of(cls, data: IndexedDataset, indices: GPTIndices, seq_len: int, count: int | None = None,
           extra_token: bool = True) -> "GPTSamples":
        count = len(indices.starts) if count is None else count
        if count > len(indices.starts):
            raise ValueError(f"{count} samples asked of a split that serves {len(indices.starts)}")
        windows = [(np.array(indices.document[b:e + 1], dtype=np.int64), int(offset), int(end) + int(extra_token))
                   for (b, offset), (e, end) in zip(indices.starts[:count], indices.ends[:count])]
        return cls(data, windows, seq_len + int(extra_token))

    def save(self, path: Path) -> None:
        """The windows as one .npz: every window's document ids back to back, where each begins, offsets, ends."""
        lengths = [len(documents) for documents, _, _ in self.samples]
        np.savez(path, documents=np.concatenate([d for d, _, _ in self.samples] or [np.zeros(0, np.int64)]),
                 begins=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                 offsets=np.array([o for _, o, _ in self.samples], np.int64),
                 ends=np.array([e for _, _, e in self.samples], np.int64), length=self.length)

    @classmethod
    def load(cls, data: IndexedDataset, path: Path) -> "GPTSamples":
        saved = np.load(path)
        begins = saved["begins"]
        windows = [(saved["documents"][begins[i]:begins[i + 1]], int(offset), int(end))
                   for i, (offset, end) in enumerate(zip(saved["offsets"], saved["ends"]))]
        return cls(data, windows, int(saved["length"]))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> torch.Tensor:
        documents, offset, end = self.samples[i]
        if len(documents) == 1:
            parts = [self.data.document(int(documents[0]))[offset:end]]
        else:
            parts = [self.data.document(int(documents[0]))[offset:]]
            parts += [self.data.document(int(d)) for d in documents[1:-1]]
            parts.append(self.data.document(int(documents[-1]))[:end])
        sample = np.concatenate(parts).astype(np.int64)
        return torch.from_numpy(np.pad(sample, (0, self.length - len(sample)), constant_values=PAD))


def megatron_eval_samples(data: IndexedDataset, seq_len: int, num_samples: int | None, seed: int, count: int,
                          extra_token: bool = True) -> GPTSamples:
    """The sequences an eval over a validation file scores when its reference reads it through Megatron-Core's
    GPTDataset, built for `num_samples` samples (what the reference's data module asks the validation split for;
    None: one epoch) with the run's seed, and evaluates dataset items 0..count-1 (its validation sampler starts
    at 0 every time: NeMo's MegatronDataSampler, Megatron-LM's MegatronPretrainingSampler).

    Building the indices shuffles every sample the split is asked for (409.6M for llama31_8b at batch 64: 1.6 GB
    and half a minute), so one process per machine builds them and keeps the windows it scores under the cache
    root, keyed by the file's document sizes and the arguments; the machine's other ranks, and later runs with the
    same seed, read those (workloads.common.cache.build_once), as the reference keeps its index files."""
    key = hashlib.sha256(data.sizes.tobytes() + repr((seq_len, num_samples, seed, count, extra_token)).encode())

    def write(folder: Path) -> None:
        indices = gpt_dataset_indices(data.sizes, seq_len, num_samples, seed, extra_token=extra_token, first=count)
        if len(indices.shuffle) < count:
            raise ValueError(f"holds {len(indices.shuffle)} sequences of {seq_len + int(extra_token)} tokens; the "
                             f"eval scores {count}")
        GPTSamples.of(data, indices, seq_len, count, extra_token).save(folder / "windows.npz")

    folder = build_once(cache_root() / f"megatron-eval-{key.hexdigest()[:20]}", write)
    return GPTSamples.load(data, folder / "windows.npz")


class BlendedSamples(Dataset):
    """`length` samples drawn from several datasets in fixed proportions.

    Sample i comes from the dataset whose share of [0, 1) holds frac(0.5 + i x 0.618...): a
    low-discrepancy sequence, so every stretch of the blend keeps the proportions (0.5/0.5
    alternates) with nothing precomputed, even for the billions of samples of a full run.
    Within that dataset it takes shuffled sample i (mod its length).
    """

    GOLDEN = (5**0.5 - 1) / 2

    def __init__(self, datasets: list[Dataset], weights: list[float], length: int):
        self.datasets, self.length = datasets, length
        self.bounds = np.cumsum(weights) / sum(weights)

    def __len__(self) -> int:
        return self.length

    def source(self, i: int) -> int:
        return min(int(np.searchsorted(self.bounds, (0.5 + i * self.GOLDEN) % 1.0, side="right")),
                   len(self.datasets) - 1)

    def __getitem__(self, i: int) -> torch.Tensor:
        dataset = self.datasets[self.source(i)]
        return dataset[i % len(dataset)]


@dataclass
class TokenLoaders:
    train: DataLoader
    eval: DataLoader
    eval_sequences: int
    sampler: ResumableSampler  # the train loader's: where a resumed run starts reading
    eval_tokens: int | None = None  # the dataset tokens the eval reads, where its reader counts them


class EvalShard(Dataset):
    """One data rank's share of the validation sequences, each scored by exactly one rank: (tokens, counted).

    Its rows and their `counted` flags are workloads.common.data.eval_row's: every rank the same number, a short
    share padded with uncounted repeats of sequence 0.
    """

    def __init__(self, data: Dataset, rank: int, world: int):
        self.data, self.rank, self.world = data, rank, world
        self.per_rank = -(-len(data) // world)

    def __len__(self) -> int:
        return self.per_rank

    def __getitem__(self, i: int) -> tuple[torch.Tensor, bool]:
        if not 0 <= i < self.per_rank:
            raise IndexError(f"eval shard item {i} of {self.per_rank}")
        index, counted = eval_row(len(self.data), self.rank, self.world, i)
        return self.data[index], counted


# Micro batches each loader worker keeps ready: one is 2,048 or 2,049 tokens a sequence, so holding a few costs nothing
# and hides the page faults of a cold memory map.
PREFETCH_PER_WORKER = 4


def token_loaders(train: Dataset, eval_set: Dataset, micro_batch: int, data_rank: int, data_world: int, workers: int,
                  pin_memory: bool, eval_batch: int | None = None) -> TokenLoaders:
    """Each data rank reads its own share; ranks of one tensor-parallel group share a data rank.

    `workers` processes per loader (0: the training thread) read the samples ahead, into pinned memory when
    asked, and stay up between iterations (persistent). The sampler runs in this process, so a skip set on
    it before iter() applies with workers too. The eval reads `eval_batch` sequences at a time (default: the
    micro batch): it keeps no gradients or activations, so it can take more per forward pass."""
    sampler = ResumableSampler(DistributedSampler(train, num_replicas=data_world, rank=data_rank, shuffle=False,
                                                  drop_last=True))
    common = dict(num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0,
                  prefetch_factor=PREFETCH_PER_WORKER if workers else None)
    return TokenLoaders(train=DataLoader(train, sampler=sampler, drop_last=True, batch_size=micro_batch, **common),
                        eval=DataLoader(EvalShard(eval_set, data_rank, data_world), batch_size=eval_batch or micro_batch,
                                        **common),
                        eval_sequences=len(eval_set), sampler=sampler)


class RandomTokens(Dataset):
    """Seeded random sequences of seq_len + 1 tokens (seq_len without `extra_token`, as SequenceSamples): input
    for throughput runs (--synthetic) that need no dataset."""

    def __init__(self, vocab_size: int, seq_len: int, count: int, seed: int, extra_token: bool = True):
        self.vocab_size, self.seq_len, self.count, self.seed = vocab_size, seq_len, count, seed
        self.length = seq_len + int(extra_token)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return torch.randint(0, self.vocab_size, (self.length,), generator=generator)


def write_markov_corpus(folder: Path, table: np.ndarray, files: list[tuple[str, int, int]], doc_tokens: int,
                        eod: int, dtype) -> None:
    """Generated text for a tiny preset: for each (prefix, documents, seed), `documents` walks of the Markov
    chain `table`, each `doc_tokens` long with its EOD token last, written as one indexed dataset."""
    for prefix, documents, seed in files:
        rng = np.random.default_rng(seed)
        docs = [np.append(tiny_text.walk(table, int(rng.integers(1, len(table))), doc_tokens - 1, rng), eod)
                for _ in range(documents)]
        write_indexed_dataset(folder / prefix, [doc.astype(dtype) for doc in docs])
