"""bench/gpu_throughput.py and its wheelhouse, on CPU: the tiny mode's JSON, the goal arithmetic a GPU row
gets, the skip when torchvision cannot run, and the offline install's choices.

Kept fast: the bench runs BERT and GPT-3 (the two that start the run on files from saved weights, one as a
state dict, one as a DCP folder), llama31_8b and gpt_oss_20b (from scratch, on int32 files) and flux1 (from
scratch, on save_to_disk folders) for 1 + 2 + 2 steps; ResNet's files are checked through its loader alone.
results/bench/gpu-cpu.json comes from a CPU run with more steps (made before llama31_8b joined the bench).
llama31_8b's, gpt_oss_20b's and flux1's goals are derived again from their logs when ../shared holds them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_throughput  # noqa: E402  (bench/ is not a package)
import wheelhouse  # noqa: E402
from workloads.decoder.config import LLAMA31_8B  # noqa: E402


@pytest.mark.slow
def test_cpu_tiny_mode_writes_a_labelled_json(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_throughput.py"), "--workloads",
                           "gpt3,bert,llama31_8b,gpt_oss_20b,flux1",
                           "--out-dir", str(tmp_path), "--warmup-steps", "1", "--timed-steps", "2",
                           "--spread-steps", "2", "--profile-steps", "1"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert report["device"] == "cpu" and report["note"] == gpu_throughput.CPU_NOTE
    assert report["torch"] and report["nccl"] is None and report["devices"] == 1
    assert report["steps"] == {"warmup": 1, "timed": 2, "spread": 2, "profiled": 1}
    assert report["skipped"] == {} and report["failed"] == {}
    rows = report["results"]
    assert [(r["workload"], r["data"]) for r in rows] == [("bert", "synthetic"), ("bert", "files"),
                                                         ("gpt3", "synthetic"), ("gpt3", "files"),
                                                         ("llama31_8b", "synthetic"), ("llama31_8b", "files"),
                                                         ("gpt_oss_20b", "synthetic"), ("gpt_oss_20b", "files"),
                                                         ("flux1", "synthetic"), ("flux1", "files")]
    # a step trains 32 sequences (tiny BERT's global batch), 1 (the bench's tiny decoders: global batch = world) or
    # 8 samples (tiny flux1's micro batch x world)
    per_step = {"bert": 32, "gpt3": 1, "llama31_8b": 1, "gpt_oss_20b": 1, "flux1": 8}
    # gpt_oss_20b: the tiny preset, expert parallel over the bench's one process, in tokens/s
    for r in [r for r in rows if r["workload"] == "gpt_oss_20b"]:
        assert r["tokens_per_s_per_device"] == pytest.approx(r["samples_per_s_per_device"] * 8192, rel=0.01)
        assert r["measured"].startswith("gpt-oss-shaped decoder (2 layers")
    for r in [r for r in rows if r["workload"] == "flux1"]:  # samples/s alone: no tokens, MFU only on a GPU
        assert r["unit"] == "samples/s" and r["tokens_per_s_per_device"] is None and r["preset"] == "bench-cpu"
        assert r["measured"].startswith("FLUX.1-shaped transformer (2 double-stream and 2 single-stream blocks")
    for r in rows:
        assert r["samples_in_window"] == 2 * per_step[r["workload"]]
        # window_s is rounded to the millisecond: tiny llama's windows last about 20 ms
        assert r["samples_per_s_per_device"] == pytest.approx(r["samples_in_window"] / r["window_s"],
                                                              rel=0.01 + 0.0005 / r["window_s"])
        assert r["ratio"] is None and r["goal"] is None and r["mfu"] is None and r["peak_memory_gib"] is None
        spread = r["step_time_s"]
        assert 0 < spread["min"] <= spread["p10"] <= spread["median"] <= spread["p90"] <= spread["max"]
        assert r["last_loss"] > 0
        assert r["profile"] == f"gpu-cpu-profile-{r['workload']}-{r['data']}.txt"
        assert "Self CPU" in (tmp_path / r["profile"]).read_text()
    assert rows[0]["measured"].startswith("BERT (2 layers") and rows[2]["tokens_per_s_per_device"] == pytest.approx(
        rows[2]["samples_per_s_per_device"] * 2048, rel=0.01)
    assert rows[4]["measured"].startswith("Llama-3.1-shaped decoder (2 layers") and rows[4]["preset"] == "bench-cpu"
    assert rows[5]["tokens_per_s_per_device"] == pytest.approx(rows[5]["samples_per_s_per_device"] * 256, rel=0.01)
    assert "rate per device" in proc.stdout
    for workload in ("gpt3", "llama31_8b", "gpt_oss_20b", "flux1"):
        assert re.search(rf"^{workload} +files ", proc.stdout, re.M), workload


def test_written_files_are_what_the_workloads_loaders_read(tmp_path):
    from gpu_formats import IMAGE_CLASSES, write_image_folder, write_megatron_corpus
    from torchvision import datasets
    from workloads.common.megatron_data import IndexedDataset
    from workloads.gpt3.data import C4_TRAIN, c4_loaders

    root = write_image_folder(tmp_path / "imagenet", 25, (40, 30), seed=1)
    train, val = datasets.ImageFolder(str(root / "train")), datasets.ImageFolder(str(root / "val"))
    assert len(train) == 25 and len(val) == IMAGE_CLASSES and train[0][0].size == (40, 30)
    root = write_megatron_corpus(tmp_path / "c4", vocab_size=300, seq_len=16, train_samples=6, eval_samples=2, seed=1)
    loaders = c4_loaders(root, seq_len=16, micro_batch=2, train_samples=6, eval_sequences=None, seed=0, data_rank=0,
                         data_world=1)
    batches = list(loaders.train)
    assert len(batches) == 3 and batches[0].shape == (2, 16) and int(batches[0].max()) < 300  # the reference's samples
    assert loaders.eval_sequences == 2 and loaders.eval_tokens == 2 * 16
    # each training shard holds every sample the run reads, so the 0.5/0.5 blend never wraps
    assert all(len(IndexedDataset(root / prefix).tokens) == 6 * 16 for prefix in C4_TRAIN)


def test_llama_files_are_what_llama31_8bs_loaders_read(tmp_path):
    """Int32 under MLCommons' names, token ids past uint16's range, a window per sample the run reads and exactly
    the validation windows the eval scores."""
    from gpu_formats import write_llama_corpus
    from workloads.common.megatron_data import IndexedDataset, SequenceSamples
    from workloads.decoder.data import TRAIN, VALIDATION, c4_loaders

    vocab = 128_256
    root = write_llama_corpus(tmp_path / "c4", vocab_size=vocab, seq_len=16, train_samples=6, eval_samples=3, seed=1)
    train, validation = IndexedDataset(root / TRAIN), IndexedDataset(root / VALIDATION)
    assert train.dtype == validation.dtype == np.int32 and int(train.tokens.max()) > 65_535
    assert len(SequenceSamples(train, 16, seed=0)) == 6 and len(SequenceSamples(validation, 16, seed=None)) == 3
    loaders = c4_loaders(root, seq_len=16, micro_batch=2, train_samples=6, eval_sequences=3, seed=0, data_rank=0,
                         data_world=1)
    batches = list(loaders.train)
    assert len(batches) == 3 and batches[0].shape == (2, 17) and int(max(b.max() for b in batches)) < vocab
    assert loaders.eval_sequences == 3 and sum(int(counted.sum()) for _, counted in loaders.eval) == 3
    with pytest.raises(ValueError, match="holds 3 sequences"):
        c4_loaders(root, 16, 2, 6, eval_sequences=4, seed=0, data_rank=0, data_world=1)


def test_flux_files_are_what_flux1s_loaders_read(tmp_path):
    """MLCommons' three folders: save_to_disk sets of exactly the rows the bench preset counts (the workload checks
    the size), at its shapes, with the validation timesteps and the empty caption's encodings, read through the
    workload's own loader."""
    from gpu_formats import write_flux_embeddings
    from workloads.flux.data import (EMPTY_FOLDER, EVAL_FOLDER, TENSORS, TIMESTEP, TRAIN_FOLDER, EmbeddingSet,
                                     RankShare, load_empty_encodings, loader)

    cfg = gpu_throughput.plan_for("flux1", on_gpu=False, world=1,
                                  steps=gpu_throughput.Steps(warmup=1, timed=2, spread=1)).extra_preset
    assert (cfg.global_batch, cfg.train_samples, cfg.eval_samples) == (8, 8 * 6, 8)
    shape = cfg.sample_shape
    root = write_flux_embeddings(tmp_path / "flux", shape, cfg.train_samples, cfg.eval_samples, seed=1)
    train, evaluation = EmbeddingSet(root / TRAIN_FOLDER, TENSORS), EmbeddingSet(root / EVAL_FOLDER,
                                                                                 (*TENSORS, TIMESTEP))
    train.check(shape, cfg.train_samples)
    evaluation.check(shape, cfg.eval_samples)
    assert evaluation.rows(list(range(8)))[TIMESTEP].tolist() == list(range(8))
    empty = load_empty_encodings(root / EMPTY_FOLDER, shape)
    assert empty["t5_encodings"].shape == shape.text and empty["clip_encodings"].shape == (shape.pooled,)
    batches = loader(train, RankShare(len(train), 0, 1, cfg.max_micro_batch), workers=0, pin_memory=False)
    batch = next(iter(batches))
    assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (8, *dims) for k, dims in shape.expected().items()}
    assert all(v.dtype == torch.bfloat16 for v in batch.values()) and batch["mean"].std() > 0.5


NVIDIA_V51 = REPO.parent / "shared" / "mlperf-results" / "training_v5.1" / "NVIDIA"
LLAMA_RESULT = NVIDIA_V51 / "results" / "theia_ngpu512_ngc25.09_nemo" / "llama31_8b" / "result_0.txt"
LLAMA_SYSTEM = NVIDIA_V51 / "systems" / "theia_ngpu512_ngc25.09_nemo.json"


def test_the_gpu_gpt3_preset_has_a_base_lr():
    """The GPU bench's GPT-3 (batch 4) takes the reference batch's LR: the closed table has none for 4."""
    from gpu_throughput import gpt3_bench_preset

    from workloads.gpt3.config import base_lr, plan_layout

    cfg = gpt3_bench_preset(on_gpu=True)
    assert plan_layout(cfg, 1, 1).global_batch == 4 and base_lr(cfg, 4) == 2e-5


@pytest.mark.skipif(not (LLAMA_RESULT.is_file() and LLAMA_SYSTEM.is_file()),
                    reason=f"NVIDIA's v5.1 llama31_8b log or system file is absent ({LLAMA_RESULT}, {LLAMA_SYSTEM}): "
                           "the hard-coded llama31_8b goal cannot be re-derived here")
def test_llama_goal_is_nvidias_v51_tokens_per_gpu():
    """GOALS' llama31_8b figure: global batch x sequence length / the median logged train_step_time / the GPUs
    the system file lists (nodes x accelerators per node)."""
    import statistics

    events = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in LLAMA_RESULT.read_text().splitlines()
              if ":::MLLOG " in line]
    value = {e["key"]: e["value"] for e in events}
    step_times = [e["value"]["train_step_time"] for e in events
                  if e["key"] == "tracked_stats" and "train_step_time" in e["value"]]
    system = json.loads(LLAMA_SYSTEM.read_text())
    gpus = int(system["number_of_nodes"]) * int(system["accelerators_per_node"])
    assert value["global_batch_size"] == 64 and value["max_sequence_length"] == 8192 and gpus == 512
    assert len(step_times) > 100 and statistics.median(step_times) == pytest.approx(0.0854, abs=0.0005)
    assert "GB200" in value["submission_platform"]
    per_gpu = value["global_batch_size"] * value["max_sequence_length"] / statistics.median(step_times) / gpus
    assert gpu_throughput.NVIDIA_V51_LLAMA_TOKENS_PER_GPU == pytest.approx(per_gpu, rel=0.001)
    goal = gpu_throughput.GOALS["llama31_8b"]
    assert goal.metric == "model_tflops_per_s"
    assert goal.value == pytest.approx(per_gpu * LLAMA31_8B.flops_per_token() / 1e12, rel=0.001)  # about 694
    assert LLAMA_RESULT.name in goal.yardstick and "GB200" in goal.yardstick and "11,980" in goal.yardstick


CISCO_GPT_OSS = REPO.parent / "shared" / "mlperf-results" / "training_v6.0" / "Cisco" / "results" / \
    "Zeus_16xH100_SXM_80GB" / "gpt_oss_20b" / "result_1.txt"


@pytest.mark.skipif(not CISCO_GPT_OSS.is_file(), reason=f"Cisco's v6.0 gpt_oss_20b log is absent ({CISCO_GPT_OSS}): "
                                                       "the hard-coded gpt_oss_20b goal cannot be re-derived here")
def test_gpt_oss_goal_is_ciscos_v60_tokens_per_gpu():
    """GOALS' gpt_oss_20b figure: the samples of the converged eval x sequence length / run_start to run_stop /
    the platform's GPUs (16 x 8 H100), times gpt-oss 20B's training FLOPs per token over its active parameters."""
    from workloads.decoder.config import GPT_OSS_20B

    events = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in CISCO_GPT_OSS.read_text().splitlines()
              if ":::MLLOG " in line]
    first = {e["key"]: e for e in reversed(events)}
    seconds = (first["run_stop"]["time_ms"] - first["run_start"]["time_ms"]) / 1000
    samples = first["run_stop"]["metadata"]["samples_count"]
    assert first["max_sequence_length"]["value"] == 8192 and samples == 294_912
    assert first["submission_platform"]["value"] == "16xH100_SXM_80GB"
    per_gpu = samples * 8192 / seconds / 128
    assert gpu_throughput.CISCO_V60_GPT_OSS_TOKENS_PER_GPU == pytest.approx(per_gpu, rel=0.001)
    goal = gpu_throughput.GOALS["gpt_oss_20b"]
    assert goal.value == pytest.approx(per_gpu * GPT_OSS_20B.flops_per_token() / 1e12, rel=0.001)


AMD_FLUX = REPO.parent / "shared" / "mlperf-results" / "training_v6.0" / "AMD" / "results" / \
    "8xMI325X_EPYC_9575F_pytorch" / "flux1" / "result_0.txt"
AMD_SYSTEM = REPO.parent / "shared" / "mlperf-results" / "training_v6.0" / "AMD" / "systems" / \
    "8xMI325X_EPYC_9575F_pytorch.json"


@pytest.mark.skipif(not (AMD_FLUX.is_file() and AMD_SYSTEM.is_file()),
                    reason=f"AMD's v6.0 flux1 log or system file is absent ({AMD_FLUX}, {AMD_SYSTEM}): the hard-coded "
                           "flux1 goal cannot be re-derived here")
def test_flux_goal_is_amds_v60_model_flops_per_gpu():
    """GOALS' flux1 figure: the samples at run_stop / run_start to run_stop (evaluations included) / the GPUs the
    system file lists (8 nodes x 8 MI325X; the platform name 8xMI325X names a node), times FLUX.1-schnell's training
    FLOPs per sample: about 653 model TFLOP/s per GPU, half an MI325X's dense bf16 peak, with fp8 linear layers."""
    from workloads.flux.config import PRESETS

    events = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in AMD_FLUX.read_text().splitlines()
              if ":::MLLOG " in line]
    first = {e["key"]: e for e in reversed(events)}
    seconds = (first["run_stop"]["time_ms"] - first["run_start"]["time_ms"]) / 1000
    samples = first["run_stop"]["metadata"]["samples_count"]
    system = json.loads(AMD_SYSTEM.read_text())
    gpus = int(system["number_of_nodes"]) * int(system["accelerators_per_node"])
    assert first["global_batch_size"]["value"] == 2048 and samples == 9_961_472 and gpus == 64
    assert first["lowest_numerical_precision_in_linear"]["value"] == "fp8"
    per_gpu = samples / seconds / gpus
    assert gpu_throughput.AMD_V60_FLUX_SAMPLES_PER_GPU == pytest.approx(per_gpu, rel=0.001)
    goal = gpu_throughput.GOALS["flux1"]
    assert goal.metric == "model_tflops_per_s"
    assert goal.value == pytest.approx(per_gpu * PRESETS["full"].flops_per_sample() / 1e12, rel=0.001)
    assert "MI325X" in goal.yardstick and "64 GPUs" in goal.yardstick


def test_unknown_workload_is_one_clear_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_throughput.py"), "--workloads", "bert,vit",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2
    assert "unknown vit; choose from resnet, bert, gpt3, llama31_8b" in proc.stderr and "Traceback" not in proc.stderr


def figures(samples: int, window: float) -> dict:
    return {"samples": samples, "window_s": window, "step_times_s": [0.2, 0.1, 0.3], "peak_memory_bytes": 3 * 2**30,
            "last_loss": 2.5}


def test_gpu_rows_get_mfu_and_ratios_against_the_goals():
    h100 = "NVIDIA H100 80GB HBM3"
    gpt = gpu_throughput.plan_for("gpt3", on_gpu=True, world=2)
    model = gpt.extra_preset.model
    assert 1.2e9 < model.params < 1.4e9 and model.seq_len == 2048
    row = gpu_throughput.row("gpt3", "synthetic", gpt, figures(samples=80, window=10.0), h100, world=2)
    tokens = 80 / 10.0 / 2 * 2048
    assert row["tokens_per_s_per_device"] == pytest.approx(tokens, rel=1e-3)
    assert row["mfu"] == pytest.approx(model.flops_per_token() * tokens / 989.4e12, abs=1e-4)
    assert row["ratio"] == pytest.approx(row["mfu"] / 0.45, abs=1e-3)
    assert row["peak_memory_gib"] == 3.0 and row["step_time_s"]["median"] == 0.2

    resnet = gpu_throughput.plan_for("resnet", on_gpu=True, world=1)
    row = gpu_throughput.row("resnet", "files", resnet, figures(samples=21_000, window=10.0), h100, world=1)
    assert row["samples_per_s_per_device"] == 2100.0 and row["ratio"] == 0.5 and row["mfu"] is None
    # llama31_8b: a Llama-3.1-shaped 1.5B model that one H100 holds with AdamW (the estimate: no checkpointing
    # needed), one sequence of 8,192 tokens per GPU and step; its ratio compares model FLOP/s with NVIDIA's.
    llama = gpu_throughput.plan_for("llama31_8b", on_gpu=True, world=1)
    cfg = llama.extra_preset
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head, cfg.model.n_kv_head, cfg.model.ffn_hidden,
            cfg.model.vocab_size, cfg.model.seq_len) == (16, 2048, 32, 8, 8192, 128_256, 8192)
    assert 1.4e9 < cfg.model.params < 1.6e9 and (cfg.global_batch, cfg.micro_batch, cfg.tensor_parallel) == (1, 1, 1)
    assert not cfg.activation_checkpointing and "activation checkpointing off" in llama.measured
    assert gpu_throughput.plan_for("llama31_8b", on_gpu=True, world=4).extra_preset.global_batch == 4
    row = gpu_throughput.row("llama31_8b", "files", llama, figures(samples=15, window=10.0), h100, world=1)
    tokens = 1.5 * 8192
    assert row["unit"] == "seq/s" and row["tokens_per_s_per_device"] == pytest.approx(tokens, rel=1e-3)
    assert row["mfu"] == pytest.approx(cfg.model.flops_per_token() * tokens / 989.4e12, abs=1e-4)
    nvidia = 11_980 * LLAMA31_8B.flops_per_token()  # the model FLOP/s per GPU of NVIDIA's v5.1 run
    assert row["ratio"] == pytest.approx(tokens * cfg.model.flops_per_token() / nvidia, abs=1e-3)
    assert "694 model TFLOP/s" in gpu_throughput.table([row], {})
    # A GPU the peak table does not know: no MFU, so no GPT ratio, rather than a guess.
    assert gpu_throughput.row("gpt3", "files", gpt, figures(80, 10.0), "Some GPU", 2)["ratio"] is None
    # flux1: FLUX.1's blocks at schnell's width and the real sequence, fewer of them, that one H100 holds with AdamW
    # by the harness's estimate; MFU and model FLOP/s from the training FLOPs per sample, the ratio against AMD's.
    flux = gpu_throughput.plan_for("flux1", on_gpu=True, world=1)
    cfg = flux.extra_preset
    m = cfg.model
    assert (m.depth, m.depth_single_blocks, m.hidden_size, m.num_heads, m.context_in_dim, m.vec_in_dim) == \
        (4, 8, 3072, 24, 4096, 768)
    assert (cfg.image_tokens, cfg.text_tokens, cfg.global_batch, cfg.max_micro_batch) == (256, 256, 16, 16)
    assert cfg.activation_checkpointing and 2.5e9 < m.params < 2.6e9 and 40 < flux.estimate_gib < 45
    assert cfg.train_samples == 16 * (gpu_throughput.DEFAULT_STEPS["cuda"].total + 2)
    row = gpu_throughput.row("flux1", "files", flux, figures(samples=160, window=10.0), h100, world=1)
    assert row["unit"] == "samples/s" and row["samples_per_s_per_device"] == 16.0
    assert row["mfu"] == pytest.approx(cfg.flops_per_sample() * 16.0 / 989.4e12, abs=1e-4)
    assert row["tokens_per_s_per_device"] is None and row["goal"] == gpu_throughput.GOALS["flux1"].value
    assert row["ratio"] == pytest.approx(16.0 * cfg.flops_per_sample() / 1e12 / row["goal"], abs=1e-3)
    assert re.search(r"^flux1 +files +16\.0 samples/s +653 model TFLOP/s +0\.\d+ +\d", gpu_throughput.table([row], {}),
                     re.M)
    # On CPU no goal applies.
    cpu = gpu_throughput.plan_for("bert", on_gpu=False, world=1)
    assert gpu_throughput.row("bert", "files", cpu, figures(64, 1.0), None, 1)["ratio"] is None
    assert gpu_throughput.device_slug(h100) == "nvidia-h100-80gb-hbm3"


def test_resnet_is_skipped_with_a_reason_when_torchvision_cannot_load(monkeypatch):
    assert gpu_throughput.resnet_problem() is None
    for module in ("torchvision", "torchvision.ops"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    problem = gpu_throughput.resnet_problem()
    assert problem.startswith("resnet skipped: torchvision does not work with torch") and "wheelhouse.py" in problem


def fake_wheel(folder: Path, name: str, version: str, torch_pin: str) -> Path:
    path = folder / f"{name}-{version}-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA",
                   f"Name: {name}\nVersion: {version}\nRequires-Dist: numpy\nRequires-Dist: torch (=={torch_pin})\n")
    return path


def test_install_leaves_out_a_torchvision_built_for_another_torch(tmp_path, monkeypatch, capsys):
    assert wheelhouse.wheel_torch_pin(fake_wheel(tmp_path, "torchvision", "0.26.0", "2.11.0")) == "2.11.0"
    real_find_spec = wheelhouse.importlib.util.find_spec
    monkeypatch.setattr(wheelhouse.importlib.util, "find_spec",
                        lambda name: None if name == "torchvision" else real_find_spec(name))
    monkeypatch.setattr("torch.__version__", "2.99.0+cu130")
    assert wheelhouse.install(tmp_path / "site", tmp_path) == 0  # nothing else is missing: pip is not run
    assert "no torchvision for torch 2.99.0" in capsys.readouterr().err and not (tmp_path / "site").exists()


def test_install_puts_only_the_missing_packages_into_the_target(tmp_path, monkeypatch):
    """pip, offline, from the wheelhouse: a package that imports already is left alone."""
    name = "gpu_bench_probe"
    with zipfile.ZipFile(tmp_path / f"{name}-1.0-py3-none-any.whl", "w") as z:
        files = {f"{name}/__init__.py": "", f"{name}-1.0.dist-info/METADATA":
                 f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
                 f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
        record = f"{name}-1.0.dist-info/RECORD"
        files[record] = "".join(f"{path},,\n" for path in [*files, record])
        for path, text in files.items():
            z.writestr(path, text)
    monkeypatch.setattr(wheelhouse, "NEEDED", {name: name, "tqdm": "tqdm"})
    assert wheelhouse.install(tmp_path / "site", tmp_path) == 0
    assert (tmp_path / "site" / name / "__init__.py").is_file() and not (tmp_path / "site" / "tqdm").exists()


def test_install_without_a_wheelhouse_names_the_fill_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(wheelhouse.importlib.util, "find_spec", lambda name: None if name == "h5py" else object())
    assert wheelhouse.install(tmp_path / "site", tmp_path / "absent") == 2
    assert "h5py missing" in capsys.readouterr().err


def normalised(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _requirement_closure(roots: list[str]) -> set[str]:
    """Distributions installed with `roots` (their requirements, extras left out), normalised names."""
    seen, todo = set(), list(roots)
    while todo:
        name = normalised(todo.pop())
        if name in seen:
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        todo += [re.match(r"[A-Za-z0-9_.\-]+", r).group(0) for r in requires if "extra ==" not in r]
    return seen


def test_the_wheelhouse_covers_what_the_bench_imports_beyond_the_gpu_machines_packages():
    """A GPU machine with only torch, pandas, matplotlib and pytest gets the rest from the wheelhouse: every
    third-party module the bench and the workloads import must come from one or the other."""
    probe = ("import sys; before = set(sys.modules); sys.path.insert(0, 'bench'); "
             "import gpu_throughput, gpu_timing, gpu_formats, torch.distributed.checkpoint; "
             "import workloads.resnet.train, workloads.bert.train, workloads.gpt3.train, workloads.decoder.pretrain, "
             "workloads.flux.train; "
             "print(' '.join({m.split('.')[0] for m in set(sys.modules) - before}))")
    imported = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout.split()
    providers = metadata.packages_distributions()
    baseline = _requirement_closure(["torch", "pandas", "matplotlib", "pytest"])
    available = baseline | {normalised(d) for d in wheelhouse.NEEDED} | {"mlperf-harness"}
    # torchvision.datasets imports defusedxml when it is installed (the in-process restart's nvidia-resiliency-ext
    # brings it here) and parses XML without it otherwise: nothing the GPU machine lacks. Likewise torch's datapipes
    # import dill, and pyarrow cloudpickle, when installed (Hugging Face datasets brings both here), and do without.
    optional = {"defusedxml", "dill", "cloudpickle"}
    uncovered = {module: providers[module] for module in imported if module in providers and module not in optional
                 and not {normalised(d) for d in providers[module]} & available}
    assert not uncovered, f"add these to bench/wheelhouse.py's NEEDED: {uncovered}"


def test_the_report_puts_the_measured_peak_beside_the_harness_estimate():
    """Every GPU run checks the memory model again: a decoder row carries the estimate that max_memory_allocated
    measures (the estimate less its reserve) and the measured peak over it; the table prints both. The figures here
    are docs/measured.md's H200 peak for the Llama bench shape, 40.8 GiB."""
    llama = gpu_throughput.plan_for("llama31_8b", on_gpu=True, world=1)
    assert 40 < llama.estimate_gib < 46 and "GiB allocated at the peak" in llama.measured
    measured = {**figures(samples=15, window=10.0), "peak_memory_bytes": int(40.8 * 2**30)}
    row = gpu_throughput.row("llama31_8b", "files", llama, measured, "NVIDIA H200", world=1)
    assert row["peak_memory_gib"] == 40.8 and row["estimated_memory_gib"] == round(llama.estimate_gib, 2)
    assert row["peak_over_estimate"] == pytest.approx(40.8 / llama.estimate_gib, abs=1e-3)
    printed = gpu_throughput.table([row], {})
    assert f"40.8 GiB (estimate {llama.estimate_gib:.1f} GiB, {row['peak_over_estimate']:.2f})" in printed
    # On CPU there is no GPU estimate to hold a peak against.
    assert gpu_throughput.plan_for("llama31_8b", on_gpu=False, world=1).estimate_gib is None
