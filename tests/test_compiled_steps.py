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


def test_the_straggler_hooks_leave_the_compiled_ddp_steps_alone(one_rank_world, tmp_path):
    """torch.compile of a DDP module compiles every Python frame its forward runs, so the straggler watch's forward
    hooks on the inner module were compiled too: dynamo guarded on the time they store and on the length of their
    list, and recompiled them every step (two more graphs a step on the tiny ResNet) until its recompile limit. The
    hooks run eagerly: after the first step, no step compiles anything, and no hook has compiled code."""
    import inspect

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    from workloads.common.resilience_options import StragglerWindow
    from workloads.common.run_record import RunRecord
    from workloads.common.stragglers import StragglerWatch

    options = RunOptions(benchmark="resnet", preset="tiny", out=tmp_path, runs=1, seed=0, submitter="test",
                         system=None, data=None, synthetic=True, max_steps=6, batch_size=None, compile="on")
    torch._dynamo.reset()
    counters.clear()
    workload = ResNetWorkload(options, one_rank_world, seed=0)
    watch = StragglerWatch(workload.model, one_rank_world, RunRecord(None, 0), StragglerWindow.parse("60"))
    workload.open_data()
    batches = workload.batches(0)
    workload.train_step(batches)  # compiles the model's forward and backward
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for _ in range(5):
        workload.train_step(batches)
    assert counters["stats"]["unique_graphs"] == graphs, "a step after the first compiled a graph"
    for hook in (StragglerWatch._before, StragglerWatch._after):
        assert not _debug_get_cache_entry_list(inspect.unwrap(hook).__code__), f"{hook.__name__} was compiled"
    assert len(watch._events) == 6  # the hooks still timed every forward
    watch.close()
