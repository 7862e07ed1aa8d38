"""llama2_70b_lora input: SCROLLS GovReport as MLCommons ships it, two parquet files of sequences already
tokenized (Llama 2's tokenizer) and packed to 8,192 tokens, read with pyarrow.

Columns, as the reference writes them (mlcommons/training `llama2_70b_lora/scripts/utils.py`,
`create_datasets`; submitters' `convert_dataset.py` reads the same two): `input_ids` and `labels`, lists of
integers, one row per packed sequence. Training labels are the input ids (group_texts copies them); validation
labels are -100 over each prompt ("### Summarize the following text: ... ### Summary:") and its last token,
so the eval scores only the summaries. Other columns (an `attention_mask`) are not read: every sequence is full.

The loss is Hugging Face's causal LM loss, which the reference trains with: position t predicts labels[t + 1].
The model reads all 8,192 input ids and the last position's target is -100, so a sequence splits evenly over
context-parallel ranks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, Subset

from workloads.common import tiny_text
from workloads.common.cache import build_once, cache_root
from workloads.common.language_model import IGNORED
from workloads.common.megatron_data import TokenLoaders, token_loaders

TRAIN = "train-00000-of-00001.parquet"
VALIDATION = "validation-00000-of-00001.parquet"
COLUMNS = ("input_ids", "labels")


def count_sequences(path: Path) -> int | None:
    """The sequences (rows) a split holds, from its parquet footer alone: no sequence is read. None when the file
    is missing or no parquet file (read_split then says why, when the run opens its data)."""
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowException):
        return None


def read_split(path: Path, seq_len: int) -> np.ndarray:
    """(sequences, 2, seq_len) int32: each row's input ids and labels (vocabulary 32,000 and -100 fit)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: llama2_70b_lora reads MLCommons' GovReport folder "
                                f"({TRAIN}, {VALIDATION})")
    schema = pq.read_schema(path)
    missing = [name for name in COLUMNS if name not in schema.names]
    if missing:
        raise ValueError(f"{path} lacks the column(s) {', '.join(missing)}: GovReport's parquet has "
                         f"{', '.join(COLUMNS)} (it holds {', '.join(schema.names)})")
    table = pq.read_table(path, columns=list(COLUMNS))
    columns = []
    for name in COLUMNS:
        column = table.column(name).combine_chunks()
        kind = column.type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) \
                or not pa.types.is_integer(kind.value_type):
            raise ValueError(f"{path}: column {name} is {kind}, not a list of integers")
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        if (lengths != seq_len).any():
            raise ValueError(f"{path}: column {name} has sequences of {sorted(set(lengths.tolist()))[:5]} tokens, "
                             f"not all {seq_len} (packed)")
        columns.append(column.flatten().to_numpy(zero_copy_only=False).astype(np.int32).reshape(-1, seq_len))
    return np.stack(columns, axis=1)


def write_split(path: Path, sequences: np.ndarray) -> None:
    """The same layout: (sequences, 2, seq_len) -> input_ids and labels columns of int64 lists."""
    table = pa.table({name: pa.array(list(sequences[:, i].astype(np.int64))) for i, name in enumerate(COLUMNS)})
    pq.write_table(table, path)


class PackedSamples(Dataset):
    """`length` training samples: the file's sequences in a fresh seeded order each pass over them, as the
    reference's Trainer reshuffles every epoch (1,024 steps at batch 8 are two passes over 3,901 sequences)."""

    def __init__(self, sequences: np.ndarray, length: int, seed: int):
        self.sequences, self.length, self.seed = sequences, length, seed
        self._order: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        epoch, index = divmod(i, len(self.sequences))
        if self._order is None or self._order[0] != epoch:
            self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.sequences))
        return torch.from_numpy(self.sequences[self._order[1][index]].astype(np.int64))


class Sequences(Dataset):
    def __init__(self, sequences: np.ndarray):
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.sequences[i].astype(np.int64))


def labelled_split(samples: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(batch, 2, seq) input ids and labels -> the model's input (every input id) and the targets: position t
    predicts labels[t + 1], the last position nothing (Hugging Face's shift, kept at the sequence's length)."""
    inputs, labels = samples[:, 0], samples[:, 1]
    return (inputs,), torch.cat((labels[:, 1:], torch.full_like(labels[:, :1], IGNORED)), dim=1)


def govreport_loaders(root: Path, seq_len: int, micro_batch: int, train_samples: int, eval_sequences: int,
                      seed: int, data_rank: int, data_world: int, workers: int = 0, pin_memory: bool = False,
                      eval_batch: int | None = None) -> TokenLoaders:
    train, validation = (read_split(Path(root, name), seq_len) for name in (TRAIN, VALIDATION))
    if len(validation) < eval_sequences:
        raise ValueError(f"{root}/{VALIDATION} holds {len(validation)} sequences; the eval scores {eval_sequences}")
    return token_loaders(PackedSamples(train, train_samples, seed), Subset(Sequences(validation), range(eval_sequences)),
                         micro_batch, data_rank, data_world, workers, pin_memory, eval_batch)


# --- the tiny preset's data: generated "reports" and their "summaries" in the same two files ------------------
#
# A report is on one of four subjects: a walk of that subject's Markov chain over its own 27 tokens (of 20..127)
# after a prompt token. Its summary, after a separator, names the subject: the subject's token (one of 4..7),
# SUMMARY_LENGTH times. Each example fills one sequence, as a GovReport report fills most of its 8,192 tokens.
# A model pretrained on reports alone (warm_start.py) has never seen a summary; the adapters learn to read the
# subject off the report (attention pools it) and write it. The eval scores the summaries only (prompt and
# report masked, the end token too), which the report determines: a model that learned them scores near 0.

TINY_VERSION = 3
TINY_VOCAB = 128
PROMPT, SEPARATOR, EOS = 1, 2, 3  # "### Summarize the following text:", "### Summary:", </s>
SUBJECT_FIRST, SUBJECTS, SUMMARY_LENGTH = 4, 4, 8
REPORT_FIRST, SUBJECT_TOKENS = 20, 27
TINY_TRAIN_SEQUENCES, TINY_VALIDATION_SEQUENCES = 256, 16


def tiny_report(rng: np.random.Generator, subject: int, length: int) -> np.ndarray:
    """A prompt token and a report of `length` tokens on `subject`."""
    chain = tiny_text.transitions(SUBJECT_TOKENS, 3, first=0, seed=27 + subject)
    body = tiny_text.walk(chain, int(rng.integers(SUBJECT_TOKENS)), length, rng)
    return np.concatenate(([PROMPT], REPORT_FIRST + subject * SUBJECT_TOKENS + body))


def tiny_examples(count: int, seq_len: int, seed: int, masked: bool) -> np.ndarray:
    """`count` examples (prompt + report, separator, summary, end), each exactly seq_len tokens, as
    (count, 2, seq_len) input ids and labels."""
    rng = np.random.default_rng(seed)
    report_length = seq_len - SUMMARY_LENGTH - 3
    rows = []
    for _ in range(count):
        subject = int(rng.integers(SUBJECTS))
        report = tiny_report(rng, subject, report_length)
        example = np.concatenate((report, [SEPARATOR], np.full(SUMMARY_LENGTH, SUBJECT_FIRST + subject), [EOS]))
        labels = example.copy()
        if masked:
            labels[:len(report) + 1] = IGNORED
            labels[-1] = IGNORED
        rows.append((example, labels))
    return np.array(rows)


def write_tiny_govreport(folder: Path, seq_len: int) -> None:
    write_split(folder / TRAIN, tiny_examples(TINY_TRAIN_SEQUENCES, seq_len, seed=1, masked=False))
    write_split(folder / VALIDATION, tiny_examples(TINY_VALIDATION_SEQUENCES, seq_len, seed=2, masked=True))


def ensure_tiny_govreport(seq_len: int) -> Path:
    return build_once(cache_root() / f"tiny-govreport-v{TINY_VERSION}-s{seq_len}",
                      lambda folder: write_tiny_govreport(folder, seq_len))
