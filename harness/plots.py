"""Pictures of a ResultSet, one panel per benchmark (their quality metrics and scales differ).

- quality: eval quality against minutes since run_start, one line per run;
- throughput: samples/s against minutes since run_start, one line per run;
- time_to_train: every run's time-to-train per system, with the MLPerf score marked.

Figures are built with matplotlib's object API, not pyplot, so `report --plot`
needs no display and a notebook keeps its own backend.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from harness.results import ResultSet


def _panels(count: int) -> tuple[Figure, list]:
    fig = Figure(figsize=(6 * count, 4.2))
    return fig, list(fig.subplots(1, count, squeeze=False)[0])


def _benchmarks(results: ResultSet) -> list[str | None]:
    return sorted({b for b in results.runs.benchmark if b}) or [None]


def _over_time(results: ResultSet, key: str, ylabel: str, value, scale: str) -> Figure:
    events = results.events
    events = events.assign(minutes=events.time_ms / 60000)
    systems = {r.file: r.system for r in results.records}
    benchmarks = _benchmarks(results)
    fig, axes = _panels(len(benchmarks))
    for ax, benchmark in zip(axes, benchmarks):
        chosen = events[(events.key == key) & (events.benchmark == benchmark) & (events.time_ms >= 0)]
        for file, rows in chosen.groupby("file", sort=True):
            ax.plot(rows.minutes, [value(v) for v in rows.value], marker=".",
                    label=f"{systems[file]} / {Path(file).stem}")
        ax.set_title(f"{benchmark or 'no benchmark'}: {ylabel} vs time")
        ax.set_xlabel("minutes since run_start")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.set_yscale(scale)
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _time_to_train(results: ResultSet) -> Figure:
    benchmarks = _benchmarks(results)
    fig, axes = _panels(len(benchmarks))
    for ax, benchmark in zip(axes, benchmarks):
        # Smallest system first, so a scaling series reads left to right.
        groups = sorted((g for g in results.groups if g.benchmark == benchmark),
                        key=lambda g: (g.runs[0].accelerators or 0, g.system or ""))
        labelled: set[str] = set()

        def label(name: str) -> str | None:  # each legend entry once per panel
            if name in labelled:
                return None
            labelled.add(name)
            return name

        for x, group in enumerate(groups):
            for converged, style in ((True, dict(color="tab:blue", s=18)),
                                     (False, dict(color="tab:red", marker="x", s=24))):
                minutes = [r.time_to_train_min for r in group.runs
                           if r.converged == converged and r.time_to_train_min is not None]
                if minutes:
                    ax.scatter([x] * len(minutes), minutes, **style,
                               label=label("run" if converged else "did not converge"))
            if group.score_min is not None:
                ax.hlines(group.score_min, x - 0.3, x + 0.3, color="black", label=label("MLPerf score"))
        ax.set_xticks(range(len(groups)), [g.system or "?" for g in groups], rotation=20, ha="right",
                      fontsize=7)
        ax.set_title(f"{benchmark or 'no benchmark'}: time-to-train per run")
        ax.set_ylabel("minutes")
        ax.grid(alpha=0.3, axis="y")
        if groups:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def figures(results: ResultSet) -> dict[str, Figure]:
    """name -> Figure, for a notebook to show or `plot` to save."""
    # Throughput spans orders of magnitude between systems (a laptop and 3,584 GPUs): log scale.
    return {
        "quality": _over_time(results, "eval_accuracy", "eval quality", lambda v: v, "linear"),
        "throughput": _over_time(results, "tracked_stats", "samples/s",
                                 lambda v: v.get("throughput") if isinstance(v, dict) else None, "log"),
        "time_to_train": _time_to_train(results),
    }


def plot(results: ResultSet, out_dir: Path) -> list[Path]:
    """Write <name>.png for every figure into out_dir; return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures(results).items():
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written
