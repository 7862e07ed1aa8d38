"""GPU checks: count and model, NVML's health readings, and a bf16 matmul per GPU.

NVML comes from nvidia-ml-py (`import pynvml`); tests pass a fake module with the same functions.
Without an NVIDIA driver every GPU check is `skipped: no GPU`, never passed.
"""

from __future__ import annotations

import time

from harness.health import FAIL, PASS, Check, at_least, at_most, equal, fault_scale, skipped

NO_GPU = "no GPU"
GPU_CHECKS = ("gpu_count", "gpu_model", "ecc_uncorrected", "remapped_rows", "retired_pages", "xid_events",
              "throttle", "temperature", "pcie_link", "matmul_tflops")
UNDER_LOAD = ("matmul_tflops", "pcie_link")  # measured while the GPU works (under_load)
# Clock-event reasons that mean the hardware is slowing itself down (idle, power caps and user clocks are normal).
BAD_THROTTLE = {"hw_slowdown": "nvmlClocksThrottleReasonHwSlowdown",
                "sw_thermal": "nvmlClocksThrottleReasonSwThermalSlowdown",
                "hw_thermal": "nvmlClocksThrottleReasonHwThermalSlowdown",
                "hw_power_brake": "nvmlClocksThrottleReasonHwPowerBrakeSlowdown"}


def load_nvml():
    """pynvml, initialised; None where there is no NVIDIA driver (or no nvidia-ml-py)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError: all mean "no GPU here"
        return None


def gpu_name(nvml) -> str | None:
    if nvml is None or nvml.nvmlDeviceGetCount() == 0:
        return None
    name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0))
    return name.decode() if isinstance(name, bytes) else name


def inventory() -> dict:
    """{"gpu": the first GPU's NVML name or None, "cuda_devices": the GPUs this process may use} (a container or
    CUDA_VISIBLE_DEVICES can show fewer than NVML does). Run in a child (harness.health.isolate): both can hang."""
    import torch

    return {"gpu": gpu_name(load_nvml()),
            "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def nvml_readings(expected: int, th: dict) -> list[Check]:
    """nvml_checks on this machine's NVML, for a child process."""
    return nvml_checks(load_nvml(), expected, th)


def xid_watch() -> list[Check]:
    """The XID events from now until the node's other checks are done (the parent closes stdin then)."""
    import sys

    watch = XidWatch(load_nvml())
    sys.stdin.read()
    return [watch.check()]


class XidWatch:
    """Critical XID events from the moment it starts (NVML reports them as they happen, not from the past)."""

    def __init__(self, nvml):
        self.nvml, self.events = nvml, None
        try:
            self.events = nvml.nvmlEventSetCreate()
            for index in range(nvml.nvmlDeviceGetCount()):
                nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(index),
                                              nvml.nvmlEventTypeXidCriticalError, self.events)
        except nvml.NVMLError as exc:
            self.events, self.why = None, f"XID events not readable here: {exc}"

    def check(self) -> Check:
        if self.events is None:
            return skipped("xid_events", self.why)
        xids = []
        while True:
            try:
                data = self.nvml.nvmlEventSetWait_v2(self.events, 0)
            except self.nvml.NVMLError:  # NVMLError_Timeout: no more events
                break
            xids.append(str(data.eventData))
        self.nvml.nvmlEventSetFree(self.events)
        return Check("xid_events", FAIL if xids else PASS, ", ".join(xids) or "none", "none during the checks")


def _per_gpu(nvml, count: int, read) -> list[tuple[str, object]]:
    """(where, reading) per GPU; a reading the GPU does not give is None (its check says so, or is left out
    where another check covers it)."""
    out = []
    for index in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        try:
            out.append((f"gpu {index}", read(handle)))
        except nvml.NVMLError:  # not supported on this GPU (ECC off, pre-Ampere row remapping): not reported
            out.append((f"gpu {index}", None))
    return out


def nvml_checks(nvml, expected: int, th: dict) -> list[Check]:
    """Count, model and NVML's health readings; `expected`: the GPUs the profile promises per node. (The PCIe
    link is read under load, with the matmul.)"""
    if nvml is None:
        if expected:  # the profile promises GPUs and the node shows none: that is a failure, not a skip
            return [Check("gpu_count", FAIL, 0, f"== {expected}", note="no NVIDIA driver or GPU found")]
        return [skipped(name, NO_GPU) for name in GPU_CHECKS if name not in UNDER_LOAD + ("xid_events",)]
    count = nvml.nvmlDeviceGetCount()
    checks = [equal("gpu_count", count, expected)]
    names = [n.decode() if isinstance(n, bytes) else n for _, n in _per_gpu(nvml, count, nvml.nvmlDeviceGetName)]
    model = th.get("gpu_model")
    checks.append(Check("gpu_model", PASS if all(model.lower() in n.lower() for n in names) else FAIL,
                        ", ".join(sorted(set(names))), f"contains {model}") if model
                  else skipped("gpu_model", "the profile names no model (preflight.gpu_model)"))
    for where, errors in _per_gpu(nvml, count, lambda h: nvml.nvmlDeviceGetTotalEccErrors(
            h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC)):
        checks.append(at_most("ecc_uncorrected", errors, 0, where=where) if errors is not None
                      else skipped("ecc_uncorrected", "ECC not enabled or not reported", where))
    for where, rows in _per_gpu(nvml, count, nvml.nvmlDeviceGetRemappedRows):
        if rows is None:  # before Ampere: page retirement instead of row remapping
            continue
        _, uncorrectable, pending, failed = rows
        checks.append(Check("remapped_rows", FAIL if pending or failed else PASS,
                            f"{uncorrectable} uncorrectable, pending {bool(pending)}, failed {bool(failed)}",
                            "none pending or failed", where=where))
    for where, pending in _per_gpu(nvml, count, nvml.nvmlDeviceGetRetiredPagesPendingStatus):
        if pending is not None:  # Ampere and later report row remapping above instead
            checks.append(equal("retired_pages", "pending" if pending else "none pending", "none pending", where))
    for where, reasons in _per_gpu(nvml, count, nvml.nvmlDeviceGetCurrentClocksThrottleReasons):
        active = [name for name, flag in BAD_THROTTLE.items() if reasons is not None and reasons & getattr(nvml, flag)]
        checks.append(Check("throttle", FAIL if active else PASS, ", ".join(active) or "none", "no hardware or "
                            "thermal slowdown", where=where) if reasons is not None
                      else skipped("throttle", "not reported", where))
    for where, celsius in _per_gpu(nvml, count, lambda h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)):
        checks.append(at_most("temperature", celsius, th.get("max_temperature_c"), "C", where))
    return checks


def pcie_link(where: str, link: tuple[int, int] | None, th: dict) -> Check:
    """A GPU's host link, (generation, width) as NVML read it while the GPU worked, against the model's minimum."""
    gen, width = th.get("min_pcie_gen"), th.get("min_pcie_width")
    if link is None or gen is None or width is None:
        return skipped("pcie_link", "not reported" if link is None else "no threshold", where)
    return Check("pcie_link", PASS if link[0] >= gen and link[1] >= width else FAIL, f"gen{link[0]} x{link[1]}",
                 f">= gen{gen} x{width}", where=where)


def link_of(nvml, uuid: str) -> tuple[int, int] | None:
    """The current PCIe (generation, width) of the GPU with this NVML UUID ("GPU-..."); None where unreadable."""
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
        return nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle), nvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
    except nvml.NVMLError:
        return None


def under_load(node: str, th: dict, size: int = 8192, iters: int = 20) -> list[Check]:
    """Each GPU in turn under a bf16 matmul: its throughput (2*n^3 flops per product), and its PCIe link, read
    while the products run. An idle GPU's link drops to a lower generation to save power, so a reading at idle
    (or after the work, once the GPU went idle again) would fail a healthy GPU. CUDA and NVML number GPUs
    differently; the GPU's UUID names the same one to both."""
    import torch

    nvml = load_nvml()
    checks = []
    for index in range(torch.cuda.device_count()):
        uuid = f"GPU-{torch.cuda.get_device_properties(index).uuid}"
        with torch.cuda.device(index):
            a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                a @ b
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                a @ b
            link = link_of(nvml, uuid)  # the products queued above are still running
            torch.cuda.synchronize()
            tflops = 2 * size**3 * iters / (time.perf_counter() - start) / 1e12
        checks.append(at_least("matmul_tflops", tflops * fault_scale(node, "matmul_tflops"), th["min_matmul_tflops"],
                               "TFLOPS", f"gpu {index}"))
        checks.append(pcie_link(f"gpu {index}", link, th))
    return checks
