"""llama31_8b input: C4 tokenized with the Llama 3.1 tokenizer, in Megatron's indexed format, as MLCommons
distributes it (mlcommons/training `small_llm_pretraining/nemo/pretrain_llama31.py`, `get_data`): one training
file and the validation subset. Token ids reach 128,255, so the files hold int32 (the index says so).

Training samples are 8,193-token windows over the training file's stream, in a seeded shuffled order, with
plain causal attention across document boundaries (the reference's reset_attention_mask=False). The eval is
the first 1,024 validation windows, in order, each scored once across the data ranks. (The reference's README
says the validation set is not shuffled; its data module shuffles it by the seed. We take the README's word:
the same 1,024 sequences for every seed, so runs are comparable.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from workloads.common import tiny_text
from workloads.common.cache import build_once, cache_root
from workloads.common.megatron_data import BlendedSamples, IndexedDataset, SequenceSamples, TokenLoaders, \
    require_datasets, token_loaders, write_markov_corpus

TRAIN = "c4-train.en_6_text_document"
VALIDATION = "c4-validation-91205-samples.en_text_document"


def c4_loaders(root: Path, seq_len: int, micro_batch: int, train_samples: int, eval_sequences: int, seed: int,
               data_rank: int, data_world: int, workers: int = 0, pin_memory: bool = False,
               eval_batch: int | None = None) -> TokenLoaders:
    """Loaders over the folder MLCommons distributes; a missing file is named with what the folder holds."""
    require_datasets(root, (TRAIN, VALIDATION), "llama31_8b: MLCommons' C4 for Llama 3.1")
    train = SequenceSamples(IndexedDataset(Path(root, TRAIN)), seq_len, seed)
    validation = SequenceSamples(IndexedDataset(Path(root, VALIDATION)), seq_len, seed=None)
    if len(validation) < eval_sequences:
        raise ValueError(f"{root}/{VALIDATION} holds {len(validation)} sequences of {seq_len + 1} tokens; the eval "
                         f"scores {eval_sequences}")
    # One source, repeated as often as the run needs (BlendedSamples over one dataset cycles it).
    return token_loaders(BlendedSamples([train], [1.0], train_samples),
                         torch.utils.data.Subset(validation, range(eval_sequences)), micro_batch, data_rank,
                         data_world, workers, pin_memory, eval_batch)


# The tiny preset's text: a Markov chain where each token has 3 likely successors. Its entropy (see
# tiny_entropy) sits below the tiny target, and the open-division rules ask for an eval log perplexity
# under 1.0 (compliance_checker/training_6.1.0/open_llama31_8b.yaml), far below a uniform guess (ln 128).
TINY_VERSION = 1
TINY_VOCAB = 128
TINY_SUCCESSORS = 3
TINY_DOC_TOKENS = 1024
EOD = 0


def tiny_transitions() -> np.ndarray:
    return tiny_text.transitions(TINY_VOCAB, TINY_SUCCESSORS, seed=11)


def tiny_entropy() -> float:
    """The chain's entropy rate in nats per token: the lowest log perplexity any model can reach."""
    return tiny_text.entropy_rate(tiny_transitions())


def write_tiny_corpus(folder: Path) -> None:
    """The real file names and dtype (int32), generated text inside."""
    write_markov_corpus(folder, tiny_transitions(), [(TRAIN, 64, 1), (VALIDATION, 24, 2)], TINY_DOC_TOKENS, EOD,
                        np.int32)


def ensure_tiny_corpus() -> Path:
    return build_once(cache_root() / f"tiny-llama-c4-v{TINY_VERSION}", write_tiny_corpus)
