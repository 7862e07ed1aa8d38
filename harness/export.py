"""Export runs as an MLPerf training submission package, then let MLCommons' package checker judge it.

The package, at the folder given (the submitter's folder of a results repository):

    systems/<system>.json                               the system description
    results/<system>/<benchmark>/result_<i>.txt          the logs, byte for byte, oldest run first
    benchmarks/<benchmark>/implementations/<impl>/       the workload code and a README with the command used

Everything is decided and checked before the first byte is written (run counts,
division, system name, every required description field), so a refused export
leaves nothing behind. Names that become paths are checked, and every path is
confirmed to lie inside the package folder before it is written.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from mlperf_logging.benchmark_meta import get_allowed_benchmarks

from harness.errors import HarnessError
from harness.launchers.base import JOB_FILE
from harness.results import ResultSet, load
from harness.results.rules import check_ruleset
from harness.results.score import required_runs
from harness.spec import JobSpec

USAGE = "training"
IMPLEMENTATION = "harness-pytorch"
FACTS_FILE = "system.json"  # written by workloads.common.system_facts (a torch module, so not imported here)

# The fields mlperf_logging.system_desc_checker requires (it keeps them in a local list).
REQUIRED_FIELDS = (
    "submitter", "division", "status", "system_name", "number_of_nodes", "host_processors_per_node",
    "host_processor_model_name", "host_processor_core_count", "host_processor_vcpu_count",
    "host_processor_frequency", "host_processor_caches", "host_processor_interconnect", "host_memory_capacity",
    "host_storage_type", "host_storage_capacity", "host_networking", "host_networking_topology",
    "host_memory_configuration", "accelerators_per_node", "accelerator_model_name",
    "accelerator_host_interconnect", "accelerator_frequency", "accelerator_on-chip_memories",
    "accelerator_memory_configuration", "accelerator_memory_capacity", "accelerator_interconnect",
    "accelerator_interconnect_topology", "cooling", "hw_notes", "framework", "other_software_stack",
    "operating_system", "sw_notes",
)
# Facts that must agree between run folders for their runs to be one system's.
IDENTITY_FIELDS = ("number_of_nodes", "accelerators_per_node", "accelerator_model_name", "host_processor_model_name")
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")


@dataclass
class Package:
    """An export, fully decided: what goes where."""

    system: str
    description: dict
    results: dict[str, list[Path]]  # benchmark -> result files, in package order
    ruleset: str  # the round's ruleset: what judged the runs, and what the package checker checks
    commands: dict[str, list[str]] = field(default_factory=dict)  # benchmark -> how its runs were made
    notes: list[str] = field(default_factory=list)  # worth a look, not worth a refusal


def _read_json(path: Path, what: str) -> dict:
    try:
        record = json.loads(path.read_text())
    except OSError as exc:
        raise HarnessError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise HarnessError(f"{what} {path} is not valid JSON: {exc}") from None
    if not isinstance(record, dict):
        raise HarnessError(f"{what} {path} must hold a JSON object")
    return record


def _one(values: set, what: str, hint: str):
    if len(values) > 1:
        raise HarnessError(f"the runs disagree on {what} ({', '.join(sorted(map(str, values)))}); {hint}")
    return next(iter(values)) if values else None


def _detected_facts(run_dirs: list[Path]) -> dict:
    """The facts recorded where the runs trained; run folders from different systems are refused."""
    found = [_read_json(d / FACTS_FILE, "system facts") for d in run_dirs if (d / FACTS_FILE).is_file()]
    for name in IDENTITY_FIELDS:
        _one({str(f[name]) for f in found if name in f}, name, "export the runs of one system at a time")
    return found[0] if found else {}


def _commands(run_dirs: list[Path]) -> list[str]:
    lines = []
    for run_dir in run_dirs:
        job = run_dir / JOB_FILE
        if not job.is_file():
            lines.append(f"{run_dir.name}: made outside the harness (no {JOB_FILE})")
            continue
        record = _read_json(job, "job record")
        try:
            command = JobSpec.from_dict(record["spec"]).command_line(record["backend"])
        except (KeyError, TypeError) as exc:
            raise HarnessError(f"{job} is not a harness job record ({exc})") from None
        lines.append(shlex.join(command))
    return lines


def _missing_fields_error(missing: list[str]) -> HarnessError:
    skeleton = json.dumps({name: "" for name in missing}, indent=1)
    return HarnessError(
        f"the system description lacks {len(missing)} field(s) that cannot be detected: {', '.join(missing)}. "
        f"Write them into a JSON file (\"\" where a field does not apply; status is one of MLPerf's availability "
        f"categories, e.g. \"Available cloud\") and pass it as --system-desc. A start:\n{skeleton}")


def _one_ruleset(results: ResultSet) -> str:
    """The ruleset every run was judged by, each by its own (harness.results.rules.ruleset_for): a package is one
    round's, so runs judged by different rulesets, or by none, are refused."""
    unjudged = [g for g in results.groups if g.ruleset is None]
    if unjudged:
        raise HarnessError(f"cannot export {unjudged[0].benchmark or 'unnamed'} runs: {unjudged[0].unscorable}")
    by_ruleset: dict[str, set] = {}
    for group in results.groups:
        by_ruleset.setdefault(group.ruleset, set()).add(str(group.benchmark))
    if len(by_ruleset) > 1:
        named = "; ".join(f"{r} ({', '.join(sorted(b))})" for r, b in sorted(by_ruleset.items()))
        raise HarnessError(f"the runs would be judged by different rulesets: {named}; a package is one round's, "
                           "so export one round's benchmarks, or force one with --ruleset")
    return next(iter(by_ruleset))


def plan(paths: list[Path], submitter: str, system: str | None = None, system_desc: Path | None = None,
         ruleset: str | None = None) -> Package:
    """Decide the whole package, or raise HarnessError naming what is wrong. Writes nothing. Without `ruleset`, the
    runs' own (which must be one) judges them and the package."""
    if ruleset is not None:
        check_ruleset(ruleset)
    if not submitter.strip():
        raise HarnessError("--submitter must not be empty")
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise HarnessError(f"no such file or folder: {', '.join(missing)}")
    unreadable: list[str] = []
    results = load(paths, ruleset=ruleset, on_error=lambda path, reason: unreadable.append(f"{path} ({reason})"))
    if unreadable:
        raise HarnessError(f"cannot export unreadable result files: {'; '.join(unreadable)}")
    if not results.records:
        raise HarnessError(f"no result_*.txt files under {', '.join(map(str, paths))}")

    synthetic = [run.file for run in results.records if run.synthetic]
    if synthetic:
        raise HarnessError(f"cannot export runs on synthetic input (throughput only, no quality target): "
                           f"{', '.join(synthetic)}")
    ruleset = _one_ruleset(results)
    allowed = get_allowed_benchmarks(USAGE, ruleset)
    by_benchmark: dict[str, list] = {}
    for run in sorted(results.records, key=lambda r: r.run_start_ms):
        if run.benchmark not in allowed:
            raise HarnessError(f"{run.file}: benchmark {run.benchmark!r} is not one of MLPerf training "
                               f"{ruleset}'s: {', '.join(sorted(allowed))}")
        by_benchmark.setdefault(run.benchmark, []).append(run)
    for benchmark, runs in by_benchmark.items():
        needed = required_runs(benchmark)
        if len(runs) != needed:
            advice = (f"run `harness run {benchmark} --runs {needed}`" if len(runs) < needed
                      else f"pass exactly {needed} result files or run folders")
            raise HarnessError(f"{benchmark}: {len(runs)} run(s) given, and an MLPerf package takes exactly "
                               f"{needed}; {advice}")

    division = _one({r.division for r in results.records}, "the division", "export one division at a time")
    user = _read_json(system_desc, "system description") if system_desc else {}
    if user.get("division", division) != division:
        raise HarnessError(f"--system-desc says division {user['division']!r} but the runs logged {division!r}")
    logged_system = _one({r.system for r in results.records if r.system}, "the system name",
                         "name the package's system with --system")
    name = system or user.get("system_name") or logged_system
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or ".." in name:
        raise HarnessError(f"system name {name!r} cannot be a folder name: use letters, digits and . _ + - "
                           "(--system NAME)")

    run_dirs = sorted({Path(r.file).parent for r in results.records})
    description = {**_detected_facts(run_dirs), **user, "submitter": submitter, "division": division,
                   "system_name": name}
    missing_fields = [f for f in REQUIRED_FIELDS if f not in description]
    if missing_fields:
        raise _missing_fields_error(missing_fields)
    # The checker and the summarizer join some fields as text: numbers become strings.
    description = {k: str(v) if isinstance(v, (int, float)) else v for k, v in description.items()}
    logged_orgs = sorted({r.submitter for r in results.records if r.submitter and r.submitter != submitter})
    notes = [f"the runs logged submission_org {', '.join(logged_orgs)}, not {submitter}; logs are copied as "
             f"they are, so run with --submitter {shlex.quote(submitter)} to log it"] if logged_orgs else []
    return Package(
        system=name, description=description,
        results={b: [Path(r.file) for r in runs] for b, runs in by_benchmark.items()}, ruleset=ruleset,
        commands={b: _commands(sorted({Path(r.file).parent for r in runs})) for b, runs in by_benchmark.items()},
        notes=notes,
    )


def _inside(root: Path, relative: str) -> Path:
    """root/relative, refusing any path that would resolve outside root."""
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise HarnessError(f"refusing to write {relative!r}: it resolves outside {root}")
    return path


def _implementation_readme(benchmark: str, package: Package) -> str:
    commands = "\n".join(package.commands[benchmark])
    return (f"# {benchmark}: {IMPLEMENTATION}\n\n"
            f"The runs in `results/{package.system}/{benchmark}/` were produced by the mlperf-harness, whose "
            "workload code is in this folder (`workloads/`: the distributed set-up, the MLPerf logging and the "
            f"{benchmark} model, data and training loop).\n\n"
            "## Command used\n\n"
            f"```sh\n{commands}\n```\n\n"
            "Each command starts one torch elastic agent per node, which runs `python -m workloads ...` on every "
            "rank; each timed run writes its own result file.\n")


def write(package: Package, out: Path) -> list[Path]:
    """Write the package into `out`, which must be new or empty; return the files written."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HarnessError(f"{out} already exists and is not an empty folder; pick a new --out so nothing "
                           "in it is overwritten")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HarnessError(f"cannot create {out}: {exc.strerror or exc}") from None
    root = out.resolve()
    written = []

    def put(relative: str, data: bytes) -> None:
        path = _inside(root, relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)

    put(f"systems/{package.system}.json", (json.dumps(package.description, indent=4) + "\n").encode())
    workloads = Path(find_spec("workloads").submodule_search_locations[0])  # the code, without importing torch
    for benchmark, files in package.results.items():
        for index, source in enumerate(files):
            put(f"results/{package.system}/{benchmark}/result_{index}.txt", source.read_bytes())
        implementation = f"benchmarks/{benchmark}/implementations/{IMPLEMENTATION}"
        for source in sorted(workloads.rglob("*.py")):
            relative = source.relative_to(workloads)
            if relative.parts[0] in ("common", benchmark) or len(relative.parts) == 1:
                put(f"{implementation}/workloads/{relative.as_posix()}", source.read_bytes())
        put(f"{implementation}/README.md", _implementation_readme(benchmark, package).encode())
    return written


@dataclass
class CheckerVerdict:
    passed: bool
    problems: list[str]  # the checker's ERROR lines
    output: str


def run_package_checker(out: Path, ruleset: str) -> CheckerVerdict:
    """MLCommons' package checker on the package, exactly as a submitter runs it.

    It always exits 0, so its verdict is read from its closing line. Its log goes
    to the null device and it runs inside the package, so nothing lands elsewhere.
    """
    proc = subprocess.run([sys.executable, "-m", "mlperf_logging.package_checker", str(Path(out).resolve()), USAGE,
                           ruleset, "--log_output", "/dev/null"], cwd=out, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    problems = [line for line in output.splitlines() if line.startswith(("ERROR", "CRITICAL"))]
    passed = proc.returncode == 0 and "PACKAGE CHECKER FOUND NO ERRORS" in output and not problems
    return CheckerVerdict(passed, problems, output)
