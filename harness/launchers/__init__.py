"""Backends by name. Each module holds one backend behind the interface in base.py, and is imported only
when its backend is asked for: `harness report` and `compare` need none, and the local and Slurm
launchers bring preflight with them (a fifth of a warm report's time)."""

from __future__ import annotations

from harness.errors import HarnessError
from harness.launchers.base import Handle, JobState, Launcher, Request, follow

BACKENDS = ("local", "slurm", "k8s")


def get_launcher(name: str) -> Launcher:
    if name == "local":
        from harness.launchers.local import LocalLauncher

        return LocalLauncher()
    if name == "slurm":
        from harness.launchers.slurm import SlurmLauncher

        return SlurmLauncher()
    if name == "k8s":
        from harness.launchers.kubernetes import KubernetesLauncher  # the kubernetes client loads slowly

        return KubernetesLauncher()
    raise HarnessError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Handle", "JobState", "Launcher", "Request", "follow", "get_launcher"]
