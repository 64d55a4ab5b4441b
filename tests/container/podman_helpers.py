"""Shared by the container tests: the job's image, one "VM" (its own podman storage and state
dir)."""

from __future__ import annotations

import os
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from spotguard.container.podman import Podman

IMAGE = "localhost/sg-counter:1"


def rootfs_tar(dest: Path) -> Path:
    """A tarball rootfs with /bin/sh (dash), /bin/sleep and the libraries they load."""
    files = {"/bin/sh": "bin/sh", "/bin/sleep": "bin/sleep"}
    for binary in ("/bin/sh", "/bin/sleep"):
        out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            path = line.split("=>")[-1].split("(")[0].strip()
            if path.startswith("/"):
                files[path] = path.lstrip("/")
    tar = dest / "rootfs.tar"
    with tarfile.open(tar, "w") as t:
        for src, name in files.items():
            t.add(os.path.realpath(src), arcname=name)
        for d in ("data", "tmp"):
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            t.addfile(info)
    return tar


@dataclass
class Vm:
    """One "VM": its own podman storage and spotguard state dir."""

    podman: Podman
    state_dir: Path

    def cli_env(self) -> dict[str, str]:
        """The environment that points spotguard's CLI at this VM."""
        env = dict(os.environ)
        env.update(
            SPOTGUARD_STATE_DIR=str(self.state_dir),
            SPOTGUARD_CONTAINER_ROOT=str(self.podman.root),
            SPOTGUARD_CONTAINER_RUNROOT=str(self.podman.runroot),
            SPOTGUARD_CONTAINER_PODMAN=self.podman.binary,
            SPOTGUARD_CRIU=self.podman.criu,
        )
        return env

    def podman_cmd(self, *args: str, check: bool = True) -> str:
        self.podman.prepare()
        out = subprocess.run(
            self.podman.argv(*args),
            env=self.podman.env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: {out.stderr[-2000:]}")
        return out.stdout

    def cleanup(self) -> None:
        self.podman_cmd("rm", "--all", "--force", "--time", "0", check=False)
        self.podman_cmd("system", "reset", "--force", check=False)
