"""The shared results folder: a node must be able to write and read it back, with room to spare."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from harness.health import FAIL, PASS, Check, at_least

PROBE_BYTES = 4 << 20


def storage_checks(folder: Path, node: str, min_free_gib: float | None) -> list[Check]:
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
    return [rw, at_least("shared_fs_free", free, min_free_gib, "GiB", str(folder))]
