"""Container settings: ``[container]`` keys, ``SPOTGUARD_CONTAINER_*`` env vars.

Which podman and runc spotguard drives for container jobs (``podman:NAME``) and, where a host
keeps containers somewhere else than podman's default, its storage (``--root`` /
``--runroot``: the tests always give private ones, so no container runtime configured on the
host is touched). For ``containerd:NAMESPACE/ID`` jobs: which ``ctr`` and which containerd
socket (``containerd_address``; the tests start their own daemon). For ``docker:NAME``:
which ``docker``, which daemon (``docker_host``) and the name of the runtime entry the daemon
has for spotguard's runc wrapper (``docker_runtime``).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from spotguard.config import Settings

#: where scripts/install-podman puts podman, conmon and runc
PREFIX = Path("/opt/spotguard/podman")
#: where scripts/install-containerd puts containerd, ctr, the runc shim and runc
CONTAINERD_PREFIX = Path("/opt/spotguard/containerd")
#: where scripts/install-docker puts dockerd and docker
DOCKER_PREFIX = Path("/opt/spotguard/docker")


class ContainerSettings(Settings):
    """``[container]``: the runtime spotguard checkpoints and restores containers with."""

    section: ClassVar[str] = "container"
    model_config = SettingsConfigDict(
        env_prefix="SPOTGUARD_CONTAINER_", extra="forbid", frozen=True, validate_default=True
    )

    podman: str | None = Field(
        default=None,
        description=(
            "podman executable (default: podman on PATH, else /opt/spotguard/podman/bin/podman "
            "from scripts/install-podman)"
        ),
    )
    runc: str | None = Field(
        default=None,
        description=(
            "runc executable podman runs containers with, told to use spotguard's CRIU "
            "(default: the prefix's runc, else runc on PATH)"
        ),
    )
    root: Path | None = Field(
        default=None, description="podman --root: container storage (default: podman's own)"
    )
    runroot: Path | None = Field(
        default=None, description="podman --runroot: runtime state (default: podman's own)"
    )
    runtime_dir: Path = Field(
        default=Path("/run/spotguard/podman"),
        description=(
            "Where spotguard writes its runc wrapper and CRIU configuration; the same path on "
            "every host, since a restored container names them"
        ),
    )
    timeout: float = Field(
        default=600.0, gt=0, description="Seconds one podman (or ctr) command may take"
    )
    ctr: str | None = Field(
        default=None,
        description=(
            "containerd's ctr executable (default: ctr on PATH, else "
            "/opt/spotguard/containerd/bin/ctr from scripts/install-containerd)"
        ),
    )
    containerd_address: Path = Field(
        default=Path("/run/containerd/containerd.sock"),
        description="The containerd socket ctr talks to (ctr --address)",
    )
    containerd_hosts_dir: Path = Field(
        default=Path("/etc/containerd/certs.d"),
        description=(
            "Registry configuration (hosts.toml per registry: mirrors, CAs, plain HTTP) for a "
            "restore that pulls a missing image; ctr reads it only when told (--hosts-dir), "
            "where the directory exists"
        ),
    )
    docker: str | None = Field(
        default=None,
        description=(
            "docker executable (default: docker on PATH, else /opt/spotguard/docker/bin/docker "
            "from scripts/install-docker)"
        ),
    )
    docker_host: str = Field(
        default="unix:///var/run/docker.sock",
        description="The docker daemon docker talks to (docker -H)",
    )
    docker_runtime: str = Field(
        default="spotguard",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description=(
            "The daemon's runtime entry for spotguard's runc wrapper (dockerd --add-runtime "
            "NAME=<docker_runtime_dir>/runc, or daemon.json runtimes): containers spotguard "
            "starts or restores run with it"
        ),
    )
    docker_runtime_dir: Path = Field(
        default=Path("/run/spotguard/docker"),
        description="Where spotguard writes the runc wrapper docker's runtime entry names",
    )
    containerd_runtime_dir: Path = Field(
        default=Path("/run/spotguard/containerd"),
        description=(
            "Where spotguard writes the runc wrapper (runc with spotguard's CRIU) that "
            "containerd's runc shim runs for containerd jobs, and CRIU's configuration"
        ),
    )
