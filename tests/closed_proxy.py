"""One rank of a closed (full-preset) campaign with a small model in place of BERT-large, GPT-3 175B, Llama 3.1 8B,
gpt-oss 20B, Llama 2 70B, DeepSeek-V3 671B or FLUX.1-schnell, which no CPU trains even for one step. Used only by
tests, through torchrun.

Only the model's size changes. Everything the closed rules look at stays the full preset's: the
hyperparameters (for bert, those of an MLPerf reference point), the schedule, the sequence length,
the eval cadence and the logging. GPT-3 also keeps its global batch of 1536 sequences, llama31_8b its 64
and its 1,024 eval sequences of 8,192 tokens (its proxy is the narrowest Llama: attention over 8,192
positions costs in proportion to its heads: one per tensor rank, of 16 dimensions, the fastest on CPU),
llama2_70b_lora its 8 and its 173, with the same Llama at Llama 2's RoPE; flux1 an RCP row's batch and the rules'
evaluation_frequency.

ResNet keeps ResNet-50; its synthetic images shrink to 8 px, so that one process can hold the global batch of a
real submission (57,344 for NVIDIA+CoreWeave: 11 MB, not 8.6 GB at 224 px). No key the rules read depends on the
image size. With --until-run-start (this script's own option) the run logs its init and hyperparameters up to
run_start and trains nothing: it stops there, aborted.
"""

import dataclasses
import sys

from workloads.bert import config as bert
from workloads.common import campaign
from workloads.gpt3 import config as gpt3
from workloads.decoder import config as llama
from workloads.flux import config as flux
from workloads.resnet import config as resnet

BERT_MODEL = bert.BertConfig(vocab_size=128, max_seq_len=512, n_layer=1, n_head=2, d_model=32, d_ff=64)
GPT3_MODEL = gpt3.GPTConfig(vocab_size=128, seq_len=2048, n_layer=1, n_head=2, d_model=32)
# llama31_8b's has no transformer block: what the proxy checks (the closed keys, the 1,024-sequence eval the
# rules fix, the checker) does not depend on it, and attention over 8,192 tokens was three quarters of its time.
LLAMA_MODEL = llama.DecoderConfig(vocab_size=128, seq_len=8192, n_layer=0, n_head=2, n_kv_head=2, d_model=32,
                                ffn_hidden=32)
# llama2_70b_lora's keeps one, for its adapters to train.
LLAMA2_MODEL = dataclasses.replace(LLAMA_MODEL, n_layer=1, rope_theta=10_000.0, rope_scaling=None)
# gpt_oss_20b's has no block either; it keeps its experts' config, so its layout splits them (expert_parallelism).
GPT_OSS_MODEL = dataclasses.replace(LLAMA_MODEL, rope_scaling=None, moe=llama.MoeConfig(experts=8, top_k=2, hidden=32))
# deepseekv3_671b's is the tiny DeepSeek at the rules' 4,096 tokens, in 2 pipeline stages (the full preset's 8 need
# 8 processes): its runs stop at run_start (--until-run-start), since one step of 16,384 sequences is 67M tokens.
DEEPSEEK_MODEL = dataclasses.replace(llama.DEEPSEEK_TINY, seq_len=4096)
# flux1's: one double block over one image token (a 2 x 2 latent) and one text token, so that a CPU trains the closed
# rules' evaluation_frequency (262,144 samples: 64 steps of the RCP row 4,096, each one micro batch) in seconds. Its
# loss cannot reach 0.586: the target is the one check its log fails. The set sizes shrink too (the closed rules read
# train_samples and eval_samples only as present).
FLUX_MODEL = flux.FluxConfig(vec_in_dim=8, context_in_dim=8, hidden_size=16, num_heads=1, depth=1,
                             depth_single_blocks=0, axes_dim=(4, 6, 6))
FLUX_SETS = {"text_tokens": 1, "latent_size": 2, "train_samples": 4096, "eval_samples": 64}
RESNET_CROP = 8
UNTIL_RUN_START = "--until-run-start"

if __name__ == "__main__":
    bert.PRESETS["full"] = dataclasses.replace(bert.PRESETS["full"], model=BERT_MODEL)
    gpt3.PRESETS["full"] = dataclasses.replace(gpt3.PRESETS["full"], model=GPT3_MODEL,
                                               pipeline_parallel=1)  # the proxy runs on 1 process
    llama.PRESETS["full"] = dataclasses.replace(llama.PRESETS["full"], model=LLAMA_MODEL)
    llama.LORA_PRESETS["full"] = dataclasses.replace(llama.LORA_PRESETS["full"], model=LLAMA2_MODEL)
    llama.GPT_OSS_PRESETS["full"] = dataclasses.replace(llama.GPT_OSS_PRESETS["full"], model=GPT_OSS_MODEL)
    llama.DEEPSEEK_PRESETS["full"] = dataclasses.replace(llama.DEEPSEEK_PRESETS["full"], model=DEEPSEEK_MODEL,
                                                         pipeline_parallel=2)
    resnet.PRESETS["full"] = dataclasses.replace(resnet.PRESETS["full"], crop=RESNET_CROP)
    flux.PRESETS["full"] = dataclasses.replace(flux.PRESETS["full"], model=FLUX_MODEL, **FLUX_SETS,
                                               max_micro_batch=4096, eval_batch=64, loader_workers=0)
    if UNTIL_RUN_START in sys.argv:
        sys.argv.remove(UNTIL_RUN_START)
        campaign.train = lambda *args: False  # the run stops at run_start, not reaching its target
    from workloads.__main__ import main

    sys.exit(main())
