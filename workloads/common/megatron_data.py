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
The tiny presets write their generated text in the same format, so they run through this very reader.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from workloads.common import tiny_text
from workloads.common.data import ResumableSampler

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

    Rank r takes sequences r, r + world, r + 2 world, ... MLPerf scores every validation sequence once,
    but ranks must run the same number of forward passes (FSDP gathers weights across them), so ranks
    with one sequence fewer run a repeat of sequence 0 that is not counted (counted = False), where
    DistributedSampler would count the repeat (5,760 sequences padded to 5,824 at 448 data ranks).
    """

    def __init__(self, data: Dataset, rank: int, world: int):
        self.data, self.rank, self.world = data, rank, world
        self.per_rank = -(-len(data) // world)

    def __len__(self) -> int:
        return self.per_rank

    def __getitem__(self, i: int) -> tuple[torch.Tensor, bool]:
        if not 0 <= i < self.per_rank:
            raise IndexError(f"eval shard item {i} of {self.per_rank}")
        index = self.rank + i * self.world
        return (self.data[index], True) if index < len(self.data) else (self.data[0], False)


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
