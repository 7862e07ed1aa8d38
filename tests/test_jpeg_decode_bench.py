"""bench/jpeg_decode.py's quick mode: the JSON it writes and the images both paths decode, never a speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torchvision.datasets.folder import default_loader
from torchvision.transforms.v2 import functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import jpeg_decode  # noqa: E402  (bench/ is not a package)
from workloads.resnet.data import decode  # noqa: E402


def test_quick_mode_writes_the_rates_their_ratios_and_what_the_paths_decoded(tmp_path):
    out = tmp_path / "jpeg_decode.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "jpeg_decode.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(out.read_text())
    assert figures["quick"] is True and figures["images"]["count"] == 4
    assert figures["images"]["size"] == [500, 375] and figures["images"]["quality"] == 90
    assert figures["conditions"]["torch_threads"] == 1 and isinstance(figures["conditions"]["pinned_cpu"], int)
    assert figures["pil_img_s"] > 0 and figures["tensor_img_s"] > 0
    assert len(figures["pil_img_s_passes"]) == len(figures["tensor_img_s_passes"]) == 1
    assert abs(figures["ratio"] - figures["tensor_img_s_passes"][0] / figures["pil_img_s_passes"][0]) < 0.01
    assert figures["met"] == (figures["tensor_img_s"] >= figures["goal_img_s_per_core"] == 600)
    # Both paths decoded every image to the same size and pixels; their 224 px crops differ by a level at most.
    assert figures["same_decoded_sizes"] is True and figures["decoded_sizes"] == [[3, 375, 500]]
    assert figures["decoded_max_difference"] == 0
    assert figures["output_size"] == [3, 224, 224] and figures["output_max_difference"] <= 1
    assert abs(figures["output_mean_difference"]) < 0.05  # one level up as often as down
    # The device path on the CPU: the same outputs as the loader's path, and its two parts timed per core.
    assert figures["device"] == "cpu" and figures["device_output_max_difference"] == 0
    assert figures["device_worker_img_s"] > 0 and figures["device_decode_img_s"] > 0
    assert figures["device_decode_img_s_wall"] > 0 and figures["device_img_s"] > 0 and figures["device_ratio"] > 0
    assert "hop from worker to training process" in figures["device_excludes"]


def test_both_paths_decode_the_bench_images_to_the_same_size_and_pixels(tmp_path):
    """The bench's ImageNet-like JPEGs (500x375, about 130 KiB), through the loader's decode and through PIL."""
    samples = jpeg_decode.write_images(tmp_path, 2)
    for name, _ in samples:
        assert 110 * 1024 < (tmp_path / name).stat().st_size < 150 * 1024
        ours, pils = decode(tmp_path / name), F.pil_to_tensor(default_loader(str(tmp_path / name)))
        assert ours.dtype == torch.uint8 and ours.shape == pils.shape == (3, 375, 500)
        assert torch.equal(ours, pils)
