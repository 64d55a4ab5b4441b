"""Real podman (scripts/install-podman's prefix) and containerd (scripts/install-containerd's:
``ctr_vms``, two daemons of their own, see containerd_helpers.py) with real CRIU, in private
storage.

Each "VM" is its own podman storage (``--root`` / ``--runroot`` under a short temp dir: conmon's
socket paths must stay short) and its own spotguard state dir; the host's podman setup, if any,
is never used. The job's image is built offline from a rootfs of the host's own ``dash`` and
``sleep`` (no registry here): imported into VM 1, then ``save``d and ``load``ed into VM 2 so
both have the same image ID, as a registry pull would give.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from containerd_helpers import IMAGE as CTRD_IMAGE
from containerd_helpers import CtrVm
from docker_helpers import IMAGE as DOCKER_IMAGE
from docker_helpers import DockerVm
from podman_helpers import IMAGE, Vm

from sgtest import installed
from spotguard.container.containerd_vm import image_layout
from spotguard.container.demo import rootfs_tar
from spotguard.container.podman import Podman
from spotguard.container.settings import CONTAINERD_PREFIX, DOCKER_PREFIX, PREFIX

ROOT = Path(__file__).resolve().parents[2]


def _install_podman() -> Path | None:
    wrapper = PREFIX / "bin" / "podman"
    if not os.access(wrapper, os.X_OK):
        subprocess.run([str(ROOT / "scripts" / "install-podman")], check=False)
    return wrapper if os.access(wrapper, os.X_OK) else None


@pytest.fixture(scope="session")
def podman_bin(criu_bin: str) -> str:
    """The prefix's podman; skips (fails in CI, SPOTGUARD_REQUIRE_CRIU=1) where it cannot be
    installed."""
    wrapper = _install_podman()
    if wrapper is None:
        if os.environ.get("SPOTGUARD_REQUIRE_CRIU") == "1":
            pytest.fail("podman could not be installed (scripts/install-podman)")
        pytest.skip("podman is not installed (scripts/install-podman)")
    return str(wrapper)


@pytest.fixture
def vms(podman_bin: str, criu_bin: str) -> Iterator[tuple[Vm, Vm]]:
    """Two VMs with the job's image (same ID on both); every container removed after."""
    base = Path(tempfile.mkdtemp(prefix="sgpm-", dir="/tmp"))
    made: list[Vm] = []
    try:
        for n in (1, 2):
            vm = base / f"vm{n}"
            podman = Podman(
                binary=podman_bin,
                runc=str(PREFIX / "bin" / "runc"),
                criu=criu_bin,
                root=vm / "storage",
                runroot=vm / "run",
                timeout=120,
            )
            made.append(Vm(podman, vm / "state"))
        vm1, vm2 = made
        tar = rootfs_tar(base)
        vm1.podman_cmd("import", "--change", 'CMD ["/bin/sh"]', str(tar), IMAGE)
        vm1.podman_cmd("save", "--quiet", "-o", str(base / "image.tar"), IMAGE)
        vm2.podman_cmd("load", "--quiet", "-i", str(base / "image.tar"))
        yield vm1, vm2
    finally:
        for vm in made:
            vm.cleanup()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def containerd_installed(criu_bin: str) -> Path:
    """scripts/install-containerd's prefix; skips (fails in CI, SPOTGUARD_REQUIRE_CRIU=1)
    where it cannot be installed."""
    installed(CONTAINERD_PREFIX / "bin" / "ctr", "install-containerd")
    return CONTAINERD_PREFIX


@pytest.fixture
def ctr_vms(containerd_installed: Path, criu_bin: str) -> Iterator[tuple[CtrVm, CtrVm]]:
    """Two VMs, each its own containerd daemon; the job's image imported into VM 1 only
    (a test imports it into VM 2 with ``vm.ctr("images", "import", ...)`` from
    ``vm.base.parent / "image.tar"``). Every task, container and daemon stopped after."""
    base = Path(tempfile.mkdtemp(prefix="sgcd-", dir="/tmp"))
    made: list[CtrVm] = []
    try:
        for n in (1, 2):
            made.append(CtrVm.start(base / f"vm{n}", criu_bin))
        image = image_layout(rootfs_tar(base), base / "image.tar", CTRD_IMAGE)
        made[0].ctr("images", "import", str(image))
        yield made[0], made[1]
    finally:
        for vm in made:
            vm.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def docker_installed(criu_bin: str) -> Path:
    """scripts/install-docker's prefix; skips (fails in CI, SPOTGUARD_REQUIRE_CRIU=1) where
    it cannot be installed."""
    installed(DOCKER_PREFIX / "bin" / "dockerd", "install-docker")
    return DOCKER_PREFIX


@pytest.fixture
def docker_vms(docker_installed: Path, criu_bin: str) -> Iterator[tuple[DockerVm, DockerVm]]:
    """Two VMs, each its own dockerd, with the job's image (same ID on both: imported into
    VM 1, saved and loaded into VM 2). Every container and daemon stopped after."""
    base = Path(tempfile.mkdtemp(prefix="sgdk-", dir="/tmp"))
    made: list[DockerVm] = []
    try:
        for n in (1, 2):
            made.append(DockerVm.start(base / f"vm{n}", criu_bin))
        vm1, vm2 = made
        tar = rootfs_tar(base)
        vm1.cmd("import", "--change", 'CMD ["/bin/sh"]', str(tar), DOCKER_IMAGE)
        saved = subprocess.run(
            vm1.docker.argv("save", DOCKER_IMAGE), capture_output=True, check=True, timeout=60
        ).stdout
        vm2.cmd("load", "--quiet", stdin=saved)
        yield vm1, vm2
    finally:
        for vm in made:
            vm.stop()
        shutil.rmtree(base, ignore_errors=True)
