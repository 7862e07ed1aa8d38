"""flux1's input: MLCommons' preprocessed embeddings, read as the reference reads them, and the tiny preset's own.

The reference never runs an encoder while training (mlcommons/training `text_to_image/README.md`;
torchtitan `torchtitan/experiments/flux/scripts/preprocess_flux_dataset.py`): each sample's T5-XXL states (256 x
4,096), CLIP-L's pooled vector (768) and the VAE's latent mean and log-variance (16 x 32 x 32 each, for 256 x 256
images) were computed once and written with Hugging Face `datasets`' `save_to_disk`, every tensor as the bytes of a
`.npy` file holding bf16 viewed as uint16; the validation samples carry their fixed `timestep` (0..7). The
reference loads them with `load_from_disk` (`dataset/flux_dataset.py`, `flux_mlperf.py`); here pyarrow memory-maps
the same Arrow files (`state.json` lists them), so that a worker reads only the rows it takes.

    DATA/cc12m_preprocessed/      the 1,099,776 training samples (a save_to_disk folder)
    DATA/coco_preprocessed/       the 29,696 validation samples, with `timestep`
    DATA/empty_encodings/         t5_empty.npy and clip_empty.npy: T5's and CLIP's encodings of "" (float16,
                                  `scripts/save_empty_encodings.py`), which caption dropout puts in a caption's place

Reading order (the reference's): no shuffle; each data rank reads its contiguous share of the training set
(`datasets.distributed.split_dataset_by_node` on a map-style dataset) from its start, again and again.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from workloads.common.cache import build_once, cache_root
from workloads.common.data import eval_row
from workloads.flux.config import EVAL_TIMESTEPS, SampleShape

TRAIN_FOLDER, EVAL_FOLDER, EMPTY_FOLDER = "cc12m_preprocessed", "coco_preprocessed", "empty_encodings"
TENSORS = ("t5_encodings", "clip_encodings", "mean", "logvar")  # each a .npy of bf16 viewed as uint16
TIMESTEP = "timestep"  # the validation samples' fixed timestep, k of k / 8
SYNTHETIC_STREAM, EVAL_DRAWS_STREAM = 1, 2  # sample_seed's streams: --synthetic's rows, the evaluation's draws
EMPTY_FILES = {"t5_encodings": "t5_empty.npy", "clip_encodings": "clip_empty.npy"}


def decode(cell: bytes, column: str, where: str) -> np.ndarray:
    """One tensor cell: the bytes of a .npy file of uint16 (bf16's bits), as the preprocessing wrote it."""
    try:
        array = np.load(io.BytesIO(cell), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"{where}: column {column!r} does not hold .npy bytes ({exc})") from None
    if array.dtype != np.uint16:
        raise ValueError(f"{where}: column {column!r} holds {array.dtype} arrays; MLCommons' preprocessing stores "
                         "bf16 viewed as uint16")
    return array


def decode_cells(cells: list[bytes], column: str, where: str) -> np.ndarray:
    """A batch of one column's cells, stacked: the first decoded by np.load, each other one checked to carry the
    same .npy header (dtype, order, shape) and read straight after it, all in one copy. One np.load per cell cost
    more than the model on small samples."""
    first = decode(cells[0], column, where)
    start = len(cells[0]) - first.nbytes  # where the data begins: the header's length
    header = cells[0][:start]
    for number, cell in enumerate(cells[1:], 1):
        if len(cell) != len(cells[0]) or cell[:start] != header:
            decode(cell, column, f"{where} (+{number})")  # names what is wrong with it
            raise ValueError(f"{where} (+{number}): column {column!r} holds an array of another shape than the "
                             f"first's {first.shape}")
    body = bytearray().join(memoryview(cell)[start:] for cell in cells)  # writable: torch.from_numpy wants it
    return np.frombuffer(body, dtype=np.uint16).reshape(len(cells), *first.shape)


def to_bf16(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).view(torch.bfloat16)


class EmbeddingSet:
    """A `datasets.Dataset.save_to_disk` folder, memory-mapped with pyarrow: its Arrow stream files in
    `state.json`'s order, checked for the columns flux1 reads (named with what was expected when missing)."""

    def __init__(self, folder: Path, columns: tuple[str, ...]):
        self.folder = Path(folder)
        state = self.folder / "state.json"
        if not state.is_file():
            raise ValueError(f"{self.folder} is not a Hugging Face `datasets` folder (no state.json): flux1 reads the "
                             "folders MLCommons' preprocessing wrote with save_to_disk")
        try:
            files = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{state}: not a save_to_disk state file (its _data_files list: {exc})") from None
        tables = []
        for name in files:
            path = self.folder / name
            if not path.is_file():
                raise ValueError(f"{state} lists {name}, which is not in {self.folder}")
            try:
                tables.append(pa.ipc.open_stream(pa.memory_map(str(path))).read_all())
            except pa.ArrowInvalid as exc:
                raise ValueError(f"{path}: not an Arrow stream file ({exc})") from None
        if not tables:
            raise ValueError(f"{state} lists no data files")
        self.table = pa.concat_tables(tables)
        missing = [c for c in columns if c not in self.table.column_names]
        if missing:
            raise ValueError(f"{self.folder} has no column {', '.join(map(repr, missing))}: flux1 reads "
                             f"{', '.join(columns)} (it has {', '.join(self.table.column_names)})")
        for column in columns:
            kind = self.table.schema.field(column).type
            wanted = pa.types.is_integer if column == TIMESTEP else \
                (lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t))
            if not wanted(kind):
                raise ValueError(f"{self.folder}: column {column!r} is {kind}, not "
                                 f"{'an integer' if column == TIMESTEP else 'binary (.npy bytes)'}")
        self.columns = columns

    def __reduce__(self):
        """Pickled as its folder (a DataLoader worker under spawn or forkserver): it memory-maps the files again,
        rather than copying the table's data into the worker."""
        return EmbeddingSet, (self.folder, self.columns)

    def __len__(self) -> int:
        return self.table.num_rows

    def check(self, shape: SampleShape, rows: int | None = None) -> None:
        """The set's size is `rows` (the rules' count), the first row's tensors have the model's shapes, every row's
        cells of a column have the same length (read from the Arrow offsets, without decoding a row), and every
        timestep is one of the 8: a bad row found here, before the clock, not by a loader worker mid-run."""
        if rows is not None and len(self) != rows:
            raise ValueError(f"{self.folder} holds {len(self):,} samples, not the {rows:,} flux1's rules count")
        first = self.rows([0])
        for column, expected in shape.expected().items():
            got = tuple(first[column].shape[1:])
            if got != expected:
                raise ValueError(f"{self.folder}: column {column!r} holds {got} arrays; this model reads {expected}")
            lengths = pc.min_max(pc.binary_length(self.table.column(column)))
            if lengths["min"] != lengths["max"]:
                raise ValueError(f"{self.folder}: column {column!r} holds cells of {lengths['min']} to "
                                 f"{lengths['max']} bytes; every sample's {column} is one {expected} array")
        if TIMESTEP in self.columns:
            steps = pc.min_max(self.table.column(TIMESTEP))
            if steps["min"].as_py() < 0 or steps["max"].as_py() >= EVAL_TIMESTEPS:
                raise ValueError(f"{self.folder}: column {TIMESTEP!r} holds {steps['min']} to {steps['max']}; the "
                                 f"validation timesteps are k of k / {EVAL_TIMESTEPS}, 0 to {EVAL_TIMESTEPS - 1}")

    def rows(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The rows `indices`, each tensor column stacked (bf16), the timestep as int64. Each cell is read from its
        own chunk (ChunkedArray indexing): a take() would first join a column's chunks, the whole column (terabytes
        of T5 states), and fails past 2 GiB of binary offsets."""
        out = {}
        for column in self.columns:
            cells = self.table.column(column)
            values = [cells[index].as_py() for index in indices]
            if column == TIMESTEP:
                out[column] = torch.tensor(values, dtype=torch.int64)
            else:
                out[column] = to_bf16(decode_cells(values, column, f"{self.folder} row {indices[0]}"))
        return out


def load_empty_encodings(folder: Path, shape: SampleShape) -> dict[str, torch.Tensor]:
    """T5's and CLIP's encodings of the empty caption (float16 .npy files of (1, ...)), as the reference's train.py
    loads them: `np.load(empty_encodings_path + "/t5_empty.npy")[0]`; each checked against the model's shapes."""
    out = {}
    for column, name in EMPTY_FILES.items():
        path = Path(folder) / name
        if not path.is_file():
            raise ValueError(f"{folder} has no {name}: caption dropout puts the encodings of the empty caption "
                             f"({', '.join(EMPTY_FILES.values())}, MLCommons' empty-encodings download) in place of "
                             "a dropped one")
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise ValueError(f"{path}: not a .npy file ({exc})") from None
        expected = (1, *shape.expected()[column])
        if array.shape != expected:
            raise ValueError(f"{path} holds a {array.shape} array; this model reads {expected}")
        out[column] = torch.from_numpy(array[0].astype(np.float32)).to(torch.bfloat16)
    return out


def sample_seed(seed: int, stream: int, index: int) -> int:
    """A 63-bit seed for one sample's own draws, mixed from the run's seed, a stream (what the draws are for) and the
    sample's index (numpy's SeedSequence: distinct inputs give unrelated seeds, any seed the user gives fits)."""
    return int(np.random.SeedSequence([seed, stream, index]).generate_state(1, np.uint64)[0] >> np.uint64(1))


class RankShare(Sampler):
    """The training rows this data rank reads, as lists of a micro batch each: its contiguous share of the set
    (split_dataset_by_node: the first len % ranks ranks take one more), from `skip` rows on, looping."""

    def __init__(self, size: int, rank: int, ranks: int, batch: int):
        share, extra = divmod(size, ranks)
        self.start = rank * share + min(rank, extra)
        self.count = share + (rank < extra)
        if self.count < batch:
            raise ValueError(f"the training set's {size:,} samples give each of {ranks} data ranks {self.count}, "
                             f"fewer than a micro batch of {batch}")
        self.batch, self.skip = batch, 0

    def __iter__(self) -> Iterator[list[int]]:
        position = self.skip
        while True:
            yield [self.start + (position + i) % self.count for i in range(self.batch)]
            position += self.batch


class Rows(Dataset):
    """A set's rows by lists of indices (the sampler hands whole batches, so a worker decodes a batch at once)."""

    def __init__(self, source):
        self.source = source

    def __getitem__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return self.source.rows(indices)


def eval_share(size: int, rank: int, ranks: int, batch: int) -> list[tuple[list[int], torch.Tensor]]:
    """This data rank's validation rows (workloads.common.data.eval_row's: every rank the same number, the padding
    uncounted) in batches of `batch`, each with its rows' `counted` flags."""
    rows = [eval_row(size, rank, ranks, i) for i in range(-(-size // ranks))]
    return [([index for index, _ in rows[i:i + batch]], torch.tensor([counted for _, counted in rows[i:i + batch]]))
            for i in range(0, len(rows), batch)]


class SyntheticSet:
    """Random embeddings of a dataset's shapes (--synthetic: throughput without the dataset), each row drawn from
    its index, so that any rank reads the same row alike."""

    def __init__(self, shape: SampleShape, size: int, seed: int, with_timestep: bool):
        self.shape, self.size, self.seed, self.with_timestep = shape, size, seed, with_timestep

    def __len__(self) -> int:
        return self.size

    def rows(self, indices: list[int]) -> dict[str, torch.Tensor]:
        out: dict[str, list[torch.Tensor]] = {}
        for index in indices:
            generator = torch.Generator().manual_seed(sample_seed(self.seed, SYNTHETIC_STREAM, index))
            for column, dims in self.shape.expected().items():
                out.setdefault(column, []).append(torch.randn(dims, generator=generator).to(torch.bfloat16))
        batch = {column: torch.stack(values) for column, values in out.items()}
        if self.with_timestep:
            batch[TIMESTEP] = torch.tensor([index % EVAL_TIMESTEPS for index in indices])
        return batch


def loader(source, sampler, workers: int, pin_memory: bool) -> DataLoader:
    """Batches of `sampler`'s index lists. The loader's own generator: a DataLoader draws its workers' base seed from
    it at each new iterator, and the default (the global generator, the training noise's) would make a resumed run,
    whose iterator starts at its checkpoint, draw other noise than a run never stopped."""
    return DataLoader(Rows(source), sampler=sampler, batch_size=None, num_workers=workers, pin_memory=pin_memory,
                      persistent_workers=workers > 0, generator=torch.Generator())


# --- the on-disk format, written (the tiny preset's generated set; the tests') -------------------------------------

def npy_bytes(array: np.ndarray) -> bytes:
    """A tensor as MLCommons' preprocessing stores it: bf16's bits as uint16, saved as a .npy file."""
    buffer = io.BytesIO()
    np.save(buffer, torch.as_tensor(array, dtype=torch.float32).to(torch.bfloat16).view(torch.uint16).numpy())
    return buffer.getvalue()


def write_embedding_set(folder: Path, columns: Mapping[str, list]) -> None:
    """A save_to_disk folder (one Arrow stream file, state.json, dataset_info.json with the features
    `datasets` reads) of `__key__` and `columns`: tensor columns as lists of arrays, `timestep` as ints."""
    folder.mkdir(parents=True, exist_ok=True)
    size = len(next(iter(columns.values())))
    arrays = {"__key__": pa.array([f"{i:08d}" for i in range(size)], pa.string())}
    features = {"__key__": {"dtype": "string", "_type": "Value"}}
    for column, values in columns.items():
        if column == TIMESTEP:
            arrays[column] = pa.array(values, pa.int32())
            features[column] = {"dtype": "int32", "_type": "Value"}
        else:
            arrays[column] = pa.array([npy_bytes(v) for v in values], pa.binary())
            features[column] = {"dtype": "binary", "_type": "Value"}
    table = pa.table(arrays).replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    name = "data-00000-of-00001.arrow"
    with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": features,
                                                          "homepage": "", "license": ""}, indent=2))
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}], "_fingerprint": "harness",
                                                   "_format_columns": None, "_format_kwargs": {},
                                                   "_format_type": None, "_output_all_columns": False,
                                                   "_split": None}, indent=2))


def write_empty_encodings(folder: Path, t5: np.ndarray, clip: np.ndarray) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / EMPTY_FILES["t5_encodings"], t5[None].astype(np.float16))
    np.save(folder / EMPTY_FILES["clip_encodings"], clip[None].astype(np.float16))


# --- the tiny preset's set --------------------------------------------------------------------------------------------

TINY_VERSION = 1
TINY_CAPTIONS = 4  # distinct captions: each draws its own latent pattern, which the model must learn from the text
TINY_TRAIN, TINY_EVAL = 4_096, 256  # the eval set: 32 samples per timestep, as the real one has 3,712
TINY_SPREAD = 0.05  # a latent's spread around its caption's pattern, after the VAE's scale
TINY_PATTERN = 0.5  # the patterns' spread


def write_tiny_set(folder: Path, shape: SampleShape, shift: float, scale: float) -> None:
    """Generated embeddings in MLCommons' layout (the three folders, the real column names and encodings): a few
    captions, each with its T5 states, pooled vector and a latent pattern; a sample is its caption's encodings with
    a little noise, and a latent mean of its caption's pattern, narrowly spread. Stored as the VAE's output is
    (before the shift and scale the step applies), so that the step's arithmetic runs as on the real set. A model
    that reads the caption reaches a validation loss under the rules' 0.586; one that does not stays above 1."""
    generator = np.random.default_rng(2023)
    patterns = generator.normal(0, TINY_PATTERN, (TINY_CAPTIONS, *shape.latent))
    text = generator.normal(0, 1, (TINY_CAPTIONS, *shape.text))
    pooled = generator.normal(0, 1, (TINY_CAPTIONS, shape.pooled))
    logvar = np.full(shape.latent, 2 * np.log(TINY_SPREAD / scale))

    def samples(count: int) -> dict[str, list]:
        captions = generator.integers(0, TINY_CAPTIONS, count)
        return {"t5_encodings": [text[c] + generator.normal(0, 0.1, shape.text) for c in captions],
                "clip_encodings": [pooled[c] + generator.normal(0, 0.1, shape.pooled) for c in captions],
                "mean": [patterns[c] / scale + shift for c in captions],
                "logvar": [logvar] * count}

    write_embedding_set(folder / TRAIN_FOLDER, samples(TINY_TRAIN))
    write_embedding_set(folder / EVAL_FOLDER, {**samples(TINY_EVAL), TIMESTEP: [i % 8 for i in range(TINY_EVAL)]})
    write_empty_encodings(folder / EMPTY_FOLDER, generator.normal(0, 0.1, shape.text),
                          generator.normal(0, 0.1, shape.pooled))


def ensure_tiny_set(shape: SampleShape, shift: float, scale: float) -> Path:
    sizes = f"{shape.text[0]}x{shape.text[1]}-{shape.pooled}-{'x'.join(map(str, shape.latent))}"
    name = f"tiny-flux-v{TINY_VERSION}-{sizes}"
    return build_once(cache_root() / name, lambda folder: write_tiny_set(folder, shape, shift, scale))
