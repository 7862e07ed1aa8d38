"""Backends by name. Each module holds one backend behind the interface in base.py."""

from __future__ import annotations

from harness.errors import HarnessError
from harness.launchers.base import Handle, JobState, Launcher, Request
from harness.launchers.local import LocalLauncher
from harness.launchers.slurm import SlurmLauncher

BACKENDS = ("local", "slurm", "k8s")


def get_launcher(name: str) -> Launcher:
    if name == "local":
        return LocalLauncher()
    if name == "slurm":
        return SlurmLauncher()
    if name == "k8s":
        from harness.launchers.kubernetes import KubernetesLauncher  # the kubernetes client loads slowly

        return KubernetesLauncher()
    raise HarnessError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Handle", "JobState", "Launcher", "Request", "get_launcher"]
