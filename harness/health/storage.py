"""The shared results folder: a node must be able to write and read it back, with room for the run's checkpoints."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from harness.health import FAIL, PASS, Check, at_least

PROBE_BYTES = 4 << 20


def free_needed(min_free_gib: float | None, checkpoints_gib: float | None) -> tuple[float | None, str]:
    """The free space to ask for, and why: what the run's checkpoints take (the kept ones and the one being
    written: a GPT-3 175B checkpoint is about 2.1 TB), or the model's floor (min_free_gib) where that is more."""
    if checkpoints_gib is None or min_free_gib is not None and min_free_gib >= checkpoints_gib:
        return min_free_gib, ""
    return checkpoints_gib, "room for the run's checkpoints"


def storage_checks(folder: Path, node: str, min_free_gib: float | None, checkpoints_gib: float | None = None
                   ) -> list[Check]:
    probe = folder / f".probe-{node}"
    data = os.urandom(PROBE_BYTES)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        same = probe.read_bytes() == data
        probe.unlink()
        rw = Check("shared_fs_rw", PASS if same else FAIL, "read back intact" if same else "read back differs",
                   "write, fsync and read back 4 MiB", where=str(folder))
    except OSError as exc:
        return [Check("shared_fs_rw", FAIL, exc.strerror or str(exc), "write, fsync and read back 4 MiB",
                      where=str(folder))]
    free = shutil.disk_usage(folder).free / 2**30
    minimum, why = free_needed(min_free_gib, checkpoints_gib)
    room = at_least("shared_fs_free", free, minimum, "GiB", str(folder))
    room.note = room.note or why
    return [rw, room]
