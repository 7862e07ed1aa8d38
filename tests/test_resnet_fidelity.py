"""The full ResNet preset against the closed rules and the references: what decays, the initialisation, the
LARS table by global batch, and the hyperparameters the RCPs and the reference submissions logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mlperf_logging.mllog import constants as C
from mlperf_logging.rcp_checker import rcp_checker
from torch import nn

from harness.results.rules import holding
from tests.conftest import SHARED, closed_proxy_run
from workloads.common import mlperf as K
from workloads.common.campaign import RunOptions
from workloads.common.mllog_reader import iter_events
from workloads.common.refusals import ConfigurationError
from workloads.resnet.config import (PRESETS, RCP, REFERENCE_LARS, default_optimizer, lars_coverage,
                                     lars_schedule)
from workloads.resnet.data import IMAGENET_TRAIN_SAMPLES
from workloads.resnet.model import build_model
from workloads.resnet.train import ResNetWorkload, optimizer_hyperparameters


RULESET = holding("resnet")[-1]  # what resnet's logs, and so its RCPs, are checked against


def full_workload(ctx, tmp_path: Path, optimizer: str, batch: int = 2) -> ResNetWorkload:
    """The full preset at a global batch of `batch` (one process), synthetic input: the real model and optimizer."""
    options = RunOptions(benchmark="resnet", preset="full", out=tmp_path, runs=1, seed=0, submitter="test",
                         system=None, data=None, synthetic=True, max_steps=1, batch_size=batch, optimizer=optimizer)
    return ResNetWorkload(options, ctx, seed=0)


def test_sgd_decays_neither_batch_norm_but_the_classifier_bias_as_the_reference(one_rank_world, tmp_path):
    """The SGD reference adds L2 for every variable but batch norm's ('bn' not in v.name): convolutions and the
    classifier (weight and bias) decay, batch norm's scale and shift do not."""
    workload = full_workload(one_rank_world, tmp_path, "sgd")
    decay = {id(p): group["weight_decay"] for group in workload.optimizer.param_groups for p in group["params"]}
    model = workload.model.module
    assert len(decay) == len(list(model.parameters()))
    for module in model.modules():
        for param in module.parameters(recurse=False):
            expected = 0.0 if isinstance(module, nn.BatchNorm2d) else workload.cfg.weight_decay
            assert decay[id(param)] == expected, (module, param.shape)
    assert decay[id(model.fc.bias)] == workload.cfg.weight_decay > 0


def test_resnet50_starts_from_the_references_distributions():
    """Convolutions N(0, 2 / fan_in) (he_normal), the classifier N(0, 0.01) with a zero bias, batch norm 1 and 0
    (the last of each block too). Checked on the convolutions whose fan-in and fan-out differ, where
    torchvision's default (fan-out) draws another spread."""
    torch.manual_seed(0)
    model = build_model("resnet50", 1000)
    checked = 0
    for name, conv in model.named_modules():
        if isinstance(conv, nn.Conv2d):
            fan_in, fan_out = (conv.weight[0].numel(), conv.weight[:, 0].numel())
            if fan_in != fan_out and conv.weight.numel() >= 16384:
                assert conv.weight.std().item() == pytest.approx((2 / fan_in) ** 0.5, rel=0.05), name
                assert abs(conv.weight.mean().item()) < 0.05 * (2 / fan_in) ** 0.5, name
                checked += 1
    assert checked >= 20
    assert model.fc.weight.std().item() == pytest.approx(0.01, rel=0.02)
    assert torch.count_nonzero(model.fc.bias) == 0
    for block in (*model.layer1, *model.layer2, *model.layer3, *model.layer4):
        for bn in (block.bn1, block.bn2, block.bn3):
            assert torch.all(bn.weight == 1) and torch.all(bn.bias == 0)


def _converged_runs(folder: Path, global_batch: int, epoch: int, runs: int = 5) -> Path:
    """`runs` result files that each reach the target at `epoch`: what mlperf-logging's RCP checker reads."""
    folder.mkdir(parents=True)
    for i in range(runs):
        events = [(C.SUBMISSION_BENCHMARK, C.RESNET, {}), (C.GLOBAL_BATCH_SIZE, global_batch, {}),
                  (C.EVAL_ACCURACY, 0.76, {C.EPOCH_NUM: epoch}), (C.RUN_STOP, None, {C.STATUS: C.SUCCESS})]
        (folder / f"result_{i}.txt").write_text("".join(
            f":::MLLOG {json.dumps({'key': key, 'value': value, 'metadata': metadata})}\n"
            for key, value, metadata in events))
    return folder


def _covered(rows, batches) -> list[int]:
    """Those of `batches` a row serves, ascending."""
    return sorted(b for b in batches if any(low <= b <= high for low, high in lars_coverage(rows)))


def test_every_covered_batch_can_pass_the_rcp_check_at_the_end_of_its_schedule(tmp_path):
    """A LARS run stops at its row's last epoch, so the latest it can converge is there: at every row's own batch
    and the lowest it serves (the batch above the previous row's), below the smallest RCP (1, 256), and at
    32,768 and 65,536 (whose RCP minimums are 55.4 and 82.9 epochs, past the 41 every batch once had), runs that
    converge there pass mlperf-logging's own RCP check (resnet's ruleset, pruned RCPs)."""
    full = PRESETS["full"]
    edges = {edge for row in full.lars for edge in (row.batch, row.batch + 1)}
    for batch in _covered(full.lars, edges | {1, 256, 32768, 65536}):
        row = lars_schedule(full, batch)
        folder = _converged_runs(tmp_path / str(batch), batch, row.epochs)
        passed, message, _ = rcp_checker.check_directory(str(folder), "training", RULESET, False, False,
                                                        rcp_pass="pruned_rcps")
        assert passed, (batch, row, message)


def test_the_lars_table_follows_the_rules_and_refuses_what_it_does_not_cover(one_rank_world, tmp_path):
    """Weight decay 1e-4 x 2^N and momentum 0.9 below 32k (training_rules.adoc); rows ascending; every batch from 1
    to 13,056 (the RCP's 8,192 and 13,056 rows fill 4,097 up) and 32,768 to 67,840 (the largest RCP) has a row; a
    batch between 13,056 and 32,768 (no momentum-0.9 row) or past 67,840 is refused in one line that names the
    covered batches."""
    full = PRESETS["full"]
    assert [row.batch for row in REFERENCE_LARS] == sorted({row.batch for row in REFERENCE_LARS})
    for row in REFERENCE_LARS:
        assert (torch.log2(torch.tensor(row.weight_decay / 1e-4)) % 1).item() == pytest.approx(0, abs=1e-6)
    assert lars_coverage(full.lars) == [(1, 13056), (32768, 67840)]
    for batch in (1, 1536, 4097, 8192, 8193, 13056, 32768, 57344, 67840):
        row = lars_schedule(full, batch)
        assert batch <= row.batch and (row.momentum == 0.9 or batch >= 32768)
    assert lars_schedule(full, 4097).batch == 8192 and lars_schedule(full, 13056).base_lr == 12.8
    assert lars_schedule(full, 57344).source.endswith("(NVIDIA+CoreWeave's v3.0 run)")
    for batch in (13057, 20000, 32767, 67841, 131072):
        with pytest.raises(ValueError) as refused:
            lars_schedule(full, batch)
        message = str(refused.value)
        assert f"global batch of {batch:,}" in message and "1 to 13,056, 32,768 to 67,840" in message
        assert "\n" not in message
    # Before its model or 20,000 images exist, and the job's own numbers: a configuration error, on every node.
    with pytest.raises(ConfigurationError, match="global batch of 20,000"):
        full_workload(one_rank_world, tmp_path, "lars", batch=20000)


@pytest.mark.parametrize("backend, args", [
    ("local", ["--procs-per-node", "2", "--batch-size", "10000"]),  # 20,000
    ("slurm", ["--nodes", "80", "--procs-per-node", "1", "--batch-size", "256"]),  # 20,480: 80 nodes x 256
])
def test_a_global_batch_the_lars_table_does_not_cover_is_refused_before_anything_starts(backend, args, tmp_path,
                                                                                        capsys):
    """The closed preset's LARS gap (13,057 to 32,767) is refused when `harness run` renders the request, dry run or
    not, in one line naming the covered batches and the split: no run folder, no job; before, the workers
    refused it once they had started (a whole allocation for one line)."""
    from harness.cli import main

    out = tmp_path / "run"
    for dry in (["--dry-run"], []):
        code = main(["run", "resnet", "--preset", "full", "--synthetic", "--backend", backend, "--out", str(out),
                     *args, *dry])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "1 to 13,056, 32,768 to 67,840" in err and "--batch-size" in err
        assert not out.exists()


def test_the_dry_run_shows_the_batch_and_the_lars_row_it_takes(tmp_path, capsys):
    from harness.cli import main

    assert main(["run", "resnet", "--preset", "full", "--synthetic", "--procs-per-node", "2", "--batch-size", "2048",
                 "--out", str(tmp_path / "run"), "--dry-run"]) == 0
    row = lars_schedule(PRESETS["full"], 4096)
    assert (f"resnet batch: global 4,096 = 2 processes x 2048; lars at base LR {row.base_lr:g}, "
            f"{row.warmup_epochs} warmup epochs of {row.epochs}") in capsys.readouterr().err


# --- the table against the RCPs: at each RCP's batch, the run logs the RCP's hyperparameters -------------------

# The RCP file's names for its hyperparameters (some are MLLOG keys, some its own), and the key a LARS run logs.
RCP_KEYS = {"optimizer": C.OPT_NAME, C.OPT_BASE_LR: C.LARS_OPT_BASE_LEARNING_RATE, C.OPT_END_LR: C.LARS_OPT_END_LR,
            "opt_learning_rate_decay_poly_power": C.LARS_OPT_LR_DECAY_POLY_POWER, "epsilon": C.LARS_EPSILON,
            C.OPT_LR_WARMUP_EPOCHS: C.LARS_OPT_LEARNING_RATE_WARMUP_EPOCHS, "opt_momentum": C.LARS_OPT_MOMENTUM,
            C.OPT_WEIGHT_DECAY: C.LARS_OPT_WEIGHT_DECAY, C.OPT_LR_DECAY_STEPS: C.LARS_OPT_LR_DECAY_STEPS,
            C.MODEL_BN_SPAN: C.MODEL_BN_SPAN}


# mlperf-logging's own resnet RCPs, for the ruleset resnet's logs are checked against.
RCPS = json.loads((Path(rcp_checker.__file__).parent / f"training_{RULESET}" / "rcps_resnet.json").read_text())


def _rcp_epochs(rcp: dict) -> int:
    """The RCP's decay length in epochs (workloads/resnet/config.py says why): its steps over ImageNet's training
    images, plus its warmup where that alone ends before the RCP's slowest run converged."""
    params = rcp["Hyperparams"]
    decay = round(params[C.OPT_LR_DECAY_STEPS] * rcp["BS"] / IMAGENET_TRAIN_SAMPLES)
    return decay if decay >= max(rcp["Epochs to converge"]) else decay + params[C.OPT_LR_WARMUP_EPOCHS]


@pytest.mark.parametrize("name", sorted(RCPS, key=lambda name: RCPS[name]["BS"]))
def test_at_each_rcp_batch_the_run_logs_the_rcps_hyperparameters(name):
    """At an RCP's global batch, the full preset logs the RCP's optimizer, LR, warmup, momentum and weight decay
    (and its end LR, poly power and epsilon where it names them) with the same values, save the FREE keys; the
    decay length is the RCP's, in the epochs the harness logs it in."""
    rcp = RCPS[name]
    theirs = {RCP_KEYS[key]: value for key, value in rcp["Hyperparams"].items()}
    theirs[C.LARS_OPT_LR_DECAY_STEPS] = _rcp_epochs(rcp)
    full = PRESETS["full"]
    logged = optimizer_hyperparameters(full, default_optimizer(full, rcp["BS"]), lars_schedule(full, rcp["BS"]))
    differing = _differing(theirs, {key: value for key, value in logged.items() if key in theirs})
    assert set(differing) <= set(FREE), (name, differing)
    assert lars_schedule(full, rcp["BS"]).source.startswith(f"{RCP} {name} ")


def test_the_full_preset_runs_lars_at_every_batch_as_every_reference():
    """Every RCP (1,632 up) and every v3.0+ submission in the shared logs (1,536 up) runs LARS; none runs SGD. The
    full preset picks LARS at any global batch, so a small closed run takes the first row (tinycorp's 1,536); the
    tiny preset (open) keeps SGD below 4,096."""
    full, tiny = PRESETS["full"], PRESETS["tiny"]
    assert {rcp["Hyperparams"]["optimizer"] for rcp in RCPS.values()} == {C.LARS}
    for batch in (1, 256, 2048, 4096, 65536):
        assert default_optimizer(full, batch) == C.LARS
    assert lars_schedule(full, 256).base_lr == 7.2 and lars_schedule(full, 256).epochs == 37
    assert default_optimizer(tiny, 64) == C.SGD and default_optimizer(tiny, 4096) == C.LARS


# --- the closed proxy against the reference submissions' own logs -----------------------------------------------

RESULTS = SHARED / "mlperf-results"
SUBMISSIONS = {  # a result log of each
    "NVIDIA+CoreWeave v3.0, 448 x 8 H100": "training_v3.0/NVIDIA_CoreWeave/results/"
                                            "coreweave_hgxh100_n448_ngc23.04_mxnet/resnet/result_0.txt",
    "GigaComputing v4.0, NVIDIA's 8 x H100 config": "training_v4.0/GigaComputing/results/G593-SD1_mxnet/resnet/"
                                                      "result_0.txt",
    "tinycorp v4.0, 6 x RTX 4090": "training_v4.0/tinycorp/results/tinybox_green/resnet/result_0.txt",
}
# What the submissions and RCPs log that a closed run may log otherwise (or not at all), and why.
FREE = {
    C.MODEL_BN_SPAN: "an arbitrary constant (training_rules.adoc); NVIDIA's is its per-GPU batch times its "
                     "BN_GROUP, the harness's batch norm is per process; tinycorp logs none",
    C.TRAIN_SAMPLES: "the dataset's count: the proxy's input is synthetic (ImageNet logs 1,281,167)",
    C.EVAL_SAMPLES: "the dataset's count: the proxy's input is synthetic (ImageNet logs 50,000)",
    K.SGD_OPT_END_LR: "NVIDIA's PolySchedule (fit.py) logs it in a LARS run too; closed_resnet_lars.yaml reads "
                      "lars_opt_end_learning_rate",
    K.SGD_OPT_LR_DECAY_POLY_POWER: "the same: lars_opt_learning_rate_decay_poly_power is the LARS run's",
}
# Not hyperparameters: who ran it, its seed and cache, its results, NVIDIA's own keys (no rule file reads them), and
# the ends of intervals (tinycorp logs init_stop, epoch_stop and eval_stop as points in time).
NOT_HYPERPARAMETERS = {C.SUBMISSION_BENCHMARK, C.SUBMISSION_ORG, C.SUBMISSION_DIVISION, C.SUBMISSION_STATUS,
                       C.SUBMISSION_PLATFORM, C.CACHE_CLEAR, C.SEED, C.WEIGHTS_INITIALIZATION, C.EVAL_ACCURACY,
                       C.INIT_STOP, C.EPOCH_STOP, C.EVAL_STOP,
                       "tracked_stats", "d_batch_size", "s_optimizer", "s_network", "s_process"}


def _logged(path: Path) -> dict:
    """A log's point-in-time keys and values (the hyperparameters among them), first value of each."""
    logged: dict = {}
    for event in iter_events(path.read_bytes()):
        if event["event_type"] == "POINT_IN_TIME":
            logged.setdefault(event["key"], event["value"])
    return logged


def _differing(theirs: dict, ours: dict) -> dict:
    """The keys either side logs with another value, or only one side logs: {key: (ours, theirs)}."""
    return {key: (ours.get(key), theirs.get(key)) for key in set(theirs) | set(ours) if ours.get(key) != theirs.get(key)}


@pytest.mark.slow
@pytest.mark.parametrize("submission", SUBMISSIONS)
def test_the_closed_proxy_logs_the_hyperparameters_the_submission_logged(submission, tmp_path):
    """At the submission's global batch, with the optimizer the full preset picks (LARS, as every submission), the
    full preset (ResNet-50, tests/closed_proxy.py, up to run_start) logs every hyperparameter the submission
    logged with the same value, and no other, save the FREE keys, each named with why."""
    path = RESULTS / SUBMISSIONS[submission]
    if not path.is_file():
        pytest.skip(f"{submission}'s log: /work/shared not present ({path})")
    theirs = {key: value for key, value in _logged(path).items() if key not in NOT_HYPERPARAMETERS}
    result = closed_proxy_run("resnet", "--synthetic", "--batch-size", str(theirs[C.GLOBAL_BATCH_SIZE]),
                              "--until-run-start", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    ours = {key: value for key, value in _logged(tmp_path / "result_0.txt").items() if key not in NOT_HYPERPARAMETERS}
    differing = _differing(theirs, ours)
    assert set(differing) <= set(FREE), differing
    assert {C.OPT_NAME, C.LARS_OPT_BASE_LEARNING_RATE, C.LARS_OPT_LEARNING_RATE_WARMUP_EPOCHS,
            C.LARS_OPT_LR_DECAY_STEPS, C.LARS_OPT_MOMENTUM, C.LARS_OPT_WEIGHT_DECAY,
            C.GLOBAL_BATCH_SIZE} <= set(theirs) - set(differing)
