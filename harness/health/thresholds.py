"""Default preflight thresholds per GPU model, and how a profile's `preflight:` settings override them.

Where each default comes from:
- Every GPU row: min_matmul_tflops is 60% of the model's dense bf16 peak (workloads/common/gpu_peaks.py, from
  NVIDIA's datasheets); a healthy H100 SXM reaches 650-750 TFLOPS (66-76%) in an 8192^3 bf16 matmul, a
  throttled or faulty GPU far less. max_ib_link_errors 6 is Azure azurehpc-health-checks'
  `check_ib_link_flapping 6` (link_downed + link_error_recovery here), and min_free_gib 100 a floor under the
  room the run's checkpoints need (harness.health.storage); neither depends on the GPU.
- H100 SXM (HGX, 8 GPUs on NVLink/NVSwitch, 8x ConnectX-7 NDR):
  - min_allreduce_busbw_gbps 460 at allreduce_mib 16384: Azure azurehpc-health-checks
    conf/nd96isr_h100_v5.conf, `check_nccl_allreduce 460.0 1 ... 16G` (8 H100s, NCCL, 16 GiB).
  - min_pair_busbw_gbps 40: one rank per GPU drives that GPU's nearest NDR 400 Gb/s NIC, which gives about
    46-48 GB/s; 40 is Azure's `check_nccl_allreduce_ib_loopback 40.0` for one NIC.
  - ib_rate_gbps 400: NDR, Azure's `check_hw_ib 400 mlx5_ibN:1`.
  - max_temperature_c 85: below the H100's slowdown temperature (NVML reports it as
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, about 90 C), so a GPU near it is caught before it throttles.
  - min_pcie_gen 5, min_pcie_width 16: the H100 SXM's host link (PCIe Gen5 x16), read after the matmul so
    the link is not in its idle power state.
- H200 SXM: the same HGX board as the H100 SXM (NVLink 4 through NVSwitch, 8x ConnectX-7 NDR, PCIe Gen5
  x16) and the same 989 dense bf16 TFLOPS (NVIDIA's H200 datasheet), so the same row.
- H100 PCIe and H100 NVL: PCIe Gen5 x16 cards (NVIDIA's H100 PCIe product brief PB-11133-001: "a dual-slot
  10.5 inch PCI Express Gen5 card"; NVIDIA's H100 datasheet, H100 NVL column: "PCIe Gen5: 128GB/s"), with
  756 and 835.5 dense bf16 TFLOPS (the datasheet's 1,513 and 1,671 "with sparsity", halved). Between GPUs
  they have no NVSwitch (at most an NVLink bridge per pair), and their NICs are the server's choice, so no
  datasheet gives an all-reduce, pair or InfiniBand figure, nor a slowdown temperature for these passively
  cooled cards: those checks are skipped until the profile sets them.
- B200 (HGX B200): NVIDIA's DGX B200 user guide ("Introduction to NVIDIA DGX B200 Systems"): 8x ConnectX-7
  single-port cards, "InfiniBand (default): Up to 400Gbps" (so ib_rate_gbps 400 and min_pair_busbw_gbps 40,
  the H100 board's one NDR NIC per GPU), and Xeon 8570 "PCIe Gen5" hosts (min_pcie_gen 5, x16); 2,250 dense bf16
  TFLOPS. NVLink 5 doubles the H100's NVLink, but no published all-reduce check gives a figure, and the B200's
  slowdown temperature is not in the guide: those are skipped until the profile sets them.
Rows are matched by the exact name NVML reports, never a substring: an H100 PCIe or NVL has "H100" in its name
too, and the SXM's thresholds would fail every such node. A model with no row here gets no default: its checks
say `skipped: no threshold ...` until the profile sets them.
"""

from __future__ import annotations

import dataclasses

from harness.profiles import PreflightSettings
from workloads.common.gpu_peaks import peak_bf16_flops

MATMUL_SHARE = 0.6  # of the dense bf16 peak: the matmul check's floor


def _row(model: str, **values) -> dict:
    """One model's defaults: its own matmul floor, plus what every GPU node shares."""
    return dict(min_matmul_tflops=round(MATMUL_SHARE * peak_bf16_flops(model) / 1e12), max_ib_link_errors=6,
                min_free_gib=100.0, **values)


_HGX_HOPPER = dict(min_allreduce_busbw_gbps=460.0, allreduce_mib=16384, min_pair_busbw_gbps=40.0, pair_mib=1024,
                   max_temperature_c=85, min_pcie_gen=5, min_pcie_width=16, ib_rate_gbps=400)
_PCIE_CARD = dict(min_pcie_gen=5, min_pcie_width=16)
GPU_DEFAULTS: dict[str, dict] = {  # by the exact name NVML reports
    "NVIDIA H100 80GB HBM3": _row("NVIDIA H100 80GB HBM3", **_HGX_HOPPER),  # H100 SXM5
    "NVIDIA H200": _row("NVIDIA H200", **_HGX_HOPPER),  # H200 SXM
    "NVIDIA H100 PCIe": _row("NVIDIA H100 PCIe", **_PCIE_CARD),
    "NVIDIA H100 NVL": _row("NVIDIA H100 NVL", **_PCIE_CARD),
    "NVIDIA B200": _row("NVIDIA B200", min_pair_busbw_gbps=40.0, pair_mib=1024, min_pcie_gen=5, min_pcie_width=16,
                        ib_rate_gbps=400),
}
CPU_DEFAULTS = dict(min_allreduce_busbw_gbps=0.005, allreduce_mib=4, min_pair_busbw_gbps=0.005, pair_mib=4,
                    ib_rate_gbps=0, max_ib_link_errors=6, min_free_gib=1.0)
# Message sizes when neither the model's row nor the profile says.
FALLBACK_SIZES = dict(allreduce_mib=1024, pair_mib=1024)


def resolve(settings: PreflightSettings | dict, gpu_name: str | None) -> dict:
    """The thresholds for a node whose first GPU is `gpu_name` (None: a CPU node): the profile's settings
    where set, else the model's defaults, else None (the check is skipped and says so)."""
    values = dataclasses.asdict(settings) if isinstance(settings, PreflightSettings) else \
        {**dataclasses.asdict(PreflightSettings()), **settings}
    if gpu_name is None:
        defaults = CPU_DEFAULTS
    else:
        defaults = GPU_DEFAULTS.get(gpu_name.strip(), {})
    merged = {key: value if value is not None else defaults.get(key) for key, value in values.items()}
    for key, size in FALLBACK_SIZES.items():
        merged[key] = merged.get(key) or size
    return merged
