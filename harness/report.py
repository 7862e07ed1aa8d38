"""Render a ResultSet as a table, JSON, CSV, Markdown or HTML: the time-to-train report.

JSON is a list of groups, one per (system, benchmark, campaign) (harness.results.group_key):
  {"submitter", "system", "system_id", "campaign", "benchmark", "division", "ruleset", "score_min",
   "required_runs", "left_out", "scaling_factor", "rcp", "rcp_message", "rcp_scaling", "energy", "unscorable",
   "runs": [{"file", "status", "compliant", "compliance_error", "converged", "time_to_train_min", "quality",
             "samples_per_s", "tokens_per_s", "mfu", "synthetic", "seed", "ruleset", "restarts", "goodput", "badput",
             "stragglers"}]}
`system` is the official system_name of a submission's systems/<folder>.json (else the logged
platform) and `system_id` the folder. `ruleset` is the one that judged the group (compliance, target, RCPs,
score): the one forced, else its logs' own (harness.results.rules.ruleset_for); null where no ruleset holds
the benchmark, and `unscorable` then says so (its files are not checked: `compliant` null); each run carries
it too, as CSV does. `campaign` is the
folder of the logs outside a submission tree (each campaign is its own group), null inside one. `compliant` is
mlperf-logging's compliance checker's verdict on the file and `compliance_error` its first error; a file that
fails is left out of the score as the summarizer leaves it out (counted as a failed run), and `left_out` counts those
files of the group, less the runs that ended aborted (failed already; the table says "aborted" instead of the
checker's verdict on a log that stopped early). `score_min` is the MLPerf score when the group has the runs the
rules require, else null; `unscorable` says why when the ruleset's rule cannot be applied. `rcp` is
the RCP verdict the official summarizer gives closed results (Pass, Fail, Interp. Fail, Missing, No
RCP, Unknown state; null where the checker cannot run, with the reason in `rcp_message`); `scaling_factor`
is the one applied (scaling.json, as the summarizer applies it) and `rcp_scaling` the one the RCP check
computes (what the summarizer writes to scaling.json for its next run). `energy` is
the summarizer's power score where the submission has power results. An unfinished run (no run_stop)
has status null and time_to_train_min null, and counts as a failed run.
`restarts` (int), `goodput` (a fraction of the wall time) and `badput` (seconds by cause:
startup, save, restore, lost, recovery, other) come from the harness's run record, and are
null for logs that have none; so do `stragglers`, the ranks the straggler checks named
(`[{"rank", "node", "score", "windows"}]`). `tokens_per_s` and `mfu` (a fraction of the GPUs' dense bf16 peak) are
logged by GPT-3, and null elsewhere.
`synthetic` is true for a run that trained on synthetic input (`harness run --synthetic`, from its run record):
a throughput run, never converged, whose group is `unscorable` for that reason.
`kept_out` lists the nodes preflight (or a failed attempt) kept out of the group's runs, from each run
folder's preflight.json: `[{"folder", "node", "check", "measured", "unit", "threshold", "reason"}]`, one entry
per failed check. CSV carries the same entries of each run's folder in a `kept_out` column (JSON); Markdown
and HTML in a table of their own. The table names each group's ruleset after its
verdict; Markdown and HTML have a `ruleset` column in their scores and runs.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from harness.results import Group, ResultSet, Run, labels

FORMATS = ("table", "json", "csv", "markdown", "html")
RUN_FIELDS = ("file", "status", "compliant", "compliance_error", "converged", "time_to_train_min", "quality",
              "samples_per_s", "tokens_per_s", "mfu", "synthetic", "seed", "ruleset", "restarts", "goodput", "badput",
              "stragglers")


def run_record(run: Run) -> dict:
    return {name: getattr(run, name) for name in RUN_FIELDS}


def _kept_out_in(folder: Path) -> list[dict]:
    """The nodes kept out of the runs in `folder` (harness.preflight.kept_out_rows)."""
    from harness.preflight import kept_out_rows, read

    record = read(folder)
    return [{"folder": str(folder), **row} for row in kept_out_rows(record)] if record else []


def kept_out(runs: list[Run]) -> list[dict]:
    """The nodes kept out of these runs, each run folder once."""
    return [row for folder in dict.fromkeys(Path(r.file).parent for r in runs) for row in _kept_out_in(folder)]


def group_record(group: Group) -> dict:
    return {"submitter": group.submitter, "system": group.system, "system_id": group.system_id,
            "campaign": group.campaign, "benchmark": group.benchmark, "division": group.division,
            "ruleset": group.ruleset, "score_min": group.score_min, "required_runs": group.required_runs,
            "left_out": len(group.left_out),
            "scaling_factor": group.scaling_factor, "rcp": group.rcp,
            "rcp_message": group.rcp_message, "rcp_scaling": group.rcp_scaling, "energy": group.energy,
            "unscorable": group.unscorable, "runs": [run_record(r) for r in group.runs],
            "kept_out": kept_out(group.runs)}


def _number(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _badput(badput: dict[str, float] | None) -> str:
    """The largest causes of lost time, e.g. `lost 3.1s, recovery 2.4s`."""
    if not badput:
        return "-"
    top = sorted(((v, k) for k, v in badput.items() if v >= 0.05), reverse=True)[:3]
    return ", ".join(f"{k} {v:.1f}s" for v, k in top) or "-"


def _stragglers(named: list[dict] | None) -> str:
    return ", ".join(f"rank {s['rank']} ({s['node']}) {s['score']:.2f}" for s in named or []) or "-"


def _verdict(group: Group) -> str:
    score = group.score_min
    if group.ruleset is None:
        return group.unscorable  # why no ruleset holds it, said as it is: nothing was judged, so nothing failed
    if group.unscorable:
        text = f"unscorable: {group.unscorable}"
    elif score is not None:
        text = f"score {score:.4f} min"
        if group.scaling_factor != 1.0:
            text += f" (scaled by {group.scaling_factor:.4f})"
        if group.energy is not None:
            text += f", energy {group.energy:.1f} J"
    elif len(group.runs) < (group.required_runs or 0):
        text = f"no score ({len(group.runs)} of {group.required_runs or '?'} required runs)"
    else:
        text = f"no score ({sum(not r.converged for r in group.runs)} failed runs, too many)"
    if group.left_out:
        text += f"; {len(group.left_out)} of {len(group.runs)} runs left out by the compliance checker"
    if group.rcp is not None:
        text += f"; RCP {group.rcp}"
    return f"{text}; ruleset {group.ruleset}"


def _table(results: ResultSet) -> str:
    lines = []
    for group, label in zip(results.groups, labels(results.groups)):
        lines.append(f"{group.submitter or '?'} / {label} / {group.benchmark or '?'}: {_verdict(group)}")
        # Token rate and MFU only for groups that log them (language models).
        tokens = any(run.tokens_per_s is not None for run in group.runs)
        slow = any(run.stragglers for run in group.runs)  # the column only where a straggler was named
        rows = [("run", "status", "time-to-train (min)", "quality", "samples/s",
                 *(("tokens/s", "MFU") if tokens else ()), "restarts", "goodput", "badput",
                 *(("stragglers",) if slow else ()), "file")]
        for i, run in enumerate(group.runs):
            status = "unfinished" if run.unfinished else run.status or "?"
            if run.synthetic:
                status += ", synthetic input"
            elif run.left_out:  # a synthetic run misses any closed target: not news
                status += ", non-compliant"
            rows.append((str(i), status, _number(run.time_to_train_min, 4), _number(run.quality, 4),
                         _number(run.samples_per_s, 1),
                         *((_number(run.tokens_per_s, 0), _number(run.mfu, 3)) if tokens else ()),
                         "-" if run.restarts is None else str(run.restarts), _number(run.goodput, 3),
                         _badput(run.badput), *((_stragglers(run.stragglers),) if slow else ()), run.file))
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]) - 1)]
        for row in rows:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
        lines.extend(f"  left out by the compliance checker: {run.file}: {run.compliance_error}"
                     for run in group.left_out)
        lines.extend(f"  aborted: {run.file}: the run stopped before its quality target; its log is kept"
                     for run in group.runs if run.aborted and not run.synthetic)
    return "\n".join(lines) if lines else "no result files found"


def _csv(results: ResultSet) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(("submitter", "system", "system_id", "campaign", "benchmark", "score_min", "rcp") + RUN_FIELDS +
                    ("kept_out",))
    for group in results.groups:
        for run in group.runs:
            record = {**run_record(run), "kept_out": kept_out([run])}
            writer.writerow((group.submitter, group.system, group.system_id, group.campaign, group.benchmark,
                             group.score_min,
                             group.rcp, *(json.dumps(v) if isinstance(v, (dict, list)) else v
                                          for v in map(record.get, RUN_FIELDS + ("kept_out",)))))
    return out.getvalue().rstrip("\n")


def _documents(results: ResultSet, fmt: str) -> str:
    """Scores side by side (one row per group, with GPUs and spread), then every run, then the files the
    compliance checker left out and the nodes preflight kept out, where there are any."""
    scores = results.scores.rename(columns={"accelerators": "GPUs", "min_min": "fastest_min",
                                            "max_min": "slowest_min"})
    runs = results.runs[["system", "system_id", "campaign", "benchmark", "ruleset", "status", "compliant", "converged",
                         "seed", "time_to_train_min", "quality", "samples_per_s", "tokens_per_s", "mfu", "restarts",
                         "goodput", "file"]]
    import pandas as pd

    rulesets = {g.ruleset for g in results.groups} - {None}  # several: each group's is in its row
    title = "MLPerf Training results" + (f" (ruleset {rulesets.pop()})" if len(rulesets) == 1 else "")
    left_out = pd.DataFrame([(run.file, run.compliance_error) for group in results.groups for run in group.left_out],
                            columns=["file", "compliance_error"])
    nodes = pd.DataFrame([row for group in results.groups for row in kept_out(group.runs)],
                         columns=["folder", "node", "check", "measured", "unit", "threshold", "reason"])
    if fmt == "markdown":
        text = (f"# {title}\n\n## Scores\n\n{scores.to_markdown(index=False, floatfmt='.4f')}\n\n"
                f"## Runs\n\n{runs.to_markdown(index=False, floatfmt='.4f')}")
        if len(left_out):
            text += f"\n\n## Left out by the compliance checker\n\n{left_out.to_markdown(index=False)}"
        return text + (f"\n\n## Nodes kept out\n\n{nodes.to_markdown(index=False)}" if len(nodes) else "")
    number = '{:.4f}'.format
    text = (f"<h1>{title}</h1>\n<h2>Scores</h2>\n{scores.to_html(index=False, na_rep='-', float_format=number)}"
            f"\n<h2>Runs</h2>\n{runs.to_html(index=False, na_rep='-', float_format=number)}")
    if len(left_out):
        text += f"\n<h2>Left out by the compliance checker</h2>\n{left_out.to_html(index=False, na_rep='-')}"
    return text + (f"\n<h2>Nodes kept out</h2>\n{nodes.to_html(index=False, na_rep='-')}" if len(nodes) else "")


def render(results: ResultSet, fmt: str) -> str:
    if fmt in ("markdown", "html"):
        return _documents(results, fmt)
    if fmt == "json":
        return json.dumps([group_record(g) for g in results.groups], indent=2)
    if fmt == "csv":
        return _csv(results)
    return _table(results)


def preflight_notes(paths) -> list[str]:
    """For each run folder among `paths` that ran a preflight: the nodes it kept out and why, and what the
    cluster was told (harness.preflight's preflight.json)."""
    from pathlib import Path

    from harness.preflight import kept_out_lines, read

    folders = dict.fromkeys(Path(p) if Path(p).is_dir() else Path(p).parent for p in paths)
    return [line for folder in folders if (record := read(folder)) for line in kept_out_lines(record)]
