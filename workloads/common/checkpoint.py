"""The checkpointer: torch.distributed.checkpoint (DCP) folders, committed atomically, kept K at a time.

    <root>/step_000000120/   .metadata, __<rank>_0.distcp ..., manifest.json   (committed)
    <root>/.partial-step_000000140/                                            (being written)

Every rank writes its own shards (DDP and FSDP states alike, so a checkpoint can be
loaded on another world size where DCP can reshard it). Commit is the atomic part:
DCP fsyncs its files, each rank hashes the files it wrote (no rank reads the whole
checkpoint, which at 175B is terabytes), rank 0 merges the hashes into manifest.json
(size and sha256 of every file, plus the loop's small JSON state), fsyncs it and
renames the folder into place. A folder without a valid manifest is not a checkpoint.

Resume takes the newest checkpoint whose files all match their manifest: rank 0 lists
the folder and reads the manifest (every rank follows it, whatever its own directory
cache says), the ranks share the checking, and a damaged one is reported and skipped. With `async_save`,
training waits only while DCP copies the state to host memory; writing, hashing and
commit go on in a background thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from workloads.common.distributed import DistContext, checkpoint_group

log = logging.getLogger("workloads")

MANIFEST = "manifest.json"
PARTIAL = ".partial-"
_COMMITTED = re.compile(r"step_(\d{9})\Z")
_PART = "hashes.rank{:05d}.json"  # one rank's hashes, merged into the manifest at commit
COMMIT_TIMEOUT_S = 1800.0  # how long rank 0 waits for the other ranks' hashes


def step_folder(step: int) -> str:
    return f"step_{step:09d}"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Restored:
    step: int
    extra: dict  # the JSON state saved with it (scheduler, counters)
    path: Path


class Checkpointer:
    """Saves and restores one run's training state under `root`. Every rank makes the same calls."""

    def __init__(self, root: Path, ctx: DistContext, keep: int = 2, async_save: bool = False,
                 report: Callable[[str], None] = log.warning):
        self.root, self.ctx, self.keep, self.async_save, self.report = Path(root), ctx, keep, async_save, report
        self.group = checkpoint_group()
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        # One stager for the run: its host buffers (pinned on GPU machines) are reused by every save, so a
        # save after the first only copies into memory that already exists.
        on_gpu = ctx.device.type == "cuda"
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=on_gpu))
        self._pending: Future | None = None
        self.fault_hook: Callable[[int], None] | None = None  # fault injection: called with the step once written
        if ctx.is_main:
            self.root.mkdir(parents=True, exist_ok=True)

    # --- saving ---------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], extra: dict) -> float:
        """Checkpoint `state` (DCP Stateful objects and tensors) at `step`; returns the seconds training waited."""
        started = time.monotonic()
        self.wait()  # one save in flight at a time
        partial = self.root / f"{PARTIAL}{step_folder(step)}"
        if self.ctx.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # left by an attempt that died while writing it
        dist.barrier(group=self.group)
        if self.async_save:
            # Returns once the state is staged in host memory; the write goes on in DCP's thread.
            written = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group,
                                     async_stager=self._stager)
            self._pending = self._background.submit(lambda: (written.result(), self._commit(partial, step, extra)))
        else:
            dcp.save(state, checkpoint_id=str(partial), process_group=self.group)
            self._commit(partial, step, extra)
        return time.monotonic() - started

    def wait(self) -> None:
        """Block until an async save in flight has been written and committed (raising its error, if any)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _commit(self, partial: Path, step: int, extra: dict) -> None:
        """Hash this rank's files; on rank 0, merge every rank's hashes into the manifest and rename."""
        own = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
               for p in sorted(partial.glob(f"__{self.ctx.rank}_*"))}
        if self.fault_hook:
            self.fault_hook(step)
        part = partial / _PART.format(self.ctx.rank)
        written = part.with_suffix(".tmp")
        written.write_text(json.dumps(own))
        _fsync(written)
        os.replace(written, part)  # rank 0 polls for `part`: it must never see it half written
        if self.ctx.is_main:
            self._write_manifest(partial, step, extra)

    def _write_manifest(self, partial: Path, step: int, extra: dict) -> None:
        files: dict[str, dict] = {}
        deadline = time.monotonic() + COMMIT_TIMEOUT_S
        for rank in range(self.ctx.world_size):
            part = partial / _PART.format(rank)
            while not part.is_file():
                if time.monotonic() > deadline:
                    self.report(f"checkpoint at step {step} not committed: rank {rank} never finished writing it")
                    return
                time.sleep(0.01)
            files.update(json.loads(part.read_text()))
        meta = partial / ".metadata"
        files[meta.name] = {"bytes": meta.stat().st_size, "sha256": _sha256(meta)}
        manifest = {"step": step, "world_size": self.ctx.world_size, "files": files, "extra": extra,
                    "saved_at": time.time()}
        path = partial / MANIFEST
        path.write_text(json.dumps(manifest, indent=1))
        _fsync(path)
        for rank in range(self.ctx.world_size):
            (partial / _PART.format(rank)).unlink()
        final = self.root / step_folder(step)
        shutil.rmtree(final, ignore_errors=True)  # a redone step after a restart replaces its older copy
        os.replace(partial, final)
        _fsync(self.root)
        self._prune()

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints; drop partial folders of earlier steps (their writers are gone)."""
        committed = self.committed()
        newest = committed[0][0] if committed else 0
        for _, path in committed[self.keep:]:
            shutil.rmtree(path, ignore_errors=True)
        for path in self.root.glob(f"{PARTIAL}step_*"):
            found = _COMMITTED.match(path.name[len(PARTIAL):])
            if found and int(found.group(1)) < newest:
                shutil.rmtree(path, ignore_errors=True)

    # --- restoring --------------------------------------------------------------------------------

    def committed(self) -> list[tuple[int, Path]]:
        """(step, folder) of every committed checkpoint, newest first."""
        found = [(int(m.group(1)), p) for p in self.root.glob("step_*") if (m := _COMMITTED.match(p.name))]
        return sorted(found, reverse=True)

    def restore(self, state_for: Callable[[dict], dict[str, Any]]) -> Restored | None:
        """Load the newest valid checkpoint into `state_for(manifest)`; None when there is none.

        Rank 0 lists the folder and reads the manifest, and every rank takes its word: on a
        shared file system (NFS, Lustre) another node's directory cache may be stale and list
        other steps. `state_for` builds the state to load from the checkpoint's manifest (its
        world size decides whether per-rank RNG states can be restored).
        """
        for step, path in self._rank0([(step, str(path)) for step, path in self.committed()]):
            path = Path(path)
            manifest, problem = self._verify(path)
            if problem:
                if self.ctx.is_main:
                    self.report(f"checkpoint {path} is damaged and skipped: {problem}")
                continue
            state = state_for(manifest)
            dcp.load(state, checkpoint_id=str(path), process_group=self.group)
            return Restored(step=step, extra=manifest.get("extra", {}), path=path)
        return None

    def _rank0(self, value):
        """Rank 0's `value` on every rank (the others' own are ignored)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _verify(self, path: Path) -> tuple[dict, str | None]:
        """Check rank 0's reading of the manifest, then every file in it; the ranks split the files."""
        manifest, problem = self._rank0(_read_manifest(path) if self.ctx.is_main else None)
        if problem is None:
            problem = _check_files(path, sorted(manifest["files"].items())[self.ctx.rank::self.ctx.world_size])
        problems: list = [None] * self.ctx.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        found = [p for p in problems if p]
        return manifest, (found[0] if found else None)

    def remove_all(self) -> None:
        """Drop this run's checkpoints (once the run has stopped they only take space)."""
        self.wait()
        dist.barrier(group=self.group)
        if self.ctx.is_main:
            shutil.rmtree(self.root, ignore_errors=True)


def _read_manifest(path: Path) -> tuple[dict, str | None]:
    """(manifest, None), or ({}, what is wrong with it)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if not isinstance(manifest.get("files"), dict):
            return {}, f"{MANIFEST} lists no files"
        return manifest, None
    except FileNotFoundError:
        return {}, f"no {MANIFEST}"
    except (OSError, ValueError, AttributeError) as exc:
        return {}, f"unreadable {MANIFEST} ({exc})"


def _check_files(folder: Path, files: list[tuple[str, dict]]) -> str | None:
    """The first of `files` (name, {"bytes", "sha256"}) that is missing or differs from the manifest."""
    try:
        for name, expected in files:
            file = folder / name
            if not file.is_file():
                return f"{name} is missing"
            if file.stat().st_size != expected["bytes"]:
                return f"{name} has {file.stat().st_size} bytes, the manifest says {expected['bytes']}"
            if _sha256(file) != expected["sha256"]:
                return f"{name} does not match its checksum"
    except (OSError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST} entry ({exc})"
    return None
