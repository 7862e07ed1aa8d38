"""`python -m workloads BENCHMARK ...`: what every rank runs, on every backend.

The exit status is 0 when the campaign completed, whether or not each run reached
its quality target (that verdict is in the logs, as run_stop's status), and
non-zero on an error, which the elastic agent may answer with a restart.
"""

import importlib.util
import os
import sys
from functools import partial

from workloads.common.requirements_check import exit_if_unfit

exit_if_unfit()  # before torch is imported: an image too old for the harness stops in one line
_argv = sys.argv[1:]
if "--restart=process" not in _argv and ["--restart", "process"] not in [_argv[i:i + 2] for i in range(len(_argv))] \
        and importlib.util.find_spec("nvidia_resiliency_ext") is not None:
    # A restart in process polls its store every 0.1 s, and torch's c10d logs a warning at each poll that times out
    # (workloads.common.inprocess); read once, when torch is loaded. Python's own errors still reach the log.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from workloads.common.campaign import RunOptions, run_campaign  # noqa: E402
from workloads.common import inprocess  # noqa: E402
from workloads.common.error_file import error_handler  # noqa: E402
from workloads.common.rank_output import redirect_rank_output  # noqa: E402
from workloads.registry import BENCHMARKS  # noqa: E402


@partial(record, error_handler=error_handler)  # the exception goes to torchelastic's error file: the agent's cause
def main() -> int:
    try:
        opts = RunOptions.parse()  # a bad command line is refused here, as a line (RunOptions' parser)
        redirect_rank_output(opts.out)
        campaign = partial(run_campaign, BENCHMARKS[opts.benchmark].workload_class(), opts)
        inprocess.run(campaign, opts.out) if inprocess.wanted(opts.restart) else campaign()
    except SystemExit as exc:
        # A refusal with its reason (a bad command line, bad input, a missing file): @record leaves SystemExit out
        # of the error file, so record it here for the agent's one-line cause (harness.agent.classify: a
        # ConfigurationError is the job's configuration error, a plain SystemExit the workload's, unless its errno
        # is a passing one; neither is retried); the worker prints it, without a traceback.
        if not isinstance(exc.code, str):
            raise
        error_handler.record_exception(exc)
        # One write of the whole line (Python's own report writes the newline apart): ranks that refuse at
        # once share the terminal, and their lines must not run into each other.
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), (exc.code + "\n").encode(errors="replace"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
