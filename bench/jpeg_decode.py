"""JPEG decode per core for ResNet's loader: libjpeg-turbo through torchvision.io with the crop on uint8 tensors,
against the same transform through PIL, both measured in one run on one pinned core (goal: 600 img/s).

    python bench/jpeg_decode.py [--images 64] [--repeats 3] [--json results/bench/jpeg_decode.json]
    python bench/jpeg_decode.py --quick --json /tmp/jpeg.json    # 4 images, one pass: the output, not a speed
    python bench/jpeg_decode.py --device cuda --json results/bench/jpeg_decode_cuda.json    # where a GPU is lent

Each image goes through what a loader worker does for one training sample: read the file, decode it to RGB, the
reference's random crop resized to 224 and the flip, kept uint8 (the loader's own TrainImages). The PIL path is
the loader before: PIL's open and convert("RGB") (torchvision's default_loader), the same train_image on the PIL
image, then a tensor; each image gets the same draws on both paths. An H100 trains ResNet-50 at NVIDIA's 7,010
img/s and a DGX-class node has about 14 cores per GPU: about 500 img/s per core.

The JPEGs are written by the bench: ImageNet's typical 500x375, quality 90, about 130 KiB (bench/gpu_formats.py's
photograph-like field with more grain). The process is pinned to one CPU and torch to one thread; the passes
alternate (PIL, then tensors, `--repeats` times, after one warm-up pass each), so load from elsewhere on the
machine falls on both. A rate is images per second of the process's CPU time (`*_img_s`: per core, whatever
else the core runs) and of wall time (`*_img_s_wall`: the same on an idle core, less on a shared one); each is
the median of its passes, and each ratio the median of the passes' ratios.
The JSON also says whether both paths decoded every image to the same size and pixels, and how far their
224 px outputs differ: the two antialiased resizes round differently, by one level up as often as down.

The device path (ResNet's --decode device) is timed in the same alternation, in two parts: what a loader worker
does (read the file, parse the JPEG's header, draw the crop and flip: `device_worker_img_s`, per CPU second), then
the whole set as one batch, decoded in one call on `--device` and cropped there, as the training process does
(`device_decode_img_s` per CPU second of that process, `device_decode_img_s_wall` per wall second, the device
synchronised). On the CPU (libjpeg-turbo in the main process) `device_img_s` is both parts per core, and
`device_ratio` its ratio to the loader's path. With `--device cuda` (nvjpeg; run it where a GPU is lent)
`device_ratio` is the GPU's batched decode per wall second against one core's loader path per wall second.
`device_output_max_difference` is how far its 224 px outputs are from the loader path's: 0 on the CPU.
Neither part includes the DataLoader's hop from a worker process to the training process (the batch pickled
into shared memory, a file descriptor per storage, the queue, unpickled and pinned), which the device path pays
on every batch and the loader path on its finished crops (`device_excludes` in the JSON says so): `device_ratio`
overstates what --decode device gains by what that hop costs, not measured here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import PIL
import torch
import torchvision
from PIL import features
from torchvision.datasets.folder import default_loader
from torchvision.transforms.v2 import functional as F

from gpu_formats import IMAGENET_LIKE_SIZE, JPEG_QUALITY, jpeg_image  # bench/, beside this script
from summary import machine, publish
from workloads.resnet.data import TrainImages, augmentation_rng, collate_encoded, decode, decode_batch, train_image

GOAL_IMG_S = 600
CROP = 224
GRAIN = 68  # about 130 KiB per 500x375 image at quality 90
SEED = 1


def write_images(folder: Path, count: int) -> list[tuple[str, int]]:
    """`count` distinct ImageNet-like JPEGs in folder/n00000000/, as scan_images lists them."""
    rng = np.random.default_rng(SEED)
    (folder / "n00000000").mkdir(parents=True, exist_ok=True)
    samples = []
    for i in range(count):
        name = f"n00000000/{i:05d}.JPEG"
        (folder / name).write_bytes(jpeg_image(rng, IMAGENET_LIKE_SIZE, GRAIN))
        samples.append((name, 0))
    return samples


def pil_image(folder: Path, samples: list[tuple[str, int]], i: int) -> torch.Tensor:
    """The PIL path: the loader's transform before it moved to torchvision.io, with the same draws."""
    image = default_loader(str(folder / samples[i][0]))
    return F.pil_to_tensor(train_image(image, CROP, augmentation_rng(SEED, 0, i)))


def rate(one, count: int) -> tuple[float, float]:
    """Images per second of one pass over the images: per second of this process's CPU time (per core, whatever
    else the shared core runs) and per second of wall time."""
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(count):
        one(i)
    return count / (time.process_time() - cpu), count / (time.perf_counter() - wall)


def device_rate(encoded: TrainImages, count: int, device: torch.device) -> tuple[float, float, float]:
    """One pass of the device path: the workers' part (read, header, draws) per CPU second, then the set decoded
    and cropped as one batch on `device`, per CPU second and per wall second of this process."""
    cpu = time.process_time()
    batch = collate_encoded([encoded[(0, i)] for i in range(count)])
    worker_cpu = time.process_time() - cpu
    cpu, wall = time.process_time(), time.perf_counter()
    decode_batch(batch, CROP, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return count / worker_cpu, count / (time.process_time() - cpu), count / (time.perf_counter() - wall)


def compare(folder: Path, samples: list[tuple[str, int]], tensors: TrainImages, encoded: TrainImages,
            device: torch.device) -> dict:
    """Both paths on every image: the decoded sizes and pixels, and the 224 px outputs; the device path's outputs
    against the loader path's."""
    decoded = [(decode(folder / name), F.pil_to_tensor(default_loader(str(folder / name)))) for name, _ in samples]
    outputs = [(tensors[(0, i)][0].int(), pil_image(folder, samples, i).int()) for i in range(len(samples))]
    out_diff = torch.cat([(a - b).flatten() for a, b in outputs])  # in uint8 levels, tensor path minus PIL
    on_device = decode_batch(collate_encoded([encoded[(0, i)] for i in range(len(samples))]), CROP, device)
    device_diff = on_device.cpu().int() - torch.stack([a for a, _ in outputs])
    return {"same_decoded_sizes": all(a.shape == b.shape for a, b in decoded),
            "decoded_sizes": sorted({tuple(a.shape) for a, _ in decoded}),
            "decoded_max_difference": max(int((a.int() - b.int()).abs().max()) for a, b in decoded),
            "output_size": list(outputs[0][0].shape),
            "output_max_difference": int(out_diff.abs().max()),
            "output_share_differing": round(float((out_diff != 0).float().mean()), 5),
            "output_mean_difference": round(float(out_diff.float().mean()), 5),
            "device_output_max_difference": int(device_diff.abs().max())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=64, help="distinct JPEGs to write and decode")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per path (the median is kept)")
    parser.add_argument("--quick", action="store_true", help="4 images, one pass: checks the output, not a speed")
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"),
                        help="where the device path decodes: cpu (libjpeg-turbo in this process) or cuda (nvjpeg)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    count, repeats = (4, 1) if args.quick else (args.images, args.repeats)
    if count < 1 or repeats < 1:
        parser.error("--images and --repeats must be at least 1")

    cpu = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        samples = write_images(folder, count)
        tensors = TrainImages(folder, samples, CROP, SEED)
        encoded = TrainImages(folder, samples, CROP, SEED, on_device=True)
        paths = {"pil": lambda i: pil_image(folder, samples, i), "tensor": lambda i: tensors[(0, i)]}
        load_before = os.getloadavg()
        for one in paths.values():  # warm-up: page cache, allocator, lazy imports
            rate(one, count)
        device_rate(encoded, count, args.device)  # and the device's decoder (nvjpeg's handle, CUDA's context)
        runs, walls = {name: [] for name in paths}, {name: [] for name in paths}
        device_runs = []  # (workers' part, decode per CPU second, decode per wall second) per pass
        for _ in range(repeats):
            for name, one in paths.items():
                per_cpu_s, per_wall_s = rate(one, count)
                runs[name].append(per_cpu_s)
                walls[name].append(per_wall_s)
            device_runs.append(device_rate(encoded, count, args.device))
        load_after = os.getloadavg()
        checked = compare(folder, samples, tensors, encoded, args.device)
        mean_kib = sum((folder / name).stat().st_size for name, _ in samples) / count / 1024

    pil, tensor = statistics.median(runs["pil"]), statistics.median(runs["tensor"])
    per_core = [1 / (1 / worker + 1 / decoding) for worker, decoding, _ in device_runs]  # both parts on one core
    if args.device.type == "cpu":
        device_ratio = statistics.median(d / t for d, t in zip(per_core, runs["tensor"]))
    else:  # one GPU's batched decode against one core's loader path
        device_ratio = statistics.median(d[2] / t for d, t in zip(device_runs, walls["tensor"]))
    figures = {
        "machine": machine(),
        "measured": f"read + decode to RGB + reference random crop resized to {CROP} + flip, uint8, one image at a "
                    f"time (the device path: the {count} images as one batch on {args.device}), {count} images x "
                    f"{repeats} passes per path, alternating; img/s per CPU second (*_img_s) and per wall second "
                    f"(*_img_s_wall)",
        "versions": {"torch": torch.__version__, "torchvision": torchvision.__version__, "pillow": PIL.__version__,
                     "pillow_libjpeg_turbo": features.version("libjpeg_turbo")},
        "conditions": {"torch_threads": torch.get_num_threads(), "pinned_cpu": cpu,
                       "load_average_1m_before": round(load_before[0], 2),
                       "load_average_1m_after": round(load_after[0], 2)},
        "images": {"count": count, "size": list(IMAGENET_LIKE_SIZE), "quality": JPEG_QUALITY,
                   "mean_kib": round(mean_kib, 1)},
        "pil_img_s": round(pil, 1),
        "tensor_img_s": round(tensor, 1),
        "ratio": round(statistics.median(t / p for t, p in zip(runs["tensor"], runs["pil"])), 3),
        "pil_img_s_passes": [round(r, 1) for r in runs["pil"]],
        "tensor_img_s_passes": [round(r, 1) for r in runs["tensor"]],
        "pil_img_s_wall": round(statistics.median(walls["pil"]), 1),
        "tensor_img_s_wall": round(statistics.median(walls["tensor"]), 1),
        "ratio_wall": round(statistics.median(t / p for t, p in zip(walls["tensor"], walls["pil"])), 3),
        "device": str(args.device),
        "device_worker_img_s": round(statistics.median(d[0] for d in device_runs), 1),
        "device_decode_img_s": round(statistics.median(d[1] for d in device_runs), 1),
        "device_decode_img_s_wall": round(statistics.median(d[2] for d in device_runs), 1),
        "device_img_s": round(statistics.median(per_core), 1) if args.device.type == "cpu" else None,
        "device_ratio": round(device_ratio, 3),
        "device_excludes": "the DataLoader's hop from worker to training process (pickling into shared memory, "
                           "file descriptors, the queue, pinning): device_ratio overstates the gain by its cost",
        **checked,
        "goal_img_s_per_core": GOAL_IMG_S,
        "met": tensor >= GOAL_IMG_S,
        "quick": args.quick,
    }
    publish(figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
