"""The rank's error file for torchelastic's agent, written whole or not at all.

torch's ErrorHandler truncates the file and then writes the JSON into it. When one rank
dies, the agent SIGTERMs the others and then parses each failed rank's error file; a rank
that was itself writing its error (its peer's loss broke a collective) dies mid-write,
and the agent crashes on the empty JSON instead of reporting the failure, so the attempt
is lost without a verdict and no restart is made. Writing to a temporary name and
renaming it into place means the agent sees either no file (it then reports the exit
code or signal) or the whole one.
"""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler


class AtomicErrorHandler(ErrorHandler):
    def __init__(self) -> None:
        super().__init__()
        self._writing_to: str | None = None

    def _get_error_file_path(self) -> str | None:
        return self._writing_to or super()._get_error_file_path()

    def record_exception(self, e: BaseException) -> None:
        final = super()._get_error_file_path()
        if not final:
            super().record_exception(e)  # no agent is listening: torch logs it instead
            return
        self._writing_to = f"{final}.{os.getpid()}.partial"
        try:
            super().record_exception(e)
            os.replace(self._writing_to, final)
        finally:
            if os.path.exists(self._writing_to):
                os.unlink(self._writing_to)
            self._writing_to = None


error_handler = AtomicErrorHandler()
