"""The image check: an image too old for the harness, or without it, fails at start-up in one line naming it."""

import subprocess
import sys
import tomllib

import pytest

from workloads.common import requirements_check as rc
from tests.conftest import REPO

NGC_25_12_TORCH = "2.10.0a0+b4e4ee81d3"  # NGC's torch is a pre-release of the next version


def versions(**found):
    return lambda distribution: found.get(distribution)


def test_a_current_image_passes_and_ngc_prereleases_count_as_their_release():
    assert rc.problems((3, 12, 3), versions(torch=NGC_25_12_TORCH, torchvision="0.25.0a0+f3c5e2a")) == []
    assert rc.problems(tuple(sys.version_info[:3]), rc.installed_version) == []  # this one runs the harness


def test_too_old_torch_and_python_are_named_with_what_needs_them():
    found = rc.problems((3, 10, 12), versions(torch="2.3.0a0+6ddf5cf85e", torchvision=None))
    assert found == [
        "has Python 3.10.12; the harness needs Python>=3.11 (hashlib.file_digest)",
        "has torch 2.3.0a0+6ddf5cf85e; the harness needs torch>=2.9 (DefaultStager and StagingOptions in "
        "torch.distributed.checkpoint.staging, fully_shard in torch.distributed.fsdp)",
        "has no torchvision; the harness needs torchvision>=0.24 (the torchvision release of torch 2.9)"]


def test_exit_if_unfit_says_one_line_naming_the_image_and_exits_2(monkeypatch, capsys):
    monkeypatch.setenv(rc.IMAGE_ENV, "nvcr.io/nvidia/pytorch:24.04-py3")
    monkeypatch.setattr(rc, "installed_version", versions(torch="2.3.0a0+6ddf5cf85e", torchvision="0.18.0a0"))
    with pytest.raises(SystemExit) as stopped:
        rc.exit_if_unfit()
    assert stopped.value.code == rc.EXIT_UNFIT_IMAGE == 2  # 1-127: permanent for Kubernetes' ExitCode policy
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("harness: image nvcr.io/nvidia/pytorch:24.04-py3 has torch 2.3.0a0+6ddf5cf85e; "
                           "the harness needs torch>=2.9")
    assert "; it has torchvision 0.18.0a0" in line and line.endswith(rc.BUILD_HINT)


def test_pyproject_declares_the_minimums_the_check_enforces():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=" + ".".join(map(str, rc.MIN_PYTHON))
    for distribution, (minimum, _) in rc.MIN_VERSIONS.items():
        assert f"{distribution}>={'.'.join(map(str, minimum))}" in project["dependencies"]


def fake_distribution(site, name, version):
    """A dist-info that importlib.metadata finds before the real one (it comes first on sys.path)."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.mark.parametrize("entry", [["harness.agent", "--out", "unused"], ["workloads", "resnet"]])
def test_agent_and_worker_stop_before_importing_an_old_torch(tmp_path, entry):
    fake_distribution(tmp_path, "torch", "2.3.0")
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "HARNESS_IMAGE": "registry.example.com/old:1", "PATH": "/usr/bin"}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", *entry], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    [line] = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert line.startswith("harness: image registry.example.com/old:1 has torch 2.3.0; the harness needs torch>=2.9")
    assert not any(" torch" in line.split("|")[-1] for line in proc.stderr.splitlines()
                   if line.startswith("import time:"))  # it never imported torch


def test_the_image_build_checks_its_base_first(tmp_path):
    fake_distribution(tmp_path, "torch", "2.3.0")  # run as a script, as manifests/image/Containerfile does
    env = {"PYTHONPATH": str(tmp_path), "HARNESS_IMAGE": "nvcr.io/nvidia/pytorch:24.04-py3"}
    proc = subprocess.run([sys.executable, str(REPO / "workloads" / "common" / "requirements_check.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    [line] = proc.stderr.splitlines()
    assert line.startswith("harness: image nvcr.io/nvidia/pytorch:24.04-py3 has torch 2.3.0;")
    assert line.endswith(": choose a newer BASE_IMAGE (NGC PyTorch 25.12 has torch 2.10 and Python 3.12)")


def test_the_node_command_in_an_image_without_the_harness_names_the_image(tmp_path):
    # -I -S: no site-packages and no working directory on the path, so no harness to import
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", rc.AGENT_BOOTSTRAP, "--out", "unused"], cwd=tmp_path,
                          env={"HARNESS_IMAGE": "nvcr.io/nvidia/pytorch:25.12-py3"}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["harness: image nvcr.io/nvidia/pytorch:25.12-py3 has no harness "
                                        f"(no module named harness): {rc.BUILD_HINT}"]
    assert "$(" not in rc.AGENT_BOOTSTRAP and "\n" not in rc.AGENT_BOOTSTRAP  # safe in a pod's args, one srun line
