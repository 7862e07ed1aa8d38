"""Paths that survive container mounts: the same files inside the container as outside.

Ranks run inside a container (pyxis on Slurm, a pod on Kubernetes) whose mounts rename
paths: with pyxis's `/mnt/results:/results`, the login node's /mnt/results/run1 is
/results/run1 inside. The harness hands every rank the path as the container sees it,
and refuses, when it renders the job, a path that no mount covers: otherwise the ranks
would fail 448 nodes later with "no such file", or write results where nobody looks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from harness.errors import HarnessError


@dataclass(frozen=True)
class Mount:
    source: str  # a host path (pyxis) or a claim name (Kubernetes)
    target: PurePosixPath  # where it appears inside the container
    spec: str  # as the profile wrote it, for messages


def pyxis_mount(entry: str) -> Mount:
    """pyxis's `--container-mounts` entry: SRC[:DST[:FLAGS]], DST defaulting to SRC."""
    source, _, rest = entry.partition(":")
    target = rest.partition(":")[0] or source
    if not source.startswith("/") or not target.startswith("/"):
        raise HarnessError(f"container mount {entry!r} must be SRC[:DST[:FLAGS]] with absolute paths")
    return Mount(source, PurePosixPath(target), entry)


def claim_mount(entry: str) -> Mount:
    """A Kubernetes profile's extra volume: CLAIM:/path[:ro]."""
    claim, _, rest = entry.partition(":")
    target, _, flags = rest.partition(":")
    if not claim or not target.startswith("/") or flags not in ("", "ro", "rw"):
        raise HarnessError(f"kubernetes mount {entry!r} must be CLAIM:/absolute/path[:ro]")
    return Mount(claim, PurePosixPath(target), entry)


def _under(path: PurePosixPath, root: PurePosixPath) -> PurePosixPath | None:
    """`path` relative to `root`, or None when it lies elsewhere ('..' never climbs out)."""
    if ".." in path.parts:
        return None
    try:
        return path.relative_to(root)
    except ValueError:
        return None


def _listing(mounts: list[Mount]) -> str:
    return ", ".join(m.spec for m in mounts) or "none"


def translate(path, mounts: list[Mount], what: str) -> PurePosixPath:
    """A host path as the container sees it, through the deepest mount whose source holds it."""
    path = PurePosixPath(path)
    covering = [(m, rest) for m in mounts if (rest := _under(path, PurePosixPath(m.source))) is not None]
    if not covering:
        raise HarnessError(f"{what} {path} is outside every container mount ({_listing(mounts)}), so the ranks "
                           "could not see it: put it under a mount's host side, or add a mount to the profile "
                           "(slurm.container_mounts)")
    mount, rest = max(covering, key=lambda found: len(PurePosixPath(found[0].source).parts))
    return mount.target / rest


def check_inside(path, mounts: list[Mount], what: str) -> PurePosixPath:
    """A path given as the container sees it, refused unless one of its mounts holds it."""
    path = PurePosixPath(path)
    if not any(_under(path, m.target) is not None for m in mounts):
        raise HarnessError(f"{what} {path} is not on any volume the pods mount ({_listing(mounts)}): give a path "
                           "under one of them, or add the volume to the profile (kubernetes.mounts: CLAIM:/path)")
    return path
