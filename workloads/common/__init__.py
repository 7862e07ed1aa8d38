"""Pieces every workload shares: distributed setup, the MLPerf log, progress, the run loop."""
