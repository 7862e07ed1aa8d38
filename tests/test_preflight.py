"""Preflight: node checks against fake NVML and sysfs readings, the verdicts, the table, the JSON and the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.health import FAIL, PASS, SKIPPED
from harness.health.allreduce import pair_rounds
from harness.health.gpu import nvml_checks
from harness.health.ib import ib_checks
from harness.health.thresholds import resolve


class FakeNVML:
    """The pynvml functions the checks call, over a list of fake GPUs."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_TEMPERATURE_GPU = 1, 0, 0
    nvmlClocksThrottleReasonHwSlowdown, nvmlClocksThrottleReasonSwThermalSlowdown = 0x8, 0x20
    nvmlClocksThrottleReasonHwThermalSlowdown, nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 0x40, 0x80

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def __init__(self, count=8, **gpu):
        self.gpus = [{**dict(name="NVIDIA H100 80GB HBM3", ecc=0, rows=(0, 0, 0, 0), throttle=0, temp=40,
                             pcie=(5, 16)), **gpu} for _ in range(count)]

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return h["ecc"]

    def nvmlDeviceGetRemappedRows(self, h):
        return h["rows"]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        raise self.NVMLError_NotSupported()

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return h["throttle"]

    def nvmlDeviceGetTemperature(self, h, sensor):
        return h["temp"]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return h["pcie"][0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return h["pcie"][1]


H100 = resolve({"gpu_model": "H100"}, "NVIDIA H100 80GB HBM3")


def _verdicts(checks, name):
    return [c.verdict for c in checks if c.name == name]


def test_a_healthy_h100_node_passes_every_nvml_check():
    checks = nvml_checks(FakeNVML(), 8, H100)
    assert {c.verdict for c in checks} == {PASS}
    assert {"gpu_count", "gpu_model", "ecc_uncorrected", "remapped_rows", "throttle", "temperature",
            "pcie_link"} == {c.name for c in checks}


def test_a_missing_gpu_fails_the_count_with_what_was_seen():
    [count] = [c for c in nvml_checks(FakeNVML(count=7), 8, H100) if c.name == "gpu_count"]
    assert (count.verdict, count.measured, count.threshold) == (FAIL, 7, "== 8")


@pytest.mark.parametrize("gpu, check", [(dict(ecc=3), "ecc_uncorrected"), (dict(rows=(0, 1, 1, 0)), "remapped_rows"),
                                        (dict(throttle=0x40), "throttle"), (dict(temp=91), "temperature"),
                                        (dict(pcie=(3, 8)), "pcie_link")])
def test_each_nvml_reading_fails_its_own_check(gpu, check):
    checks = nvml_checks(FakeNVML(**gpu), 8, H100)
    assert {c.name for c in checks if c.verdict == FAIL} == {check}


def test_no_gpu_is_skipped_where_none_is_promised_and_failed_where_one_is():
    assert {c.verdict for c in nvml_checks(None, 0, resolve({}, None))} == {SKIPPED}
    assert all(c.note == "no GPU" for c in nvml_checks(None, 0, resolve({}, None)))
    [count] = nvml_checks(None, 8, H100)
    assert (count.name, count.verdict, count.measured) == ("gpu_count", FAIL, 0)


def _port(root: Path, hca: str, state="4: ACTIVE", rate="400 Gb/sec (4X NDR)", link_downed=0):
    port = root / hca / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "rate").write_text(rate + "\n")
    (port / "counters" / "link_downed").write_text(f"{link_downed}\n")
    (port / "counters" / "link_error_recovery").write_text("0\n")


def test_infiniband_ports_from_a_fake_sysfs(tmp_path):
    for i in range(7):
        _port(tmp_path, f"mlx5_{i}")
    _port(tmp_path, "mlx5_7", state="1: DOWN", rate="10 Gb/sec (4X SDR)", link_downed=9)
    checks = ib_checks(H100, 8, tmp_path)
    failed = {(c.name, c.where) for c in checks if c.verdict == FAIL}
    assert failed == {("ib_port_state", "mlx5_7/1"), ("ib_port_rate", "mlx5_7/1"), ("ib_link_errors", "mlx5_7/1"),
                      ("ib_ports", "")}
    [state] = [c for c in checks if c.name == "ib_port_state" and c.where == "mlx5_7/1"]
    assert state.measured == "DOWN" and state.threshold == "ACTIVE"
    assert ib_checks(H100, 8, tmp_path / "none")[0].note == "no InfiniBand ports found"
    assert ib_checks(resolve({}, None), 0, tmp_path / "none")[0].verdict == SKIPPED


def test_the_pair_rounds_meet_new_partners_and_stay_bounded():
    rounds = pair_rounds(448, 3)
    assert len(rounds) == 3 and all(len(r) == 224 for r in rounds)
    assert len({p for r in rounds for p in r}) == 672  # no pair twice
    for r in rounds:
        seen = [n for p in r for n in p]
        assert len(seen) == len(set(seen))  # every node in one pair per round
    assert pair_rounds(2, 3) == [[(0, 1)]]
