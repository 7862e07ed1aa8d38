"""The job spec: one dataclass that every launcher turns into a request.

It is built from the command line, validated here with messages that name the
problem and the valid choices, and saved beside the results (job.json) so that a
run folder always says how it was produced. Nothing here imports torch: the CLI
must answer `--help` and reject bad input instantly.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from harness import profiles
from harness.errors import HarnessError
from harness.profiles import Profile
from workloads.common.compiling import COMPILE_CHOICES, WARM_UP_CHOICES  # torch-free
from workloads.common.page_cache import ALLOW_FLAG  # torch-free
from workloads.common.resilience_options import CheckpointEvery, FaultPlan, StragglerWindow  # torch-free
from workloads.decoder.config import FIXED_WARMUP, RCP_GLOBAL_BATCHES, RCP_WARMUP_BENCHMARKS, \
    rcp_batches_in_words  # torch-free
from workloads.decoder.stages import PIPELINED_BENCHMARKS  # torch-free
from workloads.registry import BENCHMARKS, missing_inputs  # torch-free

# How often a run checkpoints unless told: tiny runs often enough that a fault costs seconds; full runs
# by wall time, since a step takes from milliseconds (ResNet) to seconds (GPT-3).
CHECKPOINT_EVERY = {"tiny": "20", "full": "15m"}

RESNET_OPTIMIZERS = ("sgd", "lars")  # mllog's constants.SGD and constants.LARS
DEFAULT_RUNS_ROOT = Path("results") / "runs"
PATH_FIELDS = ("out_dir", "data", "init_checkpoint")  # JobSpec fields that hold paths (text in job.json)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")  # \Z, not $: "$" also matches before a final newline
# Job names become Kubernetes object and pod names (RFC 1123 labels, with room for "-worker-447")
# and Slurm job names; one rule for every backend keeps them safe everywhere.
JOB_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?\Z")


@dataclass
class JobSpec:
    """Everything a launcher needs to start one benchmark campaign (K runs)."""

    benchmark: str
    preset: str = "tiny"
    nodes: int = 1
    gpus_per_node: int | None = None  # GPUs each node asks for; None: the profile's (local: the visible ones)
    procs_per_node: int | None = None  # None: one per GPU, or the profile's CPU default (local: 2)
    runs: int = 1  # `harness run` without --runs: the rules' count for a closed preset (campaign_plan.default_runs)
    seed: int | None = None  # None: each run draws and logs its own random seed
    out_dir: Path | None = None  # None: results/runs/<benchmark>-<preset>-<time>
    max_restarts: int = 3  # restart budget for infrastructure failures, shared by every backend
    checkpoint_every: str | None = None  # "50" steps or "10m"; None: the preset's (CHECKPOINT_EVERY)
    keep_checkpoints: int = 2
    async_checkpoint: bool = False
    restart: str = "in-process"  # "process": every retried failure restarts the workers as new processes
    inject_failure: str | None = None  # RANK:STEP[:KIND], on the first attempt (tests, demos)
    straggler_window: str = "60"  # seconds of training between straggler checks, or "20steps"; "0": none
    optimizer: str | None = None  # resnet: "sgd" or "lars" whatever the global batch; None: the preset's choice
    straggler_threshold: float = 0.75  # a rank slower than this share of the fastest's speed is a straggler
    compile: str = "auto"  # torch.compile: "auto" (on GPUs), "on" or "off"
    warm_up: str = "auto"  # the warm-up before run_start: "auto" (compiled or on GPUs), "on" or "off"
    env: dict[str, str] = field(default_factory=dict)
    metrics_port: int | None = None  # None: the profile's; 0: no metrics endpoint
    pushgateway: str | None = None  # also push metrics there (clusters whose nodes Prometheus cannot scrape)
    data: Path | None = None
    init_checkpoint: Path | None = None  # starting weights (bert, gpt3), as MLPerf's rules start them
    synthetic: bool = False
    max_steps: int | None = None  # stop early (smoke tests, throughput runs)
    batch_size: int | None = None  # per-process batch; None: the preset's
    global_batch: int | None = None  # the Llamas: sequences per optimizer step; None: the preset's
    force_batch: bool = False  # the Llamas: accept a global batch outside the RCP table
    learning_rate: float | None = None  # the Llamas: the peak LR; None: the RCP row's, interpolated, or the preset's
    warmup_samples: int | None = None  # llama31_8b: LR warmup in samples; None: as the peak LR
    pipeline_parallel: int | None = None  # pretraining decoders: pipeline stages; None: the preset's
    allow_unflushed_cache: bool = False  # a closed run goes ahead when its page cache could not be flushed
    packing_factor: int = 1  # bert: sequences per row of packed data, on average (1: unpacked)
    decode: str | None = None  # resnet: where its JPEGs are decoded, "workers" or "device"; None: the preset's
    submitter: str = "harness"
    system: str | None = None  # the logged submission_platform; None: derived from the machine
    name: str | None = None  # the job's name on the cluster; None: <benchmark>-<preset>
    # Where each run of a campaign is a job of its own (a closed campaign on Kubernetes, whose page cache is flushed
    # as each job's pods start): the run this job does, after the ones before it (the workers' --last-run).
    launch: int | None = None
    run_minutes: float | None = None  # one run's expected time-to-train; None: the campaign plan's estimate
    # Preflight (harness.health, harness.preflight): check the nodes first and keep the bad ones out.
    preflight: bool = False
    spare_nodes: int = 0  # extra nodes allocated; the healthiest `nodes` train
    drain_bad_nodes: bool = False  # Slurm: drain the nodes preflight kept out, with the reason
    taint_bad_nodes: bool = False  # Kubernetes: a NoSchedule taint on them (a condition is always written)
    exclude_nodes: list[str] = field(default_factory=list)  # nodes the training must not use
    health_only: bool = False  # `harness preflight`: the health job alone, no workload after it
    # The verdicts of the nodes training may use, where preflight.json stays on the submitting side (Kubernetes):
    # harness.preflight.pod_verdicts, handed to the training pods for their preflight_passed metric.
    node_verdicts: dict = field(default_factory=dict)
    profile: Profile = field(default_factory=lambda: profiles.load(profiles.DEFAULT_PROFILE))

    def default_name(self) -> str:
        """The job's name without --name. MLPerf's names hold underscores (llama31_8b), which Kubernetes object
        names may not. A cluster backend may make it unique per job (Kubernetes appends the job's token)."""
        if self.health_only:
            return "preflight"
        return f"{self.benchmark}-{self.preset}".replace("_", "-")

    def resolved(self, runs_root: Path | None = None) -> "JobSpec":
        """Fill in defaults that depend on the time or the machine, once, before rendering.
        `runs_root`: where run folders go without --out (the backend's shared file system)."""
        spec = dataclasses.replace(self)
        if spec.name is None:
            spec.name = spec.default_name()
        if spec.checkpoint_every is None:
            spec.checkpoint_every = CHECKPOINT_EVERY.get(spec.preset)  # an unknown preset is refused later
        if spec.out_dir is None:
            spec.out_dir = default_out_dir(runs_root, f"{spec.benchmark}-{spec.preset}")
        for key in PATH_FIELDS:
            if getattr(spec, key) is not None:
                setattr(spec, key, Path(getattr(spec, key)).absolute())
        return spec

    def metrics(self) -> int:
        """The node agents' metrics port: as asked, else the profile's; 0 is off."""
        return self.profile.metrics_port if self.metrics_port is None else self.metrics_port

    def gpus(self) -> int:
        """GPUs per node on a cluster: as asked, else the profile's."""
        return self.profile.gpus_per_node if self.gpus_per_node is None else self.gpus_per_node

    def seeds(self) -> list[int | None]:
        """Distinct seeds, one per run: seed, seed+1, ...; None lets each run draw its own."""
        if self.seed is None:
            return [None] * self.runs
        return [self.seed + i for i in range(self.runs)]

    def worker_args(self) -> list[str]:
        """Arguments of `python -m workloads`, the program every rank runs on every backend."""
        args = [self.benchmark, "--preset", self.preset, "--out", str(self.out_dir),
                "--runs", str(self.runs), "--submitter", self.submitter]
        if self.seed is not None:
            args += ["--seed", str(self.seed)]
        if self.launch is not None:
            args += ["--last-run", str(self.launch)]
        if self.system:
            args += ["--system", self.system]
        if self.data is not None:
            args += ["--data", str(self.data)]
        if self.init_checkpoint is not None:
            args += ["--init-checkpoint", str(self.init_checkpoint)]
        if self.synthetic:
            args.append("--synthetic")
        if self.max_steps is not None:
            args += ["--max-steps", str(self.max_steps)]
        if self.batch_size is not None:
            args += ["--batch-size", str(self.batch_size)]
        if self.global_batch is not None:
            args += ["--global-batch", str(self.global_batch)]
        if self.force_batch:
            args.append("--force-batch")
        if self.learning_rate is not None:
            args += ["--learning-rate", repr(self.learning_rate)]
        if self.warmup_samples is not None:
            args += ["--warmup-samples", str(self.warmup_samples)]
        if self.pipeline_parallel is not None:
            args += ["--pipeline-parallel", str(self.pipeline_parallel)]
        if self.allow_unflushed_cache:
            args.append(ALLOW_FLAG)
        if self.packing_factor != 1:
            args += ["--packing-factor", str(self.packing_factor)]
        if self.checkpoint_every is not None:
            args += ["--checkpoint-every", self.checkpoint_every]
        args += ["--keep-checkpoints", str(self.keep_checkpoints)]
        if self.async_checkpoint:
            args.append("--async-checkpoint")
        if self.restart != "in-process":
            args += ["--restart", self.restart]
        if self.inject_failure is not None:
            args += ["--inject-failure", self.inject_failure]
        if self.optimizer is not None:
            args += ["--optimizer", self.optimizer]
        if self.decode is not None:
            args += ["--decode", self.decode]
        args += ["--compile", self.compile, "--warm-up", self.warm_up]
        args += ["--straggler-window", self.straggler_window,
                 "--straggler-threshold", f"{self.straggler_threshold:g}"]
        return args

    def command_line(self, backend: str) -> list[str]:
        """The `harness run` invocation that builds this spec again (for READMEs of exported packages)."""
        args = ["harness", "run", self.benchmark, "--backend", backend, "--profile", self.profile.name,
                "--preset", self.preset,
                "--nodes", str(self.nodes), "--runs", str(self.runs), "--max-restarts", str(self.max_restarts),
                "--submitter", self.submitter]
        for flag, value in (("--gpus-per-node", self.gpus_per_node), ("--procs-per-node", self.procs_per_node),
                            ("--seed", self.seed),
                            ("--out", self.out_dir), ("--data", self.data),
                            ("--init-checkpoint", self.init_checkpoint), ("--max-steps", self.max_steps),
                            ("--batch-size", self.batch_size), ("--global-batch", self.global_batch),
                            ("--learning-rate", None if self.learning_rate is None else repr(self.learning_rate)),
                            ("--warmup-samples", self.warmup_samples), ("--run-minutes", self.run_minutes),
                            ("--pipeline-parallel", self.pipeline_parallel),
                            ("--packing-factor", self.packing_factor if self.packing_factor != 1 else None),
                            ("--system", self.system), ("--name", self.name),
                            ("--checkpoint-every", self.checkpoint_every),
                            ("--metrics-port", self.metrics_port), ("--pushgateway", self.pushgateway),
                            ("--straggler-window", self.straggler_window), ("--optimizer", self.optimizer),
                            ("--decode", self.decode),
                            ("--straggler-threshold", self.straggler_threshold), ("--compile", self.compile),
                            ("--warm-up", self.warm_up),
                            ("--keep-checkpoints", self.keep_checkpoints)):
            if value is not None:
                args += [flag, str(value)]
        for key, value in self.env.items():
            args += ["--env", f"{key}={value}"]
        for pair in profiles.overrides(self.profile):
            args += ["--set", pair]
        if self.synthetic:
            args.append("--synthetic")
        if self.force_batch:
            args.append("--force-batch")
        if self.allow_unflushed_cache:
            args.append(ALLOW_FLAG)
        if self.async_checkpoint:
            args.append("--async-checkpoint")
        if self.restart != "in-process":
            args += ["--restart", self.restart]
        args.append("--preflight" if self.preflight else "--no-preflight")  # its default depends on nodes and preset
        if self.spare_nodes:
            args += ["--spare-nodes", str(self.spare_nodes)]
        args += [flag for flag, on in (("--drain-bad-nodes", self.drain_bad_nodes),
                                       ("--taint-bad-nodes", self.taint_bad_nodes)) if on]
        return args

    @classmethod
    def from_dict(cls, record: dict) -> "JobSpec":
        """The inverse of to_dict (job.json's "spec")."""
        known = {f.name for f in dataclasses.fields(cls)}
        spec = cls(**{key: value for key, value in record.items() if key in known})
        if isinstance(spec.profile, dict):
            spec.profile = profiles.from_dict(spec.profile)
        for key in PATH_FIELDS:
            if getattr(spec, key) is not None:
                setattr(spec, key, Path(getattr(spec, key)))
        return spec

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for key in PATH_FIELDS:
            if d[key] is not None:
                d[key] = str(d[key])
        return d


def parse_env(pairs: list[str]) -> dict[str, str]:
    """Turn repeated `--env KEY=VALUE` options into a dict, refusing malformed names."""
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not _ENV_NAME.match(key):
            raise HarnessError(f"--env {pair!r}: expected KEY=VALUE with KEY made of letters, digits and _")
        env[key] = value
    return env


def validate(spec: JobSpec, dry_run: bool = False, paths_here: bool = True) -> list[str]:
    """Reject a spec that cannot run, with one line naming the problem and the valid choices.

    `paths_here`: the nodes see this machine's paths (local, Slurm's shared file system),
    so dataset and checkpoint folders can be checked now; pods see their own volumes.
    A dry run only shows the request, so missing inputs come back as problems (one line each) instead of errors.
    """
    if spec.benchmark not in BENCHMARKS:
        raise HarnessError(f"unknown benchmark {spec.benchmark!r}; choose one of: {', '.join(BENCHMARKS)}")
    presets = BENCHMARKS[spec.benchmark].presets
    if spec.preset not in presets:
        raise HarnessError(f"unknown preset {spec.preset!r} for {spec.benchmark}; choose one of: {', '.join(presets)}")
    for name in ("nodes", "runs"):
        if getattr(spec, name) < 1:
            raise HarnessError(f"--{name} must be at least 1, got {getattr(spec, name)}")
    if (spec.global_batch is not None or spec.force_batch) and spec.benchmark not in RCP_GLOBAL_BATCHES:
        raise HarnessError(f"--global-batch and --force-batch apply to {', '.join(RCP_GLOBAL_BATCHES)} only, not "
                           f"{spec.benchmark} (its global batch follows --batch-size and the process count)")
    if spec.learning_rate is not None and spec.benchmark not in RCP_GLOBAL_BATCHES:
        raise HarnessError(f"--learning-rate applies to {', '.join(RCP_GLOBAL_BATCHES)} only, not "
                           f"{spec.benchmark} (its LR follows its reference's rule for the batch)")
    if spec.warmup_samples is not None and spec.benchmark not in RCP_WARMUP_BENCHMARKS:
        raise HarnessError(f"--warmup-samples applies to {', '.join(RCP_WARMUP_BENCHMARKS)} only, whose RCP rows "
                           f"carry a warmup; {spec.benchmark} "
                           + FIXED_WARMUP.get(spec.benchmark, "follows its reference's warmup"))
    if spec.pipeline_parallel is not None and spec.benchmark not in PIPELINED_BENCHMARKS:
        raise HarnessError(f"--pipeline-parallel applies to {', '.join(PIPELINED_BENCHMARKS)} only, not "
                           f"{spec.benchmark}")
    if spec.learning_rate is not None and not spec.learning_rate > 0:
        raise HarnessError(f"--learning-rate must be above 0 (the peak LR), got {spec.learning_rate:g}")
    if spec.warmup_samples is not None and spec.warmup_samples < 0:
        raise HarnessError(f"--warmup-samples must be 0 or more, got {spec.warmup_samples}")
    if spec.benchmark in RCP_GLOBAL_BATCHES and spec.batch_size is not None:
        raise HarnessError(f"{spec.benchmark} takes its batch as --global-batch (samples per step: an RCP row or a "
                           f"batch between two, {rcp_batches_in_words(spec.benchmark)}), not --batch-size; "
                           "the layout decides each process's share")
    if spec.packing_factor != 1 and spec.benchmark != "bert":
        raise HarnessError(f"--packing-factor applies to bert only (packed BERT data), not {spec.benchmark}")
    if spec.packing_factor < 1:
        raise HarnessError(f"--packing-factor counts sequences per packed row: 1 (unpacked) or more, got "
                           f"{spec.packing_factor}")
    if spec.force_batch and spec.global_batch is None:
        raise HarnessError("--force-batch accepts a --global-batch outside the RCP table: give --global-batch too")
    for name in ("procs_per_node", "max_steps", "batch_size", "global_batch", "pipeline_parallel"):
        value = getattr(spec, name)
        if value is not None and value < 1:
            raise HarnessError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if spec.gpus_per_node is not None and spec.gpus_per_node < 0:
        raise HarnessError(f"--gpus-per-node must be 0 (CPU nodes) or more, got {spec.gpus_per_node}")
    if spec.metrics_port is not None and not 0 <= spec.metrics_port < 65536:
        raise HarnessError(f"--metrics-port must be a TCP port (1 to 65535), or 0 for no metrics; got "
                           f"{spec.metrics_port}")
    if spec.pushgateway is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", spec.pushgateway):
        raise HarnessError(f"--pushgateway {spec.pushgateway!r} is not an http(s) URL such as "
                           "http://pushgateway.monitoring:9091")
    if spec.optimizer is not None and (spec.benchmark != "resnet" or spec.optimizer not in RESNET_OPTIMIZERS):
        raise HarnessError(f"--optimizer {spec.optimizer!r}: resnet takes one of {', '.join(RESNET_OPTIMIZERS)} "
                           "(default: LARS from a global batch of 4,096 up); bert and gpt3 use their reference's")
    # resnet's own option, from its registry entry: read here, since resnet's config imports mllog (numpy)
    decode_choices = BENCHMARKS["resnet"].own_options()["--decode"]["choices"]
    if spec.decode is not None and (spec.benchmark != "resnet" or spec.decode not in decode_choices):
        raise HarnessError(f"--decode {spec.decode!r}: resnet takes one of {', '.join(decode_choices)} (workers: "
                           "in the loader workers, the default; device: in one batched call on the run's device, "
                           "nvjpeg on GPUs); the other benchmarks read no images")
    if spec.compile not in COMPILE_CHOICES:
        raise HarnessError(f"--compile {spec.compile!r}: choose one of {', '.join(COMPILE_CHOICES)} (auto: compiled "
                           "on GPUs, eager on CPU)")
    if spec.warm_up not in WARM_UP_CHOICES:
        raise HarnessError(f"--warm-up {spec.warm_up!r}: choose one of {', '.join(WARM_UP_CHOICES)} (auto: a warm-up "
                           "before run_start when the model is compiled or on GPUs)")
    try:
        StragglerWindow.parse(spec.straggler_window)
    except ValueError as e:
        raise HarnessError(str(e)) from None
    if not 0 < spec.straggler_threshold <= 1:
        raise HarnessError(f"--straggler-threshold must be above 0 and at most 1 (a share of the fastest rank's "
                           f"speed), got {spec.straggler_threshold:g}")
    if spec.spare_nodes < 0:
        raise HarnessError(f"--spare-nodes must be 0 or more, got {spec.spare_nodes}")
    if spec.spare_nodes and not spec.preflight:
        raise HarnessError("--spare-nodes needs --preflight: the spares replace the nodes preflight keeps out")
    if spec.max_restarts < 0:
        raise HarnessError(f"--max-restarts must be 0 or more, got {spec.max_restarts}")
    if spec.keep_checkpoints < 1:
        raise HarnessError(f"--keep-checkpoints must be at least 1, got {spec.keep_checkpoints}")
    try:
        if spec.checkpoint_every is not None:
            CheckpointEvery.parse(spec.checkpoint_every)
        if spec.inject_failure is not None:
            fault = FaultPlan.parse(spec.inject_failure)
            world = spec.nodes * (spec.procs_per_node or 0)  # unknown (0) until a launcher counts the GPUs
            if world and fault.rank >= world:
                raise ValueError(f"--inject-failure {spec.inject_failure!r}: rank {fault.rank} does not exist "
                                 f"in a world of {world} processes (ranks 0 to {world - 1})")
    except ValueError as exc:
        raise HarnessError(str(exc)) from None
    if spec.run_minutes is not None and not spec.run_minutes > 0:
        raise HarnessError(f"--run-minutes must be above 0 (one run's expected time-to-train), got "
                           f"{spec.run_minutes:g}")
    if spec.seed is not None and not 0 <= spec.seed < 2**31 - spec.runs:
        raise HarnessError(f"--seed must be between 0 and {2**31 - 1 - spec.runs}, got {spec.seed}")
    if not spec.submitter.strip():
        raise HarnessError("--submitter must not be empty")
    if spec.name is not None and not JOB_NAME.match(spec.name):
        raise HarnessError(f"job name {spec.name!r} is not usable on every backend: use 1 to 40 lowercase letters, "
                           "digits and '-', starting and ending with a letter or digit (RFC 1123)")
    if spec.data is not None and spec.synthetic:
        raise HarnessError("--data and --synthetic exclude each other: pick a dataset or synthetic input")
    missing = []
    if paths_here and spec.data is not None and not spec.data.is_dir():
        missing.append(f"dataset path {spec.data} does not exist or is not a folder")
    if paths_here and spec.init_checkpoint is not None and not spec.init_checkpoint.exists():
        missing.append(f"--init-checkpoint path {spec.init_checkpoint} does not exist")
    missing += missing_inputs(spec.benchmark, spec.preset, spec.data, spec.init_checkpoint, spec.synthetic)
    if missing and not dry_run:
        raise HarnessError("; ".join(missing))
    return missing


def default_out_dir(runs_root: Path | None, kind: str) -> Path:
    """A run folder without --out: `<runs root>/<kind>-<time to the second>`, where the backend's runs go (Slurm's
    results_dir), else results/runs. claim_fresh_folder tells apart two of one second."""
    return (runs_root or DEFAULT_RUNS_ROOT) / f"{kind}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def claim_fresh_folder(out_dir: Path) -> Path:
    """Create a run folder under its default name, else (another run has it: two `harness run` without --out
    started in the same second, by a campaign script looping over seeds) that name with the first free -2,
    -3, ... mkdir makes a folder or fails, atomically on NFS too, so two runs never get the same one. Only
    default names move: an explicit --out is the user's, used or refused as given (see cmd_run)."""
    folder = out_dir
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        for n in itertools.count(2):
            try:
                folder.mkdir()
                return folder
            except FileExistsError:
                folder = out_dir.with_name(f"{out_dir.name}-{n}")
    except OSError as exc:
        raise HarnessError(f"cannot create output folder {folder}: {exc.strerror or exc}") from None


def check_writable(out_dir: Path) -> None:
    """Create the output folder now, so an unwritable path fails before any process starts."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise HarnessError(f"cannot write to output folder {out_dir}: {exc.strerror or exc}") from None

