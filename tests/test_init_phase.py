"""The untimed init, as the rules bound it: the dataset is first touched after run_start (and a dataset refused
there ends the run's log aborted), and an init that failed and was retried keeps its first init_start, so the
init limit sees every attempt.

Each test runs the real campaign (workloads.common.campaign.run_campaign) in this process, in a one-process
gloo world, on a few rows of generated data: cheap, and any reader can be instrumented.
"""

from __future__ import annotations

import builtins
import os
import time
from pathlib import Path

import h5py
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from mlperf_logging.mllog import constants as C

from harness.results.parse import iter_events
from harness.results.rules import holding
from tests.conftest import compliance, failed_checks
from tests.test_resnet_campaign import _write_images
from workloads.bert.config import PRESETS as BERT_PRESETS
from workloads.bert.data import write_tiny_dataset
from workloads.bert.model import Bert
from workloads.common import mlperf
from workloads.common import campaign
from workloads.common.campaign import RunOptions, run_campaign
from workloads.common.refusals import ConfigurationError
from workloads.gpt3.config import PRESETS as GPT3_PRESETS
from workloads.gpt3.data import write_tiny_corpus as write_gpt3_corpus
from workloads.gpt3.model import GPT
from workloads.decoder.config import LORA_PRESETS
from workloads.decoder.convert import write_checkpoint
from workloads.decoder.data import TRAIN as LLAMA_TRAIN, write_tiny_corpus as write_llama_corpus
from workloads.decoder.govreport import write_tiny_govreport
from workloads.decoder.model import Decoder
from workloads.registry import BENCHMARKS
from workloads.resnet import data as resnet_data


def tiny_bert_inputs(folder):
    """A few rows of the tiny preset's data and a starting checkpoint of its shape: the worker's arguments."""
    tiny = BERT_PRESETS["tiny"]
    write_tiny_dataset(folder / "data", tiny.model.vocab_size, tiny.model.max_seq_len, tiny.max_predictions,
                       shards=1, shard_rows=128, eval_rows=16)
    torch.manual_seed(0)
    torch.save({"model": Bert(tiny.model).state_dict()}, folder / "init.pt")
    return ["--data", str(folder / "data"), "--init-checkpoint", str(folder / "init.pt")]


def tiny_resnet_inputs(folder):
    """Eight images in ImageNet's layout, two per step."""
    _write_images(folder / "data", classes=2, per_class=4, val_per_class=1)
    return ["--data", str(folder / "data"), "--batch-size", "2"]


def tiny_gpt3_inputs(folder):
    """The tiny preset's C4-named text and a starting checkpoint of its shape (untrained: no step is trained)."""
    (folder / "data").mkdir()
    write_gpt3_corpus(folder / "data")
    torch.manual_seed(0)
    write_checkpoint({"model": GPT(GPT3_PRESETS["tiny"].model).state_dict()}, folder / "init")
    return ["--data", str(folder / "data"), "--init-checkpoint", str(folder / "init")]


def tiny_llama_inputs(folder):
    (folder / "data").mkdir()
    write_llama_corpus(folder / "data")
    return ["--data", str(folder / "data")]


def tiny_lora_inputs(folder):
    """The tiny preset's GovReport-shaped parquet files and a base checkpoint of its shape."""
    model = LORA_PRESETS["tiny"].model
    (folder / "data").mkdir()
    write_tiny_govreport(folder / "data", model.seq_len)
    torch.manual_seed(0)
    write_checkpoint(Decoder(model).state_dict(), folder / "base")
    return ["--data", str(folder / "data"), "--init-checkpoint", str(folder / "base")]


# The Megatron .bin/.idx pairs (workloads.common.megatron_data): the index is opened, both are memory-mapped.
MEGATRON_READERS = ((builtins, "open"), (np, "memmap"))
# Per benchmark: the arguments of a run on a few items of data, and the functions through which it lists or opens
# its dataset's files (each takes the path first).
DATA_READERS = {
    "bert": (tiny_bert_inputs, ((h5py, "File"), (h5py, "is_hdf5"))),
    "resnet": (tiny_resnet_inputs, ((resnet_data, "find_classes"), (resnet_data, "make_dataset"),
                                    (resnet_data, "read_file"))),
    "gpt3": (tiny_gpt3_inputs, MEGATRON_READERS),
    "llama31_8b": (tiny_llama_inputs, MEGATRON_READERS),
    "llama2_70b_lora": (tiny_lora_inputs, ((pq, "read_schema"), (pq, "read_table"))),
}


def instrument(monkeypatch, readers, data: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Record each MLLOG key as it is logged, and each use of `readers` on a file under `data` with how many keys
    were logged before it."""
    logged: list[str] = []
    reads: list[tuple[str, int]] = []

    for name in ("event", "start", "end"):
        def logging_key(self, key, *a, _original=getattr(mlperf.ResultLog, name), **kw):
            logged.append(key)
            return _original(self, key, *a, **kw)
        monkeypatch.setattr(mlperf.ResultLog, name, logging_key)
    for module, name in readers:
        def reader(path, *a, _original=getattr(module, name), **kw):
            if isinstance(path, (str, os.PathLike)) and data in Path(path).resolve().parents:
                reads.append((str(path), len(logged)))
            return _original(path, *a, **kw)
        monkeypatch.setattr(module, name, reader)
    return logged, reads


@pytest.mark.slow
@pytest.mark.parametrize("bench", sorted(DATA_READERS))
def test_nothing_reads_the_dataset_between_init_start_and_run_start(bench, tmp_path, monkeypatch,
                                                                    one_process_world):
    """Every use of the dataset's readers on a file under the data folder is recorded with the MLLOG keys logged
    before it, the warm-up's steps included: none may come before run_start ("The clock must start before any part of the system touches the
    dataset", training_rules.adoc), and some must come after (the run did read, through these readers)."""
    inputs, readers = DATA_READERS[bench]
    args = inputs(tmp_path)
    logged, reads = instrument(monkeypatch, readers, (tmp_path / "data").resolve())
    # The run stops once its data is open (aborted): the steps would read only after that, inside the timed run.
    monkeypatch.setattr(campaign, "train", lambda *args: False)

    # With the warm-up (workloads.common.warm_up): it trains and evaluates in the init, on synthetic batches only.
    opts = RunOptions.parse([bench, "--out", str(tmp_path / "out"), "--seed", "1", "--straggler-window", "0",
                             "--warm-up", "on", *args])
    run_campaign(BENCHMARKS[bench].workload_class(), opts)

    assert C.INIT_START in logged and C.RUN_START in logged and C.RUN_STOP in logged
    assert reads, "the run never opened its data: the instrumented readers miss how it reads"
    run_start = logged.index(C.RUN_START) + 1  # the keys logged up to and including run_start
    early = [(path, logged[count - 1] if count else "nothing") for path, count in reads if count < run_start]
    assert not early, f"{bench} touched its dataset before run_start (file, the last key logged): {early}"


def test_a_dataset_found_damaged_after_run_start_ends_the_log_aborted(tmp_path, one_process_world):
    """A truncated .bin (llama31_8b's C4) is found when the data is opened, after run_start: the run stops with the
    reader's one-line reason, and its log ends with run_stop, status aborted; a retry of the campaign leaves that
    run as it is."""
    args = tiny_llama_inputs(tmp_path)
    data = tmp_path / "data" / f"{LLAMA_TRAIN}.bin"
    data.write_bytes(data.read_bytes()[:1000])
    opts = RunOptions.parse(["llama31_8b", "--out", str(tmp_path / "out"), "--max-steps", "1",
                             "--straggler-window", "0", *args])
    with pytest.raises(SystemExit) as refused:
        run_campaign(BENCHMARKS["llama31_8b"].workload_class(), opts)
    assert str(refused.value) == f"workloads: {data} is shorter than its index says: truncated?"
    assert not isinstance(refused.value, ConfigurationError)  # the workload's: retried by nobody, blamed on none
    events = list(iter_events((tmp_path / "out" / "result_0.txt").read_bytes()))
    keys = [e["key"] for e in events]
    assert keys.count(C.RUN_START) == 1 and keys[-1] == C.RUN_STOP and keys.count(C.RUN_STOP) == 1
    assert events[-1]["metadata"][C.STATUS] == C.ABORTED
    assert mlperf.logged_run(tmp_path / "out" / "result_0.txt").stopped


@pytest.mark.parametrize("error, refused", [
    (FileNotFoundError(2, "No such file or directory", "/data/c4/train.idx"), True),
    (OSError("Unable to open file (file signature not found)"), True),  # h5py's, on a damaged file: no errno
    (ValueError("/data/c4/train.bin is shorter than its index says: truncated?"), True),
    (OSError(116, "Stale file handle", "/data/c4/train.idx"), False),  # ESTALE: NFS after a remount
    (OSError(5, "Input/output error", "/data/c4/train.bin"), False),
])
def test_a_dataset_the_readers_refuse_stops_the_run_and_a_passing_file_system_error_does_not(error, refused):
    """The readers' verdict on the data stops the run with one line (its log is then ended aborted); an error that
    the shared file system gives for a while goes on to the failure policy, whose restart continues the run."""
    from workloads.common.data import data_errors

    with pytest.raises(SystemExit if refused else type(error)) as raised:
        with data_errors():
            raise error
    assert (str(raised.value) == f"workloads: {error}") if refused else raised.value is error
    assert not isinstance(raised.value, ConfigurationError)  # a file one node cannot read may be that node's


class NodeLost(RuntimeError):
    pass


def test_a_run_whose_node_was_lost_while_its_data_opened_logs_the_data_keys_when_it_resumes(tmp_path, monkeypatch,
                                                                                          one_process_world):
    """Attempt 0 logs run_start, then fails while its data opens (a node lost while ImageNet is listed, which takes
    minutes on NFS). Attempt 1 continues the run: it logs train_samples and eval_samples, which the checker wants
    exactly once, and the failed attempt left nothing frozen in the process."""
    import gc

    opts = RunOptions.parse(["resnet", "--out", str(tmp_path / "out"), "--max-steps", "1", "--straggler-window", "0",
                             *tiny_resnet_inputs(tmp_path)])
    resnet = BENCHMARKS["resnet"].workload_class()

    class LosesItsNode(resnet):
        def open_data(self):
            raise NodeLost("node lost")

    with pytest.raises(NodeLost):
        run_campaign(LosesItsNode, opts)
    assert gc.get_freeze_count() == 0
    torch.distributed.destroy_process_group()
    log_path = tmp_path / "out" / "result_0.txt"
    assert mlperf.logged_run(log_path).started and not mlperf.logged_run(log_path).stopped
    monkeypatch.setenv("HARNESS_ATTEMPT", "1")
    run_campaign(resnet, opts)
    keys = [e["key"] for e in iter_events(log_path.read_bytes())]
    assert [keys.count(key) for key in (C.RUN_START, C.TRAIN_SAMPLES, C.EVAL_SAMPLES, C.RUN_STOP)] == [1, 1, 1, 1]


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
    checked = compliance(log_path, holding("bert")[-1], cwd=tmp_path)
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
    with pytest.raises(ConfigurationError, match="an earlier, failed init of this run logged opt_base_learning_rate "
                                         "0.00035; this one has 0.0004"):
        log.events({C.OPT_BASE_LR: 4e-4}, logged.values)
    log.close()
    assert [e["key"] for e in iter_events(path.read_bytes())] == [
        C.GLOBAL_BATCH_SIZE, C.OPT_BASE_LR, C.GRADIENT_ACCUMULATION_STEPS]
