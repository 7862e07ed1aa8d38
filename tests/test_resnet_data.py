"""ResNet's input: the training crop against the reference's (bounds and fallback, counted over seeded draws),
a resumed run's augmentations with loader workers, and the decoder against PIL's."""

from __future__ import annotations

import random
import statistics

import numpy as np
import torch
from PIL import Image
from torchvision.datasets.folder import default_loader
from torchvision.transforms.v2 import functional as F

from tests.test_resnet_campaign import _ctx, _write_images
from workloads.resnet.data import (CROP_ASPECT, decode, image_folder_loaders, reference_crop, scan_images,
                                   train_image)

# An ImageNet-sized image (500x375, the bench's and ImageNet's most common size) and enough draws that the
# counts below are far from their bounds; the generator is seeded, so the counts are the same on every machine.
HEIGHT, WIDTH, DRAWS = 375, 500, 4000


def test_the_crop_keeps_a_tenth_to_all_of_the_image_at_the_reference_aspect():
    """Every crop lies in the image, covers at least 10% of it (min_object_covered 0.1 with the whole image as the
    box: the area range's [0.05, 0.1) is drawn and rejected) and at most all of it, at an aspect ratio in
    [0.75, 1.33] up to rounding a side to whole pixels; the draws reach both ends of the area range. The side,
    not the area, is uniform, so the median crop holds well under half the image (torchvision's uniform area
    in [0.08, 1] puts 122 of 4,000 crops under a tenth of this image, and its median at 0.42)."""
    rng = random.Random(0)
    areas = []
    for _ in range(DRAWS):
        top, left, h, w = reference_crop(HEIGHT, WIDTH, rng)
        assert 0 <= top and top + h <= HEIGHT and 0 <= left and left + w <= WIDTH
        assert CROP_ASPECT[0] - 0.5 / h <= w / h <= CROP_ASPECT[1] + 0.5 / h
        areas.append(h * w / (HEIGHT * WIDTH))
    assert min(areas) >= 0.1 and max(areas) <= 1.0
    assert min(areas) < 0.101 and max(areas) > 0.97
    assert sum(a < 0.2 for a in areas) > 0.1 * DRAWS
    assert statistics.median(areas) < 0.4


def test_without_a_crop_in_100_tries_the_whole_image_is_the_crop():
    """A 10x1000 strip holds no crop of a tenth of its area at the reference's aspect ratios: the reference keeps
    the whole image (torchvision's fallback would center-crop it to a 10x13 square-ish box)."""
    rng = random.Random(0)
    assert [reference_crop(10, 1000, rng) for _ in range(5)] == [(0, 0, 10, 1000)] * 5
    assert reference_crop(1, 1, rng) == (0, 0, 1, 1)


def test_the_training_image_is_the_crop_resized_and_flipped_half_the_time():
    """train_image resizes the reference's crop to crop x crop, kept uint8, and flips it on the next draw with
    probability 1/2 (counted over 400 images)."""
    image = torch.arange(3 * 40 * 60).remainder(251).to(torch.uint8).reshape(3, 40, 60)
    rng, replay, flips = random.Random(1), random.Random(1), 0
    for _ in range(400):
        out = train_image(image, 16, rng)
        expected = F.resized_crop(image, *reference_crop(40, 60, replay), [16, 16], antialias=True)
        flipped = replay.random() < 0.5
        flips += flipped
        assert out.dtype == torch.uint8 and torch.equal(out, expected.flip(-1) if flipped else expected)
    assert 160 < flips < 240


def _epoch(loaders, epoch: int, skip: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch's batches after the first `skip`, as the workload asks for them (ResNetWorkload._epoch_batches)."""
    loaders.sampler.set_epoch(epoch)
    loaders.sampler.skip = skip * loaders.train.batch_size
    return list(loaders.train)


def test_a_run_resumed_with_two_workers_draws_the_batches_it_would_have(tmp_path):
    """Resumed at step 3 of epoch 1 in a fresh loader (new worker processes, torch's RNG restored from the
    checkpoint, as _RankRNG does), two loader workers give the uninterrupted run's batches, pixel for pixel, for
    the rest of that epoch and the next. With the workers' own seeds they did not: a rebuilt iterator draws the
    workers new seeds, and deals batch 3 to worker 0."""
    _write_images(tmp_path, classes=2, per_class=12)
    images = scan_images(tmp_path / "train"), scan_images(tmp_path / "val")

    def loaders():
        return image_folder_loaders(tmp_path, *images, 16, 2, 2, _ctx(rank=1), seed=5)

    torch.manual_seed(5)
    uninterrupted = loaders()
    whole = [_epoch(uninterrupted, 1, 0), _epoch(uninterrupted, 2, 0)]
    checkpointed_rng = torch.get_rng_state()
    resumed_loaders = loaders()
    torch.manual_seed(6)  # the fresh process's own start, then the checkpoint's state
    torch.set_rng_state(checkpointed_rng)
    resumed = [_epoch(resumed_loaders, 1, 3), _epoch(resumed_loaders, 2, 0)]
    assert [len(b) for b in whole] == [6, 6] and [len(b) for b in resumed] == [3, 6]
    for want, got in zip(whole[0][3:] + whole[1], resumed[0] + resumed[1]):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # The augmentation is what differs between epochs, not only the order: the same image is cropped anew.
    assert not torch.equal(whole[0][0][0], whole[1][0][0])


def test_grayscale_cmyk_and_png_files_decode_to_the_rgb_pil_gave(tmp_path):
    """ImageNet holds grayscale and CMYK JPEGs and a PNG named .JPEG: decode gives the RGB pixels PIL's
    convert("RGB") gave (the loader's old path), whatever the name says."""
    pixels = np.random.default_rng(0).integers(0, 256, (30, 40, 3), np.uint8)
    for mode, fmt in (("L", "JPEG"), ("CMYK", "JPEG"), ("RGB", "JPEG"), ("RGB", "PNG")):
        path = tmp_path / f"{mode}-{fmt}.JPEG"
        Image.fromarray(pixels).convert(mode).save(path, fmt, quality=90)
        ours = decode(path)
        assert ours.shape == (3, 30, 40) and torch.equal(ours, F.pil_to_tensor(default_loader(str(path))))
