"""Shared by the container tests: the job's image, one "VM" (its own podman storage and state
dir)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from spotguard.container.podman import Podman

IMAGE = "localhost/sg-counter:1"


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
