"""bench/loop_overhead.py: the bare loop against the harness's --synthetic run, in its quick mode (the JSON's
shape and the steps each side ran, never a speed), the window arithmetic, and one-line refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "loop_overhead.py"
sys.path.insert(0, str(REPO / "bench"))

import loop_overhead  # noqa: E402  (bench/ is not a package)


def test_the_window_counts_the_last_steps_and_leaves_saves_out():
    # 6 steps of 16 samples starting 1 s apart, with a 0.5 s save (and 0.25 s of CPU) between steps 4 and 5.
    starts = [0.0, 1.0, 2.0, 3.0, 4.5, 5.5]
    # Step 4, the first after the save, takes 0.25 s longer and 0.2 s more of the main thread's CPU time.
    ends = [s + 0.75 for s in starts]
    ends[4] += 0.25
    stamps = {"starts": starts, "ends": ends, "cpu": [0.0, 0.5, 1.0, 1.5, 2.25, 2.75],
              "step_cpu": [0.4, 0.4, 0.4, 0.3, 0.6, 0.4], "samples": [16] * 6,
              "left_out": [[3.9, 4.4, 1.9, 2.15], [0.1, 0.2, 0.0, 0.0]], "per_sample": 1}
    figures = loop_overhead.window(stamps, last=3)  # steps 3, 4, 5: from start of step 3 to start of step 6
    assert figures["steps_run"] == 6 and figures["samples"] == 48
    assert figures["left_out_s"] == pytest.approx(0.5) and figures["seconds"] == pytest.approx(3.0)
    assert figures["rate"] == pytest.approx(16.0) and figures["cpu_ms_per_step"] == pytest.approx(500.0)
    assert figures["train_step_ms_median"] == pytest.approx(750.0)
    assert figures["between_steps_ms_median"] == pytest.approx(250.0)
    assert figures["between_steps_share"] == pytest.approx((2 * 0.25 + 0.5 - 0.5) / 3.0, abs=1e-5)  # the save is not the loop's
    # The main thread's CPU time inside train_step over steps 3, 4, 5 (0.4, 0.3, 0.6 s): its median.
    assert figures["train_step_cpu_ms_median"] == pytest.approx(400.0)
    # Step 4 follows the save: 0.25 s longer than the median step (0.75 s), 0.2 s more CPU than the median (0.4 s).
    assert figures["after_left_out"] == {"steps": 1, "extra_ms": pytest.approx(250.0),
                                         "extra_cpu_ms": pytest.approx(200.0)}
    assert loop_overhead.window({**stamps, "left_out": []}, last=3)["after_left_out"]["steps"] == 0
    tokens = loop_overhead.window({**stamps, "per_sample": 1024}, last=3)  # a language model: tokens/s
    assert tokens["rate"] == pytest.approx(16.0 * 1024) and tokens["samples"] == 48


@pytest.mark.parametrize("args, says", [
    (["--benchmarks", "resnet,gpt9"], "unknown benchmark(s) gpt9; choose from: resnet, bert, llama31_8b"),
    (["--steps", "10", "--last", "10"], "--last must be at least 1 and below --steps (10), not 10"),
    (["--cpus", "zero"], "--cpus takes CPU numbers separated by commas"),
])
def test_bad_options_get_one_line(args, says):
    done = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_quick_mode_runs_both_sides_for_the_same_steps(tmp_path):
    out = tmp_path / "loop_overhead.json"
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--benchmarks", "resnet",
                           "--json", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HARNESS_DATA_DIR": str(tmp_path / "data")})
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert (figures["steps"], figures["last"], figures["repeats"], figures["ranks"]) == (12, 8, 1, 2)
    result = figures["benchmarks"]["resnet"]
    assert list(figures["benchmarks"]) == ["resnet"] and result["unit"] == "img/s"
    assert result["steps_run"] == {"bare": [12], "harness": [12]}
    assert result["ratio"] == pytest.approx(result["harness"] / result["bare"], rel=1e-3)
    bare, harness = result["runs"]["bare"][0], result["runs"]["harness"][0]
    assert bare["samples"] == harness["samples"] == 8 * 2 * 32  # the same 8 steps of 2 ranks' batches of 32
    assert bare["left_out_s"] == 0  # the bare loop neither saves nor evaluates
    assert bare["after_left_out"]["steps"] == 0
    assert set(result["train_step_cpu_ms"]) == set(result["rate_range"]) == {"bare", "harness"}
    assert all(low <= high for low, high in result["rate_range"].values())
