"""Checkpoints, restarts and goodput: the pieces on their own, then real faults in real 2-rank runs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.agent import (EXIT_BUDGET_SPENT, EXIT_REPEATED_FAILURE, EXIT_RETRY, EXIT_WORKLOAD_ERROR,
                           INFRASTRUCTURE, WORKLOAD, classify, decide)
from harness.results import load
from harness.results.goodput import account
from tests.conftest import compliance, failed_checks, free_port, harness
from workloads.common.resilience_options import CheckpointEvery, FaultPlan

# --- classification and the retry decision ----------------------------------------------------------


def test_failures_are_classified_by_what_failed():
    assert classify(1, -9, "SIGKILL", "", False).kind == INFRASTRUCTURE
    assert classify(0, 1, None, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate", True).kind \
        == WORKLOAD  # the job's batch or layout, the same on every node (tests/test_blame.py)
    assert classify(0, 1, None, "RuntimeError: [gloo] Connection closed by peer", True).kind == INFRASTRUCTURE
    assert classify(0, 1, None, "torch.distributed.DistBackendError: NCCL watchdog timeout", True).kind \
        == INFRASTRUCTURE
    for gpu_fault in ("RuntimeError: CUDA error: unspecified launch failure",
                      "torch.AcceleratorError: CUDA error: unknown error",
                      "RuntimeError: GPU has fallen off the bus (Xid 79)",
                      "RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable"):
        assert classify(0, 1, None, gpu_fault, True).kind == INFRASTRUCTURE, gpu_fault  # retried, not stopped
    assert classify(0, 1, None, "ValueError: bad shape", True).kind == WORKLOAD
    assert classify(0, 1, None, "TrainingDiverged: the training loss is nan at step 7", True).kind == WORKLOAD
    assert classify(0, 2, None, "", False).kind == WORKLOAD  # an exit the program chose


def test_a_ranks_error_file_is_never_seen_half_written(tmp_path, monkeypatch):
    """The agent parses a failed rank's error file after SIGTERMing the rest; a rank killed while writing its
    own must leave no file (the agent then reports the exit) rather than an empty one, which crashes the agent."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from torch.distributed.elastic.multiprocessing.errors import error_handler as torch_handler

    from workloads.common.error_file import AtomicErrorHandler

    final = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(final))
    real_dump = json.dump
    seen_while_writing = []

    def dump_then_check(data, fp):
        fp.write("{")  # a first piece is out: a reader of the agent's path must not see it
        seen_while_writing.append(final.exists())
        fp.seek(0)
        real_dump(data, fp)

    monkeypatch.setattr(torch_handler.json, "dump", dump_then_check)
    try:
        raise RuntimeError("[gloo] Connection closed by peer")
    except RuntimeError as exc:
        AtomicErrorHandler().record_exception(exc)
    assert seen_while_writing == [False]
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(final))
    assert failure.message["message"] == "RuntimeError: [gloo] Connection closed by peer"

    final.unlink()

    def killed_mid_write(data, fp):
        fp.write("{")
        raise KeyboardInterrupt  # stands for the signal that ends the rank mid-write

    monkeypatch.setattr(torch_handler.json, "dump", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        AtomicErrorHandler().record_exception(RuntimeError("lost"))
    assert list(tmp_path.iterdir()) == []
    assert "SIGTERM" in ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(final)).message


def _attempt(n: int, ok: bool = False, kind: str = INFRASTRUCTURE, cause: str = "rank 1 killed by SIGKILL",
             run: int = 0, step: int = 10) -> list[dict]:
    end = {"event": "end", "attempt": n, "node": "a", "time": n + 0.5, "ok": ok}
    if not ok:
        end.update(kind=kind, cause=cause, run=run, step=step)
    return [{"event": "start", "attempt": n, "node": "a", "time": n}, end]


def test_retry_decisions():
    assert decide(_attempt(0, ok=True), 0, budget=3).exit_code == 0
    assert decide(_attempt(0), 0, budget=3).exit_code == EXIT_RETRY
    workload = decide(_attempt(0, kind=WORKLOAD, cause="rank 0: ValueError: x"), 0, budget=3)
    assert workload.exit_code == EXIT_WORKLOAD_ERROR and "workload error" in workload.message
    spent = decide(_attempt(0) + _attempt(1, step=20), 1, budget=1)
    assert spent.exit_code == EXIT_BUDGET_SPENT and "--max-restarts" in spent.message
    same = _attempt(0) + _attempt(1) + _attempt(2)
    assert decide(same, 2, budget=10).exit_code == EXIT_REPEATED_FAILURE
    moving = _attempt(0, step=10) + _attempt(1, step=30) + _attempt(2, step=50)
    assert decide(moving, 2, budget=10).exit_code == EXIT_RETRY
    lost = [{"event": "start", "attempt": 0, "node": "a", "time": 0}]  # the node died with its agent
    assert decide(lost, 0, budget=1).exit_code == EXIT_RETRY


@pytest.mark.parametrize("listed", ["newest first", "by name"])
def test_the_step_at_a_failure_is_the_newest_runs_where_modification_times_tie(tmp_path, monkeypatch, listed):
    """The agent records where a failure left the campaign: the run under way and its last step. On NFS or
    overlay file systems with 1 s times, the records' modification times tie, and directory order is any
    order (here the two worst: newest first, and by name, where run_9 sorts after run_10)."""
    import os

    from harness.agent import progress_at_failure

    for index in range(11):  # run 10 is under way; every earlier run stopped
        line = {"attempt": 0, "kind": "train", "start": 1.0, "end": 2.0, "steps": [0, 100 + index]}
        (tmp_path / f"run_{index}.jsonl").write_text(json.dumps(line) + "\n")
        os.utime(tmp_path / f"run_{index}.jsonl", (1_700_000_000, 1_700_000_000))
    glob = Path.glob

    def in_order(self, pattern):
        found = list(glob(self, pattern))
        if listed == "by name":
            return sorted(found)
        return sorted(found, key=lambda p: (len(p.name), p.name), reverse=True)  # run_10, run_9, ... run_0

    monkeypatch.setattr(Path, "glob", in_order)
    assert progress_at_failure(tmp_path) == (10, 110)
    (tmp_path / "run_notes.jsonl").write_text("")  # a name the campaign never writes is not a run
    assert progress_at_failure(tmp_path) == (10, 110)


def test_run_records_are_in_run_order(tmp_path):
    """The one order of a folder's run records (the step at a failure, the straggler named, the metrics' accounting):
    by run index as a number, and only the names a campaign writes."""
    from workloads.common.run_record import run_records

    for name in ("run_10.jsonl", "run_2.jsonl", "run_0.jsonl", "run_notes.jsonl", "run_3.jsonl.tmp"):
        (tmp_path / name).write_text("")
    assert list(run_records(tmp_path)) == [0, 2, 10]
    assert run_records(tmp_path)[10] == tmp_path / "run_10.jsonl"
    assert run_records(tmp_path / "absent") == {}


def test_a_command_torchrun_refuses_is_a_configuration_error_not_a_lost_node(tmp_path, monkeypatch, capsys):
    """The node agent with a torchrun option the image's torch does not take. Before, torchrun's parser exited 2
    after the attempt's start was recorded and before its end: every node read as lost, so the policy retried the
    job (Slurm's --decide) and blamed each node (Kubernetes' watcher, preflight's exclusions). Now the attempt ends
    with torchrun's reason as a configuration error: one line, exit 3, not retried (even by --restart-here), no
    node blamed."""
    import signal

    from harness import agent, blame
    from workloads.common.metrics_feed import METRICS_DIR_ENV

    monkeypatch.setenv(agent.NODE_ENV, "node-a")
    monkeypatch.delenv(METRICS_DIR_ENV, raising=False)  # the agent sets it for its workers
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        code = agent.main(["--out", str(tmp_path), "--max-restarts", "3", "--restart-here", "--metrics-port", "0",
                           "--", "--nproc-per-node=1", "--standalone", "--no-such-option", "-m", "workloads",
                           "resnet"])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    err = capsys.readouterr().err
    assert code == EXIT_WORKLOAD_ERROR
    assert _one_refusal_line(err, "unrecognized arguments: --no-such-option") and "configuration" in err
    records = agent.read_records(tmp_path)
    assert [(r["event"], r["attempt"]) for r in records] == [("start", 0), ("end", 0)]  # one attempt, ended
    assert records[1]["kind"] == blame.CONFIGURATION and "torchrun refused" in records[1]["cause"]
    assert blame.culprits(records) == {}
    assert decide(records, 0, budget=3).exit_code == EXIT_WORKLOAD_ERROR  # what Slurm's script asks


def test_torchrun_values_it_refuses_are_named():
    from harness.agent import torchrun_args

    with pytest.raises(ValueError, match="Unsupported nproc_per_node value: many"):
        torchrun_args(["--nproc-per-node=many", "--standalone", "-m", "workloads", "resnet"])
    with pytest.raises(ValueError, match="MIN:MAX"):
        torchrun_args(["--nnodes=1:2:3", "-m", "workloads", "resnet"])
    assert torchrun_args(["--nproc-per-node=2", "--standalone", "-m", "workloads", "resnet"]).max_restarts == 0


def test_a_worker_command_the_workload_refuses_is_a_configuration_error(tmp_path, monkeypatch, capfd):
    """A worker's refusal (a bad option, a preset without its input) reaches the agent through the worker's error
    file, as the real `python -m workloads` writes it: a configuration error with the worker's own line (a usage
    error was `rank 0 exited with code 2`, a workload error), never retried or blamed. A worker's real fault
    keeps its kind (test_failures_are_classified_by_what_failed)."""
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    import workloads.__main__ as worker
    from harness.agent import attempt_failure, worker_failure
    from harness.blame import CONFIGURATION

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    # Its faulthandler would point at this test's captured stderr for the rest of the session.
    monkeypatch.setattr(worker.error_handler, "initialize", lambda: None)
    for argv, said in ((["resnet", "--no-such-option"], "unrecognized arguments: --no-such-option"),
                       (["llama31_8b", "--preset", "full"], "give --data PATH")):
        monkeypatch.setattr(sys, "argv", ["workloads", *argv, "--out", str(tmp_path / "out")])
        assert worker.main() == 1
        assert _one_refusal_line(capfd.readouterr().err, said)
        failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
        verdict = worker_failure(0, failure)
        assert verdict.kind == CONFIGURATION and said in verdict.cause and "SystemExit" not in verdict.cause
        peer = classify(1, 1, None, "RuntimeError: [gloo] Connection closed by peer", True)
        assert attempt_failure([peer, verdict]) is verdict  # the cause, not the peer that lost it
        assert not (tmp_path / "out").exists()  # refused before anything was written
        error_file.unlink()
    # A refusal whose reason reads as the machine's (a data file's server gone) is retried as it was.
    assert classify(0, 1, None, "SystemExit: workloads: [Errno 111] Connection refused", True).kind == INFRASTRUCTURE


def test_a_refusal_of_a_worker_run_as_python_m_workloads_reads_as_the_jobs(tmp_path):
    """What torchrun's workers run: `python -m workloads` (workloads/__main__.py as __main__) still imports
    ConfigurationError from workloads.common.refusals, so its traceback names that module and the agent reads a
    configuration error, not another library's ConfigurationError (a workload error)."""
    import os
    import subprocess
    import sys

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from harness.agent import worker_failure

    error_file = tmp_path / "error.json"
    worker = subprocess.run([sys.executable, "-m", "workloads", "llama31_8b", "--preset", "full", "--out",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert worker.returncode == 1, worker.stderr
    traceback = json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"]
    assert "\nworkloads.common.refusals.ConfigurationError: python -m workloads: error: preset 'full'" in traceback
    verdict = worker_failure(0, ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file)))
    assert verdict.kind == "configuration" and "give --data PATH" in verdict.cause


def _one_refusal_line(err: str, said: str) -> bool:
    """Whether stderr holds the refusal as one line and no traceback (a warning elsewhere on stderr is fine)."""
    return "Traceback" not in err and sum(said in line for line in err.splitlines()) == 1


def test_only_a_refusal_the_same_on_every_node_is_a_configuration_error(tmp_path, monkeypatch):
    """A ConfigurationError (a usage error, a missing input, a plan's or layout's refusal, a starting checkpoint's
    content) is read by its qualified name in the traceback torch's ErrorHandler records, first: the text it quotes
    cannot make it the machine's. A plain refusal may be one node's (data_errors' missing file, refuse_unflushed's
    page cache): the workload's, as it was, unless its errno is a passing one (retried); a path or value reading
    "timeout" or "NCCL" in a refusal or an exception's quoted text is not the machine's word."""
    import errno
    import os

    from harness.blame import CONFIGURATION
    from workloads.common.data import data_errors
    from workloads.common.page_cache import refuse_unflushed
    from workloads.common.refusals import MACHINE_ERRNOS, PASSING_ERRNOS, ConfigurationError

    quoting = _recorded(ConfigurationError("workloads: /nfs/timeout_runs/NCCL/ckpt holds no optimizer state"),
                        tmp_path, monkeypatch)
    assert quoting.kind == CONFIGURATION and quoting.cause == "rank 0: workloads: /nfs/timeout_runs/NCCL/ckpt " \
                                                             "holds no optimizer state"
    for refusal in (SystemExit("workloads: /nfs/timeout_runs/NCCL/x.idx is truncated"),
                    SystemExit(refuse_unflushed(0, ["node-b: Permission denied writing /proc/sys/vm/drop_caches"]))):
        assert _recorded(refusal, tmp_path, monkeypatch).kind == WORKLOAD, refusal
    assert classify(0, 1, None, "ValueError: no column 'timeout' in '/data/nccl.parquet'", True).kind == WORKLOAD
    with pytest.raises(SystemExit) as missing, data_errors():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "/nfs/timeout/train.bin")
    assert not isinstance(missing.value, ConfigurationError)  # one node's mount may be missing
    assert _recorded(missing.value, tmp_path, monkeypatch).kind == WORKLOAD
    for number in sorted(PASSING_ERRNOS | MACHINE_ERRNOS):  # one list: what data_errors passes, classify retries
        with pytest.raises(OSError) as passing, data_errors():
            raise OSError(number, os.strerror(number), "/nfs/train.bin")
        assert _recorded(passing.value, tmp_path, monkeypatch).kind == INFRASTRUCTURE, passing.value


@pytest.mark.parametrize("module", ["omegaconf.errors", "some.lib"])
def test_another_librarys_configuration_error_is_the_workloads(tmp_path, monkeypatch, module):
    """Several libraries raise their own ConfigurationError, and the error file's message names only the type
    ("ConfigurationError: <text>"): it is the workload's error, told apart from ours by the module the traceback
    names. Without its traceback (an error file written by hand) nothing says it is ours either."""
    from workloads.common.refusals import ConfigurationError as Ours

    foreign = type("ConfigurationError", (Exception,), {"__module__": module})
    verdict = _recorded(foreign("missing key 'model.nccl_timeout'"), tmp_path, monkeypatch)
    assert verdict.kind == WORKLOAD and verdict.cause == "rank 0: ConfigurationError: missing key " \
                                                         "'model.nccl_timeout'"
    exiting = type("ConfigurationError", (SystemExit,), {"__module__": module})  # a SystemExit like ours
    assert _recorded(exiting("bad value"), tmp_path, monkeypatch).kind == WORKLOAD
    assert classify(0, 1, None, "ConfigurationError: bad value", True).kind == WORKLOAD
    assert _recorded(Ours("bad value"), tmp_path, monkeypatch).kind == "configuration"
    # A reason ending in blanks: the message is stripped, the traceback's line keeps them.
    assert _recorded(Ours("bad value, not 'nccl_timeout'  "), tmp_path, monkeypatch).kind == "configuration"


def _recorded(exc: BaseException, tmp_path, monkeypatch):
    """What the agent makes of a worker that failed with `exc`: raised, recorded in its error file by the handler
    the workers use (in the `except`, as `python -m workloads` does), and read back as torchelastic reads it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from harness.agent import worker_failure
    from workloads.common.error_file import AtomicErrorHandler

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise exc
    except BaseException as raised:  # noqa: B036 (SystemExit too: the workers record their refusals)
        AtomicErrorHandler().record_exception(raised)
    verdict = worker_failure(0, ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file)))
    error_file.unlink()
    return verdict


def test_checking_torchruns_arguments_leaves_no_log_folder(tmp_path, monkeypatch):
    """The check of torchrun's arguments runs its config_from_args on a copy, which made a /tmp/torchelastic_*
    log folder on every node at every attempt that nothing removed; torchrun's own run makes the one it uses."""
    import tempfile

    from harness.agent import torchrun_args

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    torchrun_args(["--nproc-per-node=2", "--standalone", "-m", "workloads", "resnet"])
    with pytest.raises(ValueError):
        torchrun_args(["--nproc-per-node=many", "--standalone", "-m", "workloads", "resnet"])
    assert list(tmp_path.iterdir()) == []


def test_option_parsing_names_the_choices():
    assert CheckpointEvery.parse("50") == CheckpointEvery(steps=50)
    assert CheckpointEvery.parse("10m") == CheckpointEvery(seconds=600)
    assert FaultPlan.parse("1:20") == FaultPlan(1, 20, "kill")
    assert FaultPlan.parse("0:5:corrupt").kind == "corrupt"
    for bad in ("x", "0", "5d", ""):
        with pytest.raises(ValueError, match="90s, 10m, 1h"):
            CheckpointEvery.parse(bad)
    for bad in ("1", "a:b", "1:2:melt", "1:0"):
        with pytest.raises(ValueError, match="--inject-failure"):
            FaultPlan.parse(bad)


def test_bad_resilience_options_are_one_line_errors(tmp_path):
    for args, expected in ((("--inject-failure", "1:x"), "RANK:STEP"), (("--checkpoint-every", "5d"), "10m"),
                           (("--keep-checkpoints", "0"), "at least 1"),
                           (("--inject-failure", "4:3", "--procs-per-node", "2"), "ranks 0 to 1")):
        result = harness("run", "resnet", "--out", str(tmp_path / "o"), *args)
        assert result.returncode == 2 and expected in result.stderr and "Traceback" not in result.stderr


# --- goodput accounting --------------------------------------------------------------------------------

def test_goodput_splits_the_wall_time(tmp_path):
    """Attempt 0 trains steps 1-20 (checkpoint at 10), dies at step 20; attempt 1 restores step 10 and finishes."""
    t0 = 1000.0
    lines = [
        {"attempt": 0, "kind": "startup", "start": t0, "end": t0 + 1},
        {"attempt": 0, "kind": "train", "start": t0 + 1, "end": t0 + 11, "steps": [1, 10]},
        {"attempt": 0, "kind": "save", "start": t0 + 11, "end": t0 + 12, "steps": [10, 10]},
        {"attempt": 0, "kind": "train", "start": t0 + 12, "end": t0 + 22, "steps": [11, 20]},
        {"attempt": 0, "kind": "fault", "start": t0 + 23, "end": t0 + 23, "steps": [21, 21]},
        {"attempt": 1, "kind": "startup", "start": t0 + 26, "end": t0 + 30},
        {"attempt": 1, "kind": "restore", "start": t0 + 30, "end": t0 + 32, "steps": [10, 10]},
        {"attempt": 1, "kind": "train", "start": t0 + 32, "end": t0 + 52, "steps": [11, 30]},
        {"attempt": 1, "kind": "eval", "start": t0 + 52, "end": t0 + 54, "steps": [30, 30]},
    ]
    (tmp_path / "run_0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + "{cut")
    (tmp_path / "attempts.jsonl").write_text(json.dumps({"event": "end", "attempt": 0, "time": t0 + 24,
                                                         "ok": False, "run": 0, "step": 21}) + "\n")
    got = account(tmp_path / "result_0.txt", t0 * 1000, (t0 + 55) * 1000)
    assert got.restarts == 1
    # Kept: steps 1-10 (10 s), 11-30 in attempt 1 (20 s) and the eval (2 s) = 32 s of 55.
    assert got.goodput == pytest.approx(32 / 55)
    assert got.badput == {"startup": 5.0, "compile": 0.0, "save": 1.0, "restore": 2.0, "lost": 11.0, "recovery": 3.0,
                          "other": 1.0, "preflight": 0.0, "warmup": 0.0}
    assert account(tmp_path / "elsewhere.txt", 0, 1) is None  # not a harness result file: nothing guessed


def test_goodput_shows_the_warm_up_and_the_compile_apart(tmp_path):
    """A warm-up of 6 s before run_start is off the clock but on the job's time (as preflight); the first step's
    3 s of compiling, and 1 s of a restarted attempt's (lost work's share excluded), are compile badput, not
    training."""
    t0 = 1000.0
    lines = [
        {"attempt": 0, "kind": "warm_up", "start": t0 - 7, "end": t0 - 1, "train_steps": 2, "compile_s": 5.5},
        {"attempt": 0, "kind": "startup", "start": t0, "end": t0},
        {"attempt": 0, "kind": "train", "start": t0, "end": t0 + 4, "steps": [1, 1], "compile_s": 3.0},
        {"attempt": 0, "kind": "train", "start": t0 + 4, "end": t0 + 14, "steps": [2, 11]},
        {"attempt": 0, "kind": "save", "start": t0 + 14, "end": t0 + 15, "steps": [11, 11]},
        {"attempt": 1, "kind": "startup", "start": t0 + 16, "end": t0 + 18},
        {"attempt": 1, "kind": "restore", "start": t0 + 18, "end": t0 + 19, "steps": [11, 11]},
        {"attempt": 1, "kind": "train", "start": t0 + 19, "end": t0 + 21, "steps": [12, 12], "compile_s": 1.0},
        {"attempt": 1, "kind": "train", "start": t0 + 21, "end": t0 + 30, "steps": [13, 21]},
    ]
    (tmp_path / "run_0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    got = account(tmp_path / "result_0.txt", t0 * 1000, (t0 + 30) * 1000)
    assert got.badput["compile"] == 4.0 and got.badput["warmup"] == 6.0
    # Kept: 1 s of step 1 (its 3 s compiling apart), 10 s of steps 2-11, 1 + 9 s in attempt 1: 21 s of 30 + 6.
    assert got.goodput == pytest.approx(21 / 36)


# --- the checkpointer in one process ------------------------------------------------------------------

def _model_state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"weights": torch.randn(64, 64), "bias": torch.randn(64)}


def test_checkpoints_commit_atomically_keep_k_and_skip_damage(one_rank_world, tmp_path):
    from workloads.common.checkpoint import MANIFEST, PARTIAL, Checkpointer

    reports: list[str] = []
    ckpt = Checkpointer(tmp_path, one_rank_world, keep=2, report=reports.append)
    for step in (10, 20, 30):
        ckpt.save(step, _model_state(step), {"scheduler": {"last_epoch": step}})
    assert [s for s, _ in ckpt.committed()] == [30, 20]  # keep-last-2
    manifest = json.loads((tmp_path / "step_000000030" / MANIFEST).read_text())
    assert manifest["step"] == 30 and ".metadata" in manifest["files"] and manifest["extra"]["scheduler"]
    # An interrupted write (no manifest, not renamed) is not a checkpoint.
    (tmp_path / f"{PARTIAL}step_000000040").mkdir()
    state = _model_state(0)
    restored = ckpt.restore(lambda manifest: state)
    assert restored.step == 30 and torch.equal(state["weights"], _model_state(30)["weights"])
    # Damage the newest: it is reported and the one before is used.
    shard = next((tmp_path / "step_000000030").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    restored = ckpt.restore(lambda manifest: state)
    assert restored.step == 20 and torch.equal(state["weights"], _model_state(20)["weights"])
    assert any("step_000000030 is damaged" in r and "checksum" in r for r in reports)
    (tmp_path / "step_000000020" / MANIFEST).unlink()
    assert ckpt.restore(lambda manifest: state) is None and any("no manifest.json" in r for r in reports)


def test_async_save_commits_in_the_background(one_rank_world, tmp_path):
    from workloads.common.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path, one_rank_world, keep=3, async_save=True)
    ckpt.save(5, _model_state(5), {"scheduler": {}})
    ckpt.wait()
    assert [s for s, _ in ckpt.committed()] == [5]
    state = _model_state(0)
    assert ckpt.restore(lambda manifest: state).step == 5 and torch.equal(state["bias"], _model_state(5)["bias"])


# --- real faults in real runs (2 ranks, gloo) ---------------------------------------------------------------

def _records(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines() if line.strip()]


def _restored_step(out: Path, attempt: int = 1) -> int | None:
    return next((r["steps"][0] for r in _records(out, "run_0.jsonl")
                 if r["attempt"] == attempt and r["kind"] == "restore"), None)


@pytest.mark.slow
def test_inject_failure_restarts_and_reports_goodput(tmp_path):
    """The issue's done-when: a killed rank, a restart, a compliant log, restarts >= 1, 0 < goodput < 1."""
    out = tmp_path / "run"
    result = harness("run", "resnet", "--inject-failure", "1:20", "--out", str(out), "--seed", "11")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "attempt 0 failed (run 1, step 20): rank 1 killed by SIGKILL" in result.stderr
    checked = compliance(out / "result_0.txt", "4.0.0", cwd=tmp_path)
    assert checked.returncode == 0 and not failed_checks(checked), checked.stdout + checked.stderr
    [run] = json.loads(harness("report", str(out), "--format", "json").stdout)[0]["runs"]
    assert run["status"] == "success" and run["restarts"] >= 1 and 0 < run["goodput"] < 1
    assert run["badput"]["recovery"] > 0 and run["badput"]["startup"] > 0
    text = (out / "result_0.txt").read_text()
    assert text.count('"key": "run_start"') == 1 and text.count('"key": "run_stop"') == 1
    assert not (out / "checkpoints" / "run_0").exists()  # a stopped run's checkpoints are gone


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(3))
def test_a_rank_killed_at_a_random_step_loses_at_most_one_interval(tmp_path, trial):
    rng = random.Random(1000 + trial)
    every, rank, step = 5, rng.randrange(2), rng.randint(3, 28)
    out = tmp_path / "run"
    result = harness("run", "resnet", "--inject-failure", f"{rank}:{step}", "--checkpoint-every", str(every),
                     "--max-steps", "30", "--out", str(out), "--seed", str(trial))
    assert json.loads((out / "job.json").read_text())["state"] == "SUCCEEDED", result.stdout + result.stderr
    assert load([out]).records[0].status is not None  # run_stop is logged: the run finished
    restored = _restored_step(out) or 0
    assert step - restored <= every, (step, restored)
    attempts = [r for r in _records(out, "attempts.jsonl") if r["event"] == "end"]
    assert [r["ok"] for r in attempts] == [False, True] and attempts[0]["step"] == step


@pytest.mark.slow
def test_a_kill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path):
    """Armed at step 7, between saves: rank 1 dies writing step 10's checkpoint, which every rank takes (a rank
    starting a save alone would hang the others)."""
    out = tmp_path / "run"
    result = harness("run", "resnet", "--inject-failure", "1:7:kill-in-save", "--checkpoint-every", "5",
                     "--max-steps", "20", "--out", str(out))
    assert json.loads((out / "job.json").read_text())["state"] == "SUCCEEDED", result.stdout + result.stderr
    assert _restored_step(out) == 5  # step 10's checkpoint was never committed


@pytest.mark.slow
def test_a_corrupt_checkpoint_is_detected_and_the_one_before_used(tmp_path):
    out = tmp_path / "run"
    result = harness("run", "resnet", "--inject-failure", "0:12:corrupt", "--checkpoint-every", "5",
                     "--max-steps", "20", "--out", str(out))
    assert json.loads((out / "job.json").read_text())["state"] == "SUCCEEDED", result.stdout + result.stderr
    assert "step_000000010 is damaged and skipped" in result.stdout
    assert _restored_step(out) == 5


@pytest.mark.slow
def test_a_workload_exception_is_not_retried(tmp_path):
    out = tmp_path / "run"
    result = harness("run", "resnet", "--inject-failure", "1:5:exception", "--out", str(out))
    assert result.returncode == EXIT_WORKLOAD_ERROR, result.stdout + result.stderr
    assert "InjectedFault: injected workload error at step 5" in result.stderr
    assert "workload error" in result.stderr and "not retried" in result.stderr
    ends = [r for r in _records(out, "attempts.jsonl") if r["event"] == "end"]
    assert len(ends) == 1 and ends[0]["kind"] == WORKLOAD


@pytest.mark.slow
def test_no_restarts_left_stops_with_its_own_exit_code(tmp_path):
    out = tmp_path / "run"
    result = harness("run", "resnet", "--inject-failure", "0:3", "--max-restarts", "0", "--out", str(out))
    assert result.returncode == EXIT_BUDGET_SPENT, result.stdout + result.stderr
    assert "restart budget (0) is spent" in result.stderr
    assert (out / "result_0.txt").is_file()  # what was written stays


def _loss_check_rank(rank: int, port: int, losses: list, results) -> None:
    from workloads.common.distributed import DistContext
    from workloads.common.resilience import finite_everywhere

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ctx = DistContext(rank=rank, world_size=2, local_rank=rank, local_world_size=2, device=torch.device("cpu"))
    results.put((rank, [finite_everywhere(loss, ctx) for loss in losses[rank]]))
    dist.destroy_process_group()


def test_a_loss_that_diverges_on_one_rank_stops_every_rank():
    """Rank 1's loss turns NaN at the second read: both ranks learn it there, so neither goes on alone into a
    collective the other never enters."""
    import torch.multiprocessing as mp

    port = free_port()
    results = mp.get_context("spawn").SimpleQueue()
    losses = [[2.0, 1.5, 1.2], [2.1, float("nan"), 1.3]]
    mp.start_processes(_loss_check_rank, args=(port, losses, results), nprocs=2, start_method="spawn")
    got = dict(results.get() for _ in range(2))
    assert got == {0: [True, False, True], 1: [True, False, True]}
