"""`harness`: the command line. Parsing and messages only; each subcommand calls into a module.

Every problem with the input ends as one line on stderr, `harness: error: ...`,
and a non-zero exit status; never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness import __version__, campaign, profiles
from harness.api import attach
from harness.errors import HarnessError
from harness.launchers import BACKENDS
from harness.spec import JobSpec, check_writable
from workloads.common.compiling import COMPILE_CHOICES, WARM_UP_CHOICES
from workloads.common.resilience_options import FAULT_KINDS
from workloads.decoder.config import RCP_GLOBAL_BATCHES, RCP_WARMUP_BENCHMARKS, rcp_batches_in_words
from workloads.decoder.stages import PIPELINED_BENCHMARKS
from workloads.registry import BENCHMARKS



class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the problem (argparse already names the choices)."""

    def error(self, message: str):
        raise HarnessError(f"{self.prog}: error: {message}")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Show `(default: X)` where an option has a real default; options without one say theirs in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, [], argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="harness", formatter_class=_Help,
                     description="MLPerf Training benchmark harness: run benchmarks locally, on Slurm or on "
                                 "Kubernetes, and turn their MLPerf logs into time-to-train reports.")
    parser.add_argument("--version", action="version", version=f"harness {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser("run", help="run a benchmark campaign and report its time-to-train",
                         formatter_class=_Help, description=(
                             "Run K timed MLPerf runs of a benchmark and print each run's time-to-train.\n"
                             "Without --data the tiny preset trains on a small generated dataset; "
                             "with --data the full (closed) preset trains on the real one."))
    run.add_argument("benchmark", help=f"the benchmark: {', '.join(BENCHMARKS)}")
    run.add_argument("--preset", help="tiny or full (default: full with --data, else tiny)")
    run.add_argument("--backend", default="local", help=f"where to run: {', '.join(BACKENDS)}")
    run.add_argument("--nodes", type=int, default=1, help="nodes (machines) to use")
    run.add_argument("--gpus-per-node", type=int,
                     help="GPUs each node asks the scheduler for (default: the profile's; local: the visible ones)")
    run.add_argument("--procs-per-node", type=int,
                     help="worker processes per node, one per GPU at most (default: one per GPU, or the profile's "
                          "CPU default; local: 2 on a CPU-only machine)")
    run.add_argument("--runs", type=int, help="timed runs, each with its own seed and result file (default: for a "
                                               "closed preset on its dataset the count MLPerf's rules require, e.g. "
                                               "10 for llama31_8b; else 1)")
    run.add_argument("--run-minutes", type=float, metavar="MIN",
                     help="one run's expected time-to-train, for the campaign's wall-time plan (Slurm's --time) "
                          "(default: the benchmark's cited GPU-minutes over this job's GPUs, times a margin; 10 for "
                          "tiny presets)")
    run.add_argument("--seed", type=int, help="seed of the first run; run i uses seed+i "
                                              "(default: each run draws a random seed and logs it)")
    run.add_argument("--out", type=Path, help="output folder (default: results/runs/<benchmark>-<preset>-<time>)")
    run.add_argument("--max-restarts", type=int, default=3,
                     help="restarts allowed after infrastructure failures (a lost process or node, a NCCL/gloo "
                          "error or timeout, out of memory), on every backend; workload errors are never retried, "
                          "and 3 attempts failing the same way at the same step stop the job. Exit codes: "
                          "3 workload error, 4 budget spent, 5 repeated failure")
    run.add_argument("--checkpoint-every", metavar="N|TIME",
                     help="checkpoint every N steps, or every TIME of wall time (90s, 10m, 1h); a restarted run "
                          "continues from its newest valid checkpoint (default: 20 steps for tiny presets, 15m for "
                          "full)")
    run.add_argument("--keep-checkpoints", type=int, default=2, metavar="K",
                     help="checkpoints kept per run (older ones are deleted; all go when the run stops)")
    run.add_argument("--async-checkpoint", action="store_true",
                     help="write checkpoints in the background: training waits only for the copy to host memory")
    run.add_argument("--restart", choices=("in-process", "process"), default="in-process",
                     help="after a retried failure that left every worker alive (a passing I/O error), go on in "
                          "the same processes (in-process, the default; needs nvidia-resiliency-ext: pip install "
                          "'.[inprocess]', else processes are restarted), or always restart the workers as new "
                          "processes (process); a worker that died restarts as a new process either way")
    run.add_argument("--inject-failure", metavar="RANK:STEP[:KIND]",
                     help="fault injection for tests and demos, on the first attempt only: when worker RANK "
                          "reaches global step STEP of a run, KIND happens: "
                          + "; ".join(f"{k}: {v}" for k, v in FAULT_KINDS.items()) + " (default kind: kill)")
    run.add_argument("--metrics-port", type=int, metavar="PORT",
                     help="each node agent serves Prometheus metrics on PORT (the next free one if taken); 0 turns "
                          "them off (default: the profile's, 9410)")
    run.add_argument("--pushgateway", metavar="URL",
                     help="also push each node's metrics to this Prometheus Pushgateway (for clusters whose compute "
                          "nodes Prometheus cannot scrape)")
    run.add_argument("--optimizer", metavar="sgd|lars",
                     help="resnet: this optimizer whatever the global batch (default: the preset's: LARS at every "
                          "batch for full, as every RCP and reference submission; SGD below 4,096 for tiny)")
    run.add_argument("--decode", metavar="workers|device",
                     help="resnet: where the JPEGs are decoded: in the loader workers (default), or on the run's "
                          "device in one batched call per batch (nvjpeg on GPUs), the workers only reading the files "
                          "and drawing the crops")
    run.add_argument("--compile", default="auto", metavar="|".join(COMPILE_CHOICES),
                     help="torch.compile the model: auto compiles on GPUs and runs eagerly on CPU")
    run.add_argument("--warm-up", default="auto", metavar="|".join(WARM_UP_CHOICES),
                     help="before run_start, run the train step and the eval on synthetic batches of the run's shapes "
                          "(compiling, autotuning, opening the communicators), then put every state back: auto does "
                          "when the model is compiled or on GPUs (docs/clock.md)")
    run.add_argument("--straggler-window", default="60", metavar="SECONDS|Nsteps",
                     help="seconds of training between straggler checks (60, 90s, 2m: one small all-gather of each "
                          "rank's mean forward and step time; the step count follows the pace), or a fixed count of "
                          "steps (20steps); 0 turns them off (default: 60)")
    run.add_argument("--straggler-threshold", type=float, default=0.75, metavar="SCORE",
                     help="a rank whose speed is below this share of the fastest rank's is a straggler")
    run.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                     help="environment variable for the workers (repeatable)")
    run.add_argument("--data", type=Path,
                     help="dataset folder: ImageNet layout for resnet (train/, val/); MLPerf's BERT HDF5 shards for "
                          "bert (train/*.hdf5, eval/*.hdf5; fixed, varlength or packed); MLPerf's C4 .bin/.idx files "
                          "for gpt3 and llama31_8b; MLCommons' GovReport parquet files for llama2_70b_lora")
    run.add_argument("--init-checkpoint", type=Path, metavar="PATH",
                     help="starting weights, as MLPerf starts from its reference checkpoints: for bert a PyTorch "
                          "state dict file (the reference's parameter names are understood), for gpt3 a "
                          "torch.distributed.checkpoint folder, for llama2_70b_lora one `python -m "
                          "workloads.decoder.convert` wrote from Hugging Face's safetensors; default for the tiny "
                          "presets: one the harness trains once")
    run.add_argument("--synthetic", action="store_true",
                     help="train on generated input instead of a dataset (from random weights for bert and gpt3): "
                          "measures throughput only")
    run.add_argument("--max-steps", type=int, help="stop after this many training steps (smoke tests)")
    run.add_argument("--batch-size", type=int,
                     help="batch per process (default: the preset's); for bert, rows per process per forward pass "
                          "(a packed row holds several sequences: see --packing-factor)")
    run.add_argument("--packing-factor", type=int, default=1, metavar="N",
                     help="bert on packed data: the sequences a row holds on average (NVIDIA's packed data: 2); the "
                          "global batch, its RCP and the eval interval count rows x N sequences (default: 1, unpacked)")
    run.add_argument("--global-batch", type=int,
                     help=f"{', '.join(RCP_GLOBAL_BATCHES)}: samples (sequences, images) per optimizer step, a batch "
                          "MLPerf's RCPs were "
                          "measured at or one between two of them ("
                          + "; ".join(f"{name}: {rcp_batches_in_words(name)}" for name in RCP_GLOBAL_BATCHES)
                          + "); the full preset takes a row's peak LR (and warmup, where the rows have one), or "
                            "between two rows each interpolated linearly in batch, unless given; deepseekv3_671b's "
                            "is the closed rules' 2.4e-5 x sqrt(GBS / 16384) at any batch of 15,360 or more "
                            "(default: the preset's)")
    run.add_argument("--force-batch", action="store_true",
                     help=f"{', '.join(RCP_GLOBAL_BATCHES)}: accept a --global-batch outside the RCP table (the "
                          "preset's LR and warmup unless given; its runs may fail the RCP check; deepseekv3_671b: "
                          "above its rows only, with the rules' LR and warmup)")
    run.add_argument("--learning-rate", type=float, metavar="LR",
                     help=f"{', '.join(RCP_GLOBAL_BATCHES)}: the peak learning rate (logged as opt_base_learning_rate) "
                          "instead of the RCP row's or the interpolated one (default: those; deepseekv3_671b's closed "
                          "rules fix it, so only their value is taken)")
    run.add_argument("--warmup-samples", type=int, metavar="N",
                     help=f"{', '.join(RCP_WARMUP_BENCHMARKS)}: the learning-rate warmup in samples instead of the RCP "
                          "row's or the interpolated one (llama2_70b_lora runs no warmup)")
    run.add_argument("--pipeline-parallel", type=int, metavar="N",
                     help=f"{', '.join(PIPELINED_BENCHMARKS)}: split the model into N pipeline stages "
                          "(torch.distributed.pipelining, 1F1B), each on world / N consecutive processes; N must divide "
                          "the process count and leave every stage a block (default: the preset's: 1; deepseekv3_671b's "
                          "16 full, 2 tiny)")
    run.add_argument("--allow-unflushed-cache", action="store_true",
                     help="let a closed run go ahead when its page cache could not be flushed before it (the log "
                          "keeps cache_clear false); without it such a run stops with the reason")
    run.add_argument("--submitter", default="harness", help="organisation logged as submission_org")
    run.add_argument("--system", help="system name logged as submission_platform (default: e.g. cpu_n1x2)")
    run.add_argument("--name", help="job name on the cluster (default: <benchmark>-<preset>); lowercase "
                                    "letters, digits and '-'")
    run.add_argument("--profile", default="local-cpu",
                     help="cluster profile: a name from manifests/profiles/ (local-cpu, h100-ib, coreweave-h100) "
                          "or a YAML file")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override one profile setting, e.g. slurm.partition=gpu or env.NCCL_DEBUG=INFO "
                          "(repeatable)")
    run.add_argument("--api", choices=profiles.KUBERNETES_APIS,
                     help="job resource on --backend k8s: pytorchjob (Kubeflow Training v1) or trainjob (Kubeflow "
                          "Trainer v2); same as --set kubernetes.api=... (default: the profile's, pytorchjob)")
    run.add_argument("--pod-monitor", action="store_true",
                     help="with --backend k8s: print a Prometheus Operator PodMonitor for the job's metrics and "
                          "submit nothing")
    run.add_argument("--dry-run", action="store_true", help="print the exact request (command, script or every "
                                                            "object a Kubernetes run creates) and submit nothing; "
                                                            "what would be refused is listed as problems")
    run.add_argument("--strict", action="store_true",
                     help="with --dry-run: exit 1 when the request has problems (for CI gates)")
    run.add_argument("--preflight", action=argparse.BooleanOptionalAction, default=None,
                     help="check every node first (GPUs, NVML, matmul, all-reduce inside and between nodes, "
                          "InfiniBand, the shared folder) and keep failed nodes out of the training (default: on "
                          "for multi-node full runs)")
    _preflight_options(run)
    run.set_defaults(func=cmd_run)

    check = sub.add_parser("preflight", help="check nodes before trusting them: per-node table and preflight.json",
                           formatter_class=_Help, description=(
                               "Run the preflight health job on --nodes (+ --spare-nodes) nodes: per node the GPU\n"
                               "count and model, NVML's ECC, remapped rows, XID, throttle, temperature and PCIe\n"
                               "readings, a bf16 matmul per GPU, an all-reduce inside the node, InfiniBand ports and\n"
                               "the shared folder; between nodes, all-reduces on node pairs and on the whole set.\n"
                               "Thresholds: the profile's preflight section, else defaults per GPU model.\n"
                               "Exit 0: enough healthy nodes, 6: too few."))
    check.add_argument("--backend", default="local", help=f"where: {', '.join(BACKENDS)}")
    check.add_argument("--nodes", type=int, default=1, help="nodes the job would need")
    check.add_argument("--profile", default="local-cpu", help="cluster profile (name or YAML file)")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one profile setting, e.g. preflight.min_pair_busbw_gbps=35 (repeatable)")
    check.add_argument("--out", type=Path, help="output folder (default: results/runs/preflight-<time>)")
    check.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="environment variable "
                       "for the health job (repeatable)")
    check.add_argument("--dry-run", action="store_true", help="print the health job's request and submit nothing")
    _preflight_options(check)
    check.set_defaults(func=cmd_preflight)

    doctor = sub.add_parser("doctor", help="check a Kubernetes cluster's prerequisites for a profile, read-only",
                            formatter_class=_Help, description=(
                                "Before the first run on --backend k8s: read, through the kubeconfig's identity,\n"
                                "whether the cluster has what the profile needs (the job API's CRD and TrainJob\n"
                                "runtime, the namespace and its Pod Security level, the results and data PVCs,\n"
                                "the priority class, the queue, the ServiceAccounts, the submitter's permissions\n"
                                "and the watcher's Role, enough Nodes with the GPUs and RDMA devices, the image).\n"
                                "One row per check, with the fix of each that failed; nothing is changed.\n"
                                "Exit 0: no check failed, 1: some did."))
    doctor.add_argument("--profile", required=True, help="cluster profile (name or YAML file)")
    doctor.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one profile setting, e.g. kubernetes.namespace=mlperf (repeatable)")
    doctor.add_argument("--api", choices=profiles.KUBERNETES_APIS,
                        help="job resource: pytorchjob or trainjob; same as --set kubernetes.api=... "
                             "(default: the profile's)")
    doctor.add_argument("--nodes", type=int, default=1,
                        help="nodes the job would need, its spare nodes included (preflight checks them all)")
    doctor.add_argument("--rbac", action="store_true",
                        help="print the RBAC every harness identity needs in the profile's namespace (for kubectl "
                             "apply -f -) and check nothing")
    doctor.set_defaults(func=cmd_doctor)

    report = sub.add_parser("report", help="time-to-train report of MLPerf result logs", formatter_class=_Help,
                            description="Read result_*.txt files (ours or any submission's) and print each "
                                        "run's time-to-train, quality, throughput and status, and the MLPerf "
                                        "score per system and benchmark.")
    report.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="result files or folders")
    from harness.report import FORMATS

    # Without --ruleset each log is judged by its own (harness.results.rules.ruleset_for).
    own_ruleset = ("(default: each log's own: the round its submission tree's path names, e.g. training_v5.1 -> "
                   "5.1.0, else the newest ruleset that holds its benchmark)")
    report.add_argument("--format", default="table", choices=FORMATS, help="output format")
    report.add_argument("--ruleset", help="MLPerf Training ruleset that judges every log: its compliance, quality "
                                          f"target and RCPs {own_ruleset}")
    report.add_argument("--plot", type=Path, metavar="DIR",
                        help="also write quality.png (with the target), throughput.png (vs time, one line per run), "
                             "time_to_train.png (per run and system) and scaling.png (score vs accelerators, "
                             "log-log, with ideal scaling) into DIR")
    report.set_defaults(func=cmd_report)

    compare = sub.add_parser("compare", help="CI verdict: is a candidate slower than its baseline, beyond its runs' "
                                             "spread?", formatter_class=_Help, description=(
                                 "Compare a candidate with a baseline, per benchmark: time-to-train campaigns on\n"
                                 "their score (or median time-to-train), throughput campaigns (--synthetic) on\n"
                                 "their tokens/s (or samples/s, where runs log no tokens/s).\n"
                                 "Regression: a one-sided Welch t-test on log time (or log rate) finds the\n"
                                 "candidate slower than baseline x (1 + max slowdown) with 95% confidence, so\n"
                                 "both sides' run-to-run spread counts; or a candidate run that did not converge\n"
                                 "(finish, for throughput) where every baseline run did. A side with 1 run\n"
                                 "borrows the other's spread, as the verdict says; 1 run on each side: no verdict.\n"
                                 "Exit 0: pass, 1: regression, 2: unusable input or no verdict."))
    compare.add_argument("baseline", type=Path, help="baseline result files or folder (e.g. results/baselines/...)")
    compare.add_argument("candidate", type=Path, help="candidate result files or folder")
    compare.add_argument("--max-slowdown", type=float, default=10.0, metavar="PCT",
                         help="slowdown allowed, in percent of time (for a rate: 10 lets it fall to 1/1.1 of the "
                              "baseline's)")
    compare.add_argument("--ruleset", help=f"ruleset that judges every log of both sides {own_ruleset}")
    compare.set_defaults(func=cmd_compare)

    export = sub.add_parser("export", help="write an MLPerf submission package and check it with MLCommons' "
                                           "package checker", formatter_class=_Help, description=(
                                "Write the MLPerf training package layout into DIR: systems/<system>.json,\n"
                                "results/<system>/<benchmark>/result_<i>.txt and the workload code under\n"
                                "benchmarks/<benchmark>/implementations/. System facts recorded by the runs\n"
                                "(CPU, GPUs, memory, OS, software versions) fill the description; the rest\n"
                                "comes from --system-desc. Then MLCommons' package checker judges DIR.\n"
                                "Exit 0: package written and accepted, 1: the checker found errors,\n"
                                "2: refused (nothing written)."))
    export.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run folders or result files; each benchmark needs exactly the runs the rules "
                             "require (resnet 5, bert 10, gpt3 3, llama31_8b 10, gpt_oss_20b 10, llama2_70b_lora 10: mlperf-logging's counts)")
    export.add_argument("--submitter", required=True, metavar="ORG", help="the submitting organisation")
    export.add_argument("--out", required=True, type=Path, metavar="DIR", help="the package folder (new or empty)")
    export.add_argument("--system-desc", type=Path, metavar="FILE.json",
                        help="system description fields that cannot be detected (they win over detected ones)")
    export.add_argument("--system", help="system name (default: --system-desc's system_name, else the logged "
                                         "submission_platform)")
    export.add_argument("--ruleset", help="MLPerf Training ruleset to judge the runs and check the package against "
                                          f"{own_ruleset.removesuffix(')')}; the runs must share it)")
    export.set_defaults(func=cmd_export)

    logs = sub.add_parser("logs", help="print the worker logs of a run", formatter_class=_Help,
                          description="print the worker logs of a run, each under a `==> name <==` header: each "
                                      "rank's (after the job's\noutput file on Slurm), or on Kubernetes each pod's "
                                      "(a node's; --rank reads the rank's own log once collected)")
    logs.add_argument("run_dir", type=Path, metavar="RUN", help="the run's output folder")
    logs.add_argument("--rank", type=_count, metavar="R", help="rank R's logs alone (a job of 512 ranks has 0 to 511)")
    logs.add_argument("--tail", type=_count, metavar="N", help="the last N lines of each log")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="print what the logs gain until the job ends (Ctrl-C stops following; the job goes on)")
    logs.set_defaults(func=cmd_logs)

    for name, helptext, func in (
            ("status", "where a campaign stands, by its run folder: its state, job, runs done and exit code",
             cmd_status),
            ("cancel", "stop a running job", cmd_cancel),
            ("collect", "copy a cluster job's result files into its run folder (done by `harness run` when the "
                        "job ends; use it after watching was interrupted)", cmd_collect)):
        p = sub.add_parser(name, help=helptext, formatter_class=_Help, description=helptext)
        p.add_argument("run_dir", type=Path, metavar="RUN", help="the run's output folder")
        p.set_defaults(func=func)
    return parser


def _preflight_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spare-nodes", type=int, metavar="N",
                        help="allocate N more nodes than --nodes; the healthiest --nodes train (default: 0, or for a "
                             "closed run with preflight what the profile's preflight.spare_share asks above "
                             "preflight.spare_above_nodes nodes)")
    parser.add_argument("--drain-bad-nodes", action="store_true",
                        help="Slurm: drain the nodes preflight keeps out (scontrol update State=DRAIN Reason=...)")
    parser.add_argument("--taint-bad-nodes", action="store_true",
                        help="Kubernetes: a NoSchedule taint on the nodes preflight keeps out (each checked node "
                             "gets an MLPerfPreflight condition either way)")


def _run_options(args: argparse.Namespace) -> dict:
    """`harness run`'s options by name, as harness.campaign (and harness.start) takes them."""
    return {name: value for name, value in vars(args).items() if name in campaign.RUN_OPTIONS}


def _spec_from_args(args: argparse.Namespace) -> JobSpec:
    return campaign.resolve_spec(**_run_options(args))


def cmd_run(args: argparse.Namespace) -> int:
    return campaign.run(args.backend, _run_options(args), dry_run=args.dry_run, pod_monitor=args.pod_monitor,
                        strict=args.strict)


def cmd_preflight(args: argparse.Namespace) -> int:
    return campaign.preflight_only(args.backend, nodes=args.nodes, profile=args.profile, overrides=args.overrides,
                                   out=args.out, env=args.env, spare_nodes=args.spare_nodes,
                                   drain_bad_nodes=args.drain_bad_nodes, taint_bad_nodes=args.taint_bad_nodes,
                                   dry_run=args.dry_run)


def cmd_doctor(args: argparse.Namespace) -> int:
    from harness.doctor import doctor

    if args.nodes < 1:
        raise HarnessError(f"--nodes must be at least 1, got {args.nodes}")
    overrides = args.overrides + ([f"kubernetes.api={args.api}"] if args.api else [])
    profile = profiles.apply_overrides(profiles.load(args.profile), overrides)
    if args.rbac:
        import yaml

        from harness.launchers.kubernetes_rbac import rbac

        kube = profile.kubernetes
        print(yaml.safe_dump_all(rbac(kube.namespace, watcher_account=kube.watcher_service_account), sort_keys=True),
              end="")
        return 0
    return doctor(profile, args.nodes)


def cmd_report(args: argparse.Namespace) -> int:
    from harness.report import render
    from harness.results import load_found

    results = load_found(args.paths, args.ruleset)
    print(render(results, args.format))
    if args.format == "table":
        from harness.report import preflight_notes

        for line in preflight_notes(args.paths):
            print(line)
    if args.plot:
        from harness.plots import plot

        check_writable(args.plot)
        for path in plot(results, args.plot):
            print(f"harness: wrote {path}", file=sys.stderr)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from harness.compare import compare_paths, exit_code

    verdicts = compare_paths(args.baseline, args.candidate, max_slowdown=args.max_slowdown / 100,
                             ruleset=args.ruleset)
    for verdict in verdicts:
        print(verdict.line())
    return exit_code(verdicts)


def cmd_export(args: argparse.Namespace) -> int:
    from harness.export import plan, run_package_checker, write

    package = plan(args.run_dirs, args.submitter, system=args.system, system_desc=args.system_desc,
                   ruleset=args.ruleset)
    written = write(package, args.out)
    counts = ", ".join(f"{benchmark} {len(files)} runs" for benchmark, files in package.results.items())
    print(f"harness: wrote {len(written)} files to {args.out}: system {package.system}, {counts}", flush=True)
    for note in package.notes:
        print(f"harness: note: {note}", file=sys.stderr, flush=True)
    print(f"harness: running mlperf_logging.package_checker {args.out} training {package.ruleset} ...", flush=True)
    verdict = run_package_checker(args.out, package.ruleset)
    if verdict.passed:
        print("harness: package checker: no errors")
        return 0
    print("\n".join(verdict.problems or verdict.output.splitlines()[-20:]))
    print(f"harness: package checker found errors; the package stays in {args.out} for a look", file=sys.stderr)
    return 1


def _launcher_and_handle(run_dir: Path):
    from harness.launchers import Handle, get_launcher

    handle = Handle.load(run_dir)
    return get_launcher(handle.backend), handle


def _count(text: str) -> int:
    """A rank or a number of lines: a whole number, 0 or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number, 0 or more, got {text!r}")
    return int(text)


def cmd_logs(args: argparse.Namespace) -> int:
    launcher, handle = _launcher_and_handle(args.run_dir)
    if not args.follow:
        print(launcher.logs(handle, rank=args.rank, tail=args.tail), end="")
        return 0
    from harness.launchers import follow

    for chunk in follow(launcher, handle, rank=args.rank, tail=args.tail):
        print(chunk, end="", flush=True)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    print(f"harness: {attach(args.run_dir).status().line()}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    print(f"harness: {attach(args.run_dir).cancel()}")
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    run = attach(args.run_dir)
    run.collect()
    print(f"harness: the run folder {run.out_dir} is up to date")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except HarnessError as exc:
        message = str(exc)
        print(message if message.startswith("harness") else f"harness: error: {message}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stdout = open(os.devnull, "w")
        return 0
