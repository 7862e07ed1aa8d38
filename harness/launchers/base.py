"""The one small interface every backend implements, TorchX-style.

render(spec) -> Request     the exact thing that would be submitted; `--dry-run` prints `request.text`
submit(request) -> Handle   starts it; the handle is saved as <out>/job.json so other commands can find it
status / watch / logs / cancel on a handle; follow(launcher, handle) streams the logs until the job ends

Every backend starts the same program on every node: the harness's node agent
(`python -m harness.agent`), which runs torch's elastic agent (the machinery behind
torchrun) running `python -m workloads ...`, and records and classifies failures.
Only how that command reaches the nodes, and who restarts it, differs.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import fcntl
import json
import os
import re
import sys
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

from harness.errors import HarnessError
from workloads.common.requirements_check import AGENT_BOOTSTRAP
from workloads.common.run_record import replace_whole
from workloads.registry import BENCHMARKS
from harness.spec import JobSpec

JOB_FILE = "job.json"
JOB_LOCK = ".job.json.lock"  # beside job.json: its writers' lock (job.json itself is renamed over at each write)
LOCK_WAIT_S = 60.0  # a holder keeps the lock for one read and one write; longer than this, it is stuck


class JobState(str, enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class Request:
    """What a launcher would submit: `text` is shown verbatim, `payload` is what submit() uses."""

    backend: str
    spec: JobSpec
    text: str
    payload: Any
    notes: tuple[str, ...] = ()  # what the user should know about the request (printed on stderr)


_WARNED: set[tuple[Path, str]] = set()  # (run folder, what) this process has warned of


def _warn_once(out_dir: Path, what: str, line: str) -> None:
    """Said once per run folder and process: `harness run` records at every status poll, and a lock or a disk
    that fails one poll fails the next ones too."""
    if (out_dir, what) not in _WARNED:
        _WARNED.add((out_dir, what))
        print(f"harness: warning: {line}", file=sys.stderr)


@dataclass
class Handle:
    """A submitted job: enough to find it again from another process."""

    backend: str
    job_id: str
    out_dir: Path

    def save(self, request: Request, **extra: Any) -> None:
        record = {"backend": self.backend, "job_id": self.job_id, "spec": request.spec.to_dict(),
                  "request": request.text, **extra}
        self._write(record)

    def record(self) -> dict:
        return json.loads((self.out_dir / JOB_FILE).read_text())

    def update(self, **fields: Any) -> dict:
        """Record facts about the job (its state, exit code) in job.json; returns the record as written.

        `harness run` records states, an exit code and collect errors while `harness cancel` or `collect` in
        another shell records theirs: each update is read, changed and replaced under the job lock, so none
        is lost to another's stale copy. A recorded cancel is final: a state worked out before it (a status
        poll that saw the job die of the cancel's own signal) does not replace it. Backends record CANCELLED
        only once the scheduler took the cancel, so a cancel it refused leaves nothing to undo."""
        with self._locked():
            record = self.record()
            if record.get("state") == JobState.CANCELLED.value:
                fields.pop("state", None)
            record.update(fields)
            self._write(record)
        return record

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the run folder's job lock, or say in one line why not and write without it (_take_lock)."""
        fd = self._take_lock()
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock

    def _take_lock(self) -> int | None:
        """The job lock's descriptor, held: a POSIX record lock (fcntl), which NFS honours through its lock
        manager and the kernel releases when its holder dies, so a killed `harness run` leaves none behind.
        Only writers take it: a reader sees a whole job.json anyway (replace_whole), and never waits.

        The lock only keeps two writers from losing each other's fields; a record is worth more than that, and
        a cancel or a watch must never stop for it. So whatever keeps the lock from us (a lock file another user
        made that we may not open, a read-only lock file, NFS without its lock manager, a holder stuck past
        LOCK_WAIT_S: a stopped process, a crashed host's lock kept for its lease) is said in one line on stderr,
        and the record is written unlocked, replaced whole as before locks (None)."""
        path = self.out_dir / JOB_LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask's mode, as job.json's
        except OSError as exc:
            return self._unlocked(f"cannot open {path}: {exc.strerror}")
        deadline, pause = time.monotonic() + LOCK_WAIT_S, 0.001
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError as exc:
                held = exc.errno in (errno.EACCES, errno.EAGAIN)  # held elsewhere: worth waiting for
                if not held or time.monotonic() > deadline:
                    os.close(fd)
                    return self._unlocked(f"{path} stayed locked by another harness command for {LOCK_WAIT_S:g} s "
                                          "(is one stopped, or the file system hung?)" if held else
                                          f"cannot lock {path}: {exc.strerror}")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _unlocked(self, why: str) -> None:
        _warn_once(self.out_dir, "unlocked", f"{why}; recording in {self.out_dir / JOB_FILE} without the lock")
        return None

    def _write(self, record: dict) -> None:
        # Replaced whole: `harness logs`, `cancel` or `collect` in another shell reads it while `harness run`
        # records a state, and a write that fails half way (a results disk full of checkpoints) keeps the old one.
        # A folder we may not write (a teammate's run, umask 022) or a full disk is one line.
        path = self.out_dir / JOB_FILE
        try:
            replace_whole(path, json.dumps(record, indent=2) + "\n")
        except OSError as exc:
            raise HarnessError(f"cannot record in {path}: {exc.strerror or exc}", 1) from None

    @classmethod
    def load(cls, run_dir: Path) -> "Handle":
        path = Path(run_dir) / JOB_FILE
        try:
            record = json.loads(path.read_text())
            return cls(backend=record["backend"], job_id=str(record["job_id"]), out_dir=Path(run_dir).absolute())
        except FileNotFoundError:
            raise HarnessError(f"{run_dir} is not a run folder: it has no {JOB_FILE}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise HarnessError(f"{path} is unreadable: {exc}") from None


def record_cancel(handle: Handle, **fields: Any) -> None:
    """Record what a cancel did, or say in one line why it could not: the cancel itself goes on either way (a job
    left running because its folder is a teammate's, or its disk full, would cost more than a missing record)."""
    try:
        handle.update(**fields)
    except HarnessError as exc:
        print(f"harness: warning: {exc}; the cancel goes on", file=sys.stderr)


def record_state(handle: Handle, state: JobState, **facts: Any) -> JobState:
    """Record the state a status poll worked out, with its facts, and return the state now recorded: the one
    place every backend's `status` answers from, so that after a cancel (final, Handle.update) a poll that
    saw the job end of it says CANCELLED, as job.json does. A record that cannot be written (a teammate's folder,
    a full disk) is said once, and the state seen answered: a watch or a cancel does not stop for it."""
    try:
        return JobState(handle.update(state=state.value, **facts)["state"])
    except HarnessError as exc:
        _warn_once(handle.out_dir, "unrecorded", f"{exc}; the job's state is read from {handle.backend}")
        return state


class Launcher(ABC):
    """One backend. Subclasses stay small enough to read in one sitting."""

    name: ClassVar[str]
    paths_here: ClassVar[bool] = True  # the nodes see this machine's files (see spec.validate)
    # The training request itself runs preflight inside its allocation (Slurm); otherwise `harness run`
    # runs the health job first (render_preflight) and renders the training without the nodes it kept out.
    preflight_in_allocation: ClassVar[bool] = False
    poll_s: ClassVar[float] = 1.0  # between `watch`'s status reads, each a call to the scheduler

    def runs_root(self, spec: JobSpec) -> Path | None:
        """Where run folders go without --out; None: results/runs under the working folder."""
        return None

    @abstractmethod
    def render(self, spec: JobSpec) -> Request:
        """Build the exact request for a resolved, validated spec. Has no side effects."""

    def launches(self, spec: JobSpec) -> list[JobSpec]:
        """The jobs a campaign takes, in order, each rendered and submitted after the one before succeeded: one
        job for every run, unless a backend must start a job per run (Kubernetes' closed campaigns, whose pods
        flush their nodes' page cache as they start)."""
        return [spec]

    def problems(self, spec: JobSpec) -> list[str]:
        """What would fail at run time on this backend, found at render time, one line each naming the fix:
        `harness run` refuses to submit while any is left, and a dry run lists them (failing under --strict)."""
        return []

    def render_preflight(self, spec: JobSpec) -> Request:
        """The health job alone (`harness preflight`): every node of the allocation runs harness.health."""
        raise HarnessError(f"the {self.name} backend cannot run a preflight")

    @abstractmethod
    def submit(self, request: Request) -> Handle:
        """Start the job and save its handle in the run folder."""

    @abstractmethod
    def status(self, handle: Handle) -> JobState:
        """The job's state now."""

    def logs(self, handle: Handle, rank: int | None = None, tail: int | None = None) -> str:
        """The job's output so far, each source under its `==> name <==` header as `tail` shows several: every
        rank's, or rank `rank`'s alone; each source whole, or its last `tail` lines. A rank the job does not have
        is refused in one line naming those it has."""
        check_rank(handle, rank)
        shown = []
        for source in self.log_sources(handle, rank):
            text, _ = source.read(0 if tail is None else source.tail_start(tail))
            shown.append(f"==> {source.name} <==\n{text}")
        return "".join(shown)

    def log_sources(self, handle: Handle, rank: int | None = None) -> list[LogSource]:
        """Where the job's output is, in the order shown: every rank's, or rank `rank`'s alone. Here, each rank's
        files in the run folder (rank_files); backends whose output is also elsewhere add it."""
        return [FileLog(path) for path in rank_files(handle.out_dir, rank)]

    @abstractmethod
    def cancel(self, handle: Handle) -> None:
        """Stop the job; results already written stay in place."""

    def collect(self, handle: Handle) -> list[Path]:
        """Bring the run's result files into handle.out_dir; returns the files fetched.

        Local and Slurm ranks write there directly (Slurm needs a shared file system),
        so only backends with their own storage override this.
        """
        return []

    def checked_nodes(self, handle: Handle) -> list[str]:
        """The nodes a finished health job ran on, a report or not: a node that wrote none is judged failed
        (harness.preflight.judge) rather than left out unseen. Empty where the reports name every node (local)."""
        return []

    def delete(self, handle: Handle) -> None:
        """Remove a finished job from the cluster once what it wrote is read (the Kubernetes health job and its
        pods), so that nothing of it is left behind; nothing to do where a job leaves nothing (local, Slurm)."""

    def remediate(self, spec: JobSpec, preflight: dict) -> list[str]:
        """Tell the cluster about the nodes preflight judged (`preflight`: preflight.json), in the cluster's own
        terms (a Slurm drain, a Kubernetes node condition and taint); returns what was done, one line each.
        The default has no cluster to tell: the nodes are only kept out of this job."""
        return [f"{node} kept out of this job" for node in preflight["excluded"]]

    def restart_watcher(self, spec: JobSpec, handle: Handle) -> Callable[[], None] | None:
        """A `watch` tick that keeps the node a failed attempt points at out of the next attempt, where the
        job restarts without going back through preflight (Kubernetes); None where preflight does it."""
        return None

    def watch(self, handle: Handle, poll_s: float | None = None, tick: Callable[[], None] | None = None
              ) -> Iterator[JobState]:
        """Yield each state change until the job reaches a terminal state; `tick` runs at every poll."""
        last = None
        watched = self.watched_status()
        while True:
            if tick is not None:
                tick()
            state = watched(handle)
            if state != last:
                yield state
                last = state
            if state.terminal:
                return
            time.sleep(poll_s or self.poll_s)


    def watched_status(self) -> Callable[[Handle], JobState]:
        """How `watch` asks for the state at each poll: `status`, unless a backend waits out what a one-shot
        `status` would report (Kubernetes: an API server outage)."""
        return self.status


def rank_files(out_dir: Path, rank: int | None = None) -> list[Path]:
    """Each rank's log (logs/rank_<r>.log) and own output (rank_<r>.out), by rank number (rank_10 after rank_9),
    or rank `rank`'s alone."""
    def order(path: Path) -> tuple[int, str]:
        number = path.stem.removeprefix("rank_")
        return (int(number) if number.isdigit() else -1, path.name)

    return sorted(Path(out_dir, "logs").glob("rank_*.*" if rank is None else f"rank_{rank}.*"), key=order)


def check_rank(handle: Handle, rank: int | None) -> None:
    """Refuse, in one line naming the ranks there are, a rank the job does not have: counted from its recorded
    request (nodes x the node agent's --nproc-per-node), else (a job that trains nothing: a health job) from the
    rank files in its run folder."""
    if rank is None:
        return
    record = handle.record()
    procs = re.search(r"--nproc-per-node=(\d+)", record.get("request", ""))
    ranks = range(int(procs[1]) * int(record["spec"]["nodes"])) if procs else \
        sorted({int(number) for path in rank_files(handle.out_dir)
                if (number := path.stem.removeprefix("rank_")).isdigit()})
    if rank not in ranks:
        raise HarnessError(f"--rank {rank}: job {handle.job_id} has {_ranks_in_words(list(ranks))}")


def _ranks_in_words(ranks: list[int]) -> str:
    """"ranks 0-511", "ranks 0-3, 5", or "no ranks": each run of consecutive ranks as its ends."""
    if not ranks:
        return "no ranks"
    runs = [[ranks[0], ranks[0]]]
    for rank in ranks[1:]:
        if rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return "ranks " + ", ".join(f"{first}-{last}" if last > first else str(first) for first, last in runs)


class LogSource(ABC):
    """One place a job's output grows (a rank's file, the job's output file, a pod's log), read from a position
    on: what `logs` shows whole or as its last lines, and `follow` reads again as it grows."""

    name: str  # its header: ==> name <==
    key: str  # what stays the same from one read to the next (a pod's header names its phase, which changes)

    @abstractmethod
    def read(self, start: int, whole_lines: bool = False) -> tuple[str, int]:
        """The text from position `start` on, and the position after it; with `whole_lines`, up to its last newline
        (a line being written is left for the next read)."""

    @abstractmethod
    def tail_start(self, lines: int) -> int:
        """The position where the last `lines` lines begin."""


class FileLog(LogSource):
    """A file in the run folder, read in bytes from an offset: a rank's log of 512 is read from where the last
    read ended, and its last lines found from its end."""

    BLOCK = 1 << 16

    def __init__(self, path: Path) -> None:
        self.path, self.name, self.key = path, path.name, str(path)

    def read(self, start: int, whole_lines: bool = False) -> tuple[str, int]:
        try:
            with open(self.path, "rb") as f:
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            return "", start
        if whole_lines:
            data = data[:data.rfind(b"\n") + 1]
        return data.decode(errors="replace"), start + len(data)

    def tail_start(self, lines: int) -> int:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return 0
        block = self.BLOCK
        while True:  # from the end, a block at a time, growing, until `lines` newlines or the file's start
            begin = max(0, size - block)
            with open(self.path, "rb") as f:
                f.seek(begin)
                found = last_lines_start(f.read(size - begin), lines, whole=begin == 0)
            if found is not None:
                return begin + found
            block *= 4


def last_lines_start(text: str | bytes, lines: int, whole: bool = True) -> int | None:
    """Where the last `lines` lines of `text` begin (a last line without its newline counts); None where `text`
    holds fewer and is not `whole` (the lines may begin before it)."""
    newline = "\n" if isinstance(text, str) else b"\n"
    end = len(text) - 1 if text.endswith(newline) else len(text)
    for _ in range(lines):
        end = text.rfind(newline, 0, end)
        if end < 0:
            return 0 if whole else None
    return end + 1 if lines else len(text)


class TextLog(LogSource):
    """A log served whole at each read (a pod's, through the API server): positions are characters into it."""

    def __init__(self, name: str, key: str, fetch: Callable[[], str]) -> None:
        self.name, self.key, self._fetch, self._text = name, key, fetch, None

    def text(self) -> str:
        if self._text is None:
            self._text = self._fetch()
        return self._text

    def read(self, start: int, whole_lines: bool = False) -> tuple[str, int]:
        text = self.text()
        if len(text) < start:  # shorter than what was read: a new container's log
            start = 0
        new = text[start:]
        if whole_lines:
            new = new[:new.rfind("\n") + 1]
        return new, start + len(new)

    def tail_start(self, lines: int) -> int:
        return last_lines_start(self.text(), lines)


def follow(launcher: Launcher, handle: Handle, rank: int | None = None, tail: int | None = None,
           poll_s: float | None = None) -> Iterator[str]:
    """The job's output as it grows, in chunks (`harness logs --follow`; the Python API iterates it too): at first
    the output so far (every rank's, or rank `rank`'s; each source's last `tail` lines), then at every poll (`poll_s`,
    else the launcher's) what each source gained, in whole lines, under its `==> name <==` header where the source
    changes, as `tail -f` shows several. Ends once the job has ended and what it wrote is all yielded: the state is read
    before the logs at each poll, so the last read after an end holds everything the job wrote. A source that
    appears later (a rank's file, a restarted pod) is followed from its start."""
    check_rank(handle, rank)
    status = launcher.watched_status()
    shown: dict[str, int] = {}  # source key -> the position yielded up to
    first, last = True, None
    while True:
        ended = status(handle).terminal
        for source in launcher.log_sources(handle, rank):
            start = shown.get(source.key)
            if start is None:
                start = source.tail_start(tail) if first and tail is not None else 0
            text, shown[source.key] = source.read(start, whole_lines=not ended)
            if text and source.key != last:
                gap = "" if last is None else "\n"  # a blank line between sources, as `tail -f` leaves
                text = f"{gap}==> {source.name} <==\n{text}"
            if text:
                yield text
                last = source.key
        if ended:
            return
        first = False
        time.sleep(launcher.poll_s if poll_s is None else poll_s)


def workload_plan(spec: JobSpec, nproc_per_node: int, gpu_memory_gib: float | None) -> tuple[str, ...]:
    """What the workload will make of this many processes, shown with the request: for resnet the global batch
    and its optimizer's schedule, for bert the batch plan (an MLPerf reference batch and its split), for gpt3,
    the decoders and flux1 the parallel layout and the memory estimate per GPU (and for the decoders and flux1 the
    bytes each GPU sends per step). A world that cannot take the batch (a resnet global batch the LARS table does not cover),
    or a config that cannot fit, is refused here, with the numbers: by the same functions the workers call."""
    world = spec.nodes * nproc_per_node
    try:
        if spec.benchmark == "resnet":
            from workloads.resnet import config as resnet  # torch-free

            cfg = resnet.PRESETS[spec.preset]
            if spec.batch_size:
                cfg = dataclasses.replace(cfg, batch_size=spec.batch_size)
            return tuple(resnet.describe(resnet.plan_run(cfg, world, spec.optimizer)))
        if spec.benchmark == "bert":
            from workloads.bert import config as bert  # torch-free: sizes and arithmetic only

            preset = bert.PRESETS[spec.preset]
            return tuple(bert.describe(preset, bert.plan_batch(preset, world, spec.batch_size, spec.packing_factor)))
        if spec.benchmark == "gpt3":
            from workloads.gpt3 import config as gpt3

            cfg = gpt3.PRESETS[spec.preset]
            if spec.batch_size:
                cfg = dataclasses.replace(cfg, micro_batch=spec.batch_size)
            layout = gpt3.plan_layout(cfg, world, nproc_per_node)
            if gpu_memory_gib:
                gpt3.check_fits(cfg, layout, gpu_memory_gib)
            return tuple(gpt3.describe(cfg, layout, gpu_memory_gib))
        if spec.benchmark == "flux1":
            from workloads.flux import config as flux  # torch-free

            cfg = flux.run_config(spec.preset, spec.global_batch, spec.force_batch, learning_rate=spec.learning_rate,
                                  warmup_samples=spec.warmup_samples)
            layout = flux.plan_layout(cfg, world, nproc_per_node)
            if gpu_memory_gib:
                flux.check_fits(cfg, layout, gpu_memory_gib)
            return tuple(flux.describe(cfg, layout, gpu_memory_gib))
        from workloads.decoder import config as llama  # torch-free, as the others

        if spec.benchmark in llama.PRESET_TABLES:

            from workloads.decoder.stages import with_pipeline  # torch-free

            cfg = with_pipeline(llama.run_config(spec.benchmark, spec.preset, spec.global_batch, spec.force_batch,
                                                 learning_rate=spec.learning_rate,
                                                 warmup_samples=spec.warmup_samples), spec.pipeline_parallel)
            layout = llama.plan_layout(cfg, world, nproc_per_node)
            if gpu_memory_gib:
                llama.check_fits(spec.benchmark, cfg, layout, gpu_memory_gib)
            return tuple(llama.describe(spec.benchmark, cfg, layout, gpu_memory_gib))
    except ValueError as exc:
        raise HarnessError(str(exc)) from None
    return ()


def check_procs_fit(spec: JobSpec, gpus: int) -> None:
    """Each process drives one GPU: a node with `gpus` GPUs (as the launcher counts them) takes no more."""
    if gpus and spec.procs_per_node and spec.procs_per_node > gpus:
        given = "--gpus-per-node" if spec.gpus_per_node is not None else "the profile's gpus_per_node"
        raise HarnessError(f"--procs-per-node {spec.procs_per_node} is more than {given} {gpus}: each process "
                           "drives one GPU")


def cluster_procs_per_node(spec: JobSpec) -> int:
    """Processes per node on a cluster: as asked, else one per GPU, else the profile's CPU default."""
    check_procs_fit(spec, spec.gpus())
    return spec.procs_per_node or spec.gpus() or spec.profile.procs_per_node or 1


def rendezvous_timeouts(spec: JobSpec) -> tuple[int, int]:
    """(join, store read) timeouts in seconds: the profile's, else torch's defaults (600, 60) plus 2 s and
    0.25 s per node. Nodes start over minutes at scale (image pulls, container start), and one c10d store
    serves every node's agent, so 448 nodes get 1,496 s to join and 172 s per store read."""
    settings = spec.profile.rendezvous
    return (settings.join_timeout_s or 600 + 2 * spec.nodes, settings.store_timeout_s or 60 + spec.nodes // 4)


def health_command(spec: JobSpec, python: str) -> list[str]:
    """The command each node runs for preflight: its checks against the profile's thresholds."""
    settings = json.dumps({k: v for k, v in dataclasses.asdict(spec.profile.preflight).items() if v is not None},
                          sort_keys=True, separators=(",", ":"))
    room = []
    checkpoint = BENCHMARKS[spec.benchmark].checkpoint_bytes(spec.preset)
    if checkpoint is not None:  # the kept checkpoints and the one being written
        room = ["--checkpoints-gib", f"{(spec.keep_checkpoints + 1) * checkpoint / 2**30:.6g}"]
    return [python, "-m", "harness.health", "--out", str(spec.out_dir), "--settings", settings,
            "--gpus", str(spec.gpus()), "--rdma", str(spec.profile.rdma_count), *room]


def agent_command(spec: JobSpec, python: str, nproc_per_node: int, rendezvous: str | None = None,
                  rdzv_id: str = "harness", restart_here: bool = False, job_token: str | None = None,
                  launch: str | None = None) -> list[str]:
    """The command one node runs: the harness's node agent around torchrun's, then the workload.

    `python -c AGENT_BOOTSTRAP` is `python -m harness.agent`, except that in an image without the harness
    it says so in one line naming the image (see workloads.common.requirements_check).

    Without `rendezvous` the agent runs standalone (one node, a private port);
    otherwise all nodes meet at the c10d store at `rendezvous` (host:port).
    `restart_here`: the node agent restarts failed attempts itself (local); on clusters
    the scheduler restarts the job (see harness.agent). `job_token`: the node agent claims the run
    folder for this job and refuses one that another job's results are in (Kubernetes' shared volume).
    `launch`: the run of the campaign this launch is for (Slurm's step per run; a shell word there), recorded with
    the node's attempts so that the steps of one attempt are told apart (harness.agent --launch).
    """
    cmd = [python, "-c", AGENT_BOOTSTRAP, "--out", str(spec.out_dir), "--max-restarts", str(spec.max_restarts),
           "--job", spec.name or spec.benchmark, "--benchmark", spec.benchmark, "--metrics-port", str(spec.metrics())]
    if spec.pushgateway:
        cmd += ["--pushgateway", spec.pushgateway]
    if restart_here:
        cmd.append("--restart-here")
    if job_token:
        cmd += ["--job-token", job_token]
    if launch is not None:
        cmd += ["--launch", launch]
    cmd += ["--", f"--nproc-per-node={nproc_per_node}"]
    if rendezvous is None:
        cmd.append("--standalone")
    else:
        join, store = rendezvous_timeouts(spec)
        cmd += [f"--nnodes={spec.nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous}",
                f"--rdzv-id={rdzv_id}", f"--rdzv-conf=join_timeout={join},read_timeout={store}"]
    return cmd + ["-m", "workloads", *spec.worker_args()]
