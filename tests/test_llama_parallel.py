"""The decoders' parallel layouts on CPU (gloo), each against the whole model in one process
(tests/llama_parallel_worker.py): tensor parallel 2, context parallel 2 (the all-gather path the GPUs take
too), HSDP (replicate 2 x shard 2), and context x tensor together; llama2_70b_lora's adapters on a frozen
base under FSDP 2 x tensor 2 and context 2 x tensor 2; expert parallel 2 and 4 for a model with experts,
with uneven and empty experts and with a multi-token prediction depth; and a DeepSeek-V3-like model under expert and context parallel and HSDP."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # real multi-process training steps

# (replicate, shard, context, tensor) over 4 processes; "2,1,2,1" is the full preset's shape at scale (replicas
# of context groups), on the smallest world
LAYOUTS = ("1,2,1,2", "1,2,2,1", "2,2,1,1", "1,1,2,2", "2,1,2,1", "lora:1,2,1,2", "lora:1,1,2,2")
# gpt-oss-like (experts, a sliding window), its experts split over E ranks (the fifth number): expert parallel 2
# with FSDP sharding each rank's experts over 2 more (1,4,1,1,2), under HSDP, beside context parallel, over all 4
# ranks; routed to the first 3 experts only, so that an expert, and under expert parallel 4 three ranks, get none;
# with activation checkpointing, which runs each block's all-to-alls again in backward; and with a DeepSeek-V3
# multi-token prediction depth (an MoE block whose experts split too) under FSDP 4 x expert parallel 2.
MOE_LAYOUTS = ("moe:1,4,1,1,2", "moe:2,2,1,1,2", "moe:1,2,2,1,2", "moe:1,4,1,1,4", "moe-idle:1,4,1,1,4",
               "moe-idle:1,4,1,1,2", "moe-recompute:1,2,2,1,2", "moe-mtp:1,4,1,1,2")

# DeepSeek-V3-like (MLA, YaRN, a dense first layer, the sigmoid router with its bias, a shared expert, the balance
# loss): expert parallel 2 beside context parallel 2 (the balance loss counts each sequence over its context ranks),
# and under HSDP; the expert bias update after the step too.
DEEPSEEK_LAYOUTS = ("deepseek:1,2,2,1,2", "deepseek:2,2,1,1,2")


@pytest.mark.parametrize("layouts", [LAYOUTS, MOE_LAYOUTS, DEEPSEEK_LAYOUTS], ids=["dense", "experts", "deepseek"])
def test_every_layout_matches_the_whole_model(layouts):
    """The initial weights drawn from one seed, the loss over 2 accumulated micro batches, every gradient, one
    clipping norm over every mesh, and the eval's scored loss, for each layout in turn in one 4-process job."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(REPO / "tests" / "llama_parallel_worker.py"), *layouts], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    for layout in layouts:
        assert proc.stdout.count(f"parity ok {layout}") == 4, proc.stdout
