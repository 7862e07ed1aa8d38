"""Default preflight thresholds per GPU model, and how a profile's `preflight:` settings override them.

Where each default comes from:
- H100 SXM (HGX, 8 GPUs on NVLink/NVSwitch, 8x ConnectX-7 NDR):
  - min_allreduce_busbw_gbps 460 at allreduce_mib 16384: Azure azurehpc-health-checks
    conf/nd96isr_h100_v5.conf, `check_nccl_allreduce 460.0 1 ... 16G` (8 H100s, NCCL, 16 GiB).
  - min_pair_busbw_gbps 40: one rank per node drives one GPU and its nearest NDR 400 Gb/s NIC, which gives
    about 46-48 GB/s; 40 is Azure's `check_nccl_allreduce_ib_loopback 40.0` for one NIC.
  - ib_rate_gbps 400: NDR, Azure's `check_hw_ib 400 mlx5_ibN:1`.
  - max_ib_link_errors 6: Azure's `check_ib_link_flapping 6` (link_downed + link_error_recovery here).
  - min_matmul_tflops 600: about 60% of the H100 SXM's 989 dense bf16 TFLOPS (NVIDIA's H100 datasheet);
    a healthy GPU reaches 650-750 in an 8192^3 bf16 matmul, a throttled or faulty one far less.
  - max_temperature_c 85: below the H100's slowdown temperature (NVML reports it as
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, about 90 C), so a GPU near it is caught before it throttles.
  - min_pcie_gen 5, min_pcie_width 16: the H100 SXM's host link (PCIe Gen5 x16), read after the matmul so
    the link is not in its idle power state.
  - min_free_gib 100: room for a few full checkpoints of the largest benchmark (GPT-3's shards per run).
- CPU nodes (the `local-cpu` profile, laptops, CI): gloo over TCP; only what applies, with thresholds
  that catch a broken setup (a rank that cannot reach its peer, a full disk) rather than a slow one.
- H200 SXM: the same HGX board as the H100 SXM (NVLink 4 through NVSwitch, 8x ConnectX-7 NDR, PCIe Gen5
  x16) and the same 989 dense bf16 TFLOPS (NVIDIA's H200 datasheet; workloads/common/gpu_peaks.py), so the
  same row.
Rows are matched by the exact name NVML reports, never a substring: an H100 PCIe (756 TFLOPS, no NVSwitch)
or NVL has "H100" in its name too, and the SXM's thresholds would fail every such node. A model with no row
here (those among them) gets no default: its checks say `skipped: no threshold ...` until the profile sets
them.
"""

from __future__ import annotations

import dataclasses

from harness.profiles import PreflightSettings

_HGX_H100 = dict(min_matmul_tflops=600.0, min_allreduce_busbw_gbps=460.0, allreduce_mib=16384,
                 min_pair_busbw_gbps=40.0, pair_mib=1024, max_temperature_c=85, min_pcie_gen=5, min_pcie_width=16,
                 ib_rate_gbps=400, max_ib_link_errors=6, min_free_gib=100.0)
GPU_DEFAULTS: dict[str, dict] = {  # by the exact name NVML reports
    "NVIDIA H100 80GB HBM3": _HGX_H100,  # H100 SXM5
    "NVIDIA H200": _HGX_H100,  # H200 SXM
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
