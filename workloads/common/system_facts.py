"""What the machine that trains can say about itself, in MLPerf system-description fields.

Rank 0 writes these into the run folder (system.json) at the start of a
campaign, so that `harness export` describes the system the runs came from, not
the machine the export happens to run on. Only facts a program can read are
here (CPU, memory, OS, GPU model, count and memory, software versions); cooling,
networking, storage and the like come from the submitter (export --system-desc).
Values are strings, as MLCommons' checker and summarizer expect.
"""

from __future__ import annotations

import json
import os
import platform
import re
from importlib import metadata
from pathlib import Path

import torch

from workloads.common.distributed import DistContext

FACTS_FILE = "system.json"


def write_facts(out: Path, ctx: DistContext) -> None:
    (out / FACTS_FILE).write_text(json.dumps(describe(ctx), indent=2) + "\n")


def _cpuinfo() -> dict[str, set[str]]:
    """/proc/cpuinfo's fields, each with its distinct values over all processors."""
    fields: dict[str, set[str]] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), set()).add(value.strip())
    return fields


def _memory_capacity() -> str | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    found = re.search(r"^MemTotal:\s+(\d+) kB", text, re.MULTILINE)
    return f"{int(found.group(1)) / 1024**2:.0f} GB" if found else None


def _operating_system() -> str:
    try:
        found = re.search(r'^PRETTY_NAME="?([^"\n]*)', Path("/etc/os-release").read_text(), re.MULTILINE)
        if found:
            return found.group(1)
    except OSError:
        pass
    return platform.platform()


def _nvidia_driver() -> str | None:
    try:
        found = re.search(r"Kernel Module\s+(\S+)", Path("/proc/driver/nvidia/version").read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe(ctx: DistContext) -> dict:
    """System-description fields detected on this node, for a job of ctx's shape."""
    cpu = _cpuinfo()
    facts = {
        "number_of_nodes": str(ctx.nodes),
        "host_processors_per_node": str(len(cpu.get("physical id", ())) or 1),
        "host_processor_model_name": next(iter(cpu.get("model name", ())), None) or platform.processor(),
        "host_processor_core_count": next(iter(cpu.get("cpu cores", ())), None) or str(os.cpu_count()),
        "host_processor_vcpu_count": str(os.cpu_count()),
        "host_memory_capacity": _memory_capacity(),
        "framework": f"PyTorch {torch.__version__}",
        "operating_system": _operating_system(),
    }
    software = {"python": platform.python_version(), "kernel_version": platform.release(),
                "torch": torch.__version__, "torchvision": _version("torchvision"),
                "mlperf_logging": _version("mlperf-logging")}
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        facts.update({"accelerators_per_node": str(ctx.local_world_size), "accelerator_model_name": props.name,
                      "accelerator_memory_capacity": f"{props.total_memory / 1024**3:.0f} GB"})
        software.update({"cuda_version": torch.version.cuda,
                         "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
                         "cudnn_version": str(torch.backends.cudnn.version()),
                         "nvidia_kernel_driver": _nvidia_driver()})
    else:
        # CPU processes are not accelerators: MLPerf counts none, and the report counts nodes.
        facts.update({"accelerators_per_node": "0", "accelerator_model_name": "none (CPU only)",
                      "accelerator_memory_capacity": "0"})
    facts["other_software_stack"] = {name: value for name, value in software.items() if value}
    return {name: value for name, value in facts.items() if value is not None}
