"""Shared by the containerd tests: one "VM" is its own containerd daemon
(:class:`~spotguard.container.containerd_vm.ContainerdVm`: own root, state and socket under a
short temp dir, the CRI plugin off) and its own spotguard state dir; the job's image is an OCI
layout built offline from a rootfs of the host's ``dash`` and ``sleep`` (no registry)."""

from __future__ import annotations

import os

from spotguard.container.containerd_vm import ContainerdVm

IMAGE = "localhost/sg-counter:1"
NS = "sg"


class CtrVm(ContainerdVm):
    """A VM whose ``ctr`` defaults to the tests' namespace, and the CLI's environment."""

    def ctr(self, *args: str, check: bool = True, ns: str = NS) -> str:
        return super().ctr(*args, check=check, ns=ns)

    def cli_env(self) -> dict[str, str]:
        """The environment that points spotguard's CLI at this VM."""
        return {**os.environ, **self.env()}
