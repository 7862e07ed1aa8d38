"""Pictures of a ResultSet, one panel per benchmark (their quality metrics and scales differ).

- quality: eval quality against minutes since run_start, one line per run, and the ruleset's target as a dashed
  line (rules.Target.threshold);
- throughput: samples/s against minutes since run_start, one line per run; tokens/s where every run of the
  benchmark counts tokens (parse.Rates, which also reads NeMo's step times);
- time_to_train: every run's time-to-train per system, with the MLPerf score marked;
- scaling: each system's MLPerf score against its accelerators on log-log axes, with the ideal scaling from the
  smallest system (its GPU-minutes spread over more accelerators) and how much of it each system reaches: the
  question a scaling campaign asks.

A submission has up to a dozen benchmarks and hundreds of runs, often on system folders that
share one official name, so: the panels sit in a grid of at most three columns (one row of
seven panels is 4,620 pixels wide and does not fit its own labels); every run of a group has
its group's colour, the same in every panel, and the legend lists each group once; a group is
labelled by what tells it apart from the panel's others (`_told_apart`: what their labels share
is said once, as the legend's heading), and every label is written horizontally.
Tick labels are plain numbers (0.759, 604,000), never an offset or a power of ten.

Figures are built with matplotlib's object API, not pyplot, so `report --plot`
needs no display and a notebook keeps its own backend.
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Callable

import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator

from harness.results import Group, ResultSet, Run, labels
from harness.results.keys import C, TRACKED_STATS
from harness.results.rules import RuleError, Threshold, target_check
from workloads.common.mllog_reader import is_number

COLUMNS = 3  # panels per row: three 5.5-inch panels fit a screen and a page at the saved 110 dpi
HEADING_WIDTH = 50  # characters per line of a legend's heading
_SEPARATORS = re.compile(r"([\s_.()\-]+)")  # where a label's words end: a shared part is cut only there


def _panels(count: int) -> tuple[Figure, list]:
    """A grid of `count` panels, the unused places of the last row removed. The constrained layout sizes
    legends and tick labels into the figure instead of warning that they do not fit."""
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
    # Smallest system first, so a scaling series reads left to right (top to bottom).
    return sorted((g for g in results.groups if g.benchmark == benchmark),
                  key=lambda g: (g.runs[0].accelerators or 0, g.system or "", str(g.folder)))


def _told_apart(groups: list[Group]) -> tuple[str | None, list[str]]:
    """(what the groups' labels share, or None; a label per group that shows only what tells it apart).

    The labels are harness.results.labels' (the name, and the folder where names repeat); the words they all
    start and end with are said once, in the heading. University of Florida's v5.1 systems, eight folders under
    one 46-character name, read `n1`, `n2`, ... under `HiPerGator NVIDIA DGX B200 (8x B200-SXM-180GB)
    (hpg.dgxb200x8.…)`; NVIDIA's gpt3 systems read `n96`, `n192`, `n448` under
    `coreweave_hgxh100_…_ngc23.04_pytorch`."""
    full = labels(groups)
    if len(set(full)) < 2:
        return None, full
    words = [_SEPARATORS.split(label) for label in full]  # words at even places, the separators between at odd
    first, shortest = words[0], min(map(len, words))
    head = tail = 0  # how many of the first and last places all share, in (word, separator) pairs
    while head + tail + 2 < shortest and all(w[:head + 2] == first[:head + 2] for w in words):
        head += 2
    while head + tail + 2 < shortest and all(w[len(w) - tail - 2:] == first[len(first) - tail - 2:] for w in words):
        tail += 2
    short = ["".join(w[head:len(w) - tail]) for w in words]
    if not head + tail or len(set(short)) < len(set(full)) or not all(s.strip() for s in short):
        return None, full
    return "".join(first[:head]) + "…" + "".join(first[len(first) - tail:]), short


def _wrapped(label: str, width: int = 24) -> str:
    """`label` on lines of about `width` characters, broken before a space or after `_`, `.` or `-` (folder
    names have no spaces)."""
    lines = [""]
    for piece in re.split(r"(?<=[_.\-])|(?= )", label):
        if lines[-1].strip() and len(lines[-1]) + len(piece) > width:
            lines.append("")
        lines[-1] += piece
    return "\n".join(line.strip() for line in lines)


def _plain(value: float, _position=None) -> str:
    """A tick label as people write the number: 0.759, 13.2, 604,000."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:g}"


def _plain_across(axis) -> None:
    """Plain labels on a linear x axis, at most six: written out in full (0.1828, no offset), more run together."""
    axis.set_major_locator(MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]))
    axis.set_major_formatter(FuncFormatter(_plain))


def _log_axis(ax, which: str, values: list[float], ticks: list[float] | None = None) -> None:
    """A log scale over `values` with plain labels: at `ticks`, else at 1, 2 and 5 times the powers of ten
    in view, else (a view narrower than those) at the values themselves."""
    low, high = min(values) / 1.25, max(values) * 1.25
    if ticks is None:
        powers = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
        ticks = [m * 10.0 ** p for p in powers for m in (1, 2, 5) if low <= m * 10.0 ** p <= high]
        if len(ticks) < 2:
            ticks = sorted({float(f"{v:.3g}") for v in values})
    getattr(ax, f"set_{which}scale")("log")
    getattr(ax, f"set_{which}lim")(low, high)
    axis = getattr(ax, f"{which}axis")
    axis.set_ticks(ticks)
    axis.set_minor_locator(NullLocator())
    axis.set_major_formatter(FuncFormatter(_plain))


def _legend(ax, heading: str | None) -> None:
    ax.legend(fontsize=7, title=textwrap.fill(heading, HEADING_WIDTH) if heading else None, title_fontsize=7)


def _targets(groups: list[Group]) -> list[tuple[str, Threshold]]:
    """(ruleset, threshold) of each target the groups were judged by, each once (a panel can hold two rounds)."""
    found = {}
    for group in groups:
        ruleset = group.ruleset
        if ruleset is None:
            continue  # no ruleset holds its benchmark: the report says so
        try:
            target = target_check(ruleset, group.division, group.benchmark)
        except RuleError:
            continue  # the report says why the group cannot be scored
        if target is not None and target.threshold is not None:
            found[(ruleset, target.threshold)] = None
    return list(found)


def _series(results: ResultSet, key: str) -> dict[str, pd.DataFrame]:
    """file -> its `key` events from run_start on (time_ms since run_start, value)."""
    events = results.events
    chosen = events[(events.key == key) & (events.time_ms >= 0)]
    return {file: rows for file, rows in chosen.groupby("file")}


def _run_lines(ax, groups: list[Group], colours: dict, series: dict[str, pd.DataFrame],
               value: Callable[[Run, object], float | None]) -> str | None:
    """One line per run (minutes since run_start, `value` of each logged value that gives one) in its group's
    colour, one legend entry per group. Returns the groups' shared heading."""
    heading, names = _told_apart(groups)
    for group, label in zip(groups, names):
        for run in group.runs:
            rows = series.get(run.file)
            points = [] if rows is None else \
                [(ms / 60000, y) for ms, y in zip(rows.time_ms, (value(run, v) for v in rows.value)) if y is not None]
            if points:
                ax.plot(*zip(*points), marker=".", markersize=3, linewidth=0.8, color=colours[id(group)], label=label)
                label = "_nolegend_"  # the group's other runs: one legend entry per group
    ax.set_xlabel("minutes since run_start")
    ax.grid(alpha=0.3)
    _plain_across(ax.xaxis)
    return heading


def _quality(results: ResultSet) -> Figure:
    series = _series(results, C.EVAL_ACCURACY)
    colours = _colours(results)
    benchmarks = _benchmarks(results)
    fig, axes = _panels(len(benchmarks))
    for ax, benchmark in zip(axes, benchmarks):
        groups = _in(results, benchmark)
        heading = _run_lines(ax, groups, colours, series, lambda run, v: float(v) if is_number(v) else None)
        for ruleset, target in _targets(groups):
            ax.axhline(target.value, color="black", linestyle="--", linewidth=1,
                       label=f"target {target.op} {target.value:g} (ruleset {ruleset})")
        ax.set_title(f"{benchmark or 'no benchmark'}: eval quality vs time")
        ax.set_ylabel("eval quality")
        ax.yaxis.set_major_formatter(FuncFormatter(_plain))
        if ax.lines:
            _legend(ax, heading)
    return fig


def _throughput(results: ResultSet) -> Figure:
    series = _series(results, TRACKED_STATS)
    colours = _colours(results)
    benchmarks = _benchmarks(results)
    fig, axes = _panels(len(benchmarks))
    for ax, benchmark in zip(axes, benchmarks):
        groups = _in(results, benchmark)
        runs = [r for g in groups for r in g.runs if r.samples_per_s is not None or r.tokens_per_s is not None]
        tokens = bool(runs) and all(r.tokens_per_s is not None for r in runs)  # one unit per panel

        def rate(run: Run, stats) -> float | None:
            if not isinstance(stats, dict):
                return None
            return run.rates.tokens_per_s(stats) if tokens else run.rates.samples_per_s(stats)

        heading = _run_lines(ax, groups, colours, series, rate)
        unit = "tokens/s" if tokens else "samples/s"
        ax.set_title(f"{benchmark or 'no benchmark'}: {unit} vs time")
        ax.set_ylabel(unit)
        values = [y for line in ax.lines for y in line.get_ydata()]
        # Systems of one benchmark can differ by orders of magnitude (one node and 56): a log scale where they do.
        if values and min(values) > 0 and max(values) / min(values) >= 10:
            _log_axis(ax, "y", values)
        else:
            ax.yaxis.set_major_formatter(FuncFormatter(_plain))
        if ax.lines:
            _legend(ax, heading)
    return fig


def _time_to_train(results: ResultSet) -> Figure:
    """Systems down the side (labels written across, however many), minutes along the bottom."""
    colours = _colours(results)
    benchmarks = _benchmarks(results)
    fig, axes = _panels(len(benchmarks))
    for ax, benchmark in zip(axes, benchmarks):
        groups = _in(results, benchmark)
        for y, group in enumerate(groups):
            colour = colours[id(group)]
            for converged, marker in ((True, "o"), (False, "x")):
                minutes = [r.time_to_train_min for r in group.runs
                           if r.converged == converged and r.time_to_train_min is not None]
                if minutes:
                    ax.scatter(minutes, [y] * len(minutes), color=colour, marker=marker, s=18 if converged else 24)
            if group.score_min is not None:
                ax.vlines(group.score_min, y - 0.3, y + 0.3, color="black")
        ax.set_title(f"{benchmark or 'no benchmark'}: time-to-train per run")
        ax.set_xlabel("minutes")
        _plain_across(ax.xaxis)
        ax.grid(alpha=0.3, axis="x")
        if groups:  # the systems are named on the y axis; the legend says what the marks mean
            heading, names = _told_apart(groups)
            ax.set_yticks(range(len(groups)), [_wrapped(name) for name in names], fontsize=7)
            ax.set_ylim(len(groups) - 0.5, -0.5)  # the smallest system on top
            ax.set_ylabel(textwrap.fill(heading, HEADING_WIDTH) if heading else "system", fontsize=7)
            ax.legend([Line2D([], [], color="grey", marker="o", linestyle=""),
                       Line2D([], [], color="grey", marker="x", linestyle=""), Line2D([], [], color="black")],
                      ["run", "did not converge", "MLPerf score"], fontsize=7)
    return fig


def _accelerators(results: ResultSet) -> dict[int, int | None]:
    """id(group) -> its accelerators, as ResultSet.scores counts them (None where its runs disagree or say none);
    the frame's rows follow ResultSet.groups."""
    return {id(g): None if pd.isna(count) else int(count)
            for g, count in zip(results.groups, results.scores.accelerators)}


def _scaling(results: ResultSet) -> Figure:
    colours = _colours(results)
    accelerators = _accelerators(results)
    benchmarks = _benchmarks(results)
    fig, axes = _panels(len(benchmarks))
    for ax, benchmark in zip(axes, benchmarks):
        ax.set_title(f"{benchmark or 'no benchmark'}: time-to-train vs accelerators")
        ax.set_xlabel("accelerators")
        ax.set_ylabel("MLPerf score (minutes)")
        groups = [g for g in _in(results, benchmark) if g.score_min is not None and accelerators[id(g)]]
        groups.sort(key=lambda g: accelerators[id(g)])
        if not groups:
            ax.text(0.5, 0.5, "no system has both a score and an accelerator count\n(systems/<folder>.json)",
                    ha="center", va="center", fontsize=8, transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        heading, names = _told_apart(groups)
        counts = [accelerators[id(g)] for g in groups]
        scores = [g.score_min for g in groups]
        gpu_minutes = counts[0] * scores[0]  # the smallest system's: ideal scaling spreads them over more accelerators
        drawn, scaled = list(scores), len(set(counts)) > 1
        if scaled:
            ends = [counts[0], counts[-1]]
            ax.plot(ends, [gpu_minutes / c for c in ends], color="grey", linestyle="--", linewidth=1,
                    label=f"ideal scaling from {names[0]} (100%)")
            drawn.append(gpu_minutes / counts[-1])
        for group, name, count, score in zip(groups, names, counts, scores):
            ax.plot([count], [score], marker="o", linestyle="", color=colours[id(group)], label=name)
            if scaled:  # how much of the ideal speed-up the system reaches
                ax.annotate(f"{gpu_minutes / (count * score):.0%}", (count, score), xytext=(5, 4),
                            textcoords="offset points", fontsize=7)
        _log_axis(ax, "x", counts, ticks=sorted(set(counts)))
        _log_axis(ax, "y", drawn)
        ax.grid(alpha=0.3)
        _legend(ax, heading)
    return fig


def figures(results: ResultSet) -> dict[str, Figure]:
    """name -> Figure, for a notebook to show or `plot` to save."""
    return {"quality": _quality(results), "throughput": _throughput(results),
            "time_to_train": _time_to_train(results), "scaling": _scaling(results)}


def plot(results: ResultSet, out_dir: Path) -> list[Path]:
    """Write <name>.png for every figure into out_dir; return the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figures(results).items():
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written
