"""Which runtime backend serves a container job: the one place a runtime's name becomes its
class (:class:`~spotguard.container.runtime.ContainerRuntime`)."""

from __future__ import annotations

from spotguard.container.containerd import Containerd
from spotguard.container.docker import Docker
from spotguard.container.podman import Podman
from spotguard.container.runtime import ContainerRuntime
from spotguard.container.settings import ContainerSettings
from spotguard.container.spec import Runtime

#: each runtime's backend; typed so that mypy checks both satisfy the one protocol
BACKENDS: dict[Runtime, type[ContainerRuntime]] = {
    "podman": Podman,
    "docker": Docker,
    "containerd": Containerd,
}


def runtime_for(
    runtime: Runtime, settings: ContainerSettings, *, criu: str | None
) -> Podman | Containerd | Docker:
    """The backend of ``runtime`` as ``[container]`` says (CRIU: ``criu`` or the search)."""
    if runtime == "containerd":
        return Containerd.from_settings(settings, criu=criu)
    if runtime == "docker":
        return Docker.from_settings(settings, criu=criu)
    return Podman.from_settings(settings, criu=criu)
