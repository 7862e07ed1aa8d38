"""The campaign plan (harness.campaign_plan): runs, spares and wall time decided once, filled in as defaults, and
what a request lacks refused before anything is submitted, listed by a dry run, and gated by --dry-run --strict."""

from __future__ import annotations

import json

import pytest

from harness import campaign_plan, profiles
from harness.cache_flush import unflushed_note
from harness.errors import HarnessError
from harness.spec import JobSpec
from tests.conftest import harness, training_job

CLOSED_64 = ("llama31_8b", "--profile", "coreweave-h100", "--nodes", "64", "--preset", "full")


@pytest.fixture
def c4(tmp_path):
    """A dataset folder Slurm's nodes see as it is here: the profile without its image (no container mounts)."""
    (tmp_path / "c4").mkdir()
    return ("--data", str(tmp_path / "c4"), "--set", "image=")


def test_a_closed_preset_runs_the_rules_count_unless_told_and_a_smaller_count_is_said_once(tmp_path, c4):
    """mlperf-logging's result counts (what `harness export` checks a package against): 10 for llama31_8b, 5 for
    resnet; an open (tiny) preset, or one on synthetic input (a throughput run), runs once. The line is said once,
    on stderr."""
    assert campaign_plan.default_runs("llama31_8b", "full") == 10 and campaign_plan.default_runs("resnet", "full") == 5
    assert campaign_plan.default_runs("llama31_8b", "tiny") == 1
    assert campaign_plan.default_runs("llama31_8b", "full", synthetic=True) == 1
    args = ("run", *CLOSED_64, *c4, "--backend", "slurm", "--dry-run", "--out", str(tmp_path / "o"))
    default = harness(*args)
    assert default.returncode == 0, default.stderr
    assert default.stderr.count("closed llama31_8b runs 10 times, the count MLPerf's rules require") == 1
    assert "--runs 10 " in default.stdout and 'seq 0 9' in default.stdout
    fewer = harness(*args, "--runs", "3")
    assert fewer.stderr.count("closed llama31_8b needs 10 runs for a result; this campaign does 3") == 1
    assert "rules require" not in harness("run", "resnet", "--dry-run", "--out", str(tmp_path / "t")).stderr


def test_spares_default_from_the_profile_and_fewer_are_refused_listed_and_gated(tmp_path, c4):
    """coreweave-h100 asks 3% spares above 16 nodes: 64 closed nodes with preflight allocate 66 on Slurm. Asking
    for none is refused before anything is submitted, in one line naming both fixes; a dry run prints the request and
    lists the problem (exit 0), and exits 1 under --strict."""
    args = ("run", *CLOSED_64, *c4, "--backend", "slurm", "--out", str(tmp_path / "o"))
    shown = harness(*args, "--dry-run")
    assert shown.returncode == 0 and "#SBATCH --nodes=66" in shown.stdout and "problem" not in shown.stderr
    refused = harness(*args, "--spare-nodes", "0")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and not (tmp_path / "o").exists()
    [line] = refused.stderr.strip().splitlines()
    assert "asks for 2 spare node(s) for a closed allocation of 64 nodes" in line
    assert "give --spare-nodes 2, or --set preflight.spare_share=0" in line
    listed = harness(*args, "--spare-nodes", "0", "--dry-run")
    assert listed.returncode == 0 and "#SBATCH --nodes=64" in listed.stdout
    assert f"harness: problem: {line.removeprefix('harness: error: ')}" in listed.stderr
    assert harness(*args, "--spare-nodes", "0", "--dry-run", "--strict").returncode == 1
    # Below the profile's size, open presets, and runs without preflight ask none.
    spec = JobSpec("llama31_8b", preset="full", nodes=16, preflight=True, profile=profiles.load("coreweave-h100"))
    assert campaign_plan.asked_spares(spec) == 0
    assert harness("run", *CLOSED_64[:5], "--backend", "slurm", "--dry-run", "--preset", "tiny",
                   "--out", str(tmp_path / "t")).stdout.count("#SBATCH --nodes=64") == 1
    assert "--strict gates a --dry-run" in harness(*args, "--strict").stderr


def test_slurm_time_comes_from_the_plan_and_a_shorter_profile_time_is_refused(tmp_path, c4):
    """Without slurm.time the script asks for the plan's wall time: preflight's phase (deadline + start allowance),
    then each run's init allowance and its expected time-to-train (the benchmark's cited GPU-minutes over the job's
    GPUs, times a margin), rounded up to 15 minutes. A profile time shorter than that is refused, naming the time
    that fits; --run-minutes changes the plan."""
    spec = JobSpec("llama31_8b", preset="full", nodes=64, runs=10, preflight=True,
                   profile=profiles.load("coreweave-h100"))
    minutes, parts = campaign_plan.campaign_minutes(spec)
    per_run = campaign_plan.RUN_MARGIN * 2_672 / 512  # NVIDIA v5.1's GPU-minutes over 512 GPUs, times the margin
    assert minutes == pytest.approx(30 + 10 * (campaign_plan.INIT_MINUTES + per_run))
    assert parts == "preflight 30 min + 10 run(s) x (10 min init + 16 min to train)"
    args = ("run", *CLOSED_64, *c4, "--backend", "slurm", "--out", str(tmp_path / "o"))
    planned = harness(*args, "--dry-run")
    assert campaign_plan.slurm_time(minutes) == "05:00:00" and "#SBATCH --time=05:00:00" in planned.stdout
    assert "note: --time=05:00:00 from the campaign's plan" in planned.stderr
    assert "#SBATCH --time=07:15:00" in harness(*args, "--dry-run", "--run-minutes", "30").stdout  # 30 + 10 x 40
    refused = harness(*args, "--set", "slurm.time=02:00:00")
    assert refused.returncode == 2 and not (tmp_path / "o").exists()
    assert "slurm.time 02:00:00 is shorter than the campaign's plan, 05:00:00" in refused.stderr
    assert "--set slurm.time=05:00:00" in refused.stderr
    assert harness(*args, "--set", "slurm.time=02:00:00", "--dry-run", "--strict").returncode == 1
    assert harness(*args, "--set", "slurm.time=1-00:00:00", "--dry-run", "--strict").returncode == 0


@pytest.mark.parametrize("text, minutes", [("90", 90), ("90:30", 90.5), ("02:00:00", 120), ("1-0", 1440),
                                           ("1-02:30", 1590), ("2-00:00:30", 2880.5), ("UNLIMITED", None)])
def test_slurm_time_forms(text, minutes):
    assert campaign_plan.parse_slurm_time(text) == minutes


def test_slurm_time_rounds_up_and_counts_days():
    assert campaign_plan.slurm_time(61) == "01:15:00" and campaign_plan.slurm_time(1500) == "1-01:00:00"
    with pytest.raises(HarnessError, match="not a Slurm time"):
        campaign_plan.parse_slurm_time("two hours")


def test_the_full_preset_without_data_is_refused_and_a_strict_dry_run_fails(tmp_path):
    """The issue's first find: a full preset's dry run without --data exited 0 with a note. It still prints the
    request (to review), lists the problem, and fails under --strict; a submit is refused."""
    args = ("run", "llama31_8b", "--preset", "full", "--backend", "k8s", "--profile", "coreweave-h100", "--nodes",
            "64", "--out", str(tmp_path / "o"))
    listed = harness(*args, "--dry-run")
    assert listed.returncode == 0 and training_job(listed.stdout)["kind"] == "PyTorchJob"
    assert "harness: problem: preset 'full' trains on the real dataset: give --data PATH" in listed.stderr
    assert harness(*args, "--dry-run", "--strict").returncode == 1
    refused = harness(*args)
    assert refused.returncode == 2 and "give --data PATH" in refused.stderr and not (tmp_path / "o").exists()


def test_runs_that_went_unflushed_are_said_once_with_the_setting_that_fixes_them(tmp_path):
    for run in range(3):
        (tmp_path / f"run_{run}.jsonl").write_text(json.dumps(
            {"kind": "cache_clear", "cleared": run == 0, "by": ["host"],
             **({} if run == 0 else {"why_not": ["node1: host flush failed (sync && echo 3 > /proc/sys/vm/"
                                                 "drop_caches): Permission denied"]})}) + "\n")
    note = unflushed_note(tmp_path, "slurm")
    assert note.startswith("note: the page cache was not flushed before 2 run(s) (run 2: node1: host flush failed")
    assert "--set slurm.flush_page_cache='sudo /sbin/sysctl vm.drop_caches=3'" in note
    assert "kubernetes.flush_page_cache=true" in unflushed_note(tmp_path, "k8s")
    (tmp_path / "run_1.jsonl").unlink()
    (tmp_path / "run_2.jsonl").unlink()
    assert unflushed_note(tmp_path, "slurm") is None
