"""The untimed init, as the rules bound it: the dataset is first touched after run_start, and an init that
failed and was retried keeps its first init_start, so the init limit sees every attempt.

Each test runs the real campaign (workloads.common.campaign.run_campaign) in this process, in a one-process
gloo world, on a few rows of generated data: cheap, and any reader can be instrumented.
"""

from __future__ import annotations

import time
from pathlib import Path

import h5py
import pytest
import torch
from mlperf_logging.mllog import constants as C

from harness.results.parse import iter_events
from tests.conftest import compliance, failed_checks
from workloads.bert.config import PRESETS as BERT_PRESETS
from workloads.bert.data import write_tiny_dataset
from workloads.bert.model import Bert
from workloads.common import mlperf
from workloads.common.campaign import RunOptions, run_campaign
from workloads.registry import BENCHMARKS


def tiny_bert_inputs(folder):
    """A few rows of the tiny preset's data and a starting checkpoint of its shape: the worker's arguments."""
    tiny = BERT_PRESETS["tiny"]
    write_tiny_dataset(folder / "data", tiny.model.vocab_size, tiny.model.max_seq_len, tiny.max_predictions,
                       shards=1, shard_rows=128, eval_rows=16)
    torch.manual_seed(0)
    torch.save({"model": Bert(tiny.model).state_dict()}, folder / "init.pt")
    return ["--data", str(folder / "data"), "--init-checkpoint", str(folder / "init.pt")]


# Per benchmark: the arguments of a one-step run on a few rows of data, and the functions through which it opens
# its dataset's files (each takes the path first). Only bert's workload opens its data after run_start so far:
# resnet, gpt3 and llama31_8b build their loaders in their constructors (each lists or indexes its files there),
# so they are not listed until they move that into Workload.open_data().
ONE_STEP_RUNS = {"bert": (tiny_bert_inputs, ((h5py, "File"), (h5py, "is_hdf5")))}


@pytest.mark.slow
@pytest.mark.parametrize("bench", sorted(ONE_STEP_RUNS))
def test_nothing_reads_the_dataset_between_init_start_and_run_start(bench, tmp_path, monkeypatch,
                                                                    one_process_world):
    """Every open of a file under the data folder is recorded with the last MLLOG key logged before it: none may
    fall between init_start and run_start, and some must come after (the run did read, through these readers)."""
    inputs, readers = ONE_STEP_RUNS[bench]
    args = inputs(tmp_path)
    data = (tmp_path / "data").resolve()
    logged: list[str] = []
    reads: list[tuple[str, str]] = []  # (file, the last key logged when it was opened)

    for name in ("event", "start", "end"):
        def logging_key(self, key, *a, _original=getattr(mlperf.ResultLog, name), **kw):
            logged.append(key)
            return _original(self, key, *a, **kw)
        monkeypatch.setattr(mlperf.ResultLog, name, logging_key)
    for module, name in readers:
        def reader(path, *a, _original=getattr(module, name), **kw):
            if data in Path(path).resolve().parents:
                reads.append((str(path), logged[-1] if logged else "nothing"))
            return _original(path, *a, **kw)
        monkeypatch.setattr(module, name, reader)

    opts = RunOptions.parse([bench, "--out", str(tmp_path / "out"), "--max-steps", "1", "--seed", "1",
                             "--straggler-window", "0", *args])
    run_campaign(BENCHMARKS[bench].workload_class(), opts)

    assert C.INIT_START in logged and C.RUN_START in logged and C.RUN_STOP in logged
    during_init = set(logged[logged.index(C.INIT_START):logged.index(C.RUN_START)])
    assert reads, "the run never opened its data: the instrumented readers miss how it reads"
    early = [(path, key) for path, key in reads if key in during_init]
    assert not early, f"{bench} opened its dataset during the untimed init: {early}"


class FailedInit(RuntimeError):
    pass


@pytest.mark.slow
def test_a_failed_init_keeps_its_init_start_and_the_log_still_passes_the_checker(tmp_path, monkeypatch,
                                                                                  one_process_world):
    """Attempt 0's workload fails in its constructor (after init_start); attempt 1 (as the elastic agent restarts
    it) builds it and trains one step. The log keeps what attempt 0 wrote and its init_start, the only one, so the
    init limit counts from there; each key the checker wants once is there once, and the checker passes it."""
    args = tiny_bert_inputs(tmp_path)
    opts = RunOptions.parse(["bert", "--out", str(tmp_path / "out"), "--max-steps", "1", "--straggler-window", "0",
                             *args])
    bert = BENCHMARKS["bert"].workload_class()
    failed_at = []

    class FailsInInit(bert):
        def __init__(self, *a, **kw):
            failed_at.append(time.time())
            raise FailedInit("the init failed")

    with pytest.raises(FailedInit):
        run_campaign(FailsInInit, opts)
    torch.distributed.destroy_process_group()
    log_path = tmp_path / "out" / "result_0.txt"
    first = log_path.read_bytes()
    monkeypatch.setenv("HARNESS_ATTEMPT", "1")
    run_campaign(bert, opts)

    text = log_path.read_bytes()
    assert text.startswith(first)  # what attempt 0 logged is kept
    events = list(iter_events(text))
    init_starts = [e for e in events if e["key"] == C.INIT_START]
    assert len(init_starts) == 1 and init_starts[0]["time_ms"] <= failed_at[0] * 1000
    seeds = {e["value"] for e in events if e["key"] == C.SEED}
    assert len(seeds) == 1  # the retried init trains the run it started
    checked = compliance(log_path, BENCHMARKS["bert"].ruleset, cwd=tmp_path)
    assert checked.returncode == 0 and not failed_checks(checked), checked.stdout + checked.stderr


def test_a_retried_init_refuses_a_key_whose_value_changed(tmp_path):
    """A retried init logs only what its failed predecessor did not, and cannot log a second, different value."""
    path = tmp_path / "result_0.txt"
    log = mlperf.ResultLog(path)
    log.events({C.GLOBAL_BATCH_SIZE: 256, C.OPT_BASE_LR: 3.5e-4})
    log.close()
    logged = mlperf.logged_run(path)
    assert logged.values == {C.GLOBAL_BATCH_SIZE: 256, C.OPT_BASE_LR: 3.5e-4}
    log = mlperf.ResultLog(path)
    log.events({C.GLOBAL_BATCH_SIZE: 256, C.GRADIENT_ACCUMULATION_STEPS: 1}, logged.values)
    with pytest.raises(SystemExit, match="an earlier, failed init of this run logged opt_base_learning_rate "
                                         "0.00035; this one has 0.0004"):
        log.events({C.OPT_BASE_LR: 4e-4}, logged.values)
    log.close()
    assert [e["key"] for e in iter_events(path.read_bytes())] == [
        C.GLOBAL_BATCH_SIZE, C.OPT_BASE_LR, C.GRADIENT_ACCUMULATION_STEPS]
