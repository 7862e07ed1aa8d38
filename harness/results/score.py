"""MLPerf scoring, in one place: required run counts and the olympic mean.

The rules follow MLCommons' result_summarizer (`_compute_strong_score_standalone` and
`_compute_olympic_average`, mirrored here since importing the summarizer costs more than a
whole report; tests/test_results.py compares the two): a run that did not converge, or never
finished, is dropped as if it were the slowest; with more such runs than the benchmark may drop
the score is invalid (None); otherwise the fastest and the slowest remaining runs are dropped
and the rest averaged, then multiplied by the scaling factor.
"""

from __future__ import annotations

from mlperf_logging.benchmark_meta import get_result_file_counts


def max_dropped(benchmark: str) -> int:
    """Runs dropped from each end: 4 for unet3d, else 1 (`_compute_strong_score_standalone`)."""
    return 4 if benchmark == "unet3d" else 1


def required_runs(benchmark: str) -> int | None:
    """Runs the rules require for a training benchmark (resnet 5, bert 10, gpt3 3, llama31_8b 10, gpt_oss_20b 10, llama2_70b_lora 10), None if unknown."""
    return get_result_file_counts("training").get(benchmark)


def olympic_score(converged_minutes: list[float], not_converged: int, benchmark: str,
                  scaling_factor: float = 1.0) -> float | None:
    """The benchmark score in minutes, or None when the runs cannot make one (`_compute_olympic_average`)."""
    dropped = max_dropped(benchmark)
    if not_converged > dropped:
        return None
    scores = sorted(converged_minutes)
    countable = scores[dropped:len(scores) - (dropped - not_converged)]
    if not countable:
        return None
    return sum(countable) * 1.0 / len(countable) * scaling_factor


def benchmark_score(minutes: list[float | None], converged: list[bool], benchmark: str,
                    scaling_factor: float = 1.0) -> float | None:
    """Score a (system, benchmark) group, or None while it has fewer runs than the rules require."""
    needed = required_runs(benchmark)
    if needed is None or len(minutes) < needed:
        return None
    kept = [m for m, ok in zip(minutes, converged) if ok]
    return olympic_score(kept, len(minutes) - len(kept), benchmark, scaling_factor)
