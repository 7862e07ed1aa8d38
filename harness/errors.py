"""The one exception type the CLI turns into a single-line message instead of a traceback."""


class HarnessError(Exception):
    """Bad input or an unusable environment, explained in words a user can act on.

    `exit_code` lets callers distinguish usage problems (2) from failed jobs (1).
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
