"""`python -m workloads BENCHMARK ...`: what every rank runs, on every backend.

The exit status is 0 when the campaign completed, whether or not each run reached
its quality target (that verdict is in the logs, as run_stop's status), and
non-zero on an error, which the elastic agent may answer with a restart.
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from workloads.common.campaign import RunOptions, run_campaign



def workload_class(benchmark: str):
    if benchmark == "resnet":
        from workloads.resnet.train import ResNetWorkload

        return ResNetWorkload
    if benchmark == "bert":
        from workloads.bert.train import BertWorkload

        return BertWorkload
    if benchmark == "gpt3":
        from workloads.gpt3.train import GPT3Workload

        return GPT3Workload
    raise SystemExit(f"workloads: no workload named {benchmark!r} in this version (available: resnet, bert, gpt3)")


@record  # writes the exception to torchelastic's error file so the agent reports the real cause
def main() -> int:
    opts = RunOptions.parse()
    run_campaign(workload_class(opts.benchmark), opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
