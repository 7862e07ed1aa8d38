"""Energy of a (system, benchmark) group with power results, as MLCommons' result summarizer computes it.

A benchmark folder with a `power/` subfolder holds, per run, `power/result_<n>/node_*.txt` (power
readings) and `sw_*.txt` (interconnect estimates). The summarizer's own functions do the work
(`_compute_total_power` per run, `_index_olympic_average` over the runs ordered by time-to-train,
times the scaling factor, in `_compute_strong_score_standalone`); they are imported only here,
only when a group has power results, since the summarizer module imports scipy and pandas.
"""

from __future__ import annotations

from pathlib import Path

from harness.results.parse import ErrorSink, Run
from harness.results.score import max_dropped


def has_power(folder: Path) -> bool:
    """The summarizer's _has_power: a `power` folder beside the result files."""
    return (folder / "power").is_dir()


def energy(folder: Path, runs: list[Run], ruleset: str, benchmark: str, scaling_factor: float,
           on_error: ErrorSink) -> float | None:
    """The group's power score (the summarizer's `power_score`; joules), or None where it cannot be made."""
    from mlperf_logging.result_summarizer.result_summarizer import _compute_total_power, _index_olympic_average

    kept = [run for run in runs if run.converged]
    minutes = [run.time_to_train_min for run in kept]
    try:
        power = [_compute_total_power(str(folder), run.file, (run.run_stop_ms - run.run_start_ms), ruleset)
                 for run in kept]
    except (AssertionError, ValueError, KeyError, TypeError, ZeroDivisionError, OSError) as exc:
        on_error(folder / "power", f"no energy: the power logs cannot be read ({type(exc).__name__}: {exc})")
        return None
    index = sorted(range(len(minutes)), key=minutes.__getitem__)
    average = _index_olympic_average(power, index, len(runs) - len(kept), max_dropped(benchmark))
    return None if average is None else average * scaling_factor
