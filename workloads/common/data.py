"""Input helpers shared by the workloads."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

from torch.utils.data import DistributedSampler, Sampler

from workloads.common.refusals import MACHINE_ERRNOS, PASSING_ERRNOS


@contextmanager
def data_errors() -> Iterator[None]:
    """Around a workload's open_data(): a dataset its readers cannot use (a missing file, a truncated index, a
    wrong column: OSError or ValueError, each reader's message naming the file) stops the run with that one line,
    no traceback; the campaign ends the run's log first (workloads.common.campaign.open_data). A passing
    file-system error or the machine's (PASSING_ERRNOS, MACHINE_ERRNOS) is not the dataset's verdict and goes on as
    it is: the failure policy retries it. The refusal is the workload's, not a ConfigurationError: a file one node
    cannot read (its mount missing) is that node's."""
    try:
        yield
    except OSError as exc:
        if exc.errno in PASSING_ERRNOS | MACHINE_ERRNOS:
            raise
        raise SystemExit(f"workloads: {exc}") from None
    except ValueError as exc:
        raise SystemExit(f"workloads: {exc}") from None


def eval_row(size: int, rank: int, world: int, i: int) -> tuple[int, bool]:
    """The i-th validation row of `rank`'s share of `size`, and whether it counts. MLPerf scores every validation
    sample once, but every rank runs the same number of forward passes (FSDP gathers weights across them): rank r
    takes rows r, r + world, r + 2 world, ..., ceil(size / world) of them, a short share ending in uncounted repeats
    of row 0 (where DistributedSampler would count its repeats: 5,760 sequences padded to 5,824 at 448 ranks)."""
    index = rank + i * world
    return (index, True) if index < size else (0, False)


class ResumableSampler(Sampler):
    """A DistributedSampler that can start partway into an epoch: a resumed run's data position.

    Skipping indices (not batches) means no sample is read or decoded only to be thrown away.
    """

    def __init__(self, sampler: DistributedSampler):
        self.sampler, self.skip = sampler, 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        s = self.sampler
        if not s.shuffle and s.drop_last:
            # The same indices as DistributedSampler's, without the list of every sample it builds first: the
            # language models' samplers span whole runs (llama31_8b: 76.8M samples, gigabytes a rank).
            return iter(range(s.rank + self.skip * s.num_replicas, s.total_size, s.num_replicas))
        return itertools.islice(iter(s), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.skip)
