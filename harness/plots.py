"""Pictures of a ResultSet: eval quality and throughput against time since run_start, one line per run.

One panel per benchmark, since their quality metrics differ (accuracy, log perplexity).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: reports run on headless machines
import matplotlib.pyplot as plt  # noqa: E402

from harness.results import ResultSet  # noqa: E402


def _panels(count: int):
    fig, axes = plt.subplots(1, count, figsize=(6 * count, 4.2), squeeze=False)
    return fig, axes[0]


def _label(results: ResultSet, file: str) -> str:
    run = next(r for r in results.records if r.file == file)
    return f"{run.system} / {Path(file).stem}"


def plot(results: ResultSet, out_dir: Path) -> list[Path]:
    """Write quality.png and throughput.png into out_dir; return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    events = results.events
    events = events.assign(minutes=events.time_ms / 60000)
    benchmarks = sorted({b for b in results.runs.benchmark if b})
    written = []
    # Throughput spans orders of magnitude between systems (a laptop and 3,584 GPUs): log scale.
    for name, key, ylabel, value, scale in (
            ("quality.png", "eval_accuracy", "eval quality", lambda v: v, "linear"),
            ("throughput.png", "tracked_stats", "samples/s",
             lambda v: v.get("throughput") if isinstance(v, dict) else None, "log")):
        fig, axes = _panels(max(1, len(benchmarks)))
        for ax, benchmark in zip(axes, benchmarks or [None]):
            chosen = events[(events.key == key) & (events.benchmark == benchmark) & (events.time_ms >= 0)]
            for file, rows in chosen.groupby("file", sort=True):
                ys = [value(v) for v in rows.value]
                ax.plot(rows.minutes, ys, marker=".", label=_label(results, file))
            ax.set_title(f"{benchmark or 'no benchmark'}: {ylabel} vs time")
            ax.set_xlabel("minutes since run_start")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.set_yscale(scale)
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
