"""Progress for long runs: a live tqdm line on a terminal, plain timestamped lines elsewhere.

Only rank 0 shows progress; every rank's messages also go to its log file
(<out>/logs/rank_<r>.log), which is what `harness logs` reads back.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from tqdm import tqdm

LINE_INTERVAL_S = 15.0  # how often plain-line mode reports between epochs

log = logging.getLogger("workloads")


class Progress:
    """Steps done out of a planned total, with throughput, ETA and the latest eval."""

    def __init__(self, total_steps: int, desc: str, show: bool, stream=None, initial: int = 0):
        self.total = total_steps
        self.desc = desc
        self.show = show
        self.stream = stream or sys.stdout
        self.done = self.initial = initial  # a resumed run starts at its checkpoint's step
        self.stats: dict[str, str] = {}
        self.started = time.monotonic()
        self._last_line = self.started
        live = show and _terminal_columns(self.stream) > 0
        self._bar = tqdm(total=total_steps, initial=initial, desc=desc, unit="step", file=self.stream,
                         dynamic_ncols=True, leave=True) if live else None

    def advance(self, steps: int = 1, **stats: float) -> None:
        self.done += steps
        self.stats.update({k: f"{v:.4g}" for k, v in stats.items()})
        if self._bar is not None:
            self._bar.set_postfix(self.stats, refresh=False)
            self._bar.update(steps)
        elif time.monotonic() - self._last_line >= LINE_INTERVAL_S:
            self.line()

    def set(self, **stats: float | str) -> None:
        """Keep a value (the latest eval, the epoch) on the line without advancing."""
        self.stats.update({k: v if isinstance(v, str) else f"{v:.4g}" for k, v in stats.items()})
        if self._bar is not None:
            self._bar.set_postfix(self.stats)

    def line(self) -> None:
        """Print one plain status line: steps, rate, ETA and the stats (plain-line mode)."""
        self._last_line = time.monotonic()
        elapsed = self._last_line - self.started
        rate = (self.done - self.initial) / elapsed if elapsed > 0 else 0.0
        eta = tqdm.format_interval((self.total - self.done) / rate) if rate > 0 else "?"
        text = (f"{self.desc} | step {self.done}/{self.total} | {tqdm.format_interval(elapsed)} elapsed | "
                f"ETA {eta} | {rate:.2f} step/s" + "".join(f" | {k} {v}" for k, v in self.stats.items()))
        log.info(text)
        if self.show and self._bar is None:
            print(text, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """A line that stays (eval results, run status), printed above a live bar."""
        if self._bar is not None:
            log.info(text)
            self._bar.write(text, file=self.stream)
        else:
            announce(text, self.show, self.stream)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _terminal_columns(stream) -> int:
    """Width of the terminal behind `stream`; 0 for files, pipes and size-less terminals."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
    except (AttributeError, OSError, ValueError):
        return 0


def announce(text: str, show: bool = True, stream=None) -> None:
    """Log a line, and print it too where this rank shows progress."""
    log.info(text)
    if show:
        print(text, file=stream or sys.stdout, flush=True)
