"""Generated inputs (tiny datasets, warm-start checkpoints), built once and cached for every later run."""

from __future__ import annotations

import fcntl
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
    """Make `root` with write(folder) unless it exists. Processes on one machine that ask at once wait for the
    first (an advisory lock beside it) rather than build it again; where the lock is not honoured (some network
    file systems), each writes a private temporary folder and renames it into place, and the content is
    identical whoever wins."""
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: the rename below still keeps the folder whole
            pass
        if root.is_dir():  # built while this process waited
            return root
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


BUILD_THREADS_ENV = "HARNESS_BUILD_THREADS"


@contextmanager
def all_cores() -> Iterator[None]:
    """torch on every core this process may use, for a while. torchrun gives each rank one thread, but a cached
    input is built by one rank per node while the node's other ranks wait for it at a barrier. On a machine shared
    with other work, HARNESS_BUILD_THREADS caps it: threads beyond the free cores make OpenMP's workers wait on each
    other (the tiny BERT warm start ran 2x slower on 2 threads than on 1 beside one busy core)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    before = torch.get_num_threads()
    torch.set_num_threads(min(cores, int(os.environ.get(BUILD_THREADS_ENV) or cores)))
    try:
        yield
    finally:
        torch.set_num_threads(before)
