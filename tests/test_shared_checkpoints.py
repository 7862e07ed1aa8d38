"""Checkpoint decisions that every rank shares: when to save, and what to resume from.

Each test starts real gloo ranks in fresh processes and gives them a deadline, so a
disagreement shows as a failure (a hang or different answers), never as a stuck suite.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import free_port
from workloads.common.run_record import read_json_lines

DEADLINE_S = 120.0


def run_ranks(target, world: int, folder: Path, *args) -> list[dict]:
    """Run target(ctx, folder, *args) on `world` gloo ranks; each returns a JSON-able dict (rank order)."""
    port, spawn = free_port(), multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=_rank_main, args=(target, rank, world, port, folder, args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + DEADLINE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert not hung, f"ranks {hung} still running after {DEADLINE_S:.0f} s: the ranks disagreed and hung"
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world)]


def _rank_main(target, rank: int, world: int, port: int, folder: Path, args: tuple) -> None:
    from workloads.common.distributed import DistContext, shutdown_distributed

    # A short collective timeout: a rank waiting for a collective its peers never enter fails fast.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=DEADLINE_S / 2))
    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
                      device=torch.device("cpu"))
    result = target(ctx, folder, *args)
    shutdown_distributed()
    (folder / f"rank{rank}.json").write_text(json.dumps(result))


class _TinyWorkload:
    """What Resilience checkpoints: a model, its optimizer and scheduler (see campaign.Workload)."""

    compiled = False  # Workload.compiled: not under torch.compile

    def __init__(self, ctx):
        self.ctx = ctx
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)

    def position(self) -> dict:
        return {}

    def load_position(self, position: dict) -> None:
        pass

    def step(self) -> None:
        """One data-parallel step: the gradient all-reduce is the collective a wrong save decision meets."""
        self.optimizer.zero_grad()
        self.model(torch.ones(4, 8)).sum().backward()
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
        self.optimizer.step()
        self.scheduler.step()


# --- 1. when to save: one clock decides ---------------------------------------------------------------------

def _train_with_wall_clock_saves(ctx, folder: Path, late_start_s: float, step_s: list[float]) -> dict:
    from workloads.common.mlperf import ResultLog
    from workloads.common.resilience import Resilience

    workload = _TinyWorkload(ctx)
    time.sleep(late_start_s * ctx.rank)  # this rank's clock starts later than rank 0's
    support = Resilience(workload, folder, 0, "1s", keep=2, async_save=False, inject_failure=None,
                         mlog=ResultLog(None))
    saved: list[int] = []
    save = support.checkpointer.save
    support.checkpointer.save = lambda step, *a: (saved.append(step), save(step, *a))[1]
    step = support.restore()
    while step < 50:
        workload.step()
        time.sleep(step_s[ctx.rank])  # and it runs at another speed
        step += 1
        support.after_step(step)
    support.finish()
    return {"saved": saved}


def test_wall_clock_saves_are_agreed_by_every_rank(tmp_path):
    """Rank 1 starts 0.6 s later and is slower: with each rank on its own clock they save at different steps
    and hang (one in the save's barrier, the other in the next all-reduce)."""
    ranks = run_ranks(_train_with_wall_clock_saves, 2, tmp_path, 0.6, [0.04, 0.07])
    assert ranks[0]["saved"] == ranks[1]["saved"] and len(ranks[0]["saved"]) >= 2, ranks


# --- 2. shared file systems ------------------------------------------------------------------------------------

def _checkpointers_of_two_runs(ctx, folder: Path) -> dict:
    from workloads.common.checkpoint import Checkpointer

    first, second = Checkpointer(folder / "run_0", ctx), Checkpointer(folder / "run_1", ctx)
    return {"one_group": first.group is second.group}


def test_every_run_of_a_process_shares_one_checkpoint_group(tmp_path):
    """A gloo group is a full mesh of TCP connections: one per process, not one per run."""
    assert all(rank["one_group"] for rank in run_ranks(_checkpointers_of_two_runs, 2, tmp_path))


def _save_with_a_result_log(ctx, folder: Path) -> dict:
    import os

    from mlperf_logging.mllog import constants as C

    from workloads.common.mlperf import ResultLog
    from workloads.common.resilience import Resilience

    mlog = ResultLog(folder / "result_0.txt")
    mlog.start(C.RUN_START)
    synced, fsync = [], os.fsync
    os.fsync = lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1]
    workload = _TinyWorkload(ctx)
    support = Resilience(workload, folder, 0, "3", keep=2, async_save=False, inject_failure=None, mlog=mlog)
    for step in range(1, support.restore() + 4):
        workload.step()
        support.after_step(step)
    os.fsync = fsync
    return {"synced": synced}


def test_the_result_log_is_on_disk_before_its_checkpoint(tmp_path):
    [rank] = run_ranks(_save_with_a_result_log, 1, tmp_path)
    synced = [Path(p).name for p in rank["synced"]]
    assert "result_0.txt" in synced and synced.index("result_0.txt") < synced.index("manifest.json"), synced


def _resume_with_a_stale_listing(ctx, folder: Path) -> dict:
    from workloads.common.checkpoint import Checkpointer

    checkpointer = Checkpointer(folder, ctx)
    for step in (10, 20):
        checkpointer.save(step, {"weights": torch.full((4,), float(step))}, {})
    if ctx.rank == 1:  # this node's directory cache has not seen step 20 yet
        listed = checkpointer.committed()
        checkpointer.committed = lambda: [(step, path) for step, path in listed if step != 20]
    state = {"weights": torch.zeros(4)}
    restored = checkpointer.restore(lambda manifest: state)
    return {"step": restored.step, "weights": state["weights"].tolist()}


def test_every_rank_resumes_from_rank_0s_choice(tmp_path):
    ranks = run_ranks(_resume_with_a_stale_listing, 2, tmp_path)
    assert ranks == [{"step": 20, "weights": [20.0] * 4}] * 2


# --- cache_clear: the log tells the truth ------------------------------------------------------------------------

def _clear_page_caches(ctx, folder: Path, control: str) -> dict:
    from workloads.common.page_cache import clear_page_caches

    flushes = clear_page_caches(ctx, folder, folder / control.format(rank=ctx.rank))
    return {"not_dropped": [f.problem for f in flushes if f.problem], "by": [f.by for f in flushes]}


def test_the_page_cache_is_dropped_once_per_node(tmp_path):
    for rank in range(2):
        (tmp_path / f"drop_caches{rank}").write_text("")
    ranks = run_ranks(_clear_page_caches, 2, tmp_path, "drop_caches{rank}")
    assert ranks == [{"not_dropped": [], "by": ["worker"]}] * 2  # one node, which flushed from its worker
    # Both ranks are on one node here (local ranks 0 and 1): only local rank 0 drops it.
    assert [(tmp_path / f"drop_caches{rank}").read_text() for rank in range(2)] == ["3\n", ""]


def test_a_node_that_cannot_drop_the_page_cache_says_so(tmp_path, capfd):
    ranks = run_ranks(_clear_page_caches, 2, tmp_path, "read-only/drop_caches")
    [why] = ranks[0]["not_dropped"]
    assert ranks[1] == ranks[0] and "cannot write" in why and "read-only/drop_caches" in why
    err = capfd.readouterr().err
    assert err.count("was not dropped") == 1 and "the run logs cache_clear false" in err, err


@pytest.mark.parametrize("command, recorded", [("true", "flushed"),
                                               ("echo 3 > /nonexistent/drop_caches", "host flush failed")])
def test_the_host_flush_step_records_what_it_did_for_the_run_to_take(tmp_path, command, recorded):
    """The launchers' per-node step (workloads.common.page_cache.host_flush_script, outside the container) leaves
    its node's record in the run folder; the node's first run takes it (so no in-container flush is needed when it
    flushed), the next run finds none and flushes itself, and a failed host flush is named with the container's."""
    import platform

    from workloads.common.page_cache import flush_node, host_flush_script

    out = tmp_path / "run folder's"  # quoted in the script
    done = subprocess.run(["bash", "-c", host_flush_script(str(out), command)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    record = out / "page_cache" / platform.node()
    assert record.read_text().startswith(recorded)
    control = tmp_path / "read-only" / "drop_caches"  # the container cannot flush
    flush = flush_node(out, control)
    why = flush.problem
    assert not record.exists()  # taken
    if recorded == "flushed":
        assert why is None and flush.by == "host"
        after = flush_node(out, control)  # the next run of the same launch: no record left
        assert after.by == "worker" and "cannot write" in after.problem
    else:
        assert flush.by == "worker" and why.startswith("host flush failed (echo 3 > /nonexistent/drop_caches): ") and \
            "No such file or directory" in why and why.endswith(f"in the container: cannot write {control}: "
                                                                "No such file or directory")


def test_for_a_flush_before_each_run_a_campaign_told_its_run_does_it_and_no_later_one(tmp_path, monkeypatch, one_process_world):
    """--last-run i (Slurm's batch script: one step per run, each after its own flush): the finished runs before
    i are skipped, an unfinished one is done first, and the campaign stops after run i, leaving the next run for
    the next step. A --last-run outside the campaign is refused in one line."""
    from types import SimpleNamespace

    from workloads.common import campaign

    seeds = []

    class Stub:  # a workload that records its run (by its seed) and trains nothing
        compiled = False  # so no warm-up (--warm-up auto)

        def __init__(self, opts, ctx, seed):
            seeds.append(seed)

        def hyperparameters(self):
            return {}

        def open_data(self):
            return {}

        def close(self):
            pass

    monkeypatch.setattr(campaign, "Resilience", lambda *a: SimpleNamespace(finish=lambda: None))
    monkeypatch.setattr(campaign, "train", lambda *a: True)
    argv = ["resnet", "--out", str(tmp_path), "--runs", "3", "--seed", "10", "--straggler-window", "0"]
    campaign.run_campaign(Stub, campaign.RunOptions.parse([*argv, "--last-run", "1"]))
    assert seeds == [10, 11] and not (tmp_path / "result_2.txt").exists()
    campaign.run_campaign(Stub, campaign.RunOptions.parse([*argv, "--last-run", "2"]))
    assert seeds == [10, 11, 12]  # runs 0 and 1 stopped: skipped
    with pytest.raises(SystemExit) as refused:  # a refusal with its line (workloads.__main__ prints and records it)
        campaign.RunOptions.parse([*argv, "--last-run", "3"])
    assert "--last-run 3 is not one of the campaign's runs: 0 to 2 (--runs 3)" in refused.value.code


class _Constructed(Exception):
    """The campaign went past cache_clear to build the workload."""


def _closed_run_without_a_flush(ctx, folder: Path, allow: bool) -> dict:
    from workloads.common import page_cache
    from workloads.common.campaign import RunOptions, run_campaign

    def workload(*args):
        raise _Constructed

    page_cache.DROP_CACHES = folder / "read-only" / "drop_caches"  # an unprivileged container
    options = RunOptions(benchmark="gpt3", preset="full", out=folder, runs=1, seed=1, submitter="t", system="s",
                         data=None, synthetic=False, max_steps=None, batch_size=None, allow_unflushed_cache=allow)
    try:
        run_campaign(workload, options)
    except SystemExit as exc:
        return {"stopped": exc.code}
    except _Constructed:
        return {"went_ahead": True}
    return {}


@pytest.mark.parametrize("allow", [False, True])
def test_a_closed_run_that_could_not_flush_stops_unless_accepted(tmp_path, allow):
    """A closed run whose page cache was not flushed stops before init_start with the reason; with
    --allow-unflushed-cache it goes ahead. Either way the log's cache_clear is false and the run record says why."""
    from workloads.common.mllog_reader import iter_events

    [rank] = run_ranks(_closed_run_without_a_flush, 1, tmp_path, allow)
    events = [(e["key"], e["value"]) for e in iter_events((tmp_path / "result_0.txt").read_bytes())]
    assert events[0] == ("cache_clear", False)
    [noted] = [r for r in read_json_lines(tmp_path / "run_0.jsonl") if r["kind"] == "cache_clear"]
    assert noted["cleared"] is False and noted["accepted"] is allow and "cannot write" in noted["why_not"][0]
    if allow:
        assert rank == {"went_ahead": True}
    else:
        assert rank["stopped"].startswith("workloads: closed run 1 stops before init_start: MLPerf's rules require "
                                          "flushing the page cache before each run, and it was not flushed (")
        assert "--allow-unflushed-cache" in rank["stopped"] and "\n" not in rank["stopped"]
        assert ("init_start", None) not in events
