"""Bad input ends with one clear line naming the problem and the valid choices, never a traceback."""

from __future__ import annotations

import pytest

from harness.cli import main
from tests.conftest import harness


@pytest.mark.parametrize("argv, expected", [
    (["run", "nosuchbench"], ["nosuchbench", "resnet", "bert", "gpt3"]),
    (["run", "resnet", "--preset", "huge"], ["huge", "tiny", "full"]),
    (["run", "resnet", "--backend", "aws"], ["aws", "local", "slurm", "k8s"]),
    (["run", "resnet", "--backend", "k8s", "--dry-run"], ["profile local-cpu names none", "--set image="]),
    (["run", "resnet", "--profile", "nosuch"], ["unknown profile", "local-cpu", "h100-ib", "coreweave-h100"]),
    (["run", "resnet", "--set", "slurm.nope=1"], ["unknown setting", "partition"]),
    (["run", "resnet", "--nodes", "0"], ["--nodes", "at least 1"]),
    (["run", "resnet", "--nodes", "2"], ["--nodes must be 1", "slurm or k8s"]),
    (["run", "resnet", "--runs", "0"], ["--runs", "at least 1"]),
    (["run", "resnet", "--nodes", "two"], ["--nodes", "invalid int value"]),
    (["run", "resnet", "--data", "/no/such/imagenet"], ["/no/such/imagenet", "does not exist"]),
    (["run", "resnet", "--preset", "full"], ["--data", "--synthetic"]),
    (["run", "resnet", "--env", "NOEQUALS"], ["KEY=VALUE"]),
    (["run", "resnet", "--compile", "fast"], ["--compile 'fast'", "auto", "on", "off"]),
    (["run", "resnet", "--decode", "gpu"], ["--decode 'gpu'", "workers", "device"]),
    (["run", "resnet", "--straggler-window", "1.5steps"], ["--straggler-window '1.5steps'", "90s", "20steps", "0"]),
    (["run", "resnet", "--inject-failure", "0:3:freeze"], ["'freeze'", "stall", "hang"]),
    (["run", "resnet", "--out", "/proc/harness-cannot-write-here"], ["cannot write", "/proc/harness"]),
    (["run", "llama2_70b_lora", "--warmup-samples", "100"], ["--warmup-samples", "llama31_8b, gpt_oss_20b, flux1 only",
                                                             "--learning-rate alone"]),
    (["run", "resnet", "--learning-rate", "0.1"], ["--learning-rate",
                                                   "llama31_8b, gpt_oss_20b, llama2_70b_lora, deepseekv3_671b, flux1 only"]),
    (["run", "llama31_8b", "--learning-rate=-1e-4"], ["--learning-rate must be above 0", "-0.0001"]),
    (["run", "llama31_8b", "--warmup-samples=-5"], ["--warmup-samples must be 0 or more", "-5"]),
    (["run", "llama31_8b", "--preset", "full", "--synthetic", "--global-batch", "256", "--dry-run"],
     ["global batch 256", "above every row", "between two (16 to 128)", "128: LR 0.002, warmup 32,768 samples",
      "--force-batch"]),
    (["report", "/no/such/results"], ["no such file or folder", "/no/such/results"]),
    (["logs", "/"], ["not a run folder", "job.json"]),
    (["frobnicate"], ["invalid choice", "run", "report"]),
    (["doctor"], ["doctor", "required", "--profile"]),
    (["doctor", "--profile", "nosuch"], ["unknown profile", "coreweave-h100"]),
    (["doctor", "--profile", "h100-ib", "--nodes", "0"], ["--nodes must be at least 1"]),
    (["doctor", "--profile", "h100-ib", "--api", "mpijob"], ["invalid choice", "pytorchjob", "trainjob"]),
])
def test_bad_input_is_one_clear_line(argv, expected, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("harness")
    for word in expected:
        assert word in err


def test_unwritable_out_leaves_existing_results_alone(tmp_path, capsys):
    out = tmp_path / "old"
    out.mkdir()
    (out / "result_0.txt").write_text("precious\n")
    assert main(["run", "resnet", "--out", str(out)]) == 2
    assert "already holds results" in capsys.readouterr().err
    assert (out / "result_0.txt").read_text() == "precious\n"


def test_unknown_benchmark_from_the_real_entry_point():
    result = harness("run", "nosuchbench")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert all(name in result.stderr for name in ("resnet", "bert", "gpt3"))


def test_help_explains_every_run_option():
    result = harness("run", "--help")
    assert result.returncode == 0
    for option in ("--preset", "--backend", "--nodes", "--procs-per-node", "--runs", "--seed", "--out",
                   "--max-restarts", "--env", "--data", "--synthetic", "--max-steps", "--batch-size",
                   "--dry-run", "--learning-rate", "--warmup-samples", "(default: local)", "(default: 1)"):
        assert option in result.stdout
