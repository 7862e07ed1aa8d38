"""Where ResNet's first compiled steps go: build, first batch, then each step, and the first step's compile split
into dynamo's trace, the forward graphs' compile (AOT autograd + inductor) and the backward graphs' compile.

    python bench/resnet_first_steps.py [--preset full] [--batch-size 2] [--steps 4] [--optimize-ddp on|off]
                                       [--straggler-hooks] [--warm-cache]

One process, a one-rank gloo group, the workload built as a run builds it (workloads/resnet/train.py: the DDP
module compiled whole, its optimizer) on synthetic batches, `--compile on`. The inductor cache starts empty (a
temporary TORCHINDUCTOR_CACHE_DIR), as on a freshly lent machine, unless --warm-cache. --optimize-ddp off compiles
the DDP module as one graph instead of one per gradient bucket (torch._dynamo.config.optimize_ddp), to weigh the
split; --straggler-hooks adds the straggler watch's forward hooks, as `harness run` does with two ranks or more.
Counts are exact; seconds move with the machine's load.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def phases(metrics: dict[str, list[float]]) -> dict[str, float]:
    """Dynamo's compile timers, summed: its trace (each frame's compile less the backend's), the forward graphs'
    compile (the backend: DDPOptimizer's split, AOT autograd, inductor) and the backward graphs' (compiled at
    the first backward)."""
    total = lambda key: sum(metrics.get(key, []))  # noqa: E731
    frames = sum(total(k) for k in metrics if k.startswith("compile_attempt_"))
    backend = total("OutputGraph.call_user_compiler")
    return {"dynamo trace": frames - backend, "forward graphs compile": backend,
            "backward graphs compile": total("compile_fx.<locals>.bw_compiler")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="full")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--optimize-ddp", choices=("on", "off"), default="on")
    parser.add_argument("--straggler-hooks", action="store_true")
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's usual cache directory")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (a CPU rank's default: 1)")
    args = parser.parse_args()
    cache = None if args.warm_cache else tempfile.TemporaryDirectory(prefix="inductor-")
    if cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name

    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import compilation_time_metrics, counters

    from workloads.common.campaign import RunOptions, seed_everything
    from workloads.common.distributed import DistContext, shutdown_distributed
    from workloads.resnet.train import ResNetWorkload

    torch.set_num_threads(args.threads)
    torch._dynamo.config.optimize_ddp = args.optimize_ddp == "on"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    with tempfile.TemporaryDirectory() as out:
        opts = RunOptions(benchmark="resnet", preset=args.preset, out=Path(out), runs=1, seed=0, submitter="bench",
                          system=None, data=None, synthetic=True, max_steps=args.steps,
                          batch_size=args.batch_size, compile="on")
        seed_everything(0)
        started = time.perf_counter()
        workload = ResNetWorkload(opts, ctx, seed=0)
        print(f"torch {torch.__version__}, {args.preset} preset, batch {args.batch_size}, {workload.optimizer_name}, "
              f"optimize_ddp {args.optimize_ddp}, {torch.get_num_threads()} thread(s)")
        print(f"build: {time.perf_counter() - started:.2f} s")
        if args.straggler_hooks:
            from workloads.common.resilience_options import StragglerWindow
            from workloads.common.run_record import RunRecord
            from workloads.common.stragglers import StragglerWatch

            StragglerWatch(workload.model, ctx, RunRecord(None, 0), StragglerWindow.parse("60"))
        started = time.perf_counter()
        workload.open_data()
        batches = workload.batches(0)
        first = next(batches)
        print(f"open the data and draw the first batch: {time.perf_counter() - started:.2f} s")

        def stream():
            yield first
            yield from batches

        steps = stream()
        for step in range(1, args.steps + 1):
            started = time.perf_counter()
            workload.train_step(steps)
            seconds = time.perf_counter() - started
            print(f"step {step}: {seconds:.2f} s, dynamo graphs so far {counters['stats']['unique_graphs']}")
            if step == 1:
                for name, value in phases(compilation_time_metrics).items():
                    print(f"  {name}: {value:.1f} s")
                print(f"  AOT-compiled graphs: {len(compilation_time_metrics.get('compile_fx.<locals>.fw_compiler_base', []))}"
                      f" forward, {len(compilation_time_metrics.get('compile_fx.<locals>.bw_compiler', []))} backward")
    shutdown_distributed()
    if cache:
        cache.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
