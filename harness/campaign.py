"""A campaign, step by step: the one pipeline under `harness run`, `harness preflight` and the Python API.

Each step is one function, in the order a campaign takes them:

    resolve_spec      the options, by the names `harness run` gives them, into a JobSpec (the profile, the defaults
                      that depend on the preset and the node count)
    Plan.resolve      the backend's launcher, the spec resolved for it, and what would fail at run time (problems)
    Plan.render       the exact request (a dry run stops here)
    Plan.claim        the run folder: a fresh one under the default name, or --out checked writable and unused
    Execution         what the submitting side does until the campaign ends: the preflight (or its watcher inside
                      the allocation) and the nodes it keeps out, each job submitted, watched (with the ticks) and
                      collected, then the summary and the exit code

The spec goes down from here only (launchers, preflight, report), never back to the CLI: `harness run` calls
`run`, the Python API (harness.api) calls the same steps and `execute` in a process of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from harness import profiles
from harness.errors import HarnessError
from harness.launchers.base import JOB_FILE, Handle
from harness.spec import JobSpec, check_writable, claim_fresh_folder, default_out_dir, parse_env, validate
from workloads.common.run_record import replace_whole
from workloads.registry import BENCHMARKS

# JobSpec fields that no option sets: the pipeline's own (each job's launch, the nodes preflight keeps out, ...).
_PIPELINE_FIELDS = ("launch", "exclude_nodes", "health_only", "node_verdicts")
# Options that are not a JobSpec field of the same name: resolve_spec turns each into fields.
_RESOLVED = ("benchmark", "preset", "runs", "out", "env", "profile", "overrides", "api", "preflight", "spare_nodes")
_AS_GIVEN = tuple(f.name for f in dataclasses.fields(JobSpec)
                  if f.name not in (*_RESOLVED, *_PIPELINE_FIELDS, "out_dir"))
# A campaign's options by the names `harness run` gives them (its argparse destinations): the CLI and
# harness.start take the same ones.
RUN_OPTIONS = (*_RESOLVED, *_AS_GIVEN)
CAMPAIGN_LOG = "campaign.log"  # what a campaign harness.start started says, as `harness run` says it
EXIT_KEY = "campaign_exit_code"  # job.json: `harness run`'s exit code, once the campaign ended
PIPELINE_FILE = "campaign.pid"  # "<host> <pid>" of the pipeline (a `harness run` or a started one) while it runs


def resolve_spec(benchmark: str, *, preset: str | None = None, runs: int | None = None, out: str | Path | None = None,
                 env: Mapping[str, str] | typing.Iterable[str] = (), profile: str = profiles.DEFAULT_PROFILE,
                 overrides: Mapping[str, object] | typing.Iterable[str] = (), api: str | None = None,
                 preflight: bool | None = None, spare_nodes: int | None = None, **fields) -> JobSpec:
    """The job spec of a campaign from `harness run`'s options: `env` and `overrides` (--set) as KEY=VALUE words
    or a mapping; every other option a JobSpec field of its name, as given. Unresolved (Plan.resolve does that)."""
    from harness.campaign_plan import asked_spares, default_runs

    unknown = sorted(set(fields) - set(_AS_GIVEN))
    if unknown:
        raise HarnessError(f"unknown option {', '.join(map(repr, unknown))}; the options are: "
                           f"{', '.join(RUN_OPTIONS)}")
    _check_types({"preset": preset, "runs": runs, "out": out, "env": env, "profile": profile, "overrides": overrides,
                  "api": api, "preflight": preflight, "spare_nodes": spare_nodes}, typing.get_type_hints(resolve_spec))
    _check_types(fields, typing.get_type_hints(JobSpec))
    preset = preset or ("full" if fields.get("data") else "tiny")
    overrides = [*_words(overrides), *([f"kubernetes.api={api}"] if api else [])]
    loaded = profiles.apply_overrides(profiles.load(profile), overrides)
    spec = JobSpec(benchmark=benchmark, preset=preset, out_dir=out, env=parse_env(_words(env)), profile=loaded,
                   **fields)
    spec = dataclasses.replace(
        spec, runs=runs if runs is not None else default_runs(benchmark, preset, spec.synthetic),
        preflight=preflight if preflight is not None else (spec.nodes > 1 and preset == "full"),
        spare_nodes=spare_nodes or 0)
    return spec if spare_nodes is not None else dataclasses.replace(spec, spare_nodes=asked_spares(spec))


def _words(pairs: Mapping[str, object] | typing.Iterable[str]) -> list[str]:
    """KEY=VALUE words, as the command line repeats them, from words or a mapping (Python callers' choice)."""
    if isinstance(pairs, str):
        return [pairs]
    return [f"{key}={value}" for key, value in pairs.items()] if isinstance(pairs, Mapping) else list(pairs)


def _check_types(values: dict, hints: dict) -> None:
    """A Python caller's option of the wrong type is one line, as argparse's would be, not a TypeError deep inside."""
    for name, value in values.items():
        allowed = typing.get_args(hints[name]) or (hints[name],)
        kinds = tuple(typing.get_origin(kind) or kind for kind in allowed)
        kinds += (str,) if Path in kinds else ()  # a path given as text
        kinds += (int,) if float in kinds else ()
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(sorted({"None" if k is type(None) else k.__name__ for k in kinds}))
            raise HarnessError(f"option {name}={value!r}: expected {names}")


@dataclass
class Plan:
    """A campaign resolved for its backend, before anything is submitted."""

    launcher: object  # harness.launchers.Launcher
    spec: JobSpec
    problems: list[str]  # what would fail at run time: refused before submitting, listed by a dry run
    runs_given: bool  # --runs was given (the runs note says what the rules ask otherwise)
    out_given: bool  # --out was given: used as it is, never moved to a fresh name

    @classmethod
    def resolve(cls, backend: str, options: dict) -> "Plan":
        from harness import campaign_plan
        from harness.launchers import get_launcher

        launcher = get_launcher(backend)
        spec = resolve_spec(**options)
        spec = spec.resolved(runs_root=launcher.runs_root(spec))
        problems = [*validate(spec, dry_run=True, paths_here=launcher.paths_here), *campaign_plan.problems(spec),
                    *launcher.problems(spec)]
        return cls(launcher, spec, problems, runs_given=options.get("runs") is not None,
                   out_given=options.get("out") is not None)

    def refuse_problems(self) -> None:
        if self.problems:
            raise HarnessError("; ".join(self.problems))

    def render(self):
        return self.launcher.render(self.spec)

    def claim(self):
        """Claim the run folder, before the request's notes: a folder the job cannot use is then the one line said.
        Returns the request rendered for the folder claimed."""
        if not self.out_given:  # the default name, or the first free -2, -3 after it; rendered again for it
            self.spec = dataclasses.replace(self.spec, out_dir=claim_fresh_folder(self.spec.out_dir))
        check_writable(self.spec.out_dir)
        if any(self.spec.out_dir.glob("result_*.txt")):
            raise HarnessError(f"{self.spec.out_dir} already holds results; pick a new --out so they stay intact")
        return self.render()

    def notes(self, request) -> list[str]:
        """What the user should know about the request, and the runs note of a closed campaign."""
        from harness import campaign_plan

        runs = campaign_plan.runs_note(self.spec, given=self.runs_given)
        return [*request.notes, *([runs] if runs else [])]


def run(backend: str, options: dict, dry_run: bool = False, pod_monitor: bool = False, strict: bool = False) -> int:
    """`harness run`: every step in order, saying what `harness run` says; its exit code."""
    plan = Plan.resolve(backend, options)
    submits = not (dry_run or pod_monitor)
    if submits:
        plan.refuse_problems()
    if strict and not dry_run:
        raise HarnessError("--strict gates a --dry-run on its problems; add --dry-run")
    request = plan.render()
    if submits:
        request = plan.claim()
    for note in plan.notes(request):
        print(f"harness: {note}", file=sys.stderr)
    if pod_monitor:
        print(_pod_monitor(plan), end="")
        return 0
    if dry_run:
        print(request.text)
        for problem in plan.problems:
            print(f"harness: problem: {problem}", file=sys.stderr)
        return 1 if plan.problems and strict else 0
    return execute(plan.launcher, plan.spec)


def _pod_monitor(plan: Plan) -> str:
    if plan.launcher.name != "k8s":
        raise HarnessError(f"--pod-monitor is for --backend k8s; on {plan.launcher.name} Prometheus finds the nodes "
                           "through the run folder's prometheus-targets/*.json (one file a node)")
    import yaml

    from harness.launchers.kubernetes_render import pod_monitor

    return yaml.safe_dump(pod_monitor(plan.spec), sort_keys=True, default_flow_style=False)


def execute(launcher, spec: JobSpec) -> int:
    """From the claimed run folder to the verdict: what `harness run` does after its notes; its exit code, recorded
    in job.json (EXIT_KEY) for `harness status` and harness.attach."""
    marker = spec.out_dir / PIPELINE_FILE
    with contextlib.suppress(OSError):  # unmarked, `harness status` reads the job alone: the campaign goes on
        replace_whole(marker, f"{socket.gethostname()} {os.getpid()}\n")
    code = 1  # what an exception out of the steps ends the campaign with (a HarnessError: its own code)
    try:
        code = Execution(launcher, spec).run()
    except HarnessError as exc:
        code = exc.exit_code
        raise
    finally:
        if (spec.out_dir / JOB_FILE).is_file():
            # Unrecorded where job.json cannot be written (a teammate's folder, a full disk: said at every state
            # recorded already); the exit code stands.
            with contextlib.suppress(HarnessError):
                Handle(launcher.name, "", spec.out_dir).update(**{EXIT_KEY: code})
        with contextlib.suppress(OSError):
            marker.unlink(missing_ok=True)
    return code


def pipeline_alive(out_dir: Path) -> bool | None:
    """Whether the pipeline of the campaign in `out_dir` still runs (execute's PIPELINE_FILE names a live harness
    process), False where it ended or died, None where it runs on another host, which cannot be asked."""
    try:
        host, pid = (Path(out_dir) / PIPELINE_FILE).read_text().split()
    except (OSError, ValueError):
        return False
    if host != socket.gethostname():
        return None
    try:
        command = Path(f"/proc/{int(pid)}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False
    return b"harness" in command  # not a pid the system gave another program since


def background_process(plan: Plan, notes: list[str]):
    """`execute` for harness.start, in a process of its own session (it outlives the caller, and handles its own
    signals), saying what `harness run` says (its notes first) into the run folder's CAMPAIGN_LOG."""
    import json
    import os
    import subprocess

    root = str(Path(__file__).resolve().parents[1])  # this checkout's harness, whatever the caller's sys.path
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with open(plan.spec.out_dir / CAMPAIGN_LOG, "w") as log:
        process = subprocess.Popen([sys.executable, "-c", "import sys; from harness.campaign import background; "
                                    "sys.exit(background())"], stdin=subprocess.PIPE, stdout=log,
                                   stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True)
    process.stdin.write(json.dumps({"backend": plan.launcher.name, "spec": plan.spec.to_dict(), "notes": notes}))
    process.stdin.close()
    return process


def background() -> int:
    """The process background_process starts: the order on stdin; `harness run`'s exit code."""
    import json

    from harness.launchers import get_launcher

    order = json.load(sys.stdin)
    for note in order["notes"]:
        print(f"harness: {note}", file=sys.stderr)
    try:
        return execute(get_launcher(order["backend"]), JobSpec.from_dict(order["spec"]))
    except HarnessError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return exc.exit_code


def runs_done(out_dir: Path) -> int:
    """The runs of a campaign that have ended (their log holds run_stop), without parsing or checking the logs."""
    return sum('"key": "run_stop"' in path.read_text(errors="replace") for path in Path(out_dir).glob("result_*.txt"))


class Execution:
    """The submitting side of one campaign: each step a method, the state they hand on kept here."""

    def __init__(self, launcher, spec: JobSpec):
        self.launcher, self.spec = launcher, spec
        self.watcher = None  # the preflight watcher, where preflight runs inside the training's allocation
        self.preflight = None  # preflight.json's record, where the health job ran first
        self.handle = self.state = None  # the last job submitted, and its last state
        self.collected = True  # every job's files came back

    def run(self) -> int:
        launches = self.launcher.launches(self.spec)
        print(f"harness: {self.spec.benchmark} ({self.spec.preset}) on {self.launcher.name}: {self.spec.runs} run(s)"
              + (", one job each" if len(launches) > 1 else "") + f" -> {self.spec.out_dir}", flush=True)
        # A CI timeout sends SIGTERM, not Ctrl-C: either stops what runs, the health job or the training job, so no
        # job outlives `harness run` to hold its nodes.
        with sigterm_raises():
            stopped = self.check_nodes()
            if stopped is not None:
                return stopped
            for launch in launches:  # each after the one before succeeded and was collected
                try:
                    self.submit_watch_collect(self.exclude(launch))
                except (KeyboardInterrupt, Terminated) as stop:
                    return stopped_by(stop, getattr(stop, "what", f"stopped; results so far stay in "
                                                                  f"{self.spec.out_dir}"))
                if self.state is None or self.state.value != "SUCCEEDED":
                    break
                if self.handle.record().get("campaign_cancelled"):  # `harness cancel` between two of its jobs
                    print(f"harness: the campaign was cancelled after run {launch.launch + 1}; results so far stay "
                          f"in {self.spec.out_dir}", file=sys.stderr)
                    self.state = None
                    break
        return self.summary()

    def check_nodes(self) -> int | None:
        """Preflight: a watcher of the checks inside the training's allocation, or the health job first.
        None to go on; else the exit code (preflight failed, or was stopped)."""
        if not self.spec.preflight:
            return None
        from harness import remediation

        if self.launcher.preflight_in_allocation:
            self.watcher = remediation.PreflightWatcher(self.launcher, self.spec)
            return None
        try:
            self.preflight = remediation.run_health_job(self.launcher, self.spec)
        except (KeyboardInterrupt, Terminated) as stop:
            return stopped_by(stop, f"stopped during preflight (its job is cancelled); nothing trained, "
                                    f"the checks so far stay in {self.spec.out_dir}")
        return None if self.preflight["passed"] else preflight_failed(self.preflight)

    def exclude(self, launch: JobSpec) -> JobSpec:
        """One launch without the nodes preflight.json keeps out as it is now: the nodes an earlier run's failures
        were blamed on are kept out too."""
        if self.preflight is None:
            return launch
        from harness import remediation
        from harness.preflight import read

        return remediation.without_excluded(launch, read(self.spec.out_dir) or self.preflight)

    def submit_watch_collect(self, launch: JobSpec) -> None:
        """Submit one job, watch it to its end and collect what it wrote. A Ctrl-C or SIGTERM cancels the job and
        is raised again, with `what` it left."""
        launcher, request = self.launcher, self.launcher.render(launch)
        self.handle, self.state = None, None
        try:
            self.handle = launcher.submit(request)
            if launch.launch is not None:
                print(f"harness: run {launch.launch + 1}/{launch.runs}: job {self.handle.job_id}", flush=True)
            ticks = [t for t in (self.watcher, launcher.restart_watcher(request.spec, self.handle)) if t is not None]

            def tick() -> None:  # at every poll: the preflight verdicts (Slurm), the nodes a failure points at (k8s)
                for each in ticks:
                    each()

            for self.state in launcher.watch(self.handle, tick=tick):
                if launcher.name != "local":  # local workers print their own progress
                    print(f"harness: job {self.handle.job_id} {self.state.value}", flush=True)
        except (KeyboardInterrupt, Terminated) as stop:
            if self.handle is None:
                stop.what = ("stopped while submitting: the job may have reached the scheduler before its record in "
                             f"{launch.out_dir} was written")
            else:
                launcher.cancel(self.handle)
                stop.what = f"cancelled; results so far stay in {launch.out_dir}"
            raise
        try:
            collect(launcher, self.handle)
        except (KeyboardInterrupt, Terminated) as stop:
            stop.what = (f"stopped while collecting job {self.handle.job_id}'s files (it ended "
                         f"{self.state.value if self.state else '?'}); `harness collect {launch.out_dir}` copies them")
            raise
        except HarnessError as exc:
            # Said and recorded (job.json's collect_error), never the run's verdict: the job's outcome stands, and
            # its files stay on the cluster for `harness collect`. A failed job may have written nothing at all.
            print(f"harness: {exc}", file=sys.stderr)
            self.handle.update(collect_error=str(exc))
            self.collected = False

    def summary(self) -> int:
        """What the campaign came to: a preflight that failed inside the allocation, the job's recorded failure,
        an unflushed page cache, then the time-to-train report and the exit code."""
        if self.watcher is not None:
            self.watcher()  # a preflight that finished between the last poll and the end
            from harness.preflight import read

            checked = read(self.spec.out_dir)
            if checked is not None and not checked["passed"]:
                return preflight_failed(checked)
        record = self.handle.record()
        if record.get("failure"):
            print(f"harness: {record['failure']}", file=sys.stderr)
        from harness.cache_flush import unflushed_note

        unflushed = unflushed_note(self.spec.out_dir, self.launcher.name)
        if unflushed:
            print(f"harness: {unflushed}", file=sys.stderr)
        return summarize(self.spec.out_dir, job_ok=self.state is not None and self.state.value == "SUCCEEDED",
                         runs=self.spec.runs,
                         exit_code=record.get("exit_code"), collected=self.collected)


def preflight_only(backend: str, nodes: int, profile: str, overrides: list[str], out: Path | None, env: list[str],
                   spare_nodes: int | None, drain_bad_nodes: bool, taint_bad_nodes: bool, dry_run: bool) -> int:
    """`harness preflight`: the health job alone, described by a job spec like any other, with no workload to run
    after it; its exit code."""
    from harness import remediation
    from harness.launchers import get_launcher

    launcher = get_launcher(backend)
    loaded = profiles.apply_overrides(profiles.load(profile), overrides)
    spec = JobSpec(benchmark="resnet", nodes=nodes, out_dir=out, env=parse_env(env), health_only=True,
                   profile=loaded, preflight=True,
                   spare_nodes=spare_nodes or 0, drain_bad_nodes=drain_bad_nodes, taint_bad_nodes=taint_bad_nodes)
    if spec.out_dir is None:
        spec = dataclasses.replace(spec, out_dir=default_out_dir(launcher.runs_root(spec), "preflight"))
    validate(spec, paths_here=launcher.paths_here)
    spec = spec.resolved(runs_root=launcher.runs_root(spec))
    if dry_run:
        print(launcher.render_preflight(spec).text)
        return 0
    launcher.render_preflight(spec)  # refused before the folder is made
    if out is None:  # the default name, or the first free -2, -3 after it
        spec = dataclasses.replace(spec, out_dir=claim_fresh_folder(spec.out_dir))
    check_writable(spec.out_dir)
    with sigterm_raises():
        try:
            record = remediation.run_health_job(launcher, spec)
        except (KeyboardInterrupt, Terminated) as stop:
            return stopped_by(stop, f"preflight stopped (its job is cancelled); the checks so far stay in "
                                    f"{spec.out_dir}")
    print(f"harness: wrote {spec.out_dir / 'preflight.json'}")
    return 0 if record["passed"] else preflight_failed(record)


def preflight_failed(record: dict) -> int:
    from harness.preflight import EXIT_PREFLIGHT

    print(f"harness: error: preflight failed before training: {record['message']}", file=sys.stderr)
    return EXIT_PREFLIGHT


class Terminated(Exception):
    """SIGTERM arrived while `harness run` or `harness preflight` watched a job."""


def _terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cancel short
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises Terminated in the block, so that the job being watched is cancelled, as on Ctrl-C."""
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stopped_by(stop: BaseException, what: str) -> int:
    """Say what a Ctrl-C or SIGTERM left; the shell's exit code for that signal."""
    print(f"harness: {what}", file=sys.stderr)
    return 143 if isinstance(stop, Terminated) else 130


def collect(launcher, handle) -> list[Path]:
    """Bring a job's result files into its run folder, saying how many came; the files fetched."""
    fetched = launcher.collect(handle)
    if fetched:
        print(f"harness: fetched {len(fetched)} file(s) from the cluster into {handle.out_dir}", flush=True)
    return fetched


def summarize(out_dir: Path, job_ok: bool, runs: int, ruleset: str | None = None, exit_code: int | None = None,
              collected: bool = True) -> int:
    """Print the time-to-train report of a finished job, each log by its own ruleset (as `harness report`) unless
    `ruleset` is given; 0 only if every run
    reached its target, or, on synthetic input, finished (a throughput run has no target) (with a log that
    mlperf-logging's compliance checker passes: the summarizer would count it as a failed run otherwise).
    A failed job exits with the node agent's code where it has one (workload error, budget spent, ...).
    Where the collection failed (`collected` False), a run whose log did not come back is not counted as
    failed: it is named as not collected, and the job's outcome stands."""
    from harness.agent import EXIT_CODES, EXIT_RETRY
    from harness.report import preflight_notes, render
    from harness.results import load

    results = load([out_dir], ruleset=ruleset)
    print(render(results, "table"))
    for line in preflight_notes([out_dir]):
        print(line)
    if not job_ok:
        why = EXIT_CODES.get(exit_code) if exit_code != EXIT_RETRY else None
        print(f"harness: error: the job failed{f' ({why})' if why else ''}; worker logs: harness logs {out_dir}",
              file=sys.stderr)
        return exit_code if why else 1
    if results.records and all(r.synthetic for r in results.records):
        finished = sum(not r.unfinished for r in results.records)
        print(f"harness: synthetic input: a throughput run, with no quality target or score "
              f"({finished} of {runs} run(s) finished)", file=sys.stderr if finished < runs else sys.stdout)
        return 0 if finished == runs else 1
    missed = [r for r in results.records if not r.converged]
    at_scale = [r for r in missed if _fails_only_the_scale(r)]
    for run in at_scale:
        keys = ", ".join(run.compliance_failed_keys)
        print(f"harness: {run.file} reached its target; its log fails only the checks of {keys}, whose values "
              f"{run.benchmark}'s rules fix in every division at a scale no small run trains: not a result",
              file=sys.stderr)
    missed = [r for r in missed if r not in at_scale]
    if not collected and not missed and len(results.records) < runs:
        print(f"harness: {runs - len(results.records)} of {runs} run(s) not collected (see above); the job "
              "succeeded", file=sys.stderr)
        return 0
    if missed or len(results.records) < runs:
        failed = sum(r.left_out for r in missed)
        why = f" ({failed} left out by the compliance checker, named above)" if failed else ""
        print(f"harness: {len(missed)} of {runs} run(s) did not reach the quality target{why}", file=sys.stderr)
        return 1
    return 0


def _fails_only_the_scale(run) -> bool:
    """A run that reached its target and whose log the checker fails only on the keys its benchmark's rules fix at a
    scale no small run trains (workloads.registry's scale_keys: deepseekv3_671b's tiny preset)."""
    scale = BENCHMARKS[run.benchmark].scale_keys if run.benchmark in BENCHMARKS else ()
    return run.reached_target and bool(run.compliance_failed_keys) and set(run.compliance_failed_keys) <= set(scale)
