"""Backends by name. Each module holds one backend behind the interface in base.py."""

from __future__ import annotations

from harness.errors import HarnessError
from harness.launchers.base import Handle, JobState, Launcher, Request
from harness.launchers.local import LocalLauncher
from harness.launchers.slurm import SlurmLauncher

LAUNCHERS: dict[str, type[Launcher]] = {"local": LocalLauncher, "slurm": SlurmLauncher}
# Backends on the roadmap: named so that a user who asks for one gets a clear answer.
PLANNED = ("k8s",)


def get_launcher(name: str) -> Launcher:
    if name in LAUNCHERS:
        return LAUNCHERS[name]()
    if name in PLANNED:
        raise HarnessError(f"the {name} backend is not in this version yet; available now: {', '.join(LAUNCHERS)}")
    raise HarnessError(f"unknown backend {name!r}; choose one of: {', '.join([*LAUNCHERS, *PLANNED])}")


__all__ = ["Handle", "JobState", "Launcher", "Request", "LAUNCHERS", "get_launcher"]
