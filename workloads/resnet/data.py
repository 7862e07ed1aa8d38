"""ImageNet input for ResNet: the real ImageFolder path, a generated tiny dataset in the same layout, and synthetic batches.

The tiny preset writes its dataset as PNG files in ImageNet's folder layout
(train/<class>/*.png, val/<class>/*.png) so that it runs through exactly the
loader and the MLPerf preprocessing the full preset uses on real ImageNet.
"""

from __future__ import annotations

import functools
import io
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, get_worker_info
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset
from torchvision.io import ImageReadMode, decode_image, decode_jpeg, read_file
from torchvision.transforms.v2 import functional as F

from workloads.common.cache import build_once, cache_root
from workloads.common.data import ResumableSampler
from workloads.common.distributed import DistContext, broadcast_object

# ImageNet statistics, as in the MLPerf reference.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
IMAGENET_TRAIN_SAMPLES = 1_281_167
IMAGENET_EVAL_SAMPLES = 50_000


# The reference's training crop: tf.image.sample_distorted_bounding_box as _decode_crop_and_flip calls it in
# mlcommons/training retired_benchmarks/resnet/tf2/tensorflow2/imagenet_preprocessing.py (min_object_covered 0.1,
# aspect_ratio_range [0.75, 1.33], area_range [0.05, 1.0], max_attempts 100, use_image_if_no_bounding_boxes),
# drawn as TensorFlow's kernel draws it (tensorflow/core/kernels/image/sample_distorted_bounding_box_op.cc).
CROP_AREA = (0.05, 1.0)
CROP_ASPECT = (0.75, 1.33)  # width / height
CROP_MIN_OBJECT_COVERED = 0.1
CROP_ATTEMPTS = 100


def reference_crop(height: int, width: int, rng: random.Random) -> tuple[int, int, int, int]:
    """The reference's random crop of a height x width image: (top, left, crop height, crop width).

    Up to CROP_ATTEMPTS tries: an aspect ratio uniform in CROP_ASPECT, then a crop height uniform (the side, not the
    area) between the heights that give CROP_AREA's bounds, kept only if the crop covers CROP_MIN_OBJECT_COVERED of
    the object's box. ImageFolder's JPEGs carry no boxes, so the box is the whole image (the reference's
    use_image_if_no_bounding_boxes) and a kept crop holds at least 10% of the image: the area range's [0.05, 0.1)
    is drawn and rejected. When no try is kept, the crop is the whole image (torchvision's fallback, a center crop
    clamped to the aspect range, is not the reference's).
    """
    for _ in range(CROP_ATTEMPTS):
        aspect = rng.random() * (CROP_ASPECT[1] - CROP_ASPECT[0]) + CROP_ASPECT[0]
        box = _random_crop(height, width, aspect, rng)
        if box is not None and box[2] * box[3] >= max(1.0, CROP_MIN_OBJECT_COVERED * height * width):
            return box
    return 0, 0, height, width


def _random_crop(height: int, width: int, aspect: float, rng: random.Random) -> tuple[int, int, int, int] | None:
    """TensorFlow's GenerateRandomCrop: one try at a crop of `aspect` within CROP_AREA, or None (round() is C's
    lrintf, half to even)."""
    min_area, max_area = CROP_AREA[0] * width * height, CROP_AREA[1] * width * height
    crop_h, max_h = round(math.sqrt(min_area / aspect)), round(math.sqrt(max_area / aspect))
    if round(max_h * aspect) > width:  # the tallest crop whose width still fits
        max_h = int((width + 0.5 - 1e-7) / aspect)
        if round(max_h * aspect) > width:
            max_h -= 1
    max_h = min(max_h, height)
    crop_h = min(crop_h, max_h)
    if crop_h < max_h:
        crop_h += rng.randrange(max_h - crop_h + 1)
    crop_w = round(crop_h * aspect)
    if crop_w * crop_h < min_area:  # rounding's way out, a row taller then one shorter, as TensorFlow's
        crop_h += 1
        crop_w = round(crop_h * aspect)
    if crop_w * crop_h > max_area:
        crop_h -= 1
        crop_w = round(crop_h * aspect)
    area = crop_w * crop_h
    if not (min_area <= area <= max_area and 0 < crop_w <= width and 0 < crop_h <= height):
        return None
    top = rng.randrange(height - crop_h) if crop_h < height else 0
    left = rng.randrange(width - crop_w) if crop_w < width else 0
    return top, left, crop_h, crop_w


@dataclass(frozen=True)
class Augmentation:
    """One training sample's draws: the reference's crop box (top, left, height, width) and the flip."""

    box: tuple[int, int, int, int]
    flip: bool


def draw_augmentation(height: int, width: int, rng: random.Random) -> Augmentation:
    """The draws of one height x width image's augmentation, in the reference's order: its random crop
    (reference_crop), then the left-right flip with probability 1/2. Needs the image's size only, so a loader
    worker can draw them from a JPEG's header and leave the decoding to the device."""
    box = reference_crop(height, width, rng)
    return Augmentation(box, rng.random() < 0.5)


def augment(image, crop: int, augmentation: Augmentation):
    """Apply drawn augmentation to one image (PIL, or a uint8 tensor on any device): the box resized to crop x
    crop (bilinear, antialiased), flipped if drawn so."""
    image = F.resized_crop(image, *augmentation.box, [crop, crop], antialias=True)
    return F.horizontal_flip(image) if augmentation.flip else image


def train_image(image, crop: int, rng: random.Random):
    """The reference's training augmentation of one image (PIL or uint8 tensor), drawn from `rng` and applied."""
    return augment(image, crop, draw_augmentation(*F.get_size(image), rng))


def augmentation_rng(seed: int, epoch: int, index: int) -> random.Random:
    """The random draws of one training sample's augmentation, seeded by (run seed, epoch, dataset index).

    They depend on which sample it is, never on which loader worker or rank decodes it or how many that worker
    decoded before: a resumed run rebuilds its iterator and deals its batches to the workers afresh (batch k to
    worker 0), and a worker seeded by (seed, epoch, worker) would still draw another batch's crops. A string seed
    is hashed by SHA-512, the same in every process."""
    return random.Random(f"{seed}/{epoch}/{index}")


def eval_image(image, crop: int):
    """MLPerf eval preprocessing of one image (PIL or uint8 tensor): the shorter side resized to crop*256/224 (256
    for 224; bilinear, antialiased), then the center crop x crop."""
    return F.center_crop(F.resize(image, round(crop * 256 / 224), antialias=True), crop)


def decode(path: Path) -> torch.Tensor:
    """An image file to a uint8 RGB tensor (3, H, W): JPEG by libjpeg-turbo (torchvision.io), PNG (the tiny
    dataset's) by libpng, whatever the file's name says (ImageNet holds one PNG named .JPEG); grayscale and CMYK
    JPEGs (ImageNet has both) converted to RGB, to the pixels PIL's convert("RGB") gave. With the crop and resize
    on uint8 tensors, faster per core than PIL's decode and resize (bench/jpeg_decode.py, docs/measured.md).
    torchvision 0.29 deprecates its decoders for TorchCodec's: decode_bytes and decode_jpegs are the places to
    change."""
    return decode_bytes(read_file(str(path)))


def decode_bytes(data: torch.Tensor) -> torch.Tensor:
    """An image file's bytes (a uint8 tensor, as read_file gives them) to a uint8 RGB tensor: see decode."""
    return decode_image(data, mode=ImageReadMode.RGB)


class UnreadableImage(RuntimeError):
    """An image file the decoder refuses (truncated, half-written, corrupt), named: torchvision's own error says
    which line of its C++ failed, not which of ImageNet's 1.28M files."""


def decode_file_bytes(data: torch.Tensor, path: str) -> torch.Tensor:
    """decode_bytes of the file at `path`, whose failure names the file (UnreadableImage): the one decode both
    --decode workers (in the loader workers) and --decode device (for a batch its device refused) fall back on,
    so a bad file fails with the same message either way."""
    try:
        return decode_bytes(data)
    except RuntimeError as exc:
        raise UnreadableImage(f"cannot decode image file {path}: {exc}") from exc


# --- decoding on the device (--decode device) --------------------------------------------------------------------


@dataclass
class Encoded:
    """A JPEG the device decodes, as the dataset gives it: the file's bytes (a uint8 tensor on the host), the
    sample's drawn augmentation (None: eval's fixed resize and center crop) and the file (named if it fails)."""

    data: torch.Tensor
    augmentation: Augmentation | None
    path: str


def device_jpeg_size(data: torch.Tensor) -> tuple[int, int] | None:
    """(height, width) of an image file the device decoder takes, from its header alone; None for one it does
    not, which the loader worker decodes itself (decode_file_bytes) as with --decode workers.

    The device decoder is torchvision's decode_jpeg: nvjpeg on CUDA, which takes JPEGs only, and of those the
    1-component (grayscale) and 3-component (YCbCr) ones. CMYK and YCCK JPEGs (4 components; ImageNet holds a few
    dozen) are left out: torchvision's GPU decoder is not tested on them (its tests leave its CMYK image out),
    and libjpeg-turbo's RGB of them is the one the tests hold the loader to. PNG (the tiny dataset's; the one PNG
    in ImageNet, named .JPEG) is not a JPEG. nvjpeg decodes a whole batch or nothing, so a file it cannot take
    should not reach it (a batch that fails is decoded again on the CPU, image by image: decode_jpegs). The rule
    is the same on every device, so the CPU tests see the batches a GPU run sees. A file PIL cannot read is left
    to the worker too, which fails on it as --decode workers does."""
    try:
        with Image.open(io.BytesIO(data.numpy())) as image:  # parses the header, decodes nothing
            if image.format == "JPEG" and image.mode in ("L", "RGB"):
                return image.height, image.width
    except (OSError, SyntaxError, ValueError):  # PIL's UnidentifiedImageError is an OSError
        pass
    return None


@dataclass(frozen=True)
class JpegSpan:
    """One JPEG of an EncodedBatch: its place in the batch, where its bytes lie in the batch's buffer, its drawn
    augmentation (None: eval) and its file."""

    place: int
    start: int
    length: int
    augmentation: Augmentation | None
    path: str


@dataclass
class EncodedBatch:
    """A batch as the loader workers leave it with --decode device: its JPEGs' bytes one after another in one
    buffer (`data`, each JPEG a JpegSpan of it), the images the device decoder cannot take (device_jpeg_size)
    finished by the worker and stacked (uint8 (M, 3, crop, crop), at `finished_at`), and the labels.

    Three tensors whatever the batch's size: torch passes each storage that crosses from a worker to the
    training process through a file descriptor of its own (its default file_descriptor sharing strategy), and
    one per JPEG ran a worker out of descriptors (270-539 open against 17-29 with --decode workers; under
    `ulimit -n 512` "Too many open files", and the loader waited forever). pin_memory() pins the three, so a
    DataLoader with pin_memory=True pins it as it pins tensors: one pin per batch."""

    data: torch.Tensor
    jpegs: list[JpegSpan]
    finished: torch.Tensor
    finished_at: list[int]
    labels: torch.Tensor

    def pin_memory(self) -> "EncodedBatch":
        return EncodedBatch(self.data.pin_memory(), self.jpegs, self.finished.pin_memory(), self.finished_at,
                            self.labels.pin_memory())


def _joined(join, tensors: list[torch.Tensor]) -> torch.Tensor:
    """join(tensors) (torch.cat or torch.stack), an empty uint8 tensor for none. In a loader worker it is written
    straight into shared memory, as default_collate writes its batches, so it crosses without another copy."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    out = None
    if get_worker_info() is not None:
        storage = tensors[0]._typed_storage()._new_shared(sum(t.numel() for t in tensors))
        out = tensors[0].new(storage).resize_(0)  # join() sizes it, within the storage
    return join(tensors, out=out)


def collate_encoded(samples: list[tuple[Encoded | torch.Tensor, int]]) -> EncodedBatch:
    """The DataLoader's collate_fn with --decode device: an EncodedBatch (the JPEGs' bytes copied into one
    buffer, which also takes them out of read_file's mapping: a mapped storage cannot cross to the training
    process), the labels one tensor as default_collate makes it."""
    jpegs, data, finished, finished_at, start = [], [], [], [], 0
    for place, (image, _) in enumerate(samples):
        if isinstance(image, Encoded):
            jpegs.append(JpegSpan(place, start, image.data.numel(), image.augmentation, image.path))
            data.append(image.data)
            start += image.data.numel()
        else:
            finished.append(image)
            finished_at.append(place)
    return EncodedBatch(_joined(torch.cat, data), jpegs, _joined(torch.stack, finished), finished_at,
                        torch.tensor([label for _, label in samples]))


def on_side_stream(device: torch.device, decode):
    """decode() (a list of tensors it allocates on `device`) run so that nvjpeg cannot write over memory the
    caller's stream still uses; on any other device just decode().

    torchvision's decode_jpeg(list, device=cuda) allocates its outputs on the caller's current stream and has
    nvjpeg write them from a private stream that does not wait for the caller's (pytorch/vision#9606): a block
    the previous step freed while its kernels are still queued can be handed out and overwritten under them,
    silently wrong activations or gradients. On a side stream of its own the outputs come from that stream's
    pool, where nothing else runs; each is recorded on the caller's stream (record_stream), so its block returns
    to the pool only once the caller's work on it (the crops) is done; and the caller's stream waits for the
    side stream, on which torchvision makes its outputs wait for nvjpeg. Read from torchvision 0.29's source,
    never run here: no GPU has been lent to this project."""
    if device.type != "cuda":
        return decode()
    current, side = torch.cuda.current_stream(device), _side_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        decoded = decode()
    current.wait_stream(side)
    for tensor in decoded:
        tensor.record_stream(current)
    return decoded


@functools.cache
def _side_stream(device: torch.device):
    """The stream on_side_stream decodes on, one per device for the process."""
    return torch.cuda.Stream(device)


def decode_jpegs(batch: EncodedBatch, device: torch.device) -> list[torch.Tensor]:
    """The batch's JPEGs decoded to uint8 RGB on `device` in one call (on_side_stream). That call decodes all or
    nothing: if it fails (a truncated file, one nvjpeg refuses: arithmetic coding, an unknown chroma
    subsampling), they are decoded one by one on the CPU (decode_file_bytes) and moved to the device, so one odd
    file costs its batch the fast path, and a file nothing decodes fails with its name, as with --decode workers,
    rather than the batch at the same step on every resume."""
    data = [batch.data[jpeg.start:jpeg.start + jpeg.length] for jpeg in batch.jpegs]  # contiguous views
    try:
        return on_side_stream(device, lambda: decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        return [decode_file_bytes(one, jpeg.path).to(device) for one, jpeg in zip(data, batch.jpegs)]


def decode_batch(batch: EncodedBatch, crop: int, device: torch.device) -> torch.Tensor:
    """An EncodedBatch to the uint8 (N, 3, crop, crop) batch on `device` that to_model_input takes: its JPEGs
    decoded in one call on `device` (decode_jpegs: torchvision's decode_jpeg, nvjpeg on CUDA, libjpeg-turbo on
    the CPU), each then augmented or eval-cropped there by the same functions the workers use (augment,
    eval_image); the workers' finished images copied in at their places.

    On the CPU this gives the --decode workers batches exactly. On CUDA, not measured here: nvjpeg's pixels
    differ from libjpeg-turbo's by a little (torchvision's tests allow a mean of 2 levels), and torchvision
    resizes uint8 on CUDA in float32 then rounds, where the CPU has its own fixed-point uint8 kernel (they
    differ in rounding). The crop and resize run one image at a time (the boxes differ): a few small kernels per
    image on a GPU."""
    images: list[torch.Tensor | None] = [None] * len(batch.labels)
    for place, image in zip(batch.finished_at, batch.finished):
        images[place] = image
    if batch.jpegs:
        for jpeg, image in zip(batch.jpegs, decode_jpegs(batch, device)):
            images[jpeg.place] = (eval_image(image, crop) if jpeg.augmentation is None
                                  else augment(image, crop, jpeg.augmentation))
    return torch.stack([image.to(device, non_blocking=True) for image in images])


class DeviceDecoded:
    """A DataLoader of EncodedBatches as an iterable of (uint8 images on `device`, labels) batches, like the
    DataLoader of --decode workers: the decoding happens here, in the training process, batch by batch."""

    def __init__(self, loader: DataLoader, crop: int, device: torch.device):
        self.loader, self.crop, self.device = loader, crop, device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield decode_batch(batch, self.crop, self.device), batch.labels


def to_model_input(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A uint8 batch (N, 3, H, W) -> the model's input on `device`: copied as uint8 (a quarter of float32's
    bytes), then scaled to [0, 1], normalised by ImageNet's statistics (what ToTensor and Normalize did on the
    host), laid out channels_last, and cast to bf16 on GPUs (the dtype autocast would give the first conv)."""
    mean, std = _statistics(device)
    normalised = images.to(device, non_blocking=True).float().div_(255).sub_(mean).div_(std)
    return normalised.to(memory_format=torch.channels_last,
                         dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)


@functools.cache
def _statistics(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """MEAN and STD as (1, 3, 1, 1) tensors on `device`, made once: a copy to the GPU every step would wait."""
    return (torch.tensor(MEAN, device=device).view(1, 3, 1, 1), torch.tensor(STD, device=device).view(1, 3, 1, 1))


def scan_images(folder: Path) -> list[tuple[str, int]]:
    """`folder`/<class>/<image> as ImageFolder lists it, by its own functions (so in its order): (path relative
    to the folder, class index by sorted class name)."""
    _, class_to_idx = find_classes(folder)
    return [(os.path.relpath(path, folder), label)
            for path, label in make_dataset(folder, class_to_idx, extensions=IMG_EXTENSIONS)]


def shared_image_list(folder: Path, ctx: DistContext) -> list[tuple[str, int]]:
    """The folder's image list (see scan_images), scanned by rank 0 alone and sent to every rank: one listing
    of ImageNet's 1.28M files per job, not one per rank (relative paths: about 46 MB pickled). A scan that
    fails fails on every rank with rank 0's message rather than leaving the others waiting."""
    scanned: list[tuple[str, int]] | str | None = None
    if ctx.is_main:
        try:
            check_layout(folder.parent)  # rank 0's view decides, so a node without the data cannot stop alone
            scanned = scan_images(folder)
        except (OSError, ValueError) as exc:
            scanned = str(exc)
    scanned = broadcast_object(scanned, ctx)
    if isinstance(scanned, str):
        raise FileNotFoundError(scanned)
    return scanned


class EpochSampler(ResumableSampler):
    """A ResumableSampler whose items are (epoch, index) keys for TrainImages: persistent workers hold copies of
    the dataset made once, so the epoch travels with each index rather than through the dataset."""

    def __iter__(self):
        epoch = self.sampler.epoch
        return ((epoch, i) for i in super().__iter__())


class ListedImages(Dataset):
    """The images of a list from scan_images, under `folder`, with their class index. With `on_device`, the JPEGs
    the device decoder takes (device_jpeg_size) come out as Encoded bytes, the rest decoded here as without."""

    def __init__(self, folder: Path, samples: list[tuple[str, int]], crop: int, on_device: bool = False):
        self.folder, self.samples, self.crop, self.on_device = folder, samples, crop, on_device

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, i: int) -> tuple[torch.Tensor, str, tuple[int, int] | None, int]:
        """The i-th file's bytes and path; its (height, width) if the device decodes it, else None; its class
        index."""
        path, label = self.samples[i]
        path = str(self.folder / path)
        data = read_file(path)
        return data, path, device_jpeg_size(data) if self.on_device else None, label


class TrainImages(ListedImages):
    """Training images by (epoch, index) key (see EpochSampler), augmented with the sample's own draws
    (augmentation_rng): (uint8 image tensor, or Encoded with its drawn augmentation; class index)."""

    def __init__(self, folder: Path, samples: list[tuple[str, int]], crop: int, seed: int, on_device: bool = False):
        super().__init__(folder, samples, crop, on_device)
        self.seed = seed

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor | Encoded, int]:
        epoch, i = key
        data, path, size, label = self.read(i)
        rng = augmentation_rng(self.seed, epoch, i)
        if size is not None:
            return Encoded(data, draw_augmentation(*size, rng), path), label
        return train_image(decode_file_bytes(data, path), self.crop, rng), label


class EvalImages(ListedImages):
    """Eval images by index, resized and center-cropped (eval_image): (uint8 image tensor, or Encoded; class
    index)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor | Encoded, int]:
        data, path, size, label = self.read(i)
        if size is not None:
            return Encoded(data, None, path), label
        return eval_image(decode_file_bytes(data, path), self.crop), label


@dataclass
class Loaders:
    train: object  # an iterable of (uint8 images, labels) batches with len(); see to_model_input
    eval: object
    train_samples: int
    eval_samples: int
    sampler: ResumableSampler | None  # needs set_epoch() each epoch; None for synthetic input


def check_layout(root: Path) -> None:
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise FileNotFoundError(f"{root} has no {split}/ folder: expected ImageNet's layout "
                                    f"{root}/train/<class>/*.JPEG and {root}/val/<class>/*.JPEG")


def image_folder_loaders(root: Path, train_images: list[tuple[str, int]], eval_images: list[tuple[str, int]],
                         crop: int, batch_size: int, workers: int, ctx: DistContext, seed: int,
                         decode: str = "workers") -> Loaders:
    """Loaders over an ImageNet-layout folder (root/train/<class>/..., root/val/<class>/...), whose images
    `train_images` and `eval_images` list (see shared_image_list). With `decode` "workers" the loader workers
    decode and crop to uint8 tensors; with "device" they read the files and draw the augmentations, and the
    batches are decoded and cropped on ctx.device (DeviceDecoded), to the same uint8 batches.

    The training order and each sample's augmentation follow the run's seed (the same on every rank, so the
    ranks' shards stay disjoint): each run of a campaign sees its own order and crops, and a resumed run, with
    any number of workers, the order and crops it had.
    """
    on_device = decode == "device"
    train_set = TrainImages(root / "train", train_images, crop, seed, on_device)
    eval_set = EvalImages(root / "val", eval_images, crop, on_device)
    sampler = EpochSampler(DistributedSampler(train_set, ctx.world_size, ctx.rank, shuffle=True, seed=seed,
                                              drop_last=True))
    # Each rank scores a disjoint slice, so the summed counts cover every eval image exactly once.
    eval_shard = Subset(eval_set, range(ctx.rank, len(eval_set), ctx.world_size))
    common = dict(batch_size=batch_size, num_workers=workers, pin_memory=ctx.device.type == "cuda",
                  persistent_workers=workers > 0, collate_fn=collate_encoded if on_device else None)
    train = DataLoader(train_set, sampler=sampler, drop_last=True, **common)
    evaluation = DataLoader(eval_shard, shuffle=False, **common)
    if on_device:
        train, evaluation = DeviceDecoded(train, crop, ctx.device), DeviceDecoded(evaluation, crop, ctx.device)
    return Loaders(train=train, eval=evaluation, train_samples=len(train_set), eval_samples=len(eval_set),
                   sampler=sampler)


class SyntheticBatches:
    """The same random uint8 batch, already on the device, `steps` times: measures the model, not the input
    pipeline."""

    def __init__(self, steps: int, batch_size: int, crop: int, classes: int, device: torch.device):
        self.steps = steps
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (batch_size, 3, crop, crop), generator=generator,
                                    dtype=torch.uint8).to(device)
        self.labels = torch.randint(0, classes, (batch_size,), generator=generator).to(device)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self):
        for _ in range(self.steps):
            yield self.images, self.labels


def synthetic_loaders(crop: int, batch_size: int, classes: int, ctx: DistContext) -> Loaders:
    """An ImageNet-sized epoch of synthetic batches; eval is one batch per rank (its accuracy means nothing)."""
    steps = IMAGENET_TRAIN_SAMPLES // (batch_size * ctx.world_size)
    return Loaders(train=SyntheticBatches(steps, batch_size, crop, classes, ctx.device),
                   eval=SyntheticBatches(1, batch_size, crop, classes, ctx.device),
                   train_samples=steps * batch_size * ctx.world_size,
                   eval_samples=batch_size * ctx.world_size, sampler=None)


# --- the tiny dataset -------------------------------------------------------------------------

TINY_VERSION = 1
TINY_CLASSES = 10
TINY_SIZE = 32
TINY_TRAIN_PER_CLASS = 500
TINY_EVAL_PER_CLASS = 100


def tiny_dataset_root() -> Path:
    return cache_root() / f"tiny-imagenet-v{TINY_VERSION}"


def ensure_tiny_dataset(root: Path) -> Path:
    """Generate the tiny dataset once (see build_once)."""
    return build_once(root, _write_tiny_dataset)


def _class_patterns() -> list[dict]:
    """Each class is two coloured sine gratings with their own orientation and frequency."""
    patterns = []
    for c in range(TINY_CLASSES):
        rng = np.random.default_rng(1000 + c)
        patterns.append({"theta": rng.uniform(0, math.pi, 2), "freq": rng.uniform(1.5, 4.5, 2),
                         "color": rng.uniform(0.2, 1.0, (2, 3))})
    return patterns


def _tiny_image(pattern: dict, rng: np.random.Generator) -> np.ndarray:
    """One sample: the class's gratings at a random phase and jittered angle, random contrast, heavy noise."""
    yy, xx = np.mgrid[0:TINY_SIZE, 0:TINY_SIZE] / TINY_SIZE
    img = np.zeros((TINY_SIZE, TINY_SIZE, 3))
    for g in range(2):
        theta = pattern["theta"][g] + rng.normal(0, 0.15)
        wave = np.sin(2 * math.pi * pattern["freq"][g] * (xx * math.cos(theta) + yy * math.sin(theta))
                      + rng.uniform(0, 2 * math.pi))
        img += wave[..., None] * pattern["color"][g]
    img = img * rng.uniform(0.5, 1.0) + rng.normal(0, 1.3, img.shape)
    return (np.clip((img + 2) / 4, 0, 1) * 255).astype(np.uint8)


def _write_tiny_dataset(root: Path) -> None:
    patterns = _class_patterns()
    for split, per_class, seed in (("train", TINY_TRAIN_PER_CLASS, 1), ("val", TINY_EVAL_PER_CLASS, 2)):
        rng = np.random.default_rng(seed)
        for c, pattern in enumerate(patterns):
            folder = root / split / f"class_{c:02d}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(_tiny_image(pattern, rng)).save(folder / f"{i:05d}.png")
