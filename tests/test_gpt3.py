"""GPT-3: Megatron's .bin/.idx format, the tiny preset to its target through the official checker,
training from real-format files, and the 448 x 8 H100 layout with its memory estimate."""

from __future__ import annotations

import dataclasses
import math
import struct

import jsonschema
import numpy as np
import pytest
import torch.distributed.checkpoint as dcp
import yaml

from tests.closed_proxy import GPT3_MODEL as GPT3_PROXY
from tests.conftest import closed_proxy_run, compliance, failed_checks, harness
from tests.test_kubernetes import CRD, pytorchjob_schema
from workloads.gpt3.config import PRESETS, estimate_memory, plan_layout
from workloads.gpt3.model import GPT
from workloads.gpt3.data import C4_EVAL, C4_TRAIN, TINY_VOCAB, BlendedSamples, IndexedDataset, SequenceSamples, \
    tiny_entropy, write_indexed_dataset


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_indexed_dataset_round_trip(tmp_path, dtype):
    docs = [np.arange(5, dtype=dtype), np.arange(100, 103, dtype=dtype), np.array([7], dtype=dtype)]
    write_indexed_dataset(tmp_path / "c4", docs, dtype=dtype)
    header = (tmp_path / "c4.idx").read_bytes()[:34]
    assert header[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<QBQQ", header[9:]) == (1, {np.uint16: 8,
                                                                                              np.int32: 4}[dtype], 3, 4)
    data = IndexedDataset(tmp_path / "c4")
    assert len(data) == 3 and data.tokens.dtype == dtype
    assert [data.document(i).tolist() for i in range(3)] == [d.tolist() for d in docs]
    assert data.document_indices.tolist() == [0, 1, 2, 3]
    samples = SequenceSamples(data, seq_len=4, seed=None)  # 9 tokens: windows of 5 at 0 and 4
    assert len(samples) == 2 and samples[1].tolist() == [4, 100, 101, 102, 7]


def test_damaged_indexed_datasets_are_named(tmp_path):
    write_indexed_dataset(tmp_path / "c4", [np.arange(100, dtype=np.uint16)])
    (tmp_path / "c4.bin").write_bytes((tmp_path / "c4.bin").read_bytes()[:50])
    with pytest.raises(ValueError, match="shorter than its index"):
        IndexedDataset(tmp_path / "c4")
    (tmp_path / "c4.idx").write_bytes(b"NOTANIDX" + b"\x00" * 40)
    with pytest.raises(ValueError, match="not a Megatron MMIDIDX index"):
        IndexedDataset(tmp_path / "c4")
    with pytest.raises(FileNotFoundError, match="missing"):
        IndexedDataset(tmp_path / "absent")


def test_the_blend_keeps_its_proportions_everywhere():
    blend = BlendedSamples([list(range(1000)), list(range(1000, 2000))], [0.5, 0.5], 1000)
    sources = [blend.source(i) for i in range(1000)]
    assert sum(sources) == 500
    assert all(abs(sum(sources[i:i + 20]) - 10) <= 1 for i in range(0, 980, 20))  # every stretch of 20
    assert sources[3:5] == [0, 1] and blend[3] == 3 and blend[4] == 1004  # sample i of the chosen dataset


def test_the_tiny_target_is_reachable_but_not_trivial():
    """The tiny text's entropy is the best log perplexity any model can reach: below 2.69, far below a guess."""
    assert 1.8 < tiny_entropy() < PRESETS["tiny"].target - 0.3 < math.log(TINY_VOCAB) - 1.5


def _write_c4(folder, vocab: int = 128) -> None:
    rng = np.random.default_rng(0)
    for prefix in (*C4_TRAIN, C4_EVAL):
        write_indexed_dataset(folder / prefix, [rng.integers(1, vocab, 3000).astype(np.uint16) for _ in range(4)])


def test_trains_from_real_format_files(tmp_path):
    data = tmp_path / "c4"
    data.mkdir()
    _write_c4(data)
    result = harness("run", "gpt3", "--preset", "tiny", "--data", str(data), "--max-steps", "3",
                     "--out", str(tmp_path / "run"))
    log = (tmp_path / "run" / "result_0.txt").read_text()
    assert '"key": "eval_accuracy"' in log and '"key": "train_samples", "value": 24576' in log, \
        result.stdout + result.stderr
    assert result.returncode == 1 and "did not reach the quality target" in result.stderr  # random tokens
    result = harness("run", "gpt3", "--preset", "tiny", "--data", str(tmp_path), "--out", str(tmp_path / "r2"))
    assert result.returncode != 0 and "lacks c4_en_6_c4_spm_text_document.idx/.bin" in result.stdout + result.stderr


def test_tiny_gpt3_reaches_its_target_and_passes_the_checker(tmp_path):
    result = harness("run", "gpt3", "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "success" in result.stdout and "gpt3" in result.stdout
    checked = compliance(tmp_path / "run" / "result_0.txt", "4.1.0", cwd=tmp_path)
    assert "SUCCESS" in checked.stdout + checked.stderr and not failed_checks(checked), checked.stdout
    log = (tmp_path / "run" / "result_0.txt").read_text()
    for key in ("init_checkpoint_step", "opt_learning_rate_decay_schedule", "tracked_stats"):
        assert f'"key": "{key}"' in log


@pytest.mark.parametrize("backend", ["slurm", "k8s"])
def test_full_preset_on_448_h100_nodes_shows_its_layout_and_memory(tmp_path, backend):
    args = ("run", "gpt3", "--preset", "full", "--backend", backend, "--profile", "coreweave-h100", "--nodes", "448",
            "--gpus-per-node", "8", "--dry-run", "--out", str(tmp_path / "o"))
    result = harness(*args)
    assert result.returncode == 0, result.stderr
    assert harness(*args).stdout == result.stdout  # deterministic
    assert "tensor 8 x pipeline 1 x data (FSDP) 448" in result.stderr
    assert "global batch 1792 = 448 x micro batch 1 x 4 accumulation steps" in result.stderr
    assert "gpt3 memory per GPU: 10.3 GiB of 80 GiB" in result.stderr
    assert "give --init-checkpoint DIR (a torch.distributed.checkpoint folder)" in result.stderr  # a dry run names what a real run still needs
    if backend == "slurm":
        assert "#SBATCH --nodes=448" in result.stdout and "#SBATCH --gpus-per-node=8" in result.stdout
        assert "srun " in result.stdout
    else:
        job = yaml.safe_load(result.stdout)
        if CRD.is_file():  # the same schema check as tests/test_kubernetes.py, where ../shared is present
            jsonschema.validate(job, pytorchjob_schema())
        container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        replicas = job["spec"]["pytorchReplicaSpecs"]
        assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 448


def test_a_config_that_cannot_fit_is_refused_with_the_numbers(tmp_path):
    result = harness("run", "gpt3", "--preset", "full", "--backend", "slurm", "--profile", "h100-ib", "--nodes", "1",
                     "--synthetic", "--dry-run", "--out", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "needs about 334.8 GiB per GPU" in result.stderr and "more than the 80 GiB" in result.stderr


def test_memory_estimate_shrinks_with_more_gpus():
    cfg = PRESETS["full"]
    small, large = (estimate_memory(cfg, plan_layout(cfg, world, 8)).total for world in (64, 3584))
    assert small > large
    no_checkpointing = estimate_memory(dataclasses.replace(cfg, activation_checkpointing=False),
                                       plan_layout(cfg, 3584, 8))
    assert no_checkpointing.activations > estimate_memory(cfg, plan_layout(cfg, 3584, 8)).activations


def test_synthetic_throughput_runs_start_from_random_weights(tmp_path):
    result = harness("run", "gpt3", "--preset", "tiny", "--synthetic", "--max-steps", "2", "--out", str(tmp_path / "r"))
    log = (tmp_path / "r" / "result_0.txt").read_text()
    assert '"key": "tracked_stats"' in log and "tokens_per_second" in log, result.stdout + result.stderr
    assert '"key": "init_checkpoint_step"' not in log  # no checkpoint was loaded, so none is claimed


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the starting checkpoint is saved in one process
def test_closed_preset_logs_every_closed_key(tmp_path):
    """The full preset, shortened to 1 step of 1536 sequences (with tests/closed_proxy.py's small model in place
    of 175B): the 4.1.0 checker's only complaint is the unreached target."""
    data = tmp_path / "c4"
    data.mkdir()
    _write_c4(data)
    init = tmp_path / "init"
    dcp.save({"model": GPT(GPT3_PROXY).state_dict()}, checkpoint_id=str(init), no_dist=True)
    out = tmp_path / "closed"
    result = closed_proxy_run("gpt3", "--data", str(data), "--init-checkpoint", str(init), "--max-steps", "1",
                              "--batch-size", "32", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    log = (out / "result_0.txt").read_text()
    assert '"global_batch_size", "value": 1536' in log and '"init_checkpoint_step", "value": 4000' in log
    checked = compliance(out / "result_0.txt", "4.1.0", cwd=tmp_path)
    assert "closed_gpt3.yaml" in checked.stdout + checked.stderr
    failures = failed_checks(checked)
    assert len(failures) == 1 and "eval_accuracy" in failures[0] and "2.69" in failures[0], checked.stdout


def test_mfu_matches_the_gpu_by_its_exact_name():
    """An H100 PCIe or NVL is not given the SXM's peak (its name also holds "H100"), and an unknown GPU gets none."""
    from workloads.common.gpu_peaks import mfu, peak_bf16_flops

    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756.0e12 and peak_bf16_flops("NVIDIA H100 NVL") == 835.5e12
    assert peak_bf16_flops("NVIDIA H200") == 989.4e12 and peak_bf16_flops("NVIDIA GB200") == 2500.0e12
    assert peak_bf16_flops("NVIDIA H800") is None and mfu(1e9, 1e6, 8, "Tesla T4") is None
    assert mfu(6e9, 100e3, 8, "NVIDIA A100-SXM4-80GB") == pytest.approx(6e9 * 100e3 / (8 * 312e12))
