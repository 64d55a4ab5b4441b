"""``spotguard run --container podman:NAME -- IMAGE ARGS``: start a container that spotguard
can checkpoint.

What it adds to a plain ``podman run --detach``: spotguard's runtime (runc with spotguard's
CRIU, :class:`~spotguard.container.podman.Podman`), the CRIU configuration annotation
(nftables network lock), bounded ``nofile`` / ``nproc`` limits (podman's defaults ask for
more than a process without CAP_SYS_RESOURCE may set, and CRIU sizes its descriptor table from
``nofile``) and, unless told otherwise, ``--network none`` (a network namespace
with only loopback: nothing outside the container to lose).
"""

from __future__ import annotations

import resource
from collections.abc import Sequence

from spotguard.container.podman import CRIU_CONFIG_ANNOTATION, Podman
from spotguard.container.spec import ContainerRef
from spotguard.errors import JobError

#: ``nofile`` at most (CRIU sizes its descriptor table from it; podman's default is 1048576)
MAX_NOFILE = 65536
#: ``nproc``: podman runs runc under a hard limit of its own (32768 seen with podman 4.3), so a
#: container asking for more fails to start; root's own processes are not counted by the
#: kernel, so for root containers the value only has to be accepted
NPROC = 4096


def nofile_limit() -> str:
    """``SOFT:HARD`` for ``nofile``: :data:`MAX_NOFILE`, or less where our hard limit is."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = MAX_NOFILE if hard == resource.RLIM_INFINITY else min(hard, MAX_NOFILE)
    return f"{n}:{n}"


async def start_container(
    ref: ContainerRef,
    image: str,
    args: Sequence[str],
    *,
    podman: Podman,
    volumes: Sequence[str] = (),
    env: Sequence[str] = (),
    devices: Sequence[str] = (),
    network: str = "none",
) -> str:
    """Start ``image`` with ``args`` as the detached container ``ref``; its ID."""
    if await podman.exists("container", ref.name):
        raise JobError(f"a container named {ref.name!r} already exists (podman rm it first)")
    argv = ["run", "--detach", "--name", ref.name, "--network", network]
    argv += ["--annotation", f"{CRIU_CONFIG_ANNOTATION}={podman.criu_conf}"]
    argv += ["--ulimit", f"nofile={nofile_limit()}", "--ulimit", f"nproc={NPROC}:{NPROC}"]
    for v in volumes:
        argv += ["--volume", v]
    for e in env:
        argv += ["--env", e]
    for d in devices:
        argv += ["--device", d]
    out = await podman.run(*argv, image, *args, what=f"starting {ref}")
    return out.strip().splitlines()[-1] if out.strip() else ""
