"""A closed run's peak LR and warmup at its global batch, from its benchmark's RCP rows (mlperf-logging's
`rcp_checker/training_6.1.0/rcps_<benchmark>.json`): at a row, between two, or outside them. Torch-free: the dry run
and the CLI's checks use it, for every benchmark whose RCP rows the batch chooses between (the decoders, flux1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchHyperparameters:
    """A run's peak LR (and warmup) at its global batch, and where each came from: `rows` are the RCP table's rows
    it sits on ((batch,)) or between ((low, high)), () when off the table or with no table (an open preset);
    `lr_from` and `warmup_from` say "row", "interpolated", "given" (the user's) or "preset" (the preset's own)."""

    benchmark: str
    global_batch: int
    base_lr: float
    warmup_samples: int | None  # None: the benchmark's RCP rows carry no warmup (llama2_70b_lora)
    rows: tuple[int, ...]
    lr_from: str
    warmup_from: str | None = None
    table: tuple[int, ...] = ()  # every row's batch, for the dry run's words; () for an open preset

    def describe(self) -> str:
        """One line for the dry run: the rows that bound the batch and how each hyperparameter was chosen."""
        if not self.table:
            where = f"global batch {self.global_batch} (an open preset: no RCP table)"
        elif len(self.rows) == 1:
            where = f"global batch {self.global_batch} is an RCP row (rcps_{self.benchmark}.json)"
        elif self.rows:
            where = (f"global batch {self.global_batch} lies between the RCP rows {self.rows[0]} and {self.rows[1]} "
                     f"(rcps_{self.benchmark}.json; the RCP checker interpolates its reference convergence between "
                     "them)")
        else:
            where = (f"global batch {self.global_batch} is outside the RCP rows ({self.table[0]} to {self.table[-1]}) "
                     "and accepted by --force-batch (its runs may fail the RCP check)")
        words = {"row": "the row's", "interpolated": "interpolated linearly between the rows",
                 "given": "given", "preset": "the preset's", "rule": "by the closed rules' formula"}
        chosen = f"peak LR {self.base_lr:g} {words[self.lr_from]}"
        if self.warmup_samples is not None:
            chosen += f", warmup {self.warmup_samples:,} samples {words[self.warmup_from]}"
        return f"{where}: {chosen}"


def rcp_hyperparameters(benchmark: str, table: Mapping[int, float | tuple[float, int]], global_batch: int, *,
                        preset: tuple[float, int | None], learning_rate: float | None = None,
                        warmup_samples: int | None = None, force: bool = False) -> BatchHyperparameters:
    """The peak LR (and warmup samples) for `global_batch` from an RCP table, batch -> peak LR or batch -> (peak LR,
    warmup samples), as mlperf-logging's `rcp_checker/training_6.1.0/rcps_<benchmark>.json` rows carry them.

    - At a row: the row's values.
    - Strictly between two rows: what the user gives (`learning_rate`, `warmup_samples`), else each interpolated
      linearly in batch between the two bounding rows (the LR to 6 significant digits, warmup to whole samples).
      Why: the RCP checker accepts such a batch (mlperf-logging `rcp_checker/rcp_checker.py`, `check_directory`:
      no row at the batch, a row below (`_find_top_min_rcp`) and one above (`_find_bottom_max_rcp`) -> "RCP
      Interpolation") and builds its reference by `_create_interp_rcp`, which interpolates only the two rows'
      mean and standard deviation of samples to converge (np.interp over batch size) and gives the record
      "Hyperparams": {}, so it compares the run's convergence and never its hyperparameters. The rules say the
      same: MLCommons training_policies `training_rules.adoc`, "Reference Convergence Points (RCPs)": "If there is
      no RCP for that batch size but there are RCPs for smaller and larger batch sizes an interpolated RCP is
      created, and the mean epochs to converge is compared against the interpolated RCP"; they prescribe no
      hyperparameters for such a batch (the closed hyperparameter table and the 6.1.0 compliance checker,
      `closed_llama2_70b_lora.yaml` and `closed_llama31_8b.yaml`, constrain neither the base LR nor the warmup;
      the verifier is the rules' source of truth). Linear interpolation is this harness's choice, made to match
      the convergence the checker expects (interpolated linearly between the same rows); NVIDIA's v5.1
      llama2_70b_lora at batch 64 logs opt_base_learning_rate 0.0006, the linear value between rows 32 (4e-4)
      and 128 (1e-3).
    - Below the smallest row or above the largest: refused (ValueError listing the table), unless `force`: then
      the given values, else the preset's, and the runs cannot pass the RCP check (above the table the checker
      asks for a new RCP; below it, the smallest row's convergence must still be met).

    User-given values are taken at a row too (the rules leave the LR unconstrained). A table of LRs alone has no
    warmup: `warmup_samples` is refused for it."""
    rows = {batch: value if isinstance(value, tuple) else (value, None) for batch, value in sorted(table.items())}
    has_warmup = all(warmup is not None for _, warmup in rows.values())
    if warmup_samples is not None and not has_warmup:
        raise ValueError(f"{benchmark} has no learning-rate warmup (its RCP rows carry a peak LR only), so "
                         "--warmup-samples does not apply; give --learning-rate alone")
    if learning_rate is not None and not learning_rate > 0:
        raise ValueError(f"--learning-rate must be above 0, got {learning_rate:g}")
    if warmup_samples is not None and warmup_samples < 0:
        raise ValueError(f"--warmup-samples must be 0 or more, got {warmup_samples}")
    batches = tuple(rows)
    below = [batch for batch in batches if batch < global_batch]
    above = [batch for batch in batches if batch > global_batch]
    if global_batch in rows:
        bounds, (lr, warmup), source = (global_batch,), rows[global_batch], "row"
    elif below and above:
        low, high = below[-1], above[0]
        share = (global_batch - low) / (high - low)
        (low_lr, low_warmup), (high_lr, high_warmup) = rows[low], rows[high]
        lr = float(f"{low_lr + share * (high_lr - low_lr):.6g}")
        warmup = round(low_warmup + share * (high_warmup - low_warmup)) if has_warmup else None
        bounds, source = (low, high), "interpolated"
    elif force:
        bounds, (lr, warmup), source = (), preset, "preset"
    else:
        listed = "; ".join(f"{batch}: LR {lr:g}" + (f", warmup {warmup:,} samples" if warmup is not None else "")
                           for batch, (lr, warmup) in rows.items())
        raise ValueError(f"{benchmark} has no reference convergence point (RCP) at or around global batch "
                         f"{global_batch}: it is {'below' if above else 'above'} every row, so the RCP checker has "
                         f"none to interpolate for it and asks for a new RCP; choose a row or a batch between two "
                         f"({batches[0]} to {batches[-1]}) of {listed} (or add --force-batch)")
    return BatchHyperparameters(
        benchmark=benchmark, global_batch=global_batch, rows=bounds, table=batches,
        base_lr=learning_rate if learning_rate is not None else lr,
        lr_from="given" if learning_rate is not None else source,
        warmup_samples=(warmup_samples if warmup_samples is not None else warmup) if has_warmup else None,
        warmup_from=("given" if warmup_samples is not None else source) if has_warmup else None)


def open_hyperparameters(benchmark: str, global_batch: int, preset: tuple[float, int | None],
                         learning_rate: float | None = None, warmup_samples: int | None = None) -> BatchHyperparameters:
    """An open preset's (tiny): any batch, the given LR and warmup, else the preset's; no RCP table applies."""
    lr, warmup = preset
    if warmup_samples is not None and warmup is None:
        raise ValueError(f"{benchmark} has no learning-rate warmup, so --warmup-samples does not apply")
    if learning_rate is not None and not learning_rate > 0:
        raise ValueError(f"--learning-rate must be above 0, got {learning_rate:g}")
    if warmup_samples is not None and warmup_samples < 0:
        raise ValueError(f"--warmup-samples must be 0 or more, got {warmup_samples}")
    return BatchHyperparameters(
        benchmark=benchmark, global_batch=global_batch, rows=(),
        base_lr=learning_rate if learning_rate is not None else lr,
        lr_from="given" if learning_rate is not None else "preset",
        warmup_samples=(warmup_samples if warmup_samples is not None else warmup) if warmup is not None else None,
        warmup_from=("given" if warmup_samples is not None else "preset") if warmup is not None else None)
