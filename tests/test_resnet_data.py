"""ResNet's input: the training crop against the reference's (bounds and fallback, counted over seeded draws),
a resumed run's augmentations with loader workers, the decoder against PIL's, and decoding on the device
(--decode device) against decoding in the workers."""

from __future__ import annotations

import dataclasses
import random
import statistics
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from mlperf_logging.mllog import constants as C
from PIL import Image
from torch.utils.data._utils.pin_memory import pin_memory
from torchvision.datasets.folder import default_loader
from torchvision.io import read_file
from torchvision.transforms.v2 import functional as F

from harness.cli import _spec_from_args, build_parser
from harness.errors import HarnessError
from harness.results.parse import iter_events
from harness.spec import JobSpec, validate
from tests.test_resnet_campaign import _ctx, _write_images
from workloads.common.campaign import RunOptions, run_campaign
from workloads.resnet import data as resnet_data
from workloads.resnet.data import (CROP_ASPECT, Augmentation, EncodedBatch, EvalImages, JpegSpan, TrainImages,
                                   UnreadableImage, collate_encoded, decode, decode_batch, device_jpeg_size,
                                   image_folder_loaders, on_side_stream, reference_crop, scan_images, train_image)
from workloads.resnet.train import ResNetWorkload

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


def _epoch(loaders, epoch: int, skip: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch's batches after the first `skip`, as the workload asks for them (ResNetWorkload._epoch_batches)."""
    loaders.sampler.set_epoch(epoch)
    loaders.sampler.skip = skip * batch
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
    whole = [_epoch(uninterrupted, 1, 0, 2), _epoch(uninterrupted, 2, 0, 2)]
    checkpointed_rng = torch.get_rng_state()
    resumed_loaders = loaders()
    torch.manual_seed(6)  # the fresh process's own start, then the checkpoint's state
    torch.set_rng_state(checkpointed_rng)
    resumed = [_epoch(resumed_loaders, 1, 3, 2), _epoch(resumed_loaders, 2, 0, 2)]
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


def test_a_decode_prints_no_warning_outside_pytest(tmp_path):
    """torchvision 0.29 warns that its decoders are deprecated at every call; Python ignores a library's
    DeprecationWarning outside pytest (whose config ignores that one), so a run's log carries none of them."""
    path = tmp_path / "one.JPEG"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40, 3), np.uint8)).save(path, "JPEG")
    proc = subprocess.run([sys.executable, "-c", "import sys; from workloads.resnet.data import decode; "
                           "print(tuple(decode(sys.argv[1]).shape))", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "(3, 30, 40)" and proc.stderr == "", proc.stderr


# --- decoding on the device (--decode device) ---------------------------------------------------------------------

def _write_mixed_images(root):
    """_write_images' RGB JPEGs and PNGs (varied sizes), and of each class folder's JPEGs one grayscale, one CMYK
    and one a PNG named .JPEG, as ImageNet holds: the device decodes the RGB and grayscale JPEGs, the workers the
    rest."""
    _write_images(root, classes=2, per_class=8, val_per_class=7)
    for name, mode, fmt in (("0.JPEG", "L", "JPEG"), ("2.JPEG", "CMYK", "JPEG"), ("4.JPEG", "RGB", "PNG")):
        for path in root.glob(f"*/*/{name}"):
            with Image.open(path) as image:
                converted = image.convert(mode)
            converted.save(path, fmt, quality=90)


def test_the_device_takes_rgb_and_grayscale_jpegs_by_their_header_and_leaves_the_rest_to_the_workers(tmp_path):
    """The size comes from the header, as (height, width); CMYK JPEGs (nvjpeg's RGB of them is not libjpeg-turbo's),
    PNG whatever its name, and a file that is no image go to the worker's own decode."""
    pixels = np.random.default_rng(0).integers(0, 256, (30, 40, 3), np.uint8)
    for mode, fmt, expected in (("RGB", "JPEG", (30, 40)), ("L", "JPEG", (30, 40)), ("CMYK", "JPEG", None),
                                ("RGB", "PNG", None)):
        path = tmp_path / f"{mode}-{fmt}.JPEG"
        Image.fromarray(pixels).convert(mode).save(path, fmt, quality=90)
        assert device_jpeg_size(read_file(str(path))) == expected, (mode, fmt)
    assert device_jpeg_size(torch.frombuffer(bytearray(b"not an image at all"), dtype=torch.uint8)) is None


def test_the_bytes_for_the_device_can_cross_to_the_training_process(tmp_path):
    """A loader worker sends its batch through a queue, pickled as torch shares CPU tensors (by their storage's
    file descriptor: importing torch registers that with ForkingPickler). read_file's tensor maps the file and
    cannot be sent (EBADF in the worker's feeder thread, which drops the batch: the loader waited forever), so
    the collate copies the bytes out, into the batch's one buffer."""
    _write_mixed_images(tmp_path)
    train = TrainImages(tmp_path / "train", scan_images(tmp_path / "train"), 16, 5, on_device=True)
    evaluation = EvalImages(tmp_path / "val", scan_images(tmp_path / "val"), 16, on_device=True)
    samples = [train[(1, 0)], evaluation[0]]  # 0.JPEG of the first class: a grayscale JPEG
    with pytest.raises(OSError):  # the mapped bytes as read_file gives them: what the collate must not pass on
        ForkingPickler.dumps(samples[0][0].data)
    ForkingPickler.dumps(collate_encoded(samples))


def _storages(obj) -> set[int]:
    """The distinct storages of the tensors in `obj` (through dataclasses, lists and tuples): each crosses from
    a loader worker to the training process through a file descriptor of its own."""
    if isinstance(obj, torch.Tensor):
        return {obj.untyped_storage().data_ptr()}
    if dataclasses.is_dataclass(obj):
        obj = [getattr(obj, field.name) for field in dataclasses.fields(obj)]
    if isinstance(obj, (list, tuple)):
        return set().union(*(_storages(item) for item in obj))
    return set()


def test_a_batch_for_the_device_holds_three_storages_whatever_its_size(tmp_path):
    """One storage per JPEG ran the workers out of file descriptors (270-539 open; under `ulimit -n 512` the
    worker failed and the run hung): a batch's JPEG bytes cross in one buffer, its finished images in one
    tensor, its labels in a third, for 2 images as for 16."""
    _write_mixed_images(tmp_path)
    train = TrainImages(tmp_path / "train", scan_images(tmp_path / "train"), 16, 5, on_device=True)
    samples = [train[(1, i)] for i in range(16)]
    for size in (2, 16):
        batch = collate_encoded(samples[:size])
        assert batch.jpegs and batch.finished_at  # both kinds, so both tensors are real
        assert len(_storages(batch)) == 3, size


@pytest.mark.parametrize("workers", [0, 2])
def test_decoding_on_the_device_gives_the_batches_the_workers_give(tmp_path, workers):
    """--decode device on the CPU against --decode workers, same seed and sampler, rank 1 of 2: the same uint8
    batches, pixel for pixel, and labels, from the start and after a resume's skip, train and eval, over RGB,
    grayscale and CMYK JPEGs and PNGs. The device's batches mix JPEGs the workers left encoded (with their drawn
    crop and flip) and images the workers finished."""
    _write_mixed_images(tmp_path)
    images = scan_images(tmp_path / "train"), scan_images(tmp_path / "val")
    batch = 2

    def loaders(decode):
        return image_folder_loaders(tmp_path, *images, 16, batch, workers, _ctx(rank=1), seed=5, decode=decode)

    on_workers, on_device = loaders("workers"), loaders("device")
    assert any(encoded.jpegs and encoded.finished_at for encoded in on_device.train.loader)  # a batch with both
    compared = 0
    for epoch, skip in ((1, 0), (2, 1)):
        want, got = _epoch(on_workers, epoch, skip, batch), _epoch(on_device, epoch, skip, batch)
        want, got = want + list(on_workers.eval), got + list(on_device.eval)
        assert len(got) == len(want) == 4 - skip + 4
        for (images, labels), (want_images, want_labels) in zip(got, want):
            assert images.dtype == torch.uint8 and images.shape[1:] == (3, 16, 16)
            assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
            compared += len(labels)
    assert compared == (8 + 7) + (6 + 7)


@pytest.mark.slow
def test_a_tiny_run_decoding_on_the_device_trains_as_one_decoding_in_the_workers(tmp_path, monkeypatch,
                                                                                   one_process_world):
    """The tiny ResNet for 8 steps (2 epochs of 4 batches of 4, an eval after each) on the mixed folder, seed 1,
    in this process: --decode device gives the loss of every step and the eval accuracies --decode workers gives."""
    _write_mixed_images(tmp_path / "data")
    losses, train_step = [], ResNetWorkload.train_step

    def recorded(self, batches):
        loss, samples = train_step(self, batches)
        losses.append(loss.item())
        return loss, samples

    monkeypatch.setattr(ResNetWorkload, "train_step", recorded)
    runs = {}
    for decode in ("workers", "device"):
        losses.clear()
        out = tmp_path / decode
        run_campaign(ResNetWorkload, RunOptions.parse(["resnet", "--out", str(out), "--data", str(tmp_path / "data"),
                                                       "--seed", "1", "--batch-size", "4", "--max-steps", "8",
                                                       "--straggler-window", "0", "--decode", decode]))
        events = list(iter_events((out / "result_0.txt").read_bytes()))
        runs[decode] = (list(losses), [e["value"] for e in events if e["key"] == C.EVAL_ACCURACY])
    assert len(runs["workers"][0]) == 8 and len(runs["workers"][1]) == 2
    assert runs["device"] == runs["workers"]


def test_a_pinned_encoded_batch_pins_every_tensor_it_holds(monkeypatch):
    """The DataLoader's pin thread (pin_memory=True on GPUs) pins an EncodedBatch through its own pin_memory():
    the JPEGs' buffer, the finished images and the labels; torch would hand an unknown object back unpinned."""
    pinned = []

    def fake_pin(tensor, *args):
        pinned.append(tensor)
        return tensor.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)  # pinning needs a GPU
    jpeg = JpegSpan(0, 0, 5, Augmentation((0, 0, 4, 4), flip=True), "a.JPEG")
    batch = EncodedBatch(torch.arange(5, dtype=torch.uint8), [jpeg], torch.zeros(1, 3, 2, 2, dtype=torch.uint8),
                         [1], torch.tensor([1, 0]))
    out = pin_memory(batch)
    assert isinstance(out, EncodedBatch) and out.jpegs == [jpeg] and out.finished_at == [1]
    assert [id(t) for t in pinned] == [id(batch.data), id(batch.finished), id(batch.labels)]


def test_on_cuda_the_decode_runs_on_a_side_stream_the_step_waits_for(monkeypatch):
    """The stream choreography against pytorch/vision#9606, on a recorded stand-in for torch.cuda (no GPU here):
    the side stream waits for the caller's, the decode runs on it, the caller's stream waits for it, and each
    output is recorded on the caller's stream, in that order; on the CPU the decode runs as it is."""
    calls = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            calls.append(("wait", self.name, other.name))

    class Decoded:
        def record_stream(self, stream):
            calls.append(("record", stream.name))

    class Using:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            calls.append(("enter", self.stream.name))

        def __exit__(self, *exc):
            calls.append(("exit", self.stream.name))

    def decode():
        calls.append(("decode",))
        return [Decoded(), Decoded()]

    device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: Stream("current"))
    monkeypatch.setattr(torch.cuda, "Stream", lambda d: Stream(f"side{d.index}"))
    monkeypatch.setattr(torch.cuda, "stream", Using)
    resnet_data._side_stream.cache_clear()
    try:
        assert len(on_side_stream(device, decode)) == 2
    finally:
        resnet_data._side_stream.cache_clear()
    assert calls == [("wait", "side0", "current"), ("enter", "side0"), ("decode",), ("exit", "side0"),
                     ("wait", "current", "side0"), ("record", "current"), ("record", "current")]
    calls.clear()
    assert len(on_side_stream(torch.device("cpu"), decode)) == 2 and calls == [("decode",)]


def test_a_batch_the_device_refuses_is_decoded_image_by_image(tmp_path, monkeypatch):
    """The batched decode is all or nothing (nvjpeg refuses arithmetic coding, unknown chroma subsampling): a
    batch it refuses is decoded on the CPU one image at a time, to the same batch."""
    _write_mixed_images(tmp_path)
    train = TrainImages(tmp_path / "train", scan_images(tmp_path / "train"), 16, 5, on_device=True)
    batch = collate_encoded([train[(1, i)] for i in range(16)])
    want = decode_batch(batch, 16, torch.device("cpu"))
    refused = []

    def refuse(data, **kwargs):
        refused.append(len(data))
        raise RuntimeError("Error while decoding JPEG images: Unknown chroma subsampling")

    monkeypatch.setattr(resnet_data, "decode_jpeg", refuse)
    assert torch.equal(decode_batch(batch, 16, torch.device("cpu")), want)
    assert refused == [len(batch.jpegs)]


def test_a_truncated_jpeg_fails_naming_the_file_as_with_decode_workers(tmp_path):
    """A half-written JPEG (its header whole, so the device takes it) fails the batch's decode; decoded again
    one by one, it fails naming the file, with the message --decode workers gives for it."""
    _write_mixed_images(tmp_path)
    bad = tmp_path / "train" / "n00000000" / "6.JPEG"
    bad.write_bytes(bad.read_bytes()[:-200])
    images = scan_images(tmp_path / "train"), scan_images(tmp_path / "val")
    assert device_jpeg_size(read_file(str(bad))) is not None
    messages = {}
    for decode_on in ("workers", "device"):
        loaders = image_folder_loaders(tmp_path, *images, 16, 4, 0, _ctx(rank=0, world=1), seed=5, decode=decode_on)
        loaders.sampler.set_epoch(1)
        with pytest.raises(UnreadableImage, match=f"cannot decode image file {bad}: ") as failure:
            list(loaders.train)
        messages[decode_on] = str(failure.value)
    assert messages["device"] == messages["workers"]


def test_the_decode_option_reaches_the_workers_and_is_resnet_only(tmp_path):
    spec = JobSpec("resnet", out_dir=tmp_path, decode="device").resolved()
    validate(spec)
    assert RunOptions.parse(spec.worker_args()).decode == "device"
    assert _spec_from_args(build_parser().parse_args(spec.command_line("local")[1:])).resolved() == spec
    assert RunOptions.parse(JobSpec("resnet", out_dir=tmp_path).resolved().worker_args()).decode is None
    with pytest.raises(HarnessError, match="--decode 'gpu': resnet takes one of workers, device"):
        validate(JobSpec("resnet", decode="gpu").resolved())
    with pytest.raises(HarnessError, match="--decode 'device': resnet takes"):
        validate(JobSpec("bert", decode="device").resolved())
    # the worker's own parser, for a command line written by hand: a refusal with its reason
    with pytest.raises(SystemExit, match="--decode applies to resnet only, not bert"):
        RunOptions.parse(["bert", "--out", str(tmp_path), "--decode", "device"])
