"""BERT: MLPerf's HDF5 layouts, packing, LAMB and its schedule, the RCP batch plan, starting checkpoints in
the reference's names, the tiny preset through the official checker, real-format files and a killed rank."""

from __future__ import annotations

import dataclasses
import itertools
import re

import h5py
import numpy as np
import pytest
import torch
from mlperf_logging.mllog import constants as C

from harness.results.parse import iter_events
from tests.closed_proxy import BERT_MODEL as BERT_PROXY
from tests.conftest import SHARED, closed_proxy_run, compliance, failed_checks, harness
from tests.test_resilience import _restored_step
from workloads.bert.config import PRESETS, BertConfig, eval_interval, plan_batch, reference_points
from workloads.bert.data import (TrainStream, collate, eval_batches, pack, read_rows, tiny_pair, train_batches,
                                 write_shard, write_tiny_dataset)
from workloads.bert.lamb import Lamb
from workloads.bert.model import Bert, load_reference_state_dict
from workloads.bert.model import model_outputs
from workloads.bert.train import BertWorkload
from workloads.common import tiny_text
from workloads.common.campaign import RunOptions, run_campaign
from workloads.common.param_groups import parameter_groups
from workloads.common.refusals import ConfigurationError

TINY = PRESETS["tiny"]
SMALL = BertConfig(vocab_size=128, max_seq_len=64, n_layer=1, n_head=2, d_model=16, d_ff=32, dropout=0.0)


def _write(folder, layout, shards=2, rows=24, eval_rows=16):
    write_tiny_dataset(folder, TINY.model.vocab_size, TINY.model.max_seq_len, TINY.max_predictions, layout=layout,
                       shards=shards, shard_rows=rows, eval_rows=eval_rows)


@pytest.mark.parametrize("layout", ["fixed", "varlength", "packed"])
def test_every_mlperf_layout_reads_back(tmp_path, layout):
    _write(tmp_path, layout)
    shard = tmp_path / "train" / "part-00000-of-00002.hdf5"
    with h5py.File(shard) as f:
        keys = set(f)
        assert (f["input_ids"].ndim == 2) == (layout == "fixed")
    assert {"input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels"} <= keys
    assert ("input_mask" in keys) == (layout == "fixed")
    assert ({"packed_input_len", "packed_masked_lm_len"} <= keys) == (layout == "packed")
    rows = read_rows(shard)
    for row in rows:
        assert len(row.input_ids) == len(row.segment_ids) == row.lengths.sum() <= TINY.model.max_seq_len
        assert len(row.nsp_labels) == len(row.lengths) and len(row.mlm_positions) == len(row.mlm_ids) > 0
        restored = row.input_ids.copy()
        restored[row.mlm_positions] = row.mlm_ids
        starts = np.concatenate([[0], np.cumsum(row.lengths)[:-1]])
        assert (restored[starts] == 1).all()  # every sequence starts with [CLS], wherever it sits in the row
        assert (row.mlm_positions > 0).all() and not np.isin(row.mlm_positions, starts).any()
    if layout == "packed":
        assert len(rows) < 24 and max(len(r.lengths) for r in rows) >= 2
        with h5py.File(shard) as f:  # per-sequence masked counts, as NVIDIA's packer writes them
            assert [list(n) for n in f["packed_masked_lm_len"]] == [
                list(np.histogram(r.mlm_positions, np.concatenate([[0], np.cumsum(r.lengths)]))[0]) for r in rows]


def test_eval_samples_counts_sequences(tmp_path):
    """A packed eval set's rows hold about 2 sequences each: eval_samples counts those, as train samples do."""
    _write(tmp_path, "packed", eval_rows=16)
    batches, evaluated = eval_batches(tmp_path / "eval", 4, TINY.model.max_seq_len, None, rank=0, world=1)
    assert evaluated == 16 == sum(len(b["nsp_labels"]) for b in batches) > len(read_rows(tmp_path / "eval" / "eval.hdf5"))


def test_a_file_that_is_not_a_bert_shard_is_named(tmp_path):
    with h5py.File(tmp_path / "bad.hdf5", "w") as f:
        f["input_ids"] = np.zeros((2, 8))
    with pytest.raises(ValueError, match="bad.hdf5 is not an MLPerf BERT shard: it lacks segment_ids"):
        read_rows(tmp_path / "bad.hdf5")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no HDF5 shards"):
        TrainStream(tmp_path / "empty", seed=0, rank=0, world=1)


def _batches_as_before(stream, batch, max_seq_len, skip):
    """The loader before issue 14, verbatim: every unit read whole and every batch collated on the training
    thread. The oracle the worker loader must match."""
    def rows(skip):
        epoch, skip = divmod(skip, stream.rows_per_epoch)
        while True:
            rng = np.random.default_rng([stream.seed, epoch, stream.rank])
            for u in rng.permutation(len(stream.units)):
                shard, start, stop = stream.units[u]
                order = rng.permutation(stop - start)
                if skip >= len(order):
                    skip -= len(order)
                    continue
                unit = read_rows(shard, start, stop)
                for i in order[skip:]:
                    yield unit[i]
                skip = 0
            epoch += 1
    stream_rows = rows(skip)
    while True:
        yield collate([next(stream_rows) for _ in range(batch)], max_seq_len)


@pytest.mark.parametrize("layout", ["fixed", "packed"])
def test_the_worker_loader_yields_the_batches_the_training_thread_did(tmp_path, layout):
    """Same batches, same order, from the start, mid-epoch and past an epoch, with 0 and 2 workers; rank 1 of 3
    reads slices of the 2 shards."""
    _write(tmp_path, layout)
    max_seq_len = TINY.model.max_seq_len
    for rank, world in ((0, 1), (1, 3)):
        stream = TrainStream(tmp_path / "train", seed=7, rank=rank, world=world)
        epoch = stream.rows_per_epoch
        for skip in (0, epoch // 2 + 1, epoch + 3):
            expected = list(itertools.islice(_batches_as_before(stream, 5, max_seq_len, skip), 3 * epoch // 5))
            for workers in (0, 2):
                got = list(itertools.islice(train_batches(stream, 5, max_seq_len, skip, workers, pin_memory=False),
                                            len(expected)))
                assert len(got) == len(expected)
                for ours, theirs in zip(got, expected):
                    assert ours.keys() == theirs.keys()
                    assert all(torch.equal(ours[key], theirs[key]) for key in theirs), (rank, skip, workers)


def test_a_packed_row_scores_each_sequence_as_if_it_were_alone():
    """Packing must not leak attention across sequences: same logits packed or not."""
    torch.manual_seed(0)
    model = Bert(SMALL).eval()
    rng = np.random.default_rng(0)
    rows = [tiny_pair(tiny_text.transitions(128, 8, first=4), 24, 4, rng) for _ in range(3)]
    packed = pack(rows, 64)
    assert len(packed) == 1 and len(packed[0].lengths) == 3

    alone_mlm, alone_nsp = model_outputs(model, collate(rows, 64))
    packed_mlm, packed_nsp = model_outputs(model, collate(packed, 64))
    torch.testing.assert_close(packed_mlm, alone_mlm, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_nsp, alone_nsp, atol=1e-5, rtol=1e-5)


def test_lamb_matches_the_reference_update():
    weight = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))  # norm 5
    bias = torch.nn.Parameter(torch.tensor([1.0]))
    model = torch.nn.Module()
    model.weight, model.bias = weight, bias
    groups = parameter_groups(model, 0.1)
    assert groups[0]["params"] == [weight] and groups[1]["params"] == [bias]
    optimizer = Lamb(groups, lr=0.01, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.1)
    weight.grad, bias.grad = torch.tensor([[1.0, -2.0]]), torch.tensor([0.5])
    optimizer.step()
    # After one step the bias-corrected Adam direction is sign(grad) (up to eps).
    update = np.array([1.0, -1.0]) / (1 + 1e-6) + 0.1 * np.array([3.0, 4.0])
    trust = 5.0 / np.linalg.norm(update)
    np.testing.assert_allclose(weight.detach().numpy()[0], [3.0, 4.0] - 0.01 * trust * update, rtol=1e-6)
    np.testing.assert_allclose(bias.detach().numpy(), [1.0 - 0.01 / (1 + 1e-6)], rtol=1e-6)  # no decay, no trust


def _lamb_one_tensor_at_a_time(params, state, lr, betas, eps, weight_decay):
    """The update written out per tensor, as the reference's optimization.py does: the oracle for the
    multi-tensor version."""
    beta1, beta2 = betas
    for param in params:
        step, m, v = state.setdefault(id(param), [0, torch.zeros_like(param), torch.zeros_like(param)])
        step += 1
        state[id(param)][0] = step
        m.mul_(beta1).add_(param.grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
        update = (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)).sqrt() + eps)
        trust = 1.0
        if weight_decay:
            update = update + weight_decay * param
            norms = param.norm(), update.norm()
            trust = norms[0] / norms[1] if norms[0] > 0 and norms[1] > 0 else 1.0
        param.sub_(lr * trust * update)


def test_the_multi_tensor_lamb_equals_the_update_one_tensor_at_a_time():
    """Several steps over BERT-like shapes (matrices that decay and adapt, vectors that do not), a zero weight
    (trust 1) and a parameter without a gradient in one step."""
    torch.manual_seed(3)
    shapes = [(64, 32), (32,), (128, 64), (64,), (7, 5), (5,)]
    ours = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    theirs = [p.detach().clone() for p in ours]
    with torch.no_grad():
        ours[4].zero_()
        theirs[4].zero_()
    model = torch.nn.Module()
    for i, p in enumerate(ours):
        model.register_parameter(f"p{i}", p)
    optimizer = Lamb(parameter_groups(model, 0.01), lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    state_decay, state_plain = {}, {}
    for step in range(5):
        grads = [torch.randn(shape) for shape in shapes]
        for i, (p, q, g) in enumerate(zip(ours, theirs, grads)):
            p.grad = None if (step == 2 and i == 0) else g.clone()
            q.grad = p.grad.clone() if p.grad is not None else None
        optimizer.step()
        with torch.no_grad():
            _lamb_one_tensor_at_a_time([q for q in theirs if q.ndim >= 2 and q.grad is not None], state_decay,
                                       1e-3, (0.9, 0.999), 1e-6, 0.01)
            _lamb_one_tensor_at_a_time([q for q in theirs if q.ndim < 2 and q.grad is not None], state_plain,
                                       1e-3, (0.9, 0.999), 1e-6, 0.0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-7)


def test_the_closed_plan_takes_an_rcp_and_mlperf_eval_interval():
    points = reference_points()
    assert points[256][1].base_lr == 0.00035 and points[12288][1].warmup_steps == 300
    plan = plan_batch(PRESETS["full"], world=3072, micro_batch=4)  # NVIDIA's 384 x 8 H100s
    assert (plan.global_batch, plan.micro_batch, plan.grad_accum) == (12288, 4, 1)
    assert plan.source == "MLPerf RCP bert_ref_12288"
    # NVIDIA's v3.0 log at batch 12288 evaluates every ~275,000 samples.
    assert eval_interval(PRESETS["full"], 12288) == 275_000
    single = plan_batch(PRESETS["full"], world=8, micro_batch=32)
    assert (single.global_batch, single.micro_batch, single.grad_accum) == (256, 32, 1)
    with pytest.raises(ValueError, match="no MLPerf BERT reference batch .* splits evenly over 11 processes"):
        plan_batch(PRESETS["full"], world=11)
    assert plan_batch(TINY, world=2).global_batch == 32


def test_a_packed_plan_counts_sequences():
    """The batch is in sequences: rows x packing factor. NVIDIA+CoreWeave's v3.0 packed run: 2 rows per GPU on
    3,072 GPUs at packing factor 2 is global batch 12,288 (their logged global_batch_size and d_batch_size)."""
    full = PRESETS["full"]
    plan = plan_batch(full, world=3072, micro_batch=2, packing_factor=2)
    assert (plan.global_batch, plan.rows, plan.micro_batch, plan.grad_accum) == (12288, 6144, 2, 1)
    assert plan.source == "MLPerf RCP bert_ref_12288" and plan.hyperparameters.base_lr == 0.0031
    # Read as sequences, the same 2 rows per GPU would be batch 6,144 with another RCP's hyperparameters.
    assert plan_batch(full, world=3072, micro_batch=2).global_batch == 6144
    assert plan_batch(TINY, world=2, packing_factor=2).rows == 16  # the tiny preset's 32 sequences
    with pytest.raises(ValueError, match="splits evenly over 11 processes in rows of 2 sequences"):
        plan_batch(full, world=11, packing_factor=2)
    with pytest.raises(ValueError, match="1 \\(unpacked data\\) or more, not 0"):
        plan_batch(full, world=8, packing_factor=0)


def _write_packed_two_per_row(folder, rows=96, eval_rows=16):
    """Packed shards whose every row holds exactly 2 sequences, so the sequences per step are known exactly."""
    table = tiny_text.transitions(TINY.model.vocab_size, 8, first=4)
    rng = np.random.default_rng(0)
    max_seq_len = TINY.model.max_seq_len
    pairs = [tiny_pair(table, max_seq_len // 2, TINY.max_predictions, rng) for _ in range(2 * rows)]
    packed = pack(pairs, max_seq_len, per_row=2)
    assert {len(row.lengths) for row in packed} == {2}
    (folder / "train").mkdir(parents=True)
    write_shard(folder / "train" / "part-0.hdf5", packed, "packed", max_seq_len, TINY.max_predictions)
    (folder / "eval").mkdir()
    eval_pairs = [tiny_pair(table, max_seq_len, TINY.max_predictions, rng) for _ in range(eval_rows)]
    write_shard(folder / "eval" / "eval.hdf5", eval_pairs, "fixed", max_seq_len, TINY.max_predictions)


def _tiny_run(tmp_path, data, *args) -> list[dict]:
    torch.manual_seed(0)
    torch.save({"model": Bert(TINY.model).state_dict()}, tmp_path / "init.pt")
    out = tmp_path / "out"
    run_campaign(BertWorkload, RunOptions.parse(["bert", "--out", str(out), "--data", str(data), "--init-checkpoint",
                                                 str(tmp_path / "init.pt"), "--straggler-window", "0", *args]))
    return list(iter_events((out / "result_0.txt").read_bytes()))


@pytest.mark.slow
def test_a_packed_run_logs_the_sequences_it_trains_per_step(tmp_path, one_process_world):
    """Two steps on rows of exactly 2 sequences each, declared with --packing-factor 2: the logged global batch is
    the sequences each step trained (32), not the rows (16)."""
    _write_packed_two_per_row(tmp_path / "data")
    events = _tiny_run(tmp_path, tmp_path / "data", "--packing-factor", "2", "--max-steps", "2")
    value = {e["key"]: e["value"] for e in events if e["event_type"] == "POINT_IN_TIME"}
    steps = 2
    rows_per_step = 16  # 32 sequences in rows of 2
    assert value[C.TRAIN_SAMPLES] == steps * rows_per_step * 2
    assert value[C.GLOBAL_BATCH_SIZE] == value[C.TRAIN_SAMPLES] // steps == 32


def test_packed_data_without_its_packing_factor_stops_at_once(tmp_path, one_process_world):
    """Found when the data is opened, after run_start: the run stops with the one-line reason, and its log ends
    with run_stop, status aborted (the log is whole, and a restart does not start the run over)."""
    _write_packed_two_per_row(tmp_path / "data")
    with pytest.raises(ConfigurationError, match="the bert training data is packed .* give --packing-factor N") \
            as refused:  # the shared data and the job's option: the same on every node
        _tiny_run(tmp_path, tmp_path / "data", "--max-steps", "1")
    assert "\n" not in str(refused.value)
    events = list(iter_events((tmp_path / "out" / "result_0.txt").read_bytes()))
    keys = [e["key"] for e in events]
    assert keys.count(C.RUN_START) == 1 and keys[-1] == C.RUN_STOP
    assert events[-1]["metadata"][C.STATUS] == C.ABORTED


def test_a_run_whose_rows_stray_from_the_declared_packing_factor_stops():
    """The check at each block boundary: within 5% of the declared factor goes on, beyond it stops."""
    from types import SimpleNamespace

    plan = plan_batch(TINY, world=1, packing_factor=2)  # 16 rows a step
    for samples, stops in ((10 * 16 * 2.04, False), (10 * 16 * 1.96, False), (10 * 16 * 2.2, True)):
        workload = SimpleNamespace(samples=samples, plan=plan)
        if stops:
            with pytest.raises(SystemExit, match="hold 2.200 sequences on average over 10 steps, not the 2"):
                BertWorkload._check_packing(workload, 10)
        else:
            BertWorkload._check_packing(workload, 10)


def test_the_schedule_is_the_references():
    schedule = reference_points()[12288][1]  # warmup 300 from step -100, decay to 0 at step 500
    factors = [schedule.lr_factor(step) for step in (0, 199, 200, 499, 600)]
    np.testing.assert_allclose(factors, [100 / 300, 299 / 300, 1 - 200 / 500, 1 / 500, 0.0])


def test_a_reference_named_checkpoint_loads():
    """NVIDIA's and Hugging Face's names (and TensorFlow's gamma/beta, DDP's module. prefix) map onto ours."""
    model = Bert(SMALL)
    ours = model.state_dict()
    d, ff = SMALL.d_model, SMALL.d_ff
    layer = "bert.encoder.layer.0."
    reference = {
        "bert.embeddings.word_embeddings.weight": torch.randn(128, d),
        "bert.embeddings.position_embeddings.weight": torch.randn(64, d),
        "bert.embeddings.token_type_embeddings.weight": torch.randn(2, d),
        "bert.embeddings.LayerNorm.gamma": torch.randn(d), "bert.embeddings.LayerNorm.beta": torch.randn(d),
        **{f"{layer}attention.self.{n}.{p}": torch.randn(d, d) if p == "weight" else torch.randn(d)
           for n in ("query", "key", "value") for p in ("weight", "bias")},
        f"{layer}attention.output.dense.weight": torch.randn(d, d), f"{layer}attention.output.dense.bias": torch.randn(d),
        f"{layer}attention.output.LayerNorm.weight": torch.randn(d),
        f"{layer}attention.output.LayerNorm.bias": torch.randn(d),
        f"{layer}intermediate.dense_act.weight": torch.randn(ff, d), f"{layer}intermediate.dense_act.bias": torch.randn(ff),
        f"{layer}output.dense.weight": torch.randn(d, ff), f"{layer}output.dense.bias": torch.randn(d),
        f"{layer}output.LayerNorm.weight": torch.randn(d), f"{layer}output.LayerNorm.bias": torch.randn(d),
        "bert.pooler.dense_act.weight": torch.randn(d, d), "bert.pooler.dense_act.bias": torch.randn(d),
        "cls.predictions.bias": torch.randn(128),
        "cls.predictions.transform.dense_act.weight": torch.randn(d, d),
        "cls.predictions.transform.dense_act.bias": torch.randn(d),
        "cls.predictions.transform.LayerNorm.weight": torch.randn(d),
        "cls.predictions.transform.LayerNorm.bias": torch.randn(d),
        "cls.predictions.decoder.weight": torch.randn(128, d),
        "cls.seq_relationship.weight": torch.randn(2, d), "cls.seq_relationship.bias": torch.randn(2),
    }
    reference = {f"module.{k}": v for k, v in reference.items()}
    assert len({k for k in reference if "decoder" not in k}) == len(ours)
    load_reference_state_dict(model, reference)
    torch.testing.assert_close(model.layers[0].attn.q.weight, reference[f"module.{layer}attention.self.query.weight"])
    torch.testing.assert_close(model.ln_emb.bias, reference["module.bert.embeddings.LayerNorm.beta"])
    torch.testing.assert_close(model.mlm_bias, reference["module.cls.predictions.bias"])
    del reference["module.cls.seq_relationship.bias"]
    reference["module.bert.pooler.dense_act.weight"] = torch.randn(3, 3)
    with pytest.raises(ValueError, match=r"missing: nsp.bias; wrong shape: pooler.weight \(3, 3\)"):
        load_reference_state_dict(model, reference)


def test_the_warm_start_trains_on_every_core_while_the_other_ranks_wait(tmp_path, monkeypatch):
    """torchrun gives each rank one thread; the one rank that trains the tiny starting checkpoint takes the
    node's cores for it, and gives them back. HARNESS_BUILD_THREADS caps it on a shared machine (the suite's
    workers set it to their share)."""
    import os

    from workloads.bert import warm_start
    from workloads.common.cache import BUILD_THREADS_ENV

    threads = []
    monkeypatch.setattr(warm_start, "_train_tiny_init", lambda preset, folder: threads.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for cap, expected in ((None, len(os.sched_getaffinity(0))), ("1", 1)):
            if cap is None:
                monkeypatch.delenv(BUILD_THREADS_ENV, raising=False)
            else:
                monkeypatch.setenv(BUILD_THREADS_ENV, cap)
            monkeypatch.setenv("HARNESS_DATA_DIR", str(tmp_path / str(cap)))  # a fresh cache: it trains again
            warm_start.ensure_tiny_init_checkpoint(PRESETS["tiny"])
            assert threads[-1] == expected and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["varlength", "packed"])
def test_trains_from_real_format_files(tmp_path, layout):
    data = tmp_path / "bert"
    _write(data, layout, shards=1, rows=200, eval_rows=32)  # one shard, two ranks: each reads half of it
    packing = ["--packing-factor", "2"] if layout == "packed" else []  # the tiny packer's rows hold 2.04 on average
    result = harness("run", "bert", "--preset", "tiny", "--data", str(data), "--max-steps", "3", *packing,
                     "--seed", "1", "--out", str(tmp_path / "run"))
    log = (tmp_path / "run" / "result_0.txt").read_text()
    assert '"key": "eval_accuracy"' in log, result.stdout + result.stderr
    trained = int(log.split('"key": "train_samples", "value": ')[1].split(",")[0])
    # 3 steps of 32 sequences: 32 rows of one, or 16 packed rows of 1 to 3 (2.04 on average over the file, so
    # the 48 rows read hold about 96; test_a_packed_run_logs_the_sequences_it_trains_per_step counts them exactly)
    assert trained == 96 if layout == "varlength" else 96 * 0.95 <= trained <= 96 * 1.05
    result = harness("run", "bert", "--preset", "tiny", "--data", str(tmp_path), "--out", str(tmp_path / "r2"))
    assert result.returncode != 0 and "has no train/ folder" in result.stdout + result.stderr


@pytest.mark.slow
def test_tiny_bert_survives_a_killed_rank_reaches_its_target_and_passes_the_checker(tmp_path):
    """`harness run bert` on the local default, with rank 1 killed at step 70: one restart from step 60's
    checkpoint, and a log that the 5.0.0 checker passes (open, since the tiny model is not BERT-large)."""
    out = tmp_path / "run"
    result = harness("run", "bert", "--inject-failure", "1:70", "--checkpoint-every", "30", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "success" in result.stdout and "masked-LM accuracy" in result.stdout
    assert _restored_step(out) == 60
    checked = compliance(out / "result_0.txt", "5.0.0", cwd=tmp_path)
    assert checked.returncode == 0 and not failed_checks(checked), checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout + checked.stderr and "open_bert.yaml" in checked.stdout + checked.stderr
    log = (out / "result_0.txt").read_text()
    for key in ("opt_lamb_beta_1", "start_warmup_step", "max_predictions_per_seq", "tracked_stats"):
        assert f'"key": "{key}"' in log
    assert log.count('"key": "run_start"') == 1 and log.count('"key": "run_stop"') == 1
    blocks = {key: [e["metadata"]["first_epoch_num"] for e in iter_events(log.encode()) if e["key"] == key]
              for key in ("block_start", "block_stop")}
    assert set(blocks["block_stop"]) == set(blocks["block_start"])  # each block closes under its own start


def test_the_dry_run_shows_the_batch_plan_and_refuses_a_world_no_rcp_fits(tmp_path):
    args = ("run", "bert", "--preset", "full", "--backend", "slurm", "--profile", "coreweave-h100", "--nodes", "384",
            "--gpus-per-node", "8", "--batch-size", "4", "--dry-run", "--out", str(tmp_path / "o"))
    result = harness(*args)
    assert result.returncode == 0, result.stderr
    assert "bert batch: global 12288 = 3072 processes x micro batch 4 x 1 accumulation steps (MLPerf RCP " \
           "bert_ref_12288); eval every 275000 samples" in result.stderr
    assert "#SBATCH --nodes=396" in result.stdout and "--nnodes=384" in result.stdout  # the profile's 3% spares
    packed = [*args[:args.index("--batch-size")], "--batch-size", "2", "--packing-factor", "2", "--dry-run", "--out",
              str(tmp_path / "p")]
    result = harness(*packed)
    assert result.returncode == 0, result.stderr
    assert "bert batch: global 12288 = 3072 processes x micro batch 2 x 1 accumulation steps x 2 sequences per " \
           "packed row (MLPerf RCP bert_ref_12288); eval every 275000 samples" in result.stderr
    assert "--packing-factor 2" in result.stdout  # the workers are told
    result = harness("run", "bert", "--preset", "full", "--backend", "slurm", "--profile", "h100-ib", "--nodes", "11",
                     "--gpus-per-node", "1", "--synthetic", "--dry-run", "--out", str(tmp_path / "o2"))
    assert result.returncode == 2 and "splits evenly over 11 processes" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_closed_preset_logs_every_closed_key(tmp_path):
    """The full preset, shortened to 2 steps (with tests/closed_proxy.py's small model in place of BERT-large):
    the 5.0.0 checker's only complaint is the unreached target."""
    data = tmp_path / "bert"
    write_tiny_dataset(data, 128, 64, 10, shards=1, shard_rows=600, eval_rows=10_000)
    torch.save({"model": Bert(BERT_PROXY).state_dict()}, tmp_path / "init.pt")
    out = tmp_path / "closed"
    result = closed_proxy_run("bert", "--data", str(data), "--init-checkpoint", str(tmp_path / "init.pt"),
                              "--max-steps", "2", "--batch-size", "64", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    log = (out / "result_0.txt").read_text()
    assert '"global_batch_size", "value": 256' in log and '"opt_base_learning_rate", "value": 0.00035' in log
    assert '"eval_samples", "value": 10000' in log
    checked = compliance(out / "result_0.txt", "5.0.0", cwd=tmp_path)
    assert "closed_bert.yaml" in checked.stdout + checked.stderr
    failures = failed_checks(checked)
    assert len(failures) == 1 and "eval_accuracy" in failures[0] and "0.720" in failures[0], checked.stdout


@pytest.mark.slow
def test_an_unreadable_starting_checkpoint_is_named_without_a_traceback(tmp_path):
    (tmp_path / "model.pt").write_text("not a checkpoint")
    result = harness("run", "bert", "--preset", "tiny", "--init-checkpoint", str(tmp_path / "model.pt"),
                     "--out", str(tmp_path / "run"))
    assert result.returncode == 3, result.stdout + result.stderr  # the job's input, the same anywhere: not retried
    # Whichever rank raised first is named: the elastic agent stops the other, which may not have reached the load.
    assert re.search(rf"attempt 0 failed \(run 1\): rank [01]: workloads: the bert starting checkpoint "
                     rf"{re.escape(str(tmp_path / 'model.pt'))} is not a PyTorch state dict", result.stderr), \
        result.stderr
    assert "This is a configuration error" in result.stderr and "no node is blamed" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_the_packing_factor_reaches_the_workers_and_is_bert_only(tmp_path):
    from harness.cli import _spec_from_args, build_parser
    from harness.spec import HarnessError, JobSpec, validate

    spec = JobSpec("bert", preset="full", out_dir=tmp_path, synthetic=True, batch_size=2, packing_factor=2).resolved()
    assert RunOptions.parse(spec.worker_args()).packing_factor == 2
    assert _spec_from_args(build_parser().parse_args(spec.command_line("local")[1:])).resolved() == spec
    with pytest.raises(HarnessError, match="--packing-factor applies to bert only"):
        validate(JobSpec("resnet", packing_factor=2).resolved())
    with pytest.raises(HarnessError, match="1 \\(unpacked\\) or more, got 0"):
        validate(JobSpec("bert", packing_factor=0).resolved())


# NVIDIA+CoreWeave's v3.0 BERT results: 384 nodes x 8 H100s, 2 packed rows per GPU at packing factor 2.
NVIDIA_V3_BERT = SHARED / "mlperf-results" / "training_v3.0" / "NVIDIA_CoreWeave" / "results" / \
    "coreweave_hgxh100_n384_ngc23.04_pytorch" / "bert"
# Keys of their init that the rules leave to the submitter, and why.
FREE_KEYS = {
    C.SEED: "drawn anew for each run",
    C.SUBMISSION_ORG: "who submits",
    C.SUBMISSION_PLATFORM: "the system's name",
    C.SUBMISSION_STATUS: "onprem, available or preview: the submitter's category",
    "d_batch_size": "rows per GPU: how the global batch is split over processes is the system's choice (the "
                    "rules fix the global batch); the harness logs the split's other half, gradient_accumulation_steps",
    C.WEIGHTS_INITIALIZATION: "NVIDIA's record of a tensor's initialisation; BERT starts from the reference "
                              "checkpoint, and the 5.0.0 checker asks for no such key",
}
# NVIDIA logs LAMB's epsilon under a second name too: it must equal the harness's opt_lamb_epsilon.
ALIASES = {"opt_epsilon": C.OPT_LAMB_EPSILON}
# Keys only the harness logs, and why that is no difference in hyperparameters.
HARNESS_ONLY = {
    C.MAX_SEQUENCE_LENGTH: "512, which the rules fix and NVIDIA's BERT logs leave out",
    C.OPT_NAME: "lamb, the only optimizer the BERT rules allow; NVIDIA's logs leave it out",
}


class _StopAtRunStart(Exception):
    pass


def _init_values(events) -> dict:
    """The POINT_IN_TIME values logged from init_start to run_start."""
    keys = [e["key"] for e in events]
    window = events[keys.index(C.INIT_START):keys.index(C.RUN_START)]
    return {e["key"]: e["value"] for e in window if e["event_type"] == "POINT_IN_TIME"}


def test_the_closed_proxy_logs_nvidias_v3_hyperparameters_key_by_key(tmp_path, monkeypatch, one_process_world):
    """The closed preset (tests/closed_proxy.py's small model) at NVIDIA+CoreWeave's global batch of 12,288 (6,144
    packed rows of 2 per step, here in one process) logs, between init_start and run_start, every key their ten
    runs log there with the same value, except the keys FREE_KEYS names. It stops at run_start: what follows is
    the data and the training, which no hyperparameter decides."""
    if not NVIDIA_V3_BERT.is_dir():
        pytest.skip(f"NVIDIA's v3.0 BERT logs: {SHARED} not present")
    monkeypatch.setitem(PRESETS, "full", dataclasses.replace(PRESETS["full"], model=BERT_PROXY))

    def stop(self):
        raise _StopAtRunStart
    monkeypatch.setattr(BertWorkload, "open_data", stop)
    out = tmp_path / "out"
    with pytest.raises(_StopAtRunStart):
        run_campaign(BertWorkload, RunOptions.parse(["bert", "--preset", "full", "--synthetic", "--out", str(out),
                                                     "--batch-size", "6144", "--packing-factor", "2"]))
    ours = _init_values(list(iter_events((out / "result_0.txt").read_bytes())))
    assert ours[C.GLOBAL_BATCH_SIZE] == 12288 and ours[C.SUBMISSION_DIVISION] == C.CLOSED
    for result in sorted(NVIDIA_V3_BERT.glob("result_*.txt")):
        theirs = _init_values(list(iter_events(result.read_bytes())))
        compared = {ALIASES.get(key, key): value for key, value in theirs.items() if key not in FREE_KEYS}
        assert {key: ours.get(key) for key in compared} == compared, result.name
        assert set(ours) - set(compared) - set(FREE_KEYS) == set(HARNESS_ONLY), result.name
