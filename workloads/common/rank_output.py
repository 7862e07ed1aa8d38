"""Each rank's own output file, for clusters with thousands of ranks.

On Slurm every rank's stdout and stderr would otherwise land, interleaved, in the job's
one output file (3,584 ranks at 448 x 8). With RANK_OUTPUT_ENV set, every rank but 0
sends both to <out>/logs/rank_<r>.out (appended across attempts); rank 0 keeps the
console, so the job's output shows the run's progress and the node agents' verdicts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

RANK_OUTPUT_ENV = "HARNESS_RANK_OUTPUT"


def rank_output_path(out: Path, rank: int) -> Path:
    return Path(out) / "logs" / f"rank_{rank}.out"


def redirect_rank_output(out: Path) -> None:
    """Point this process's stdout and stderr (the file descriptors, so child libraries' output too) at its
    rank's file, when the launcher asked for it and this is not rank 0."""
    rank = int(os.environ.get("RANK", "0"))
    if not os.environ.get(RANK_OUTPUT_ENV) or rank == 0:
        return
    path = rank_output_path(out, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
