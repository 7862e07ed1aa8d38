"""How a worker's failure tells the node agent's failure policy (harness.agent.classify) what kind it is.

Two things decide it, and both are the worker's to say, so they live here, beside the code that raises them
(torch-free: harness.blame builds its patterns from these):

- ConfigurationError: a refusal that every node and every attempt would repeat (a usage error, a preset without
  its input, a batch or layout the plan refuses, a starting checkpoint whose content is wrong). The agent reads
  its qualified name, workloads.common.refusals.ConfigurationError, in the traceback torch's ErrorHandler writes
  into the rank's error file (the message names the type alone, as several libraries' own ConfigurationError
  read: those are workload errors), and neither retries it nor blames a node. A plain SystemExit refusal (a file
  one node cannot read) stays the workload's: it may belong to one node, so it is not said to be the same on
  every node.
- The errnos that are the machine's or its file system's for a while (PASSING_ERRNOS, MACHINE_ERRNOS): a data
  reader lets them through (workloads.common.data.data_errors) and the policy retries them.
"""

from __future__ import annotations

import errno

# What a shared file system says for a while (a server failing over or refusing connections meanwhile, a handle
# gone stale across a remount, a timeout): not the dataset's fault, so the run's log stays open and the failure
# policy restarts the attempt, which continues the run. Not blamed on the node that read first (harness.blame).
PASSING_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR, errno.ENOLCK,
                            errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETDOWN, errno.ENETUNREACH,
                            errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED})
# The node's own machine failing the program (its memory exhausted): retried, and blamed on that node.
MACHINE_ERRNOS = frozenset({errno.ENOMEM})


class ConfigurationError(SystemExit):
    """A refusal with its one-line reason that is the job's command or shared input, the same on every node and
    at every attempt: not retried, no node blamed. Its qualified name is the marker the agent reads: keep it here."""
