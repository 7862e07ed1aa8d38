"""MLLOG key names: mlperf-logging's own (`mllog/constants.py`), and the tracked_stats key of NVIDIA's logs.

The constants file is loaded by its path rather than imported as `mlperf_logging.mllog.constants`:
importing that package runs its logger module, which imports numpy, a quarter of a report's CPU time
(bench/report_vs_summarizer.py). Where the package is already imported, its module is used.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import mlperf_logging


def _constants() -> ModuleType:
    loaded = sys.modules.get("mlperf_logging.mllog.constants")
    if loaded is not None:
        return loaded
    path = Path(mlperf_logging.__file__).parent / "mllog" / "constants.py"
    spec = importlib.util.spec_from_file_location("harness.results._mllog_constants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


C = _constants()
# Throughput, tokens/s and MFU, as NVIDIA's submissions log them; workloads.common.mlperf writes the same key
# (tests/test_results.py checks that they agree).
TRACKED_STATS = "tracked_stats"
