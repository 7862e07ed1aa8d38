"""torch.compile changes how a step runs, not what it computes: the compiled step of each workload (DDP
compiled whole for ResNet and BERT, GPT-3 compiled block by block under FSDP2) gives the eager step's losses.
On CPU, where `--compile auto` runs eagerly, `on` forces it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from workloads.bert.train import BertWorkload
from workloads.common.campaign import RunOptions, seed_everything
from workloads.gpt3.train import GPT3Workload
from workloads.resnet.train import ResNetWorkload

pytestmark = pytest.mark.slow  # real multi-process or compiled training steps

WORKLOADS = {"resnet": ResNetWorkload, "bert": BertWorkload, "gpt3": GPT3Workload}
STEPS = 3


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_compiled_steps_give_the_eager_losses(one_rank_world, tmp_path, name):
    options = RunOptions(benchmark=name, preset="tiny", out=tmp_path, runs=1, seed=0, submitter="test",
                         system=None, data=None, synthetic=True, max_steps=STEPS, batch_size=None)
    losses = {}
    for choice in ("off", "on"):
        torch._dynamo.reset()
        seed_everything(0)
        workload = WORKLOADS[name](replace(options, compile=choice), one_rank_world, seed=0)
        assert workload.compiled == (choice == "on")
        workload.open_data()  # after run_start in a real run
        batches = workload.batches(0)
        losses[choice] = [workload.train_step(batches)[0].item() for _ in range(STEPS)]
    assert losses["on"] == pytest.approx(losses["off"], rel=1e-4)
    assert len(set(losses["off"])) == STEPS  # the steps trained: the weights moved
