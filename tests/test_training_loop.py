"""The one training loop (workloads/common/loop.py), driven by a counting workload: blocks, evaluations,
resuming inside and at the end of a block, the loss read every few steps, and a rate without saves.
The real workloads run through it in test_resnet_campaign, test_bert, test_gpt3 and test_resilience."""

from __future__ import annotations

import math
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from mlperf_logging.mllog import constants as C

from workloads.common import loop
from workloads.common.loop import LOSS_READ_EVERY, Target, train
from workloads.common.resilience import Block


class Log:
    """What the loop writes to the MLPerf log, as (kind, key, value or metadata)."""

    def __init__(self):
        self.lines = []

    def start(self, key, metadata=None):
        self.lines.append(("start", key, metadata))

    def end(self, key, metadata=None):
        self.lines.append(("end", key, metadata))

    def event(self, key, value, metadata=None):
        self.lines.append(("event", key, value))

    def keys(self):
        return [key for _, key, _ in self.lines]


class Support:
    """Resilience's side of the loop, without a process group or a disk."""

    def __init__(self, resume_at=0, block=None, save_seconds_per_step=0.0):
        self.resume_at, self.block, self.save_seconds = resume_at, block, 0.0
        self.per_step, self.losses, self.evals = save_seconds_per_step, [], []

    def restore(self):
        return self.resume_at

    def after_step(self, step, loss):
        self.losses.append((step, loss))
        self.save_seconds += self.per_step

    @contextmanager
    def phase(self, kind, step):
        self.evals.append(step)
        yield


class Counting:
    """Steps of 10 samples; an evaluation every 4 steps; the quality is the step / 10."""

    logs_trained_samples = True
    rate_shown = ("samples/s", "throughput")
    eval_count_key = C.EPOCH_NUM
    eval_also_logged_as = ()

    def __init__(self, total_steps=10, target=2.0, losses=None, synthetic=False):
        self.ctx = SimpleNamespace(device=torch.device("cpu"), is_main=False)
        self.opts = SimpleNamespace(synthetic=synthetic)
        self.total_steps, self.target = total_steps, Target("quality", "q", target)
        self.losses, self.trained = losses or {}, []

    def batches(self, step):
        self.resumed = step
        return iter(range(step + 1, self.total_steps + 1))

    def train_step(self, batches):
        step = next(batches)
        self.trained.append(step)
        return torch.tensor(self.losses.get(step, 1.0 / step)), 10

    def evaluate(self):
        return self.trained[-1] / 10 if self.trained else self.resumed / 10

    def epoch_num(self, step):
        return step * 10

    def next_block(self, step):
        first = step - step % 4
        return Block(first * 10, min(4, self.total_steps - first) * 10)

    def block_ends(self, step):
        return step % 4 == 0

    def tracked_stats(self, samples_per_second):
        return {"throughput": samples_per_second}

    def step_starts(self, step, mlog):
        pass

    def step_ended(self, step, mlog, last):
        pass


def blocks(log):
    return [(kind, meta[C.FIRST_EPOCH_NUM]) for kind, key, meta in log.lines if key in (C.BLOCK_START, C.BLOCK_STOP)]


def test_blocks_close_with_an_evaluation_until_the_step_limit():
    log, support = Log(), Support()
    assert train(Counting(total_steps=10, target=5.0), log, "run", support) is False
    assert blocks(log) == [("start", 0), ("end", 0), ("start", 40), ("end", 40), ("start", 80), ("end", 80)]
    assert support.evals == [4, 8, 10]  # the last, short block is evaluated too
    starts = [meta for _, key, meta in log.lines if key == C.BLOCK_START]
    assert [s[C.EPOCH_COUNT] for s in starts] == [40, 40, 20]
    assert log.lines[-1] == ("event", C.TRAIN_SAMPLES, 100)


def test_the_run_stops_at_the_first_evaluation_that_reaches_the_target():
    log, support = Log(), Support()
    assert train(Counting(total_steps=20, target=0.8), log, "run", support) is True
    assert support.evals == [4, 8]
    assert ("event", C.EVAL_ACCURACY, 0.8) in log.lines
    assert log.lines[-1] == ("event", C.TRAIN_SAMPLES, 80)


def test_a_synthetic_run_trains_to_its_step_limit_whatever_its_eval_says(monkeypatch):
    """Synthetic input measures throughput: an eval that happens to pass the target must not cut it short."""
    said = []
    monkeypatch.setattr(loop.Progress, "message", lambda self, text: said.append(text))
    log, support = Log(), Support()
    workload = Counting(total_steps=20, target=0.8, synthetic=True)
    assert train(workload, log, "run", support) is False
    assert workload.trained == list(range(1, 21)) and support.evals == [4, 8, 12, 16, 20]
    assert "(synthetic input: no target)" in said[1] and "target 0.8" not in " ".join(said)


def test_a_run_resumed_inside_a_block_continues_it():
    log, workload = Log(), Counting(total_steps=8, target=5.0)
    support = Support(resume_at=6, block=Block(40, 40))
    train(workload, log, "run", support)
    assert workload.trained == [7, 8]  # the input continues where the checkpoint left it
    assert blocks(log) == [("end", 40)]  # no second block_start for the open block
    assert support.evals == [8]


def test_a_run_resumed_after_the_step_that_closes_a_block_evaluates_first():
    log, workload = Log(), Counting(total_steps=8, target=5.0)
    support = Support(resume_at=4)
    train(workload, log, "run", support)
    assert support.evals == [4, 8]
    assert blocks(log) == [("start", 40), ("end", 40)]


def test_a_run_resumed_after_its_last_step_evaluates_before_it_stops():
    """Killed during the final evaluation of a run whose last step closes no regular block: the resumed
    attempt evaluates, and can still reach the target."""
    log, workload = Log(), Counting(total_steps=10, target=0.95)
    support = Support(resume_at=10, block=Block(80, 20))
    assert train(workload, log, "run", support) is True
    assert support.evals == [10] and workload.trained == []


def test_the_loss_is_read_every_few_steps_and_a_nan_between_reads_is_caught():
    workload = Counting(total_steps=2 * LOSS_READ_EVERY + 3, target=5.0, losses={LOSS_READ_EVERY + 2: math.nan})
    workload.block_ends = lambda step: False  # one block: reads only every LOSS_READ_EVERY steps and at the end
    support = Support()
    train(workload, Log(), "run", support)
    read = {step: loss for step, loss in support.losses if loss is not None}
    assert sorted(read) == [LOSS_READ_EVERY, 2 * LOSS_READ_EVERY, 2 * LOSS_READ_EVERY + 3]
    assert read[LOSS_READ_EVERY] == pytest.approx(1 / LOSS_READ_EVERY)
    assert math.isnan(read[2 * LOSS_READ_EVERY])  # the NaN of an unread step shows at the next read
    assert read[2 * LOSS_READ_EVERY + 3] == pytest.approx(1 / (2 * LOSS_READ_EVERY + 3))


def test_a_step_whose_loss_is_not_read_adds_no_torch_operation():
    """The loop's own cost per step (bench/loop_overhead.py): between reads the loss is only kept."""
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    reader, losses = loop._LossReader(), [torch.tensor(value) for value in (1.0, math.nan, 2.0)]
    with Count():
        for loss in losses:
            assert reader.after(loss, read=False) is None
    assert Count.calls == 0
    assert math.isnan(reader.after(torch.tensor(3.0), read=True))  # the unread NaN is still caught
    assert reader.after(torch.tensor(4.0), read=True) == 4.0


def test_the_block_rate_leaves_checkpoint_saves_out(monkeypatch):
    def rate(save_seconds_per_step):
        ticks = iter(range(0, 100, 10))  # the block opens at 0 and closes at 10 s
        monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
        log = Log()
        train(Counting(total_steps=4, target=5.0), log, "run", Support(save_seconds_per_step=save_seconds_per_step))
        return next(value for _, key, value in log.lines if key == "tracked_stats")["throughput"]

    # The clock restarts after the attempt's first step (which compiles): 3 steps of 10 samples in 10 s.
    assert rate(0.0) == pytest.approx(30 / 10)
    assert rate(1.5) == pytest.approx(30 / (10 - 4 * 1.5))  # 6 of those 10 s went to saves


def test_a_finished_runs_loader_workers_end_when_the_campaign_closes_it(one_rank_world, tmp_path, monkeypatch):
    """GPT-3's persistent loader workers live as long as the workload, which reference cycles keep past its
    run: the campaign closes each run's workload, and its workers end then, at once. Left to the garbage
    collector, the loaders' queues close before the loaders can tell their workers to stop, and each worker
    costs a join timeout (5 s in torch, 60 s here): the event waited for is every worker gone, with a
    deadline of half a timeout."""
    import gc
    import multiprocessing
    import time

    import torch.utils.data._utils as loader_utils
    from dataclasses import replace

    from workloads.common.campaign import RunOptions
    from workloads.gpt3.config import PRESETS
    from workloads.gpt3.train import GPT3Workload

    monkeypatch.setattr(loader_utils, "MP_STATUS_CHECK_INTERVAL", 60.0)
    options = RunOptions(benchmark="gpt3", preset="tiny", out=tmp_path, runs=1, seed=0, submitter="test",
                         system=None, data=None, synthetic=True, max_steps=2, batch_size=None)
    monkeypatch.setitem(PRESETS, "tiny", replace(PRESETS["tiny"], loader_workers=2))
    workload = GPT3Workload(options, one_rank_world, seed=0)
    workload.open_data()  # after run_start in a real run
    next(workload.batches(0))
    workers = multiprocessing.active_children()
    assert len(workers) == 2
    started = time.monotonic()
    workload.close()
    del workload
    gc.collect()
    assert time.monotonic() - started < 30 and [w.exitcode for w in workers] == [0, 0]
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_the_inits_objects_are_frozen_while_the_run_trains_and_given_back_after(one_process_world, tmp_path):
    """What the init leaves alive (torch's modules, the model: hundreds of thousands of objects) is out of the
    cyclic collector's reach while the run trains, so no full collection scans it inside a step (a pause of
    about 0.2 s in the tiny ResNet's process, docs/measured.md); after the run it is given back, so the
    campaign's collect frees the run's workload, reference cycles and all."""
    import gc
    import weakref

    from workloads.common.campaign import RunOptions, run_campaign
    from workloads.resnet.train import ResNetWorkload

    frozen_in_steps, workloads, frozen_at_open = [], [], []

    class Recording(ResNetWorkload):
        def open_data(self):  # after run_start: what it builds (here 1,000 lists) is frozen before the steps
            frozen_at_open.append(gc.get_freeze_count())
            self.listed = [[i] for i in range(1000)]
            return super().open_data()

        def train_step(self, batches):
            if not workloads:
                workloads.append(weakref.ref(self))
            frozen_in_steps.append(gc.get_freeze_count())
            return super().train_step(batches)

    run_campaign(Recording, RunOptions.parse(["resnet", "--out", str(tmp_path), "--synthetic", "--max-steps", "2",
                                              "--seed", "1", "--straggler-window", "0"]))
    assert len(frozen_in_steps) == 2 and frozen_at_open[0] > 10_000
    assert min(frozen_in_steps) >= frozen_at_open[0] + 900  # (a few frozen objects die by refcount meanwhile)
    assert gc.get_freeze_count() == 0 and workloads[0]() is None


@pytest.mark.parametrize("every, first, total", [(4, None, 18), (4, 4, 16), (1, 43, 60), (8, 40, 43), (5, 2, 2)])
def test_an_evaluation_block_runs_from_the_evaluation_at_or_before_a_step_to_the_next(every, first, total):
    """evaluation_block, the one rule the decoders, GPT-3 and flux1 share: each block begins at an evaluation's step
    (or 0) and ends at the next (the first at `first`, then every `every`) or at the last step, in the log's unit."""
    from workloads.common.resilience import evaluation_block

    evaluations = sorted({s for s in range(1, total + 1)
                          if s >= (first or every) and (s - (first or every)) % every == 0} | {total})
    for step in range(total):
        start = max([0] + [e for e in evaluations if e <= step])
        end = min(e for e in evaluations if e > step)
        assert evaluation_block(step, every, total, 3, first) == Block(3 * start, 3 * (end - start)), step
