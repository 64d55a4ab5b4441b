"""The CLI's container side: ``spotguard run --container``, ``checkpoint podman:NAME`` (or
``containerd:NAMESPACE/ID``) and ``restore`` of a container image. ``commands/checkpoint.py``
hands over to these when a job name is a container's or an image is a container image; the
backend is the job's runtime (:func:`~spotguard.container.backends.runtime_for`); settings are
loaded here, at the edge (``[container]``, ``[checkpoint]`` state_dir, ``[image]``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from spotguard.cli import config
from spotguard.config import load
from spotguard.container.settings import ContainerSettings
from spotguard.container.spec import ContainerImage, ContainerRef, Runtime, is_container_image
from spotguard.errors import ConfigError, ImageError
from spotguard.image.reader import ImageReader
from spotguard.image.settings import ImageSettings

if TYPE_CHECKING:
    from spotguard.container.dispatch import Backend

F = TypeVar("F", bound=Callable[..., Any])

#: the options ``spotguard run`` takes for a container (popped before its own settings)
RUN_KEYS = ("container", "volume", "env", "network", "device")


def run_options(fn: F) -> F:
    """``--container`` and the few ``podman run`` options spotguard passes on."""
    opts = [
        click.option(
            "--container",
            "container",
            default=None,
            metavar="podman:NAME|docker:NAME|containerd:NS/ID",
            help="Start a container instead: COMMAND is IMAGE [ARGS...] (docs/containers.md).",
        ),
        click.option(
            "-v", "--volume", "volume", multiple=True, help="With --container: a bind mount."
        ),
        click.option("-e", "--env", "env", multiple=True, help="With --container: NAME=VALUE."),
        click.option(
            "--network", "network", default=None, help="With --container: network (none)."
        ),
        click.option("--device", "device", multiple=True, help="With --container: a device."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def split_run_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """Remove the container options from ``run``'s flags; refuse them without --container."""
    mine = {k: flags.pop(k, None) for k in RUN_KEYS}
    if mine["container"] is None and any(mine[k] for k in RUN_KEYS[1:]):
        raise ConfigError("--volume, --env, --network and --device go with --container")
    return mine


def backend_for(ctx: click.Context, runtime: Runtime, criu: str | None) -> Backend:
    """The runtime backend of a job or image (``[container]`` settings)."""
    from spotguard.container.backends import runtime_for  # the backends: when one is used

    settings = load(ContainerSettings, {}, config_file=config(ctx))
    return runtime_for(runtime, settings, criu=criu)


def run(
    ctx: click.Context,
    mine: dict[str, Any],
    command: tuple[str, ...],
    criu: str | None,
    as_json: bool,
) -> None:
    """``spotguard run --container podman:NAME -- IMAGE ARGS``."""
    from spotguard.container import dispatch  # the backends, when one is used

    ref = ContainerRef.parse(mine["container"])
    image, *args = command
    backend = backend_for(ctx, ref.runtime, criu)
    opts: dict[str, Any] = {
        "volumes": mine["volume"] or (),
        "env": mine["env"] or (),
        "devices": mine["device"] or (),
        "network": mine["network"] or "none",
    }
    cid = asyncio.run(dispatch.start(ref, image, args, backend=backend, **opts))
    if as_json:
        click.echo(json.dumps({"job": str(ref), "id": cid}))
    else:
        click.echo(f"container {ref} started ({cid[:12]}): checkpoint it as {ref}")


def checkpoint(
    ctx: click.Context,
    job: str,
    to: str,
    *,
    leave_running: bool,
    as_json: bool,
    state_dir: Path,
    criu: str | None,
    tcp_established: bool,
) -> None:
    """``spotguard checkpoint podman:NAME --to STORE_URL``."""
    from spotguard import operations
    from spotguard.container import dispatch  # the backends, when one is used

    ref = ContainerRef.parse(job)
    if not operations.is_url(to):
        raise ConfigError(
            f"a container is checkpointed to a store URL (file:///DIR, s3://, gs://), not {to!r}"
        )
    image = load(ImageSettings, {}, config_file=config(ctx))
    backend = backend_for(ctx, ref.runtime, criu)
    opts: dict[str, Any] = {
        "image_settings": image,
        "state_dir": state_dir,
        "leave_running": leave_running,
        "tcp_established": tcp_established,
    }
    result = asyncio.run(dispatch.checkpoint(ref, to, backend=backend, **opts))
    if as_json:
        click.echo(json.dumps(result.to_json()))
    else:
        click.echo(
            f"container {ref} checkpointed to {result.image_url} ({result.mode}); "
            f"{result.bytes} bytes, {result.stored_bytes} stored"
        )


async def _container_image(url: str, settings: ImageSettings) -> tuple[str, Runtime] | None:
    """The resolved URL of the image at ``url`` and its container's runtime if it is a
    container image, else None."""
    async with ImageReader(url, settings=settings) as reader:
        meta = reader.manifest.meta
        if not is_container_image(meta):
            return None
        return reader.url, ContainerImage.from_meta(meta, reader.url).runtime


def restore(
    ctx: click.Context,
    url: str,
    *,
    name: str | None,
    as_json: bool,
    state_dir: Path,
    criu: str | None,
) -> bool:
    """Restore ``url`` as a container if it is a container image; False when it is not (the
    caller restores a process). ``--name`` is only for container images."""
    from spotguard.container import dispatch  # the backends, when one is used

    settings = load(ImageSettings, {}, config_file=config(ctx))
    found = asyncio.run(_container_image(url, settings))
    if found is None:
        if name is not None:
            raise ImageError(f"{url} holds a process, not a container: --name does not apply")
        return False
    resolved, runtime = found
    backend = backend_for(ctx, runtime, criu)
    result = asyncio.run(
        dispatch.restore(
            resolved, backend=backend, image_settings=settings, state_dir=state_dir, name=name
        )
    )
    if as_json:
        click.echo(json.dumps(result.to_json()))
    else:
        click.echo(f"container {result.container} restored from {resolved} ({result.id[:12]})")
    return True


def park(
    ctx: click.Context,
    job: str,
    to: str,
    *,
    reason: str,
    as_json: bool,
    state_dir: Path,
    criu: str | None,
) -> None:
    """``spotguard park podman:NAME [--to memory|disk|tmpfs|URL]``."""
    from spotguard.container import park as parking

    ref = ContainerRef.parse(job)
    rec = asyncio.run(
        parking.park(
            ref,
            to,
            podman=backend_for(ctx, ref.runtime, criu),
            image_settings=load(ImageSettings, {}, config_file=config(ctx)),
            state_dir=state_dir,
            reason=reason,
        )
    )
    if as_json:
        click.echo(rec.model_dump_json())
    else:
        where = f" ({rec.image_url})" if rec.image_url else ""
        click.echo(f"container {ref} parked to {rec.place}{where}: {rec.seconds:.2f} s")


def unpark(
    ctx: click.Context, job: str, *, as_json: bool, state_dir: Path, criu: str | None
) -> None:
    """``spotguard unpark podman:NAME``."""
    from spotguard.container import park as parking

    ref = ContainerRef.parse(job)
    rec = asyncio.run(
        parking.unpark(
            ref,
            podman=backend_for(ctx, ref.runtime, criu),
            image_settings=load(ImageSettings, {}, config_file=config(ctx)),
            state_dir=state_dir,
        )
    )
    if as_json:
        click.echo(json.dumps({"container": str(ref), "place": rec.place}))
    else:
        click.echo(f"container {ref} unparked from {rec.place}")


def demo(
    ctx: click.Context,
    *,
    as_json: bool,
    workdir: Path | None,
    keep: bool,
    runtime: str = "podman",
) -> bool:
    """``spotguard demo --container [--runtime containerd|docker]``
    (:mod:`spotguard.container.demo`); True if it held."""
    import shutil
    import tempfile

    from spotguard.checkpoint.settings import CheckpointSettings
    from spotguard.container.demo import run_container_demo

    criu = load(CheckpointSettings, {}, config_file=config(ctx)).criu
    chosen: Runtime = "docker" if runtime == "docker" else "podman"
    if runtime == "containerd":
        chosen = "containerd"
    podman = backend_for(ctx, chosen, criu)
    image = load(ImageSettings, {}, config_file=config(ctx))
    work = workdir or Path(tempfile.mkdtemp(prefix="sg-ctr-demo-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)

    def say(line: str) -> None:
        click.echo(f"  {line}", err=as_json)

    click.echo(f"container demo in {work}", err=as_json)
    try:
        result = asyncio.run(run_container_demo(podman, image, work, say))
    except Exception:
        click.echo(f"spotguard: the work dir is kept: {work}", err=True)
        raise
    if as_json:
        click.echo(json.dumps({**result.to_json(), "workdir": str(work)}, indent=2))
    else:
        click.echo(" → ".join(result.history))
        verdict = "every number once, in order: identical to an uninterrupted run"
        click.echo(
            f"{'OK' if result.ok else 'FAILED'}: {result.numbers} numbers counted across two "
            f"VMs in {result.seconds} s; {verdict if result.ok else result.reason}"
        )
    if result.ok and not keep and workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return result.ok
