"""`harness export`: an MLPerf submission package that MLCommons' own tools accept, and every refusal."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import HarnessError
from harness.export import REQUIRED_FIELDS, _inside
from harness.results.parse import parse_file
from tests.conftest import TINY_RUNS, harness
from tests.test_results import write_run

# What a submitter writes by hand: the fields no program can read off the machine.
BY_HAND = {name: "" for name in (
    "host_processor_frequency", "host_processor_caches", "host_processor_interconnect", "host_storage_type",
    "host_storage_capacity", "host_networking", "host_networking_topology", "host_memory_configuration",
    "accelerator_host_interconnect", "accelerator_frequency", "accelerator_on-chip_memories",
    "accelerator_memory_configuration", "accelerator_interconnect", "accelerator_interconnect_topology",
    "cooling", "hw_notes", "sw_notes")} | {"status": "Research, Development, or Internal (RDI)"}


@pytest.fixture
def system_desc(tmp_path) -> Path:
    path = tmp_path / "desc.json"
    path.write_text(json.dumps(BY_HAND))
    return path


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def package_checker(package: Path, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "mlperf_logging.package_checker", str(package), "training",
                           "4.0.0", "--log_output", str(cwd / "checker.log")], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    return proc.stdout + proc.stderr


def test_export_of_a_tiny_campaign_passes_mlcommons_checks(tiny_campaign, system_desc, tmp_path):
    out, _ = tiny_campaign
    package = tmp_path / "package"
    run_before = tree(out)
    here = tmp_path / "working-directory"  # its own, not the repository, where the other test worker writes
    here.mkdir()
    result = harness("export", str(out), "--submitter", "ACME", "--out", str(package),
                     "--system-desc", str(system_desc), cwd=here)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "package checker: no errors" in result.stdout
    assert "logged submission_org harness, not ACME" in result.stderr  # a note, not a refusal

    # MLCommons' package checker, run here by the test itself, finds no errors.
    checked = package_checker(package, tmp_path)
    assert "PACKAGE CHECKER FOUND NO ERRORS" in checked and "ERROR -" not in checked, checked

    # The layout, the logs byte for byte (oldest run first), and a complete system description.
    system = parse_file(out / "result_0.txt").system
    results = package / "results" / system / "resnet"
    sources = sorted(out.glob("result_*.txt"), key=lambda p: parse_file(p).run_start_ms)
    assert [p.read_bytes() for p in sorted(results.iterdir())] == [p.read_bytes() for p in sources]
    assert len(sources) == TINY_RUNS
    description = json.loads((package / "systems" / f"{system}.json").read_text())
    assert set(REQUIRED_FIELDS) <= set(description)
    assert description["submitter"] == "ACME" and description["division"] == "open"
    assert description["accelerator_model_name"] == "none (CPU only)" and description["number_of_nodes"] == "1"
    assert description["framework"].startswith("PyTorch ") and "torch" in description["other_software_stack"]
    implementation = package / "benchmarks" / "resnet" / "implementations" / "harness-pytorch"
    assert (implementation / "workloads" / "resnet" / "model.py").is_file()
    readme = (implementation / "README.md").read_text()
    assert f"harness run resnet --backend local --profile local-cpu --preset tiny --nodes 1 --runs {TINY_RUNS}" \
        in readme

    # The official summarizer scores the package exactly as `harness report` does.
    submission = tmp_path / "summarizer" / "ACME"
    shutil.copytree(package, submission)
    subprocess.run([sys.executable, "-m", "mlperf_logging.result_summarizer", str(submission), "training", "4.0.0"],
                   cwd=submission.parent, capture_output=True, timeout=300, check=True)
    official = json.loads((submission.parent / "summary.json").read_text())[0]["resnet:time_to_train"]
    ours = json.loads(harness("report", str(package), "--format", "json").stdout)[0]["score_min"]
    assert abs(ours - official) < 1e-9  # the summarizer rounds to 10 digits

    # Nothing written anywhere but the package: not the run folder, not the working directory (the checkers'
    # compliance_checker.log and summary.json land there by default).
    assert tree(out) == run_before and not any(here.iterdir())


def closed_runs(folder: Path, count: int) -> Path:
    """Hand-written closed-division ResNet logs (not checker-clean: fine for refusals)."""
    folder.mkdir()
    for i in range(count):
        write_run(folder / f"result_{i}.txt", 1.0 + i / 10, accuracy=0.76)
    return folder


def refused(tmp_path: Path, *args: str) -> str:
    out = tmp_path / "pkg"
    result = harness("export", *args, "--submitter", "ACME", "--out", str(out))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and not out.exists()  # refused before writing anything
    return result.stderr


def test_too_few_runs_are_refused(tmp_path, system_desc):
    runs = closed_runs(tmp_path / "runs", 2)
    message = refused(tmp_path, str(runs), "--system-desc", str(system_desc))
    assert "resnet: 2 run(s) given, and an MLPerf package takes exactly 5" in message
    assert "harness run resnet --runs 5" in message


def test_missing_description_fields_are_listed(tmp_path):
    message = refused(tmp_path, str(closed_runs(tmp_path / "runs", 5)))
    assert "cannot be detected" in message and "--system-desc" in message
    # No system facts were recorded by these hand-written logs, so the detectable fields are missing too.
    for name in ("cooling", "host_networking", "accelerator_model_name", "framework"):
        assert name in message


@pytest.mark.parametrize("hostile", ["../escape", "a/b", "..", "/etc/x", ".hidden"])
def test_system_names_cannot_escape_the_package(tmp_path, system_desc, hostile):
    runs = closed_runs(tmp_path / "runs", 5)
    message = refused(tmp_path, str(runs), "--system-desc", str(system_desc), "--system", hostile)
    assert "cannot be a folder name" in message
    desc = tmp_path / "hostile.json"
    desc.write_text(json.dumps({**BY_HAND, "system_name": hostile}))
    assert "cannot be a folder name" in refused(tmp_path, str(runs), "--system-desc", str(desc))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["desc.json", "hostile.json", "runs"]


def test_paths_are_confined_to_the_package(tmp_path):
    assert _inside(tmp_path, "results/box/resnet/result_0.txt") == tmp_path / "results/box/resnet/result_0.txt"
    for escape in ("../x", "results/../../x", "/etc/passwd"):
        with pytest.raises(HarnessError, match="outside"):
            _inside(tmp_path, escape)


def test_damaged_logs_mixed_divisions_and_bad_descriptions_are_refused(tmp_path, system_desc):
    runs = closed_runs(tmp_path / "runs", 5)
    (runs / "result_4.txt").write_bytes(b":::MLLOG {\"key\": \"run_start\", \"time_ms\": 0, \"va")
    assert "result_4.txt (line 1: damaged MLLOG record" in refused(tmp_path, str(runs), "--system-desc",
                                                                   str(system_desc))
    write_run(runs / "result_4.txt", 1.4, division="open")
    assert "disagree on the division (closed, open)" in refused(tmp_path, str(runs), "--system-desc",
                                                                str(system_desc))
    write_run(runs / "result_4.txt", 1.4)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert "is not valid JSON" in refused(tmp_path, str(runs), "--system-desc", str(broken))
    assert "division 'open' but the runs logged 'closed'" in refused(
        tmp_path, str(runs), "--system-desc", str(_with(tmp_path, division="open")))


def _with(tmp_path: Path, **fields) -> Path:
    path = tmp_path / "custom.json"
    path.write_text(json.dumps({**BY_HAND, **fields}))
    return path


def test_an_existing_folder_is_never_overwritten(tmp_path, system_desc):
    runs = closed_runs(tmp_path / "runs", 5)
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = harness("export", str(runs), "--submitter", "ACME", "--out", str(out), "--system-desc",
                     str(_with(tmp_path, **FACTS)))
    assert result.returncode == 2 and "not an empty folder" in result.stderr
    assert tree(out) == {"keep.txt": b"mine"}


# What a run folder's system.json holds on a CPU machine, for hand-written logs that have none.
FACTS = {"number_of_nodes": "1", "host_processors_per_node": "1", "host_processor_model_name": "cpu",
         "host_processor_core_count": "2", "host_processor_vcpu_count": "2", "host_memory_capacity": "8 GB",
         "framework": "PyTorch", "operating_system": "Linux", "accelerators_per_node": "0",
         "accelerator_model_name": "none", "accelerator_memory_capacity": "0", "other_software_stack": {}}


def test_checker_errors_are_reported_and_the_package_kept(tmp_path):
    """Hand-written closed logs lack most closed keys: the checker's errors reach the user, exit 1."""
    runs = closed_runs(tmp_path / "runs", 5)
    out = tmp_path / "pkg"
    result = harness("export", str(runs), "--submitter", "ACME", "--out", str(out), "--system-desc",
                     str(_with(tmp_path, **FACTS)))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ERROR" in result.stdout and "package checker found errors" in result.stderr
    assert len(list((out / "results" / "box" / "resnet").glob("result_*.txt"))) == 5


def test_a_package_is_one_rounds_and_its_runs_own_ruleset_checks_it(tmp_path):
    """Without --ruleset each run is judged by its own, and a package is one round's: resnet (newest in 4.0.0)
    beside llama31_8b (6.1.0) is refused naming both; --ruleset forces one; llama31_8b alone is checked by 6.1.0."""
    resnet = closed_runs(tmp_path / "resnet", 5)
    llama = tmp_path / "llama"
    llama.mkdir()
    for i in range(10):
        write_run(llama / f"result_{i}.txt", 1.0 + i / 10, benchmark="llama31_8b")
    desc = str(_with(tmp_path, **FACTS))
    message = refused(tmp_path, str(resnet), str(llama), "--system-desc", desc)
    assert "the runs would be judged by different rulesets: 4.0.0 (resnet); 6.1.0 (llama31_8b)" in message
    assert len(message.strip().splitlines()) == 1
    assert "benchmark 'llama31_8b' is not one of MLPerf training 4.0.0's" in refused(
        tmp_path, str(resnet), str(llama), "--system-desc", desc, "--ruleset", "4.0.0")
    result = harness("export", str(llama), "--submitter", "ACME", "--out", str(tmp_path / "pkg"), "--system-desc",
                     desc)
    assert "package_checker" in result.stdout and " training 6.1.0 ..." in result.stdout, result.stdout + result.stderr


def test_runs_no_ruleset_holds_are_refused_with_the_reason(tmp_path, system_desc):
    runs = tmp_path / "runs"
    runs.mkdir()
    for i in range(5):
        write_run(runs / f"result_{i}.txt", 1.0 + i / 10, benchmark="newbench")
    assert "cannot export newbench runs: no ruleset holds newbench" in refused(
        tmp_path, str(runs), "--system-desc", str(system_desc))
