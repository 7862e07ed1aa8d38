"""llama31_8b input: C4 tokenized with the Llama 3.1 tokenizer, in Megatron's indexed format, as MLCommons
distributes it (mlcommons/training `small_llm_pretraining/nemo/pretrain_llama31.py`, `get_data`): one training
file and the validation subset. Token ids reach 128,255, so the files hold int32 (the index says so).

Training samples are 8,193-token windows over the training file's stream, in a seeded shuffled order, with
plain causal attention across document boundaries (the reference's reset_attention_mask=False).

The eval scores the 1,024 validation sequences the reference scores, each once across the data ranks. Its README
says "the first 1,024, not shuffled"; its code does otherwise, and that code produced the RCPs. `get_data` gives
NeMo's PreTrainingDataModule the validation file as its own split (`paths["validation"]`) with the run's seed;
the module (nemo/collections/llm/gpt/data/pre_training.py, `build`) asks Megatron-Core's GPTDataset
(megatron/core/datasets/gpt_dataset.py, through blended_megatron_dataset_builder.py) for
(max_steps // val_check_interval + 1) x limit_val_batches x global batch samples, which it draws from as many
epochs of the file as that takes, documents and samples shuffled by numpy's RandomState(seed); each eval reads
dataset items 0..1,023 (limit_val_batches = ceil(1,024 / global batch) batches; the validation sampler starts at
0 every time). So the set depends on the seed and on that requested count:
workloads.common.megatron_data.megatron_eval_samples builds it, and reference_validation_samples gives the count.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from workloads.common import tiny_text
from workloads.common.cache import build_once, cache_root
from workloads.decoder.config import steps_per
from workloads.common.megatron_data import BlendedSamples, IndexedDataset, SequenceSamples, TokenLoaders, \
    megatron_eval_samples, require_datasets, token_loaders, write_markov_corpus

TRAIN = "c4-train.en_6_text_document"
VALIDATION = "c4-validation-91205-samples.en_text_document"


def reference_validation_samples(global_batch: int, max_steps: int, eval_interval: int, eval_sequences: int,
                                 framework: str = "nemo", eval_batch: int | None = None) -> int:
    """The samples the reference asks its validation split for, on which the scored sequences depend.

    gpt_oss_20b's (framework "megatron"): Megatron-LM's get_train_valid_test_num_samples (megatron/training/
    training.py) asks for (train_iters // eval_interval + 1) x eval_iters x GBS, with eval_interval = 12,288 / GBS
    and eval_iters = 1,024 / GBS steps (mlcommons/training small_llm_moe_pretraining/primus/config_*_1x8x1.sh):
    6,401,024 at GBS 64 for 1,200,000 steps.

    deepseekv3_671b's (framework "megatron", `eval_batch` 1,024): Megatron-Bridge, as Megatron-LM, asks for
    (train_iters // eval_interval + 1) x eval_iters x the eval's batch; its reference evaluates after every step,
    one batch of 1,024 sequences (config_GB300_*.sh: EVAL_CHECK_INTERVAL=1, EVAL_BATCHES=1, EVAL_BATCH_SIZE=1024,
    through its eval_batch_size.patch): 12,289,024 for its 12,000 steps. (The patch itself is not in the public
    index: docs/benchmarks/deepseekv3_671b.md says so.)

    llama31_8b's: pretrain_llama31.py (mlcommons/training small_llm_pretraining/nemo, as of 08d765e) sets the trainer's
    val_check_interval to ceil(eval_every / GBS) / GBS (a float: 12.0 at GBS 32, 0.75 at 128) and
    limit_val_batches to ceil(eval_tokens / GBS); NeMo's PreTrainingDataModule.build
    (nemo/collections/llm/gpt/data/pre_training.py) turns them into
    int((max_steps // val_check_interval + 1) x limit_val_batches x GBS): 102,401,024 at GBS 32 and
    409,601,024 at GBS 64 for max_steps 1,200,000."""
    every = steps_per(eval_interval, global_batch, framework)
    iters = steps_per(eval_sequences, eval_batch or global_batch, framework)
    if framework == "megatron":
        return (max_steps // every + 1) * iters * (eval_batch or global_batch)
    return int((max_steps // (every / global_batch) + 1) * iters * global_batch)


def c4_loaders(root: Path, seq_len: int, micro_batch: int, train_samples: int, eval_sequences: int, seed: int,
               data_rank: int, data_world: int, workers: int = 0, pin_memory: bool = False,
               eval_batch: int | None = None, validation_samples: int | None = None) -> TokenLoaders:
    """Loaders over the folder MLCommons distributes; a missing file is named with what the folder holds.

    The eval scores GPTDataset's items 0..eval_sequences-1 of the validation file, built with `seed` for
    `validation_samples` samples (reference_validation_samples; None: one epoch of the file)."""
    require_datasets(root, (TRAIN, VALIDATION), "MLCommons' C4 for Llama 3.1, llama31_8b's and gpt_oss_20b's")
    train = SequenceSamples(IndexedDataset(Path(root, TRAIN)), seq_len, seed)
    try:
        validation = megatron_eval_samples(IndexedDataset(Path(root, VALIDATION)), seq_len, validation_samples, seed,
                                           eval_sequences)
    except ValueError as e:
        raise ValueError(f"{root}/{VALIDATION} {e}") from None
    # One source, repeated as often as the run needs (BlendedSamples over one dataset cycles it).
    return token_loaders(BlendedSamples([train], [1.0], train_samples), validation, micro_batch, data_rank,
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
