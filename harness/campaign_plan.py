"""What a campaign asks of a cluster beyond its workload: how many runs, how many spare nodes, how much wall time.

Each is decided here once, from the rules and the profile, so that `harness run` fills in the defaults and a
render refuses what would fail at run time (`problems`), with the same numbers:
- runs: a closed preset on its dataset runs the count MLPerf's rules require for a result (mlperf-logging's result
  file counts, which `harness export` checks a package against), unless --runs says otherwise;
- spare nodes: a closed allocation above the profile's `preflight.spare_above_nodes` gets
  ceil(nodes x `preflight.spare_share`) spares by default, so that one node preflight keeps out does not
  waste the allocation;
- wall time: preflight's whole phase, then each run's init allowance and its expected time-to-train
  (`run_minutes`), which Slurm's --time must cover.
Nothing here imports torch.
"""

from __future__ import annotations

import math
import re

from harness.errors import HarnessError
from harness.spec import JobSpec
from workloads.common.mlperf import division
from workloads.registry import BENCHMARKS

# Per run, before run_start: the closed rules allow 30 minutes of init (training_rules.adoc, "Run Results"); the
# harness's runs take far less (a model built, a checkpoint read, a compile), so this is an allowance, not a
# measurement: --run-minutes or slurm.time overrides the plan where a cluster needs more.
INIT_MINUTES = 10.0
TINY_RUN_MINUTES = 10.0  # a tiny preset converges in minutes on a CPU (the suite runs them)
# An H100's time is not the cited result's: other GPU generations, fewer GPUs than the result scaled across, and
# the eval of every step of a slow run. The plan takes the cited GPU-minutes times this.
RUN_MARGIN = 3.0
PLAN_ROUND_MINUTES = 15


def default_runs(benchmark: str, preset: str, synthetic: bool = False) -> int:
    """Runs a campaign does without --runs: the rules' count for a closed preset on its dataset, else 1 (a run on
    synthetic input is a throughput run, never a result)."""
    if division(preset) != "closed" or synthetic:
        return 1
    from harness.results.score import required_runs  # mlperf-logging: only when a closed campaign asks

    return required_runs(benchmark) or 1


def runs_note(spec: JobSpec, given: bool) -> str | None:
    """The one line a closed campaign gets about its run count: the rules' default taken, or fewer asked."""
    if division(spec.preset) != "closed" or spec.synthetic:
        return None
    needed = default_runs(spec.benchmark, spec.preset)
    if not given:
        return (f"note: closed {spec.benchmark} runs {needed} times, the count MLPerf's rules require for a result "
                "(--runs to change)")
    if spec.runs < needed:
        return (f"note: closed {spec.benchmark} needs {needed} runs for a result; this campaign does {spec.runs}, "
                "so `harness export` will refuse it alone")
    return None


def asked_spares(spec: JobSpec) -> int:
    """Spare nodes the profile asks for this campaign: a closed allocation above spare_above_nodes, with preflight
    on (spares replace the nodes it keeps out), gets ceil(nodes x spare_share)."""
    checks = spec.profile.preflight
    if not (spec.preflight and division(spec.preset) == "closed" and spec.nodes > checks.spare_above_nodes):
        return 0
    return math.ceil(spec.nodes * checks.spare_share)


def run_minutes(spec: JobSpec) -> float:
    """One run's expected time-to-train on this job: --run-minutes, else the benchmark's cited GPU-minutes over the
    job's GPUs (times RUN_MARGIN), else TINY_RUN_MINUTES for a tiny preset or a CPU job."""
    if spec.run_minutes is not None:
        return spec.run_minutes
    gpu_minutes = BENCHMARKS[spec.benchmark].gpu_minutes
    gpus = spec.nodes * spec.gpus()
    if spec.preset == "tiny" or not gpus or gpu_minutes is None:
        return TINY_RUN_MINUTES
    return max(TINY_RUN_MINUTES, RUN_MARGIN * gpu_minutes / gpus)


def campaign_minutes(spec: JobSpec) -> tuple[float, str]:
    """The wall time the whole campaign needs in one allocation, and how it adds up (for the messages)."""
    checks = spec.profile.preflight
    preflight = (checks.deadline_s + checks.start_allowance_s) / 60 if spec.preflight else 0.0
    per_run = INIT_MINUTES + run_minutes(spec)
    total = preflight + spec.runs * per_run
    parts = [f"preflight {preflight:.0f} min"] if preflight else []
    parts.append(f"{spec.runs} run(s) x ({INIT_MINUTES:.0f} min init + {run_minutes(spec):.0f} min to train)")
    return total, " + ".join(parts)


def slurm_time(minutes: float) -> str:
    """Slurm's --time for `minutes`, rounded up to PLAN_ROUND_MINUTES: HH:MM:SS, or D-HH:MM:SS from a day."""
    total = math.ceil(minutes / PLAN_ROUND_MINUTES) * PLAN_ROUND_MINUTES
    days, rest = divmod(total, 24 * 60)
    text = f"{rest // 60:02d}:{rest % 60:02d}:00"
    return f"{days}-{text}" if days else text


_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?\Z")


def parse_slurm_time(text: str) -> float | None:
    """Minutes in one of Slurm's --time forms (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); None for no limit."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    match = _TIME.match(text)
    if not match:
        raise HarnessError(f"slurm.time {text!r} is not a Slurm time: MINUTES, HH:MM:SS or D-HH:MM:SS")
    days, first, second, third = match.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
        return int(days) * 1440 + hours * 60 + minutes + seconds / 60
    if third is not None:  # H:M:S
        return int(first) * 60 + int(second) + int(third) / 60
    return int(first) + int(second or 0) / 60  # M or M:S


def problems(spec: JobSpec) -> list[str]:
    """What the profile asks of the campaign and it lacks, one line each naming the fix (backend-independent)."""
    found = []
    spares = asked_spares(spec)
    if spec.spare_nodes < spares:
        checks = spec.profile.preflight
        found.append(f"profile {spec.profile.name} asks for {spares} spare node(s) for a closed allocation of "
                     f"{spec.nodes} nodes (preflight.spare_share {checks.spare_share:g} above "
                     f"{checks.spare_above_nodes} nodes), and --spare-nodes is {spec.spare_nodes}: one node preflight "
                     f"keeps out would stop the job; give --spare-nodes {spares}, or --set preflight.spare_share=0")
    return found
