"""`harness compare`: the CI regression verdict."""

from __future__ import annotations

import json
from pathlib import Path

from workloads.common.mllog_reader import MARKER
from tests.conftest import REPO, harness

BASELINE = REPO / "results" / "baselines" / "resnet-tiny"


def retimed_copy(src: Path, dst: Path, minutes: float) -> Path:
    """Copy a run folder's logs with every run's time-to-train set to `minutes`."""
    dst.mkdir(parents=True)
    for log in sorted(src.glob("result_*.txt")):
        lines, start = [], None
        for line in log.read_bytes().splitlines():
            at = line.find(MARKER)
            if at >= 0:
                event = json.loads(line[at + len(MARKER):])
                if event["key"] == "run_start":
                    start = event["time_ms"]
                elif event["key"] == "run_stop":
                    event["time_ms"] = start + minutes * 60000
                line = MARKER + json.dumps(event).encode()
            lines.append(line)
        (dst / log.name).write_bytes(b"\n".join(lines) + b"\n")
    return dst


def test_a_run_passes_against_itself(tiny_campaign):
    out, _ = tiny_campaign
    result = harness("compare", str(out), str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resnet: pass" in result.stdout and "+0.0%" in result.stdout


def test_a_30_percent_slower_copy_regresses(tiny_campaign, tmp_path):
    # Two real runs can differ by 20% or more, which compare rightly counts as noise; a baseline whose runs
    # all take the same time isolates the 30% slowdown the test is about.
    out, _ = tiny_campaign
    base = retimed_copy(out, tmp_path / "base", 0.5)
    slow = retimed_copy(out, tmp_path / "slow", 0.65)
    result = harness("compare", str(base), str(slow), "--max-slowdown", "10")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "resnet: REGRESSION" in result.stdout and "+30.0%" in result.stdout


def test_noise_widens_the_limit(tmp_path):
    from tests.test_results import write_run

    base, cand = tmp_path / "base", tmp_path / "cand"
    base.mkdir(), cand.mkdir()
    for i, minutes in enumerate([1.0, 1.2]):  # 20% run-to-run spread
        write_run(base / f"result_{i}.txt", minutes, accuracy=0.76)
    write_run(cand / "result_0.txt", 1.25, accuracy=0.76)  # median 1.1 -> +13.6%: inside 10% + 18% noise
    assert harness("compare", str(base), str(cand), "--max-slowdown", "10").returncode == 0
    write_run(cand / "result_0.txt", 1.25, accuracy=0.70)  # below the closed target: did not converge
    result = harness("compare", str(base), str(cand))
    assert result.returncode == 1 and "did not converge" in result.stdout


def test_unusable_input_exits_2(tiny_campaign, tmp_path):
    out, _ = tiny_campaign
    assert harness("compare", str(tmp_path / "missing"), str(out)).returncode == 2
    (tmp_path / "empty").mkdir()
    result = harness("compare", str(out), str(tmp_path / "empty"))
    assert result.returncode == 2 and "no readable result" in result.stderr and "Traceback" not in result.stderr


def test_project_ci_gate_against_the_committed_tiny_baseline(tiny_campaign):
    """What the project's CI enforces: this machine's tiny ResNet is not wildly slower than the baseline."""
    out, _ = tiny_campaign
    result = harness("compare", str(BASELINE), str(out), "--max-slowdown", "200")
    assert result.returncode == 0, result.stdout + result.stderr


def test_two_systems_are_compared_each_with_itself_never_pooled(tmp_path):
    """A fast and a slow system on both sides: only the one that slowed down regresses."""
    from tests.test_results import write_run

    def campaign(root: Path, minutes: dict[str, float]) -> Path:
        for system, m in minutes.items():
            folder = root / system
            folder.mkdir(parents=True)
            for i in range(5):
                write_run(folder / f"result_{i}.txt", m, accuracy=0.76, platform=system)
        return root

    base = campaign(tmp_path / "base", {"small": 4.0, "big": 1.0})
    cand = campaign(tmp_path / "cand", {"small": 4.0, "big": 1.5})
    result = harness("compare", str(base), str(cand), "--max-slowdown", "10")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "resnet on big: REGRESSION" in result.stdout and "+50.0%" in result.stdout
    assert "resnet on small: pass" in result.stdout and "+0.0%" in result.stdout
    other = campaign(tmp_path / "other", {"tiny": 4.0, "huge": 1.0})  # no system in common with base
    result = harness("compare", str(base), str(other))
    assert result.returncode == 2 and "none is on both sides" in result.stderr and "Traceback" not in result.stderr


def test_a_parent_folder_of_campaigns_gets_one_verdict_per_campaign(tmp_path):
    """Grouped as report groups: two campaigns on one platform are never pooled into one score."""
    import shutil

    for name in ("a", "b"):
        shutil.copytree(BASELINE, tmp_path / "runs" / name)
    retimed_copy(BASELINE, tmp_path / "runs" / "slow", 0.65)
    result = harness("compare", str(BASELINE), str(tmp_path / "runs"), "--max-slowdown", "10")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("resnet on cpu_n1x2 (a): pass: score 0.2875 min vs baseline 0.2875 min (+0.0%)")
    assert lines[1].startswith("resnet on cpu_n1x2 (b): pass: score 0.2875 min")
    assert lines[2].startswith("resnet on cpu_n1x2 (slow): REGRESSION: score 0.6500 min")
    result = harness("compare", str(tmp_path / "runs"), str(BASELINE))  # which of three baselines?
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"harness: error: resnet: the baseline holds 3 campaigns on cpu_n1x2 ({tmp_path / 'runs' / 'a'}, "
        f"{tmp_path / 'runs' / 'b'}, {tmp_path / 'runs' / 'slow'}); give the one to compare with"]
