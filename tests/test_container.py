"""The harness image, for real: built from manifests/image/Containerfile with podman, on a local stand-in for
NGC's PyTorch image, it runs `harness run resnet` to a compliant log in the host's run folder, mounted at
another path inside; and a plain PyTorch image fails at once, in one line naming it."""

from __future__ import annotations

import os

import pytest

from workloads.common.requirements_check import AGENT_BOOTSTRAP, BUILD_HINT
from tests import container_images as images
from tests.conftest import compliance

pytestmark = pytest.mark.container

TORCH_VERSION = "import importlib.metadata as m; print(m.version('torch'), m.version('torchvision'))"


@pytest.fixture(scope="module")
def podman_env(tmp_path_factory) -> dict:
    missing = images.missing_programs()
    if missing:
        pytest.skip(f"podman is not usable here (missing {', '.join(missing)}); the README's test command installs "
                    "Debian's podman, runc and debootstrap when run as root")
    if os.geteuid() != 0:
        pytest.skip("the container tests build a Debian rootfs with debootstrap and run podman as root; run the "
                    "tests as root")
    env = images.write_containers_conf(tmp_path_factory.mktemp("podman"))
    info = images.podman(env, "info", timeout=120, check=False)
    if info.returncode:
        pytest.skip(f"podman cannot run here: {(info.stderr.strip().splitlines() or ['no reason given'])[-1]}")
    return env


@pytest.fixture(scope="module")
def base(podman_env, tmp_path_factory) -> str:
    return images.base_image(podman_env, tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def image(podman_env, base, tmp_path_factory) -> str:
    return images.harness_image(podman_env, base, tmp_path_factory.mktemp("image"))


def test_the_image_is_labelled_and_keeps_the_base_torch(podman_env, base, image):
    labels = images.podman(podman_env, "image", "inspect", "--format",
                           '{{index .Labels "org.opencontainers.image.version"}} '
                           '{{index .Labels "org.opencontainers.image.base.name"}}', image).stdout.split()
    assert labels == [images.harness_version(), base]
    versions = [images.podman(podman_env, "run", "--rm", name, "python", "-c", TORCH_VERSION, timeout=120).stdout
                for name in (base, image)]
    assert versions[0] == versions[1]  # pip kept the base's torch and torchvision


def test_harness_run_in_the_image_writes_a_compliant_log_to_the_host_folder(podman_env, image, tmp_path):
    host_out = tmp_path / "out"
    host_out.mkdir()
    run = images.podman(podman_env, "run", "--rm", "--network", "host", "--shm-size=1g",
                        f"--volume={host_out}:/results", "--env", f"HARNESS_IMAGE={image}", image,
                        "harness", "run", "resnet", "--out", "/results/tiny", timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "success" in run.stdout
    result = host_out / "tiny" / "result_0.txt"
    assert result.is_file(), sorted(p.name for p in host_out.rglob("*"))
    checked = compliance(result, "4.0.0", cwd=tmp_path)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout + checked.stderr, checked.stdout + checked.stderr


def test_an_image_without_the_harness_fails_at_once_in_one_line_naming_it(podman_env, base):
    # "At once": it stops in the bootstrap, before any agent or rendezvous could wait (the one line shows it),
    # rather than within so many seconds, which a busy machine could miss.
    node = images.podman(podman_env, "run", "--rm", "--env", f"HARNESS_IMAGE={base}", base,
                         "python", "-c", AGENT_BOOTSTRAP, "--out", "/results", timeout=300, check=False)
    assert node.returncode == 2, node.stdout + node.stderr
    assert node.stderr.strip().splitlines() == [f"harness: image {base} has no harness (no module named harness): "
                                                f"{BUILD_HINT}"]
