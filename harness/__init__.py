"""MLPerf Training benchmark harness: launch, log, and score distributed PyTorch training."""

__version__ = "0.1.0"
