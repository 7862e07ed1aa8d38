"""Pictures of a ResultSet, one panel per benchmark (their quality metrics and scales differ).

- quality: eval quality against minutes since run_start, one line per run;
- throughput: samples/s against minutes since run_start, one line per run;
- time_to_train: every run's time-to-train per system, with the MLPerf score marked.

A submission has up to a dozen benchmarks and hundreds of runs, often on system folders that
share one official name, so: the panels sit in a grid of at most three columns (one row of
seven panels is 4,620 pixels wide and does not fit its own labels); every run of a group has
its group's colour, the same in every panel, and the legend lists each group once; a group is
labelled by its name, and by its folder too where names repeat (harness.results.labels).

Figures are built with matplotlib's object API, not pyplot, so `report --plot`
needs no display and a notebook keeps its own backend.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from harness.results import Group, ResultSet, labels

COLUMNS = 3  # panels per row: three 5.5-inch panels fit a screen and a page at the saved 110 dpi


def _panels(count: int) -> tuple[Figure, list]:
    """A grid of `count` panels, the unused places of the last row removed. The constrained layout sizes
    legends and rotated tick labels into the figure instead of warning that they do not fit."""
    columns = min(count, COLUMNS)
    rows = math.ceil(count / columns)
    fig = Figure(figsize=(5.5 * columns, 4.2 * rows), layout="constrained")
    axes = list(fig.subplots(rows, columns, squeeze=False).flat)
    for ax in axes[count:]:
        fig.delaxes(ax)
    return fig, axes[:count]


def _benchmarks(results: ResultSet) -> list[str | None]:
    return sorted({g.benchmark for g in results.groups if g.benchmark}) or [None]


def _colours(results: ResultSet) -> dict[int, tuple]:
    """id(group) -> its colour; a system (folder) keeps its colour across benchmarks and figures."""
    folders = list(dict.fromkeys((g.system, g.folder) for g in results.groups))
    palette = colormaps["tab10" if len(folders) <= 10 else "tab20"]
    return {id(g): palette(folders.index((g.system, g.folder)) % palette.N) for g in results.groups}


def _in(results: ResultSet, benchmark: str | None) -> list[Group]:
    # Smallest system first, so a scaling series reads left to right.
    return sorted((g for g in results.groups if g.benchmark == benchmark),
                  key=lambda g: (g.runs[0].accelerators or 0, g.system or "", str(g.folder)))


def _over_time(results: ResultSet, key: str, ylabel: str, value, scale: str) -> Figure:
    events = results.events
    chosen = events[(events.key == key) & (events.time_ms >= 0)]
    minutes, values = {}, {}
    for file, rows in chosen.groupby("file"):
        minutes[file], values[file] = rows.time_ms / 60000, [value(v) for v in rows.value]
    colours = _colours(results)
    benchmarks = _benchmarks(results)
    fig, axes = _panels(len(benchmarks))
    for ax, benchmark in zip(axes, benchmarks):
        groups = _in(results, benchmark)
        for group, label in zip(groups, labels(groups)):
            for run in group.runs:
                if run.file in minutes:
                    ax.plot(minutes[run.file], values[run.file], marker=".", markersize=3, linewidth=0.8,
                            color=colours[id(group)], label=label)
                    label = "_nolegend_"  # the group's other runs: one legend entry per group
        ax.set_title(f"{benchmark or 'no benchmark'}: {ylabel} vs time")
        ax.set_xlabel("minutes since run_start")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.set_yscale(scale)
            ax.legend(fontsize=7)
    return fig


def _time_to_train(results: ResultSet) -> Figure:
    colours = _colours(results)
    benchmarks = _benchmarks(results)
    fig, axes = _panels(len(benchmarks))
    for ax, benchmark in zip(axes, benchmarks):
        groups = _in(results, benchmark)
        for x, group in enumerate(groups):
            colour = colours[id(group)]
            for converged, marker in ((True, "o"), (False, "x")):
                minutes = [r.time_to_train_min for r in group.runs
                           if r.converged == converged and r.time_to_train_min is not None]
                if minutes:
                    ax.scatter([x] * len(minutes), minutes, color=colour, marker=marker, s=18 if converged else 24)
            if group.score_min is not None:
                ax.hlines(group.score_min, x - 0.3, x + 0.3, color="black")
        ax.set_xticks(range(len(groups)), labels(groups), rotation=20, ha="right", fontsize=7)
        ax.set_title(f"{benchmark or 'no benchmark'}: time-to-train per run")
        ax.set_ylabel("minutes")
        ax.grid(alpha=0.3, axis="y")
        if groups:  # the systems are named on the x axis; the legend says what the marks mean
            ax.legend([Line2D([], [], color="grey", marker="o", linestyle=""),
                       Line2D([], [], color="grey", marker="x", linestyle=""), Line2D([], [], color="black")],
                      ["run", "did not converge", "MLPerf score"], fontsize=7)
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
