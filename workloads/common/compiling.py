"""Whether the workloads run under torch.compile. Torch-free, so the CLI can check the choice.

"auto" compiles on GPUs, where fused kernels pay for the compile time many times over, and runs
eagerly on CPU, where compiling the tiny presets takes longer than training them.
"""

from __future__ import annotations

COMPILE_CHOICES = ("auto", "on", "off")


def compile_wanted(choice: str, device_type: str) -> bool:
    return choice == "on" or (choice == "auto" and device_type == "cuda")
