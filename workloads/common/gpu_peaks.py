"""Dense bf16 peak FLOP/s per GPU, by the exact name CUDA reports, for MFU.

Matched by the whole name, not a substring: an H100 PCIe or NVL has a lower peak than an
H100 SXM, and "H100" is in all three names. The figures are the vendors' dense (not 2:4
sparse) tensor-core bf16 peaks from their data sheets. A GPU not listed gets None: the
harness reports no MFU rather than a guess.
"""

from __future__ import annotations

PEAK_BF16_FLOPS: dict[str, float] = {
    "NVIDIA H100 80GB HBM3": 989.4e12,  # H100 SXM5
    "NVIDIA H100 PCIe": 756.0e12,
    "NVIDIA H100 NVL": 835.5e12,
    "NVIDIA H200": 989.4e12,  # H200 SXM
    "NVIDIA H200 NVL": 835.5e12,
    "NVIDIA B200": 2250.0e12,
    "NVIDIA GB200": 2500.0e12,  # per GPU of a GB200 superchip
    "NVIDIA A100-SXM4-80GB": 312.0e12,
    "NVIDIA A100-SXM4-40GB": 312.0e12,
    "NVIDIA A100 80GB PCIe": 312.0e12,
    "NVIDIA A100-PCIE-40GB": 312.0e12,
}


def peak_bf16_flops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak, or None when its exact name is not in the table."""
    return PEAK_BF16_FLOPS.get(device_name.strip())


def mfu(flops_per_token: float, tokens_per_second: float, gpus: int, device_name: str) -> float | None:
    """Model FLOPs utilisation: the FLOP/s the model needed over what the GPUs could do at peak; None where the
    peak is unknown."""
    peak = peak_bf16_flops(device_name)
    return flops_per_token * tokens_per_second / (gpus * peak) if peak else None
