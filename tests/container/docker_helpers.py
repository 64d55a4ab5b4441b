"""Shared by the docker tests: one "VM" is its own dockerd
(:class:`~spotguard.container.docker_vm.DockerVm`: own data root, exec root, pid file and
socket under a short temp dir, ``--experimental``, the ``spotguard`` runtime entry) and its
own spotguard state dir; the job's image is imported from a rootfs of the host's ``dash`` and
``sleep`` (no registry)."""

from __future__ import annotations

import os

from spotguard.container.docker_vm import DockerVm as _DockerVm

IMAGE = "localhost/sg-counter:1"


class DockerVm(_DockerVm):
    """A VM with the CLI's environment."""

    def cli_env(self) -> dict[str, str]:
        """The environment that points spotguard's CLI at this VM."""
        return {**os.environ, **self.env()}
