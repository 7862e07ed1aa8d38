"""The foundation's promise: `harness run resnet` trains to its target with compliant MLPerf logs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mlperf_logging.mllog import constants as C
from PIL import Image
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms

from harness.results import parse_file
from harness.results.parse import iter_events
from tests.conftest import REPO, TINY_RUNS, Completed, compliance, failed_checks, harness
from workloads.common.distributed import DistContext
from workloads.common.param_groups import parameter_groups
from workloads.common.run_record import read_json_lines
from workloads.resnet.config import PRESETS, lars_schedule
from workloads.resnet.data import (MEAN, STD, EpochSampler, augmentation_rng, image_folder_loaders, scan_images,
                                   shared_image_list, to_model_input, train_image)
from workloads.resnet.lars import TRUST_COEFFICIENT, Lars


def test_tiny_campaign_reaches_target_and_prints_time_to_train(tiny_campaign):
    out, result = tiny_campaign
    assert re.search(r"time-to-train \(min\)", result.stdout)
    rows = [line for line in result.stdout.splitlines() if re.match(r"\s+\d+\s+success\s+\d+\.\d+", line)]
    assert len(rows) == TINY_RUNS, result.stdout
    for i in range(TINY_RUNS):
        run = parse_file(out / f"result_{i}.txt")
        assert run.status == C.SUCCESS and run.quality >= 0.90
        assert run.division == C.OPEN and run.benchmark == C.RESNET
        assert run.samples_per_s > 0 and 0 < run.time_to_train_min < 5


def test_tiny_logs_pass_the_official_checker(tiny_campaign, tmp_path):
    out, _ = tiny_campaign
    for i in range(TINY_RUNS):
        result = compliance(out / f"result_{i}.txt", "4.0.0", cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout + result.stderr


def test_runs_log_distinct_seeds_and_the_required_keys(tiny_campaign):
    out, _ = tiny_campaign
    seeds = []
    for i in range(TINY_RUNS):
        events = list(iter_events((out / f"result_{i}.txt").read_bytes()))
        keys = [e["key"] for e in events]
        for key in (C.CACHE_CLEAR, C.INIT_START, C.INIT_STOP, C.SUBMISSION_ORG, C.SEED, C.GLOBAL_BATCH_SIZE,
                    C.RUN_START, C.BLOCK_START, C.EPOCH_START, C.EVAL_START, C.EVAL_ACCURACY, C.EVAL_STOP,
                    C.TRAIN_SAMPLES, C.EVAL_SAMPLES, C.RUN_STOP):
            assert key in keys, key
        assert keys.count(C.RUN_START) == 1 and keys.count(C.RUN_STOP) == 1
        assert keys.index(C.INIT_STOP) < keys.index(C.RUN_START) < keys.index(C.RUN_STOP)
        assert all(C.EPOCH_NUM in e["metadata"] for e in events if e["key"] == C.EVAL_ACCURACY)
        seeds.append(next(e["value"] for e in events if e["key"] == C.SEED))
    assert len(set(seeds)) == TINY_RUNS


def test_cache_clear_logs_whether_the_page_cache_was_dropped(tiny_campaign):
    """Each run logs cache_clear as it happened, and its run record says why not when it was not dropped."""
    out, result = tiny_campaign
    for i in range(TINY_RUNS):
        logged = [e["value"] for e in iter_events((out / f"result_{i}.txt").read_bytes()) if e["key"] == C.CACHE_CLEAR]
        [noted] = [r for r in read_json_lines(out / f"run_{i}.jsonl") if r["kind"] == "cache_clear"]
        assert logged == [noted["cleared"]]
        assert noted["cleared"] or ("why_not" in noted and "was not dropped" in result.stderr)
        assert noted["by"] == ["worker"]  # a local run has no launcher step: its worker flushed, or tried


def test_only_rank_zero_writes_the_log_and_every_rank_logs_progress(tiny_campaign):
    out, _ = tiny_campaign
    assert sorted(p.name for p in out.glob("result_*.txt")) == [f"result_{i}.txt" for i in range(TINY_RUNS)]
    assert {p.name for p in (out / "logs").glob("*.log")} == {"rank_0.log", "rank_1.log"}
    assert "eval top-1" in (out / "logs" / "rank_0.log").read_text()
    job = json.loads((out / "job.json").read_text())
    assert job["backend"] == "local" and job["state"] == "SUCCEEDED" and "harness.agent" in job["request"]


def test_report_reads_the_campaign_in_every_format(tiny_campaign):
    out, _ = tiny_campaign
    groups = json.loads(harness("report", str(out), "--format", "json").stdout)
    assert len(groups) == 1
    group = groups[0]
    assert group["benchmark"] == "resnet" and group["submitter"] == "harness"
    assert [r["status"] for r in group["runs"]] == ["success"] * TINY_RUNS
    assert all(r["time_to_train_min"] > 0 for r in group["runs"])
    middle = sorted(r["time_to_train_min"] for r in group["runs"])[1:-1]  # olympic: drop fastest and slowest
    assert abs(group["score_min"] - sum(middle) / len(middle)) < 1e-12
    csv = harness("report", str(out), "--format", "csv").stdout.splitlines()
    assert csv[0].startswith("submitter,system,system_id,campaign,benchmark,score_min,rcp,file,status,compliant,"
                             "compliance_error,converged,time_to_train_min")
    assert all(row.split(",")[9] == "True" for row in csv[1:])  # every run passed the compliance checker
    assert csv[0].endswith(",restarts,goodput,badput,stragglers,kept_out")
    assert len(csv) == 1 + TINY_RUNS
    table = harness("report", str(out)).stdout
    assert f"score {group['score_min']:.4f} min" in table
    few = harness("report", str(out / "result_0.txt"), str(out / "result_1.txt")).stdout
    assert "no score (2 of 5 required runs)" in few


@pytest.mark.slow
def test_closed_preset_logs_every_closed_key(tmp_path):
    """ResNet-50, synthetic input, 3 steps: the checker's only complaint is the unreached target. A synthetic run
    is a throughput run: it says so, exits 0, and its record keeps it out of the score."""
    out = tmp_path / "closed"
    result = harness("run", "resnet", "--preset", "full", "--synthetic", "--max-steps", "3", "--batch-size", "2",
                     "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "harness: synthetic input: a throughput run, with no quality target or score" in result.stdout
    assert "did not reach" not in result.stdout + result.stderr and "aborted, synthetic input" in result.stdout
    checked = compliance(out / "result_0.txt", "4.0.0", cwd=tmp_path)
    assert checked.returncode != 0
    failures = failed_checks(checked)
    assert len(failures) == 1 and "eval_accuracy" in failures[0] and "0.7590" in failures[0], failures
    assert "closed_resnet.yaml" in checked.stdout + checked.stderr
    run = parse_file(out / "result_0.txt")
    assert run.division == C.CLOSED and run.status == C.ABORTED


# --- large batches: LARS, and each run's own data order --------------------------------------------------------

def worker_run(out: Path, *args: str, procs: int = 1, timeout: float = 600) -> Completed:
    """`python -m workloads resnet` under torchrun, for the worker options `harness run` does not pass on."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(procs), "-m", "workloads", "resnet", "--out", str(out), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    return Completed(proc.returncode, proc.stdout, proc.stderr)


def test_lars_matches_the_reference_update():
    """Weights adapt by eta*||w||/(||g|| + wd*||w||) and decay, each by its own norms (two weights in one
    multi-tensor group); biases (and batch norm) take plain momentum SGD."""
    starts, grads = [np.array([3.0, 4.0]), np.array([0.5, -1.0, 2.0])], [np.array([1.0, -2.0]), np.array([4.0, 0.0, 1.0])]
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.tensor([starts[0].tolist()]))
    model.weight2 = torch.nn.Parameter(torch.tensor([starts[1].tolist()]))
    model.bias = torch.nn.Parameter(torch.tensor([1.0]))
    optimizer = Lars(parameter_groups(model, 0.1), lr=2.0, momentum=0.9, weight_decay=0.1)
    for _ in range(2):
        model.weight.grad, model.weight2.grad = (torch.tensor([g.tolist()]) for g in grads)
        model.bias.grad = torch.tensor([0.5])
        optimizer.step()
    for param, w, grad in zip((model.weight, model.weight2), starts, grads):
        velocity = 0.0
        for _ in range(2):
            trust = TRUST_COEFFICIENT * np.linalg.norm(w) / (np.linalg.norm(grad) + 0.1 * np.linalg.norm(w))
            velocity = 0.9 * velocity + 2.0 * trust * (grad + 0.1 * w)
            w = w - velocity
        np.testing.assert_allclose(param.detach().numpy()[0], w, rtol=1e-6)
    np.testing.assert_allclose(model.bias.item(), 1.0 - 2.0 * 0.5 - (0.9 * 2.0 * 0.5 + 2.0 * 0.5), rtol=1e-6)


def test_the_global_batch_chooses_the_lars_lr():
    full = PRESETS["full"]
    assert lars_schedule(full, full.batch_size * 8).base_lr == 11.0  # one node of 8 GPUs, 2,048: the 3,200 row
    assert lars_schedule(full, full.batch_size * 16).base_lr == 10.0  # the reference's own 4,096 command
    assert lars_schedule(full, full.batch_size * 128).base_lr == 21.2  # 128 GPUs, 32,768: the RCP's, not SGD's 12.8


def test_optimizer_is_refused_for_other_benchmarks(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "workloads", "bert", "--out", str(tmp_path), "--optimizer", "lars"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "--optimizer applies to resnet only, not bert" in proc.stderr  # a refusal's code
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_closed_lars_run_logs_what_the_lars_rules_check(tmp_path):
    """ResNet-50, synthetic input, one step with LARS forced: the checker's only complaint is the unreached target."""
    out = tmp_path / "closed"
    result = worker_run(out, "--preset", "full", "--synthetic", "--max-steps", "1", "--batch-size", "2",
                        "--optimizer", "lars")
    assert result.returncode == 0, result.stdout + result.stderr
    events = list(iter_events((out / "result_0.txt").read_bytes()))
    logged = {e["key"]: e["value"] for e in events}
    assert logged[C.OPT_NAME] == C.LARS and logged[C.LARS_OPT_BASE_LEARNING_RATE] == 7.2  # the 1,536 row
    checked = compliance(out / "result_0.txt", "4.0.0", cwd=tmp_path)
    failures = failed_checks(checked)
    assert len(failures) == 1 and "eval_accuracy" in failures[0] and "0.7590" in failures[0], failures


@pytest.mark.slow
def test_the_tiny_resnet_reaches_its_target_with_lars(tmp_path):
    result = worker_run(tmp_path / "lars", "--optimizer", "lars", "--seed", "3", procs=2)
    assert result.returncode == 0, result.stdout + result.stderr
    run = parse_file(tmp_path / "lars" / "result_0.txt")
    assert run.status == C.SUCCESS and run.quality >= 0.90


def _write_images(root, classes=3, per_class=5, val_per_class=2):
    """Random-noise images of varied sizes in ImageNet's layout (train/<class>, val/<class>), PNG and JPEG."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", val_per_class)):
        for c in range(classes):
            (root / split / f"n{c:08d}").mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (int(rng.integers(20, 48)), int(rng.integers(20, 48)), 3), np.uint8)
                Image.fromarray(pixels).save(root / split / f"n{c:08d}" / f"{i}.{'png' if i % 2 else 'JPEG'}")


def _ctx(rank=0, world=2):
    return DistContext(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                       device=torch.device("cpu"))


def test_each_run_sees_its_own_data_order(tmp_path):
    """The training order follows the run's seed: two runs of a campaign never see the same order."""
    _write_images(tmp_path, classes=2, per_class=8)
    images = scan_images(tmp_path / "train"), scan_images(tmp_path / "val")

    def order(seed: int) -> list[int]:
        sampler = image_folder_loaders(tmp_path, *images, 8, 2, 0, _ctx(), seed).sampler
        sampler.set_epoch(1)
        return list(sampler)

    assert order(7) == order(7) and order(7) != order(8)


def _list_on_a_rank(ctx, folder):
    """shared_image_list on one rank, counting the directory listings this process makes."""
    scans = []
    real = os.scandir

    def counted(path="."):
        scans.append(str(path))
        return real(path)

    os.scandir = counted
    try:
        images = shared_image_list(folder / "train", ctx)
    finally:
        os.scandir = real
    return {"scans": len(scans), "images": images}


@pytest.mark.slow
def test_the_file_list_is_scanned_once_and_shared(tmp_path):
    """Rank 0 lists the folder (the class folder and each class), rank 1 lists nothing, and both get
    ImageFolder's list and order; a folder rank 0 cannot list fails on both ranks with its message."""
    from tests.test_shared_checkpoints import run_ranks

    _write_images(tmp_path)
    ranks = run_ranks(_list_on_a_rank, 2, tmp_path)
    assert ranks[0]["scans"] == 1 + 3 and ranks[1]["scans"] == 0
    folder = datasets.ImageFolder(str(tmp_path / "train"))
    expected = [[os.path.relpath(path, tmp_path / "train"), label] for path, label in folder.samples]
    assert ranks[0]["images"] == ranks[1]["images"] == expected and len(expected) == 15
    shutil.rmtree(tmp_path / "train")
    (tmp_path / "train").mkdir()
    with pytest.raises(AssertionError, match=r"\[1, 1\]"):  # both ranks raise, neither hangs
        run_ranks(_list_on_a_rank, 2, tmp_path)


@pytest.mark.slow
def test_a_folder_without_images_is_named_on_every_rank(tmp_path):
    _write_images(tmp_path / "data")
    shutil.rmtree(tmp_path / "data" / "val")
    (tmp_path / "data" / "val").mkdir()
    result = worker_run(tmp_path / "run", "--data", str(tmp_path / "data"), procs=2, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    # Rank 0's message, one line from each rank (torchrun's own report of the failed ranks aside).
    assert re.findall(r"^workloads: Couldn't find any class folder in .*/val\.$", output, re.M) == [
        f"workloads: Couldn't find any class folder in {tmp_path / 'data' / 'val'}."] * 2, output


class _KeyedImageFolder(torch.utils.data.Dataset):
    """An ImageFolder read by EpochSampler's (epoch, index) keys, its transform given the image and the key."""

    def __init__(self, folder: datasets.ImageFolder, transform):
        self.folder, self.transform = folder, transform

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, key: tuple[int, int]):
        image, label = self.folder[key[1]]
        return self.transform(image, key), label


@pytest.mark.parametrize("workers", [0, 2])
def test_uint8_batches_normalised_on_the_device_equal_the_float_pipeline(tmp_path, workers):
    """The new loader (libjpeg-turbo through torchvision.io, crop and resize on uint8 tensors in the workers,
    to_model_input after) against the old one (ImageFolder's PIL decode, the same transform on PIL images, ToTensor
    and Normalize on the host), same seed and sampler: the same images, crops, flips and labels, from the start
    and after a resume's skip, train and eval. Both draw each sample's crop and flip from augmentation_rng, as the
    loader does.

    Tolerance: one uint8 level (1/255/std in normalised units) on any value, and no bias: over all batches the
    differences average under 0.05 of a level. The decoders give the same pixels (tests/test_jpeg_decode_bench.py);
    the antialiased bilinear resizes of PIL and of torchvision's uint8 kernel round their fixed-point sums
    differently, by one level up as often as down, on up to a quarter of the values for some crop shapes
    (bench/jpeg_decode.py's output_share_differing: 5% over its 64 ImageNet-sized JPEGs)."""
    _write_images(tmp_path)
    crop, batch, ctx = 16, 2, _ctx(rank=1)
    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    old_train = _KeyedImageFolder(datasets.ImageFolder(str(tmp_path / "train")), lambda image, key: normalize(
        train_image(image, crop, augmentation_rng(3, *key))))
    old_eval = datasets.ImageFolder(str(tmp_path / "val"), transforms.Compose(
        [transforms.Resize(round(crop * 256 / 224)), transforms.CenterCrop(crop), normalize]))
    old_sampler = EpochSampler(DistributedSampler(old_train, 2, 1, shuffle=True, seed=3, drop_last=True))
    common = dict(batch_size=batch, num_workers=workers, persistent_workers=workers > 0)
    old = (DataLoader(old_train, sampler=old_sampler, drop_last=True, **common),
           DataLoader(Subset(old_eval, range(1, len(old_eval), 2)), **common))
    new = image_folder_loaders(tmp_path, scan_images(tmp_path / "train"), scan_images(tmp_path / "val"), crop, batch,
                               workers, ctx, seed=3)
    compared, differences = 0, []
    for epoch, skip in ((1, 0), (2, 1)):
        for sampler in (old_sampler, new.sampler):
            sampler.set_epoch(epoch)
            sampler.skip = skip * batch
        for theirs, ours in ((old[0], new.train), (old[1], new.eval)):
            torch.manual_seed(epoch)
            expected = list(theirs)
            torch.manual_seed(epoch)
            got = list(ours)
            assert len(got) == len(expected) > 0
            for (images, labels), (want, want_labels) in zip(got, expected):
                assert images.dtype == torch.uint8
                model_input = to_model_input(images, torch.device("cpu"))
                assert model_input.is_contiguous(memory_format=torch.channels_last)
                levels = (model_input - want) * torch.tensor(STD).view(1, 3, 1, 1) * 255
                assert levels.abs().max() <= 1 + 1e-4
                differences.append(levels.flatten())
                assert torch.equal(labels, want_labels)
                compared += 1
    assert compared >= 8 and torch.cat(differences).mean().abs() < 0.05
