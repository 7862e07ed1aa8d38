"""Whether the workloads run under torch.compile. Torch-free, so the CLI can check the choice.

"auto" compiles on GPUs, where fused kernels pay for the compile time many times over, and runs
eagerly on CPU, where compiling the tiny presets takes longer than training them.
"""

from __future__ import annotations

COMPILE_CHOICES = ("auto", "on", "off")
WARM_UP_CHOICES = COMPILE_CHOICES  # the warm-up before run_start (workloads.common.warm_up)


def compile_wanted(choice: str, device_type: str) -> bool:
    return choice == "on" or (choice == "auto" and device_type == "cuda")


def warm_up_wanted(choice: str, device_type: str, compiled: bool) -> bool:
    """"auto" warms up where the first steps cost most: a compiled model, or any GPU run (communicators, the
    allocator, cuBLAS's workspaces); an eager CPU run's first step costs about what a later one does."""
    return choice == "on" or (choice == "auto" and (compiled or device_type == "cuda"))


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far (dynamo's frames and the backward graphs it compiled
    later: tracing, AOTAutograd, Inductor's code generation and its C++/Triton builds); 0 before anything compiled."""
    from torch._dynamo.utils import calculate_time_spent  # torch only when asked: the CLI imports this module

    return calculate_time_spent().get("total_wall_time", 0.0)
