"""Generated inputs (tiny datasets, warm-start checkpoints), built once and cached for every later run."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator


def cache_root() -> Path:
    """$HARNESS_DATA_DIR, else ~/.cache/mlperf-harness."""
    return Path(os.environ.get("HARNESS_DATA_DIR") or Path.home() / ".cache" / "mlperf-harness")


def build_once(root: Path, write: Callable[[Path], None]) -> Path:
    """Make `root` with write(folder) unless it exists. Safe when several processes race: each writes
    a private temporary folder and renames it into place; the content is identical whoever wins."""
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    try:
        write(tmp)
        os.rename(tmp, root)
    except OSError:
        if not root.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


@contextmanager
def all_cores() -> Iterator[None]:
    """torch on every core this process may use, for a while. torchrun gives each rank one thread, but a cached
    input is built by one rank per node while the node's other ranks wait for it at a barrier."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
