"""GPT-3 input: MLPerf's C4 in Megatron's indexed format (workloads.common.megatron_data reads it), from two
training shards blended 0.5/0.5, and the tiny preset's generated text written in the same format.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from workloads.common import tiny_text
from workloads.common.cache import build_once, cache_root
from workloads.common.megatron_data import BlendedSamples, IndexedDataset, RandomTokens, SequenceSamples, \
    TokenLoaders, require_datasets, token_loaders, write_markov_corpus

# MLPerf's preprocessed C4 (SentencePiece): two training shards blended 0.5/0.5, and the validation subset.
C4_TRAIN = ("c4_en_6_c4_spm_text_document", "c4_en_7_c4_spm_text_document")
C4_EVAL = "c4_en_validation_subset_c4_spm_text_document"


def c4_loaders(root: Path, seq_len: int, micro_batch: int, train_samples: int, eval_sequences: int | None,
               seed: int, data_rank: int, data_world: int, workers: int = 0, pin_memory: bool = False,
               train_prefixes=C4_TRAIN, eval_prefix=C4_EVAL) -> TokenLoaders:
    """Loaders over MLPerf's C4 layout in `root`, cut as the reference cuts it (`--no-seq-len-plus-one-tokens`):
    disjoint samples of seq_len tokens, shuffled; the eval reads the whole validation set, its last sample
    padded, and the log's eval_samples counts its tokens (NVIDIA's: 11,590,004)."""
    require_datasets(root, (*train_prefixes, eval_prefix), "gpt3: MLPerf's C4")
    shards = [SequenceSamples(IndexedDataset(Path(root, p)), seq_len, seed + i, extra_token=False)
              for i, p in enumerate(train_prefixes)]
    train = BlendedSamples(shards, [1.0] * len(shards), train_samples)
    validation = SequenceSamples(IndexedDataset(Path(root, eval_prefix)), seq_len, seed=None, extra_token=False,
                                 keep_last=True)
    count = len(validation) if eval_sequences is None else min(eval_sequences, len(validation))
    loaders = token_loaders(train, torch.utils.data.Subset(validation, range(count)), micro_batch, data_rank,
                            data_world, workers, pin_memory)
    return replace(loaders, eval_tokens=validation.tokens_in(count))


def synthetic_loaders(vocab_size: int, seq_len: int, micro_batch: int, train_samples: int, eval_sequences: int,
                      seed: int, data_rank: int, data_world: int, workers: int = 0, pin_memory: bool = False
                      ) -> TokenLoaders:
    loaders = token_loaders(RandomTokens(vocab_size, seq_len, train_samples, seed, extra_token=False),
                            RandomTokens(vocab_size, seq_len, eval_sequences, seed + 1, extra_token=False), micro_batch,
                            data_rank, data_world, workers, pin_memory)
    return replace(loaders, eval_tokens=eval_sequences * seq_len)


# The tiny preset's text: a Markov chain over a small vocabulary, where each token has a few likely
# successors. Its entropy (about 2.4 nats per token) sits below the 2.69 target, so the target is reachable,
# and well below a uniform guess (ln 128 = 4.85), so reaching it takes real learning.
TINY_VERSION = 1
TINY_VOCAB = 128
TINY_SUCCESSORS = 16
TINY_DOC_TOKENS = 2048
EOD = 0


def tiny_transitions() -> np.ndarray:
    return tiny_text.transitions(TINY_VOCAB, TINY_SUCCESSORS)


def tiny_entropy() -> float:
    """The chain's entropy rate in nats per token: the lowest log perplexity any model can reach."""
    return tiny_text.entropy_rate(tiny_transitions())


def write_tiny_corpus(folder: Path) -> None:
    write_markov_corpus(folder, tiny_transitions(), [(C4_TRAIN[0], 96, 1), (C4_TRAIN[1], 96, 2), (C4_EVAL, 24, 3)],
                        TINY_DOC_TOKENS, EOD, np.uint16)


def tiny_corpus_root() -> Path:
    return cache_root() / f"tiny-c4-v{TINY_VERSION}"


def ensure_tiny_corpus() -> Path:
    return build_once(tiny_corpus_root(), write_tiny_corpus)
