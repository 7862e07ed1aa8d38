"""Podman for the container tests: the machine's limits, a local stand-in for an NGC base image, the harness image.

No image registry is reachable from the tests, so the base is built here: a Debian rootfs from debootstrap,
imported with `podman import`, plus torch and torchvision in a venv (tests/container/base.Containerfile).
It is tagged by a hash of everything that goes into it, so a second run on the same machine reuses it.
pip inside the builds sees what the host's pip sees: the host's local package indexes and wheel folders,
mounted read-only at the same paths, and the host's CA bundle as the `pip_ca` build secret (through an
intercepting TLS proxy, PyPI is reachable only with it).
"""

from __future__ import annotations

import hashlib
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from tests.conftest import REPO

PROGRAMS = ("podman", "runc", "debootstrap")
DEBIAN_SUITE = "bookworm"  # its python3 is 3.11, the harness's minimum
DEBIAN_PYTHON_TAG = "cp311"
DEBIAN_PACKAGES = "python3,python3-venv"
BASE_CONTAINERFILE = REPO / "tests" / "container" / "base.Containerfile"
HARNESS_CONTAINERFILE = REPO / "manifests" / "image" / "Containerfile"
BUILD_TIMEOUT_S = 900


def missing_programs() -> list[str]:
    return [name for name in PROGRAMS if shutil.which(name) is None]


def write_containers_conf(folder: Path) -> dict:
    """The environment for podman here: runc (crun refuses this cgroup layout) and explicit nofile and nproc
    limits that this machine allows (runc cannot set nproc above kernel.pid_max here)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], int(Path("/proc/sys/kernel/pid_max").read_text()))
    conf = folder / "containers.conf"
    conf.write_text(f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
                    '[engine]\nruntime = "runc"\n')
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(env: dict, *args: str, timeout: float = BUILD_TIMEOUT_S, check: bool = True,
           **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], env=env, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode:
        raise AssertionError(f"podman {' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


# --- what the host's pip sees --------------------------------------------------------------------

def host_pip_config() -> dict[str, list[str]]:
    """The host pip's settings (files and PIP_* variables): key without its section -> values."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            timeout=60).stdout
    config: dict[str, list[str]] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        config[key.rpartition(".")[2]] = value.strip().strip("'\"").split()
    return config


def local_pip_sources(config: dict[str, list[str]]) -> tuple[list[str], list[str], list[Path]]:
    """(extra index URLs, find-links, folders to mount read-only): the host's local sources of packages."""
    indexes, links = config.get("extra-index-url", []), config.get("find-links", [])
    folders = []
    for source in indexes:
        if source.startswith("file://"):  # a simple index links to files beside it: mount its parent
            folders.append(Path(urlparse(source).path).parent)
    for source in links:
        path = Path(urlparse(source).path if source.startswith("file://") else source)
        if path.is_dir():
            folders.append(path)
    return indexes, links, [f for f in folders if f.is_dir()]


def local_torch_pins(folders: list[Path]) -> tuple[str, str]:
    """Requirements for torch and its torchvision: the newest pair of wheels for the base's Python in the
    host's local folders (a pair: torchvision 0.(N+15) is the one of torch 2.N, and a CUDA torchvision does
    not load with a CPU-only torch); without one, whatever PyPI has, which is a download of several GB."""
    wheel = re.compile(rf"(torch|torchvision)-(\d+)\.(\d+)\.(\d+)-{DEBIAN_PYTHON_TAG}-{DEBIAN_PYTHON_TAG}-"
                       r"manylinux[^/]*_x86_64\.whl$")
    found: dict[str, set[tuple[int, int, int]]] = {"torch": set(), "torchvision": set()}
    for folder in folders:
        for path in folder.rglob("torch*.whl"):
            match = wheel.match(path.name)
            if match:
                found[match[1]].add(tuple(int(n) for n in match.groups()[1:]))
    for torch in sorted(found["torch"], reverse=True):
        vision = [v for v in found["torchvision"] if v[:2] == (0, torch[1] + 15)]
        if torch[0] == 2 and vision:
            return "torch==" + ".".join(map(str, torch)), "torchvision==" + ".".join(map(str, max(vision)))
    return "torch", "torchvision"


def host_ca_bundle(config: dict[str, list[str]]) -> Path | None:
    """The CA bundle the host's pip trusts (an intercepting proxy's CA among them), if it names one."""
    for candidate in (*config.get("cert", []), os.environ.get("SSL_CERT_FILE", "")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def pip_build_args(config: dict[str, list[str]]) -> list[str]:
    """What podman build needs to let pip in the build see what the host's pip sees."""
    args = []
    ca = host_ca_bundle(config)
    if ca:
        args += ["--secret", f"id=pip_ca,src={ca}"]
    return args


# --- the images ----------------------------------------------------------------------------------

def base_image(env: dict, work: Path) -> str:
    """The stand-in for an NGC PyTorch image, built once per machine (tagged by what goes into it)."""
    config = host_pip_config()
    indexes, links, folders = local_pip_sources(config)
    torch, vision = local_torch_pins(folders)
    recipe = "\n".join([DEBIAN_SUITE, DEBIAN_PACKAGES, torch, vision, *indexes, *links,
                        BASE_CONTAINERFILE.read_text()])
    tag = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    name = f"localhost/mlperf-harness-test-base:{tag}"
    if podman(env, "image", "exists", name, check=False).returncode == 0:
        return name
    rootfs = Path(tempfile.mkdtemp(prefix="rootfs-", dir=work))
    try:
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={DEBIAN_PACKAGES}", DEBIAN_SUITE,
                        str(rootfs)], check=True, capture_output=True, timeout=BUILD_TIMEOUT_S)
        os_image = f"localhost/mlperf-harness-test-os:{tag}"
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        podman(env, "import", "-", os_image, stdin=tar.stdout)
        assert tar.wait() == 0
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    cache = Path.home() / ".cache" / "pip"
    cache.mkdir(parents=True, exist_ok=True)
    mounts = [f"--volume={cache}:/root/.cache/pip"] + [f"--volume={f}:{f}:ro" for f in folders]
    podman(env, "build", "--network", "host", "-f", str(BASE_CONTAINERFILE), *mounts, *pip_build_args(config),
           "--build-arg", f"OS_IMAGE={os_image}", "--build-arg", f"TORCH={torch}", "--build-arg",
           f"TORCHVISION={vision}", "--build-arg", f"PIP_EXTRA_INDEX_URL={' '.join(indexes)}", "--build-arg",
           f"PIP_FIND_LINKS={' '.join(links)}", "-t", name, str(BASE_CONTAINERFILE.parent))
    podman(env, "untag", os_image)  # its layer stays, as the base's parent
    return name


def harness_version() -> str:
    return re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)[1]


TEST_IMAGE_LABEL = "org.mlperf-harness.test-image=1"


def harness_image(env: dict, base: str, work: Path) -> str:
    """manifests/image/Containerfile on `base`, built as a user builds it (from the repository root); its ID,
    which no other test session's build can retag meanwhile.

    Each session's build takes the tag from the last one's image, which would stay behind untagged (0.6 GB of
    its own each): those with the tests' label that no container uses are removed (a session still running
    another's image keeps it)."""
    iidfile = work / "harness-image.id"
    podman(env, "build", "--network", "host", "-f", str(HARNESS_CONTAINERFILE), *pip_build_args(host_pip_config()),
           "--build-arg", f"BASE_IMAGE={base}", "--build-arg", f"HARNESS_VERSION={harness_version()}",
           "--label", TEST_IMAGE_LABEL, "--iidfile", str(iidfile), "-t", "localhost/mlperf-harness:test", str(REPO))
    podman(env, "image", "prune", "--force", "--filter", f"label={TEST_IMAGE_LABEL}", check=False)
    return iidfile.read_text().strip()
