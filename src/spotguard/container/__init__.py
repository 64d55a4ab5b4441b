"""Jobs in containers: a podman, docker or containerd container checkpointed and restored like
a process.

A job named ``podman:NAME`` is a container. Its checkpoint is podman's own (``podman container
checkpoint --export``: runc drives spotguard's CRIU over the container's process tree, podman
adds the writable layer and its config), carried into the store as a spotguard image — chunked,
zstd, BLAKE3, signed manifest last — whose meta records the container's config (typed:
:class:`~spotguard.container.spec.ContainerImage`). Restore verifies the whole image and checks
the host (image, mounts, devices) before ``podman container restore --import`` creates the new
container. A ``containerd:NAMESPACE/ID`` job is the same story through ``ctr`` (``containerd``:
the runtime, ``containerd_ops``: start, checkpoint, restore): containerd's task checkpoint
(runc with spotguard's CRIU, the writable layer's diff, the OCI spec) carried as an OCI layout
that ``ctr containers restore`` takes. A ``docker:NAME`` job: ``docker checkpoint create``
through the daemon's runtime entry for spotguard's runc, plus the writable layer and docker's
inspect (``docker``, ``docker_ops``). The backends satisfy one protocol
(``runtime.ContainerRuntime``); ``backends.runtime_for`` picks one by the job's runtime and
``dispatch`` runs the backend's own operation.
docs/ARCHITECTURE.md, "Containers", says which piece is the runtime's and which is ours.

Modules: ``spec`` (names and the typed record), ``podman`` (the one way podman is run),
``start`` (``spotguard run --container``), ``checkpoint``, ``restore``, ``park``, ``archive``,
``settings``, ``cli`` (what the commands hand over), ``guard`` (the agent's container jobs:
``spotguard agent --job podman:NAME`` and assignments of container images), ``demo``
(``spotguard demo --container``), ``containerd_vm`` / ``docker_vm`` (daemons of spotguard's
own: the demo's and the tests' VMs).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spotguard.container.checkpoint import ContainerCheckpoint, checkpoint_container
    from spotguard.container.containerd import Containerd
    from spotguard.container.docker import Docker
    from spotguard.container.podman import Podman
    from spotguard.container.restore import ContainerRestore, restore_container
    from spotguard.container.runtime import ContainerRuntime
    from spotguard.container.settings import ContainerSettings
    from spotguard.container.spec import (
        ContainerConfig,
        ContainerImage,
        ContainerRef,
        is_container_image,
        is_container_job,
    )
    from spotguard.container.start import start_container

#: where each name of the package is defined: imported when first asked for, so a command
#: that needs one module (``spotguard checkpoint`` of a process job needs the option
#: definitions only) does not import every backend before its freeze (issue 25, item 5)
_WHERE = {
    "ContainerCheckpoint": "checkpoint",
    "checkpoint_container": "checkpoint",
    "Containerd": "containerd",
    "Docker": "docker",
    "Podman": "podman",
    "ContainerRestore": "restore",
    "restore_container": "restore",
    "ContainerRuntime": "runtime",
    "ContainerSettings": "settings",
    "ContainerConfig": "spec",
    "ContainerImage": "spec",
    "ContainerRef": "spec",
    "is_container_image": "spec",
    "is_container_job": "spec",
    "start_container": "start",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{where}"), name)


__all__ = [
    "ContainerCheckpoint",
    "ContainerConfig",
    "ContainerImage",
    "ContainerRef",
    "ContainerRestore",
    "ContainerRuntime",
    "ContainerSettings",
    "Containerd",
    "Docker",
    "Podman",
    "checkpoint_container",
    "is_container_image",
    "is_container_job",
    "restore_container",
    "start_container",
]
