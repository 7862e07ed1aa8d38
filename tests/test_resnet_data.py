"""ResNet's input against the reference: the training crop's bounds and fallback, counted over seeded draws."""

from __future__ import annotations

import random
import statistics

import torch
from torchvision.transforms.v2 import functional as F

from workloads.resnet.data import CROP_ASPECT, reference_crop, train_image

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
