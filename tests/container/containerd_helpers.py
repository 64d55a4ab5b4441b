"""Shared by the containerd tests: one "VM" is its own containerd daemon
(:class:`~spotguard.container.containerd_vm.ContainerdVm`: own root, state and socket under a
short temp dir, the CRI plugin off) and its own spotguard state dir; the job's image is an OCI
layout built offline from a rootfs of the host's ``dash`` and ``sleep`` (no registry)."""

from __future__ import annotations

import os
import time

from spotguard.container.containerd_vm import ContainerdVm
from spotguard.container.runtime import CRIU_RETRY_S
from spotguard.errors import ContainerError

IMAGE = "localhost/sg-counter:1"
NS = "sg"


class CtrVm(ContainerdVm):
    """A VM whose ``ctr`` defaults to the tests' namespace, and the CLI's environment."""

    def ctr(self, *args: str, check: bool = True, ns: str = NS) -> str:
        """``ctr ARGS``; a user's ``tasks checkpoint`` whose CRIU failed is run once more, as
        spotguard's own checkpoint is (``runtime.once_more_if_criu_failed``): CI saw runc's
        CRIU fail it once ("Unseizable non-zombie ... state D" past its 10 s seize timeout),
        and the tests that run it check spotguard's checkpoint beside it, not ctr's."""
        try:
            return super().ctr(*args, check=check, ns=ns)
        except ContainerError as exc:
            if args[:2] != ("tasks", "checkpoint") or "criu failed" not in str(exc):
                raise
        time.sleep(CRIU_RETRY_S)
        return super().ctr(*args, check=check, ns=ns)

    def cli_env(self) -> dict[str, str]:
        """The environment that points spotguard's CLI at this VM."""
        return {**os.environ, **self.env()}
