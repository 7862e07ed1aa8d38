"""The start-up check of an image: does its Python and torch meet what the harness imports?

The node agent (`python -m harness.agent`) and every worker (`python -m workloads`) call
`exit_if_unfit()` first. An image too old for the harness would otherwise fail with an
ImportError traceback deep in a checkpoint or FSDP import, on every node of a job that
took an hour to schedule; this says so in the first second, in one line that names the
image (the launchers pass it in HARNESS_IMAGE) and what is missing, and exits 2: a
permanent error, which Kubernetes' ExitCode policy (and the agent) do not retry.

Stdlib only and torch-free, on purpose: it must run where torch is missing or broken.
`AGENT_BOOTSTRAP` covers the image that lacks the harness altogether.
The minimums here are the ones pyproject.toml declares (a test keeps them equal).
"""

from __future__ import annotations

import os
import re
import sys
from importlib import metadata
from typing import Callable

IMAGE_ENV = "HARNESS_IMAGE"
EXIT_UNFIT_IMAGE = 2
BUILD_HINT = "build the harness image (manifests/image/Containerfile)"

MIN_PYTHON = (3, 11)  # hashlib.file_digest
WHY_PYTHON = "hashlib.file_digest"
# distribution -> (minimum (major, minor), what needs it)
MIN_VERSIONS = {
    "torch": ((2, 9), "DefaultStager and StagingOptions in torch.distributed.checkpoint.staging, "
                      "fully_shard in torch.distributed.fsdp"),
    "torchvision": ((0, 24), "the torchvision release of torch 2.9"),
}


def release(version: str) -> tuple[int, ...]:
    """(major, minor, ...) of a version string, without pre-release and local tags: NGC's torch is a
    snapshot such as 2.10.0a0+b4e4ee81d3 of the branch that became 2.10, and counts as 2.10."""
    numbers = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(n) for n in numbers.group().split(".")) if numbers else ()


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def problems(python: tuple[int, ...], version_of: Callable[[str], str | None]) -> list[str]:
    """What this environment lacks, one phrase each; empty when it can run the harness."""
    found = []
    if python[:2] < MIN_PYTHON:
        found.append(f"has Python {'.'.join(map(str, python))}; the harness needs Python>="
                     f"{'.'.join(map(str, MIN_PYTHON))} ({WHY_PYTHON})")
    for distribution, (minimum, why) in MIN_VERSIONS.items():
        version = version_of(distribution)
        needs = f"the harness needs {distribution}>={'.'.join(map(str, minimum))} ({why})"
        if version is None:
            found.append(f"has no {distribution}; {needs}")
        elif release(version)[:2] < minimum:
            found.append(f"has {distribution} {version}; {needs}")
    return found


def image_name() -> str:
    """The image this runs in, as the launcher named it; else the Python that runs it."""
    return os.environ.get(IMAGE_ENV) or f"(the environment of {sys.executable})"


def exit_if_unfit(remedy: str = BUILD_HINT) -> None:
    """Exit 2 with one line on stderr if this image cannot run the harness; return otherwise."""
    found = problems(tuple(sys.version_info[:3]), installed_version)
    if found:
        print(f"harness: image {image_name()} {'; it '.join(found)}: {remedy}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_UNFIT_IMAGE)


# What a node runs as `python -c AGENT_BOOTSTRAP ARGS...`: the node agent, or, in an image without the
# harness, one line naming the image instead of "No module named harness". One line of Python (so the Slurm
# script keeps one srun line) without `$(` (Kubernetes would expand it in a container's args).
AGENT_BOOTSTRAP = (
    "import importlib.util,os,sys;"
    "importlib.util.find_spec('harness') or [print('harness: image',"
    f"os.environ.get({IMAGE_ENV!r}) or '(the environment of '+sys.executable+')',"
    f"{'has no harness (no module named harness): ' + BUILD_HINT!r},file=sys.stderr),sys.exit({EXIT_UNFIT_IMAGE})];"
    "import harness.agent;sys.exit(harness.agent.main(sys.argv[1:]))"
)


if __name__ == "__main__":  # how manifests/image/Containerfile checks its BASE_IMAGE before installing anything
    exit_if_unfit("choose a newer BASE_IMAGE (NGC PyTorch 25.12 has torch 2.10 and Python 3.12)")
