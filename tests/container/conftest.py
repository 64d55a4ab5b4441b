"""Real podman (scripts/install-podman's prefix) with real CRIU, in private storage.

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
from podman_helpers import IMAGE, Vm

from spotguard.container.demo import rootfs_tar
from spotguard.container.podman import Podman
from spotguard.container.settings import PREFIX

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
