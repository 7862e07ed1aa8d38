"""The quality targets of a ruleset, read from mlperf-logging's own compliance rule files.

Each `compliance_checker/training_<ruleset>/<division>_<benchmark>.yaml` states
the target as an `ATLEAST_ONE_CHECK` on `eval_accuracy` (for example
`v['value'] >= 0.7590 and v['value'] < 1.0`). We evaluate exactly that
expression on each logged accuracy, instead of running the whole, slow checker.
"""

from __future__ import annotations

import functools
import math
from importlib import resources
from typing import Callable

import yaml
from mlperf_logging.mllog import constants as C

from harness.errors import HarnessError

DEFAULT_RULESET = "4.0.0"
TargetCheck = Callable[[float], bool]


@functools.cache
def rulesets() -> tuple[str, ...]:
    """Training rulesets the installed mlperf-logging knows, oldest first."""
    root = resources.files("mlperf_logging") / "compliance_checker"
    names = [p.name.removeprefix("training_") for p in root.iterdir()
             if p.name.startswith("training_") and p.name.count(".") == 2 and "_warn" not in p.name]
    return tuple(sorted(names, key=lambda r: tuple(int(x) for x in r.split("."))))


def check_ruleset(ruleset: str) -> str:
    if ruleset not in rulesets():
        raise HarnessError(f"unknown ruleset {ruleset!r}; choose one of: {', '.join(rulesets())}")
    return ruleset


@functools.cache
def target_check(ruleset: str, division: str | None, benchmark: str | None) -> TargetCheck | None:
    """The ruleset's target test for one accuracy value, or None where its rule files state none."""
    if division not in (C.CLOSED, C.OPEN) or not benchmark or not benchmark.replace("_", "").isalnum():
        return None  # a logged name that is no rule file's (and no path)
    rule_file = (resources.files("mlperf_logging") / "compliance_checker" / f"training_{ruleset}"
                 / f"{division}_{benchmark}.yaml")
    if not rule_file.is_file():
        return None
    records = yaml.safe_load(rule_file.read_text()) or []
    for record in records:
        key = record.get("KEY") if isinstance(record, dict) else None
        if key and key.get("NAME") == C.EVAL_ACCURACY and key.get("ATLEAST_ONE_CHECK"):
            # The expression is MLCommons' rule text shipped in the installed package, never user input.
            code = compile(key["ATLEAST_ONE_CHECK"], str(rule_file), "eval")
            return lambda value: bool(eval(code, {"__builtins__": {}, "math": math}, {"v": {"value": value}}))
    return None


def converged(status: str | None, accuracies: list[float], check: TargetCheck | None) -> bool:
    """A run converged if it logged success and, where the ruleset states a target, an eval met it."""
    if status != C.SUCCESS:
        return False
    return check is None or any(check(value) for value in accuracies)
