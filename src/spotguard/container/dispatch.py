"""The container operations whatever the runtime: each picks the backend's own function by
the backend's class (podman: checkpoint.py, restore.py, start.py; containerd:
containerd_ops.py), so the commands, park and the agent's guard are written once."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spotguard import warm
from spotguard.container import containerd_ops, ctrspec, docker_ops
from spotguard.container.checkpoint import (
    ContainerCheckpoint,
    checkpoint_container,
)
from spotguard.container.checkpoint import (
    inspect_running as podman_running,
)
from spotguard.container.containerd import Containerd
from spotguard.container.docker import Docker
from spotguard.container.podman import Podman
from spotguard.container.restore import ContainerRestore, restore_container
from spotguard.container.spec import ContainerRef
from spotguard.container.start import start_container
from spotguard.image.settings import ImageSettings
from spotguard.statedir import StateDir

Backend = Podman | Containerd | Docker


async def start(
    ref: ContainerRef, image: str, args: Sequence[str], *, backend: Backend, **opts: Any
) -> str:
    """Start a container that spotguard can checkpoint (``spotguard run --container``)."""
    if isinstance(backend, Containerd):
        return await containerd_ops.start_containerd(ref, image, args, ctrd=backend, **opts)
    if isinstance(backend, Docker):
        return await docker_ops.start_docker(ref, image, args, docker=backend, **opts)
    return await start_container(ref, image, args, podman=backend, **opts)


async def checkpoint(
    ref: ContainerRef, store_url: str, *, backend: Backend, **opts: Any
) -> ContainerCheckpoint:
    """Checkpoint the running container ``ref`` into the store (see each backend), holding
    the agent's memory warm-up back meanwhile (``opts["state_dir"]``)."""
    with warm.holding_back(StateDir(opts["state_dir"]).container_busy):
        if isinstance(backend, Containerd):
            return await containerd_ops.checkpoint_containerd(ref, store_url, ctrd=backend, **opts)
        if isinstance(backend, Docker):
            return await docker_ops.checkpoint_docker(ref, store_url, docker=backend, **opts)
        return await checkpoint_container(ref, store_url, podman=backend, **opts)


async def restore(
    image_url: str,
    *,
    backend: Backend,
    image_settings: ImageSettings,
    state_dir: Path,
    name: str | None = None,
) -> ContainerRestore:
    """Restore a container image as a new container (``backend``: the image's runtime's),
    holding the agent's memory warm-up back meanwhile."""
    opts: dict[str, Any] = {
        "image_settings": image_settings, "state_dir": state_dir, "name": name,
    }  # fmt: skip
    with warm.holding_back(StateDir(state_dir).container_busy):
        if isinstance(backend, Containerd):
            return await containerd_ops.restore_containerd(image_url, ctrd=backend, **opts)
        if isinstance(backend, Docker):
            return await docker_ops.restore_docker(image_url, docker=backend, **opts)
        return await restore_container(image_url, podman=backend, **opts)


async def inspect(backend: Backend, ref: ContainerRef) -> dict[str, Any] | None:
    """The container's state in podman's inspect shape (``State.Status``, ``State.Pid``,
    ``Id``); None when there is no such container."""
    if isinstance(backend, Containerd):
        return await backend.inspect(ref)
    return await backend.inspect(ref.name)


async def running(backend: Backend, ref: ContainerRef) -> None:
    """JobNotFound when there is no container ``ref``, JobError when it does not run."""
    if isinstance(backend, Containerd):
        await containerd_ops.inspect_running(backend, ref)
    elif isinstance(backend, Docker):
        await docker_ops.inspect_running(backend, ref)
    else:
        await podman_running(backend, ref)


async def pause(backend: Backend, ref: ContainerRef, *, what: str) -> None:
    """Freeze the container's processes in memory (the cgroup freezer)."""
    if isinstance(backend, Containerd):
        await backend.run("tasks", "pause", ref.name, namespace=ref.namespace, what=what)
    else:
        await backend.run("pause", ref.name, what=what)


async def unpause(backend: Backend, ref: ContainerRef, *, what: str) -> None:
    """Thaw what :func:`pause` froze."""
    if isinstance(backend, Containerd):
        await backend.run("tasks", "resume", ref.name, namespace=ref.namespace, what=what)
    else:
        await backend.run("unpause", ref.name, what=what)


async def recover_held(backend: Backend, state_dir: Path) -> None:
    """Put back what a killed checkpoint of this runtime moved aside and kept in
    ``state_dir`` (containerd: its spec blobs, :mod:`.ctrspec`); the agent runs it as it starts
    guarding a container. Never raises."""
    if isinstance(backend, Containerd):
        await ctrspec.recover_held(backend, state_dir)
