"""The quality targets of a ruleset, read from mlperf-logging's own compliance rule files.

Each `compliance_checker/training_<ruleset>/<division>_<benchmark>.yaml` states
the target as an `ATLEAST_ONE_CHECK`, for example on `eval_accuracy`
(`v['value'] >= 0.7590 and v['value'] < 1.0`), or, for a two-metric eval such as
stable diffusion's FID and CLIP, on the virtual key `aggregated_eval_accuracy`
that the rule file's BEGIN block builds (pairing FID and CLIP by `eval_step_key`, which
differs between rulesets). We evaluate exactly that expression, as
the checker does (stripped, with `v` = {'value', 'metadata'}), instead of running
the whole, slow checker. A rule that cannot be read or evaluated raises RuleError:
the caller makes that one (system, benchmark) group unscorable and goes on.
The pictures draw the target: `Target.threshold` reads its value from the same expression.

Which ruleset judges a log, unless the caller forces one, is decided here too (`ruleset_for`): the round its
submission tree's path names, else the newest ruleset that holds its benchmark.
"""

from __future__ import annotations

import ast
import builtins
import functools
import math
import re
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import CodeType

import yaml
from mlperf_logging.benchmark_meta import get_allowed_benchmarks

from harness.errors import HarnessError
from harness.results.keys import C

AGGREGATED = "aggregated_eval_accuracy"  # the virtual key of two-metric evals (stable diffusion)
# What a rule expression may call: the names mlperf-logging's checker gives it (`math`, `s`) and plain builtins.
_BUILTINS = {name: getattr(builtins, name)
             for name in ("abs", "min", "max", "len", "float", "int", "round", "isinstance", "all", "any")}


class RuleError(ValueError):
    """Why a ruleset's target cannot be applied to a group."""


def rules_root() -> Path:
    """mlperf-logging's compliance rule folders: a new round's rules come with a newer mlperf-logging."""
    return Path(str(resources.files("mlperf_logging") / "compliance_checker"))


@functools.cache
def _rulesets(root: Path) -> tuple[str, ...]:
    names = [p.name.removeprefix("training_") for p in root.iterdir()
             if p.name.startswith("training_") and p.name.count(".") == 2 and "_warn" not in p.name]
    return tuple(sorted(names, key=lambda r: tuple(int(x) for x in r.split("."))))


def rulesets() -> tuple[str, ...]:
    """Training rulesets the installed mlperf-logging knows, oldest first."""
    return _rulesets(rules_root())


def check_ruleset(ruleset: str) -> str:
    if ruleset not in rulesets():
        raise HarnessError(f"unknown ruleset {ruleset!r}; choose one of: {', '.join(rulesets())}")
    return ruleset


# A round's folder: MLCommons publishes round 5.1 as the repository training_results_v5.1 (this project's shared copy
# calls it training_v5.1), whose <org>/results/<system>/<benchmark>/ its summarizer judges by ruleset 5.1.0.
ROUND_FOLDER = re.compile(r"training(?:_results)?_v(\d+)\.(\d+)")


class NoRuleset(RuleError):
    """No ruleset the installed mlperf-logging knows can judge a log: said as such, never scored as a failure."""


@functools.cache
def _holding(root: Path, benchmark: str) -> tuple[str, ...]:
    def holds(ruleset: str) -> bool:
        try:
            listed = benchmark in get_allowed_benchmarks("training", ruleset)
        except ValueError:  # a rule folder newer than mlperf-logging's own round table
            return False
        return listed and any((root / f"training_{ruleset}" / f"{prefix}{benchmark}.yaml").is_file()
                              for prefix in ("closed_", "open_", ""))  # 0.6.0's files have no division

    return tuple(filter(holds, _rulesets(root)))


def holding(benchmark: str) -> tuple[str, ...]:
    """The rulesets that hold a benchmark, oldest first: those whose round lists it (mlperf-logging's
    benchmark_meta, which the package checker and the summarizer accept a benchmark by) and whose compliance
    rules have its rule file. Rule files alone would say more: 5.1.0 still ships closed_bert.yaml, but round
    5.1 retired bert, and its package checker refuses it."""
    return _holding(rules_root(), benchmark)


def ruleset_for(path: str | Path, benchmark: str | None) -> str:
    """The ruleset that judges a log unless the caller forces one, the one place this is decided: the round a
    folder of its path names (training_results_v5.1/<org>/results/..., or training_v5.1: 5.1.0; the innermost
    such folder), as MLCommons judges a round's submissions; else the newest ruleset that holds its benchmark
    (`holding`), which is what a new run is trained to. Raises NoRuleset, saying why, where none can."""
    for folder in reversed(Path(path).absolute().parts[:-1]):
        if found := ROUND_FOLDER.fullmatch(folder):
            named = f"{found[1]}.{found[2]}.0"
            if named not in rulesets():
                raise NoRuleset(f"{folder} names ruleset {named}, which the installed mlperf-logging does not know "
                                f"(it knows {rulesets()[0]} to {rulesets()[-1]}): upgrade it, or force a ruleset")
            return named
    if not benchmark:
        raise NoRuleset("the log names no benchmark (submission_benchmark), so no ruleset holds it")
    if not (held := holding(benchmark)):
        raise NoRuleset(f"no ruleset holds {benchmark}: none of the installed mlperf-logging's ({rulesets()[0]} to "
                        f"{rulesets()[-1]}) has rules for it; force a ruleset to judge it anyway")
    return held[-1]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def eval_step_key(ruleset: str) -> str:
    """The metadata field that pairs the metrics of one two-metric eval (stable diffusion's FID and CLIP).

    The one place this is decided, for the target (aggregate_metrics) and for the RCP check (rcp.py):
    3.1.0's closed_stable_diffusion.yaml merges by `step_num` (so does rcp_checker's read_submission_file,
    switched on the same ruleset), every later rule file by `samples_count`; stable diffusion has no
    rule file before 3.1.0. tests/test_results.py runs every ruleset's BEGIN block against this.
    """
    return "step_num" if ruleset == "3.1.0" else "samples_count"


def aggregate_metrics(records: list[tuple[object, dict]], step: str) -> list[dict]:
    """eval_accuracy records told apart by metadata['metric'] -> one value per eval step (metadata[step]),
    e.g. {'samples_count': 512000, 'FID': 80.1, 'CLIP': 0.16}.

    Mirrors the BEGIN block of mlperf-logging's closed_stable_diffusion.yaml (which builds
    `aggregated_eval_accuracy`); tests/test_results.py runs that block on the same records.
    """
    merged: dict[object, dict] = {}
    for value, metadata in records:
        if "metric" not in metadata or step not in metadata:
            continue
        samples = metadata[step]
        try:
            entry = merged.setdefault(samples, {step: samples})
        except TypeError:  # an unhashable samples_count: no eval step to file it under
            continue
        try:
            entry[metadata["metric"]] = value
        except TypeError:
            continue
    return list(merged.values())


@dataclass(frozen=True)
class Threshold:
    """The value a rule's target names, and how an eval's value must compare with it (">=", ">", "<=" or "<")."""

    op: str
    value: float


_OPS = {ast.GtE: ">=", ast.Gt: ">", ast.LtE: "<=", ast.Lt: "<"}
_MIRRORED = {">=": "<=", ">": "<", "<=": ">=", "<": ">"}  # `0.759 <= v` is `v >= 0.759`


def _number(node: ast.expr) -> float | None:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):  # no literal: a name, a call, arithmetic on text
        return None
    return float(value) if _is_number(value) else None


def _is_value(node: ast.expr) -> bool:
    """Whether `node` is `v['value']` itself (not a field of it, such as stable diffusion's v['value']['FID'])."""
    return isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "v" and \
        isinstance(node.slice, ast.Constant) and node.slice.value == "value"


def threshold(expression: str) -> Threshold | None:
    """The target an ATLEAST_ONE_CHECK expression states, for drawing: its first bound on v['value'] by a number
    that is no range check (a lower bound of 0, an upper bound of 1: `v['value'] < 1.0` beside resnet's
    `v['value'] >= 0.7590`, `v['value'] > 0.0` beside llama31_8b's `v['value'] <= 3.3`; the rule files state the
    target first, as in gpt3's `(v['value'] <= 2.69) and v['value'] > 2.6`). None where the expression names no
    such bound, or reads anything but v (two metrics, the checker's state such as s['target_accuracy']): there is
    then no one value to draw. tests/test_plots.py holds every rule file's threshold to its compiled check."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return None
    if any(isinstance(node, ast.Name) and node.id != "v" for node in ast.walk(tree)):
        return None
    bounds = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for left, op, right in zip(operands, node.ops, operands[1:]):
                name = _OPS.get(type(op))
                if name and _is_value(left) and _number(right) is not None:
                    bounds.append(((right.lineno, right.col_offset), Threshold(name, _number(right))))
                elif name and _is_value(right) and _number(left) is not None:
                    bounds.append(((left.lineno, left.col_offset), Threshold(_MIRRORED[name], _number(left))))
    targets = [bound for _, bound in sorted(bounds, key=lambda found: found[0])  # in the expression's order
               if not (bound.op in (">=", ">") and bound.value == 0 or bound.op in ("<=", "<") and bound.value == 1)]
    return targets[0] if targets else None


@dataclass(frozen=True)
class Target:
    """One ruleset's ATLEAST_ONE_CHECK for a (division, benchmark)."""

    rule_file: str
    key: str  # eval_accuracy, or AGGREGATED for two-metric evals
    expression: str
    code: CodeType
    step: str  # the metadata field that pairs a two-metric eval's metrics (eval_step_key)

    def _holds(self, value, metadata: dict) -> bool:
        try:
            return bool(eval(self.code, {"__builtins__": _BUILTINS, "math": math, "s": {}},  # noqa: S307
                             {"v": {"value": value, "metadata": metadata}}))
        except Exception as exc:  # noqa: BLE001 - a rule file is outside our control
            if _is_number(value) or self.key == AGGREGATED:
                if self.key == AGGREGATED and isinstance(exc, KeyError):
                    return False  # an eval step that logged only one of the metrics
                raise RuleError(f"{self.rule_file}: the rule {self.expression.strip()!r} cannot be evaluated "
                                f"on {value!r}: {type(exc).__name__}: {exc}") from None
            return False  # a logged value of a kind the rule does not read (text, a list) meets no target

    @property
    def threshold(self) -> Threshold | None:
        """The target's value, where the rule names one (see `threshold`)."""
        return threshold(self.expression)

    def met_by(self, records: list[tuple[object, dict]]) -> bool:
        """Whether any logged eval meets the target. Raises RuleError when the rule cannot be evaluated."""
        if self.key == AGGREGATED:
            return any(self._holds(value, {}) for value in aggregate_metrics(records, self.step))
        return any(self._holds(value, metadata) for value, metadata in records)


@functools.cache
def _target(root: Path, ruleset: str, division: str, benchmark: str) -> Target | None:
    rule_file = root / f"training_{ruleset}" / f"{division}_{benchmark}.yaml"
    if not rule_file.is_file():
        return None
    try:
        records = yaml.safe_load(rule_file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise RuleError(f"{rule_file}: cannot be read: {exc}") from None
    found = None
    for record in records if isinstance(records, list) else []:
        key = record.get("KEY") if isinstance(record, dict) else None
        if isinstance(key, dict) and key.get("NAME") in (C.EVAL_ACCURACY, AGGREGATED) and \
                "ATLEAST_ONE_CHECK" in key:
            found = key  # as in the checker, a later record of a key replaces an earlier one
    if found is None:
        return None
    expression = found["ATLEAST_ONE_CHECK"]
    if not isinstance(expression, str):
        raise RuleError(f"{rule_file}: the {found['NAME']} check is not an expression: {expression!r}")
    try:
        # MLCommons' rule text shipped in the installed package, never user input; stripped as the checker does.
        with warnings.catch_warnings():  # a mangled rule is reported once, as unscorable, not as Python warnings
            warnings.simplefilter("ignore", SyntaxWarning)
            code = compile(expression.strip(), str(rule_file), "eval")
    except (SyntaxError, ValueError) as exc:
        raise RuleError(f"{rule_file}: the rule {expression!r} is not a valid expression: {exc}") from None
    return Target(str(rule_file), found["NAME"], expression, code, eval_step_key(ruleset))


def target_check(ruleset: str, division: str | None, benchmark: str | None) -> Target | None:
    """The ruleset's target for a (division, benchmark), or None where its rule files state none.
    Raises RuleError for a rule file that cannot be read or compiled."""
    if division not in (C.CLOSED, C.OPEN) or not benchmark or not benchmark.replace("_", "").isalnum():
        return None  # a logged name that is no rule file's (and no path)
    return _target(rules_root(), ruleset, division, benchmark)


def converged(status: str | None, records: list[tuple[object, dict]], target: Target | None) -> bool:
    """A run converged if it logged success and, where the ruleset states a target, an eval met it."""
    if status != C.SUCCESS:
        return False
    return target is None or target.met_by(records)
