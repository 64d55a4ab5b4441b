"""Park and unpark a container (``spotguard park podman:NAME``, ``docker:NAME`` or
``containerd:NS/ID``).

Where a parked container's state goes (``--to``), and how it comes back (a GPU container's
GPU processes are locked and their GPU memory moved into host memory before the pause or the
dump, and moved back and unlocked at unpark: :mod:`spotguard.container.gpu`):

* ``memory``: ``podman pause`` / ``docker pause`` / ``ctr tasks pause`` (the cgroup freezer:
  the processes stay in memory, stopped); unpark: ``podman unpause`` / ``docker unpause`` /
  ``ctr tasks resume``.
* ``disk`` / ``tmpfs`` (podman only; docker and containerd refuse it): ``podman container
  checkpoint`` (CRIU's images kept in podman's storage; the processes end); unpark:
  ``podman container restore`` in place.
* a store URL: :func:`~spotguard.container.checkpoint.checkpoint_container` (a signed image;
  the container is removed); unpark: :func:`~spotguard.container.restore.restore_container`,
  here or on any host that reaches the store (``spotguard restore URL``).

A record ``<state_dir>/containers/parked/<name>.json`` (containerd:
``containerd:<ns>:<id>.json``) (typed, written atomically, root-only)
says which; unpark reads it, brings the container back, then removes it. For a store park the
record holds the image URL, so another node's unpark needs only the URL (``spotguard restore``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from spotguard import safefs
from spotguard.container import dispatch
from spotguard.container.dispatch import Backend
from spotguard.container.gpu import for_container
from spotguard.container.podman import Podman
from spotguard.container.spec import ContainerRef
from spotguard.errors import ParkError
from spotguard.image.settings import ImageSettings
from spotguard.statedir import StateDir
from spotguard.timeline import Timeline

Place = Literal["memory", "disk", "store"]
MAX_RECORD_BYTES = 1 << 20


class ParkedContainer(BaseModel):
    """What ``park`` did to a container, for ``unpark``."""

    model_config = ConfigDict(extra="forbid")

    container: str  # podman:NAME, containerd:NS/ID
    place: Place
    image_url: str = ""
    reason: str = ""
    parked_at: datetime
    seconds: float


def _dir(state_dir: Path) -> Path:
    return safefs.ensure_private_dir(StateDir(state_dir).parked_containers)


def _file(ref: ContainerRef) -> str:
    """The record's file name: podman's container name, or containerd's namespace and ID
    (``:`` is in no podman name, so the two never meet)."""
    if ref.runtime == "containerd":
        return f"containerd:{ref.namespace}:{ref.name}.json"
    return f"{ref.name}.json"


def _path(state_dir: Path, ref: ContainerRef) -> Path:
    return _dir(state_dir) / _file(ref)


def load(state_dir: Path, ref: ContainerRef) -> ParkedContainer | None:
    """The record of a parked container, or None."""
    d = _dir(state_dir)
    try:
        fd = safefs.open_dir_nofollow(d)
        try:
            data = safefs.read_at(fd, _file(ref), limit=MAX_RECORD_BYTES)
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None
    try:
        return ParkedContainer.model_validate_json(data)
    except ValidationError as exc:
        raise ParkError(f"the park record of {ref} is unreadable: {str(exc)[:200]}") from exc


def place_of(to: str) -> Place:
    """``memory``, ``disk`` (``tmpfs`` too: podman keeps its checkpoint in its storage) or
    ``store`` (a URL)."""
    if to == "memory":
        return "memory"
    if to in ("disk", "tmpfs"):
        return "disk"  # podman's checkpoint in its storage
    if "://" in to:
        return "store"
    raise ParkError(f"--to {to!r}: use memory, disk, tmpfs or a store URL")


async def park(
    ref: ContainerRef,
    to: str,
    *,
    podman: Backend,
    image_settings: ImageSettings,
    state_dir: Path,
    reason: str = "",
) -> ParkedContainer:
    """Park the running container ``ref`` (see the module's table; ``podman``: the
    container's runtime backend, podman or containerd)."""
    place = place_of(to)
    if place == "disk" and not isinstance(podman, Podman):
        raise ParkError(
            f"--to {to}: a {ref.runtime} container parks to memory or a store URL "
            f"(spotguard keeps no {ref.runtime} checkpoint in place to restore from): "
            "docs/limits.md"
        )
    if load(state_dir, ref) is not None:
        raise ParkError(f"{ref} is already parked: spotguard unpark {ref}")
    t0 = time.monotonic()
    url = ""
    if place == "store":
        done = await dispatch.checkpoint(
            ref, to, backend=podman, image_settings=image_settings, state_dir=state_dir
        )
        url = done.image_url
    else:
        await dispatch.running(podman, ref)
        # its GPU processes' memory moves into host memory first (the GPU is free while it
        # is parked); a park that fails brings it back
        gpu = for_container(podman, ref)
        tl = Timeline()
        await gpu.freeze(tl)
        try:
            if place == "memory":
                await dispatch.pause(podman, ref, what=f"parking {ref} in memory")
            elif isinstance(podman, Podman):
                await podman.checkpoint(ref.name, what=f"parking {ref} to disk")
        except BaseException:
            if gpu.frozen:
                await gpu.thaw_quietly(tl)  # never raised over the error that brought us here
            raise
    rec = ParkedContainer(
        container=str(ref),
        place=place,
        image_url=url,
        reason=reason,
        parked_at=datetime.now(UTC),
        seconds=round(time.monotonic() - t0, 3),
    )
    await asyncio.to_thread(
        safefs.write_file, _path(state_dir, ref), rec.model_dump_json().encode()
    )
    return rec


@contextlib.asynccontextmanager
async def thawed(ref: ContainerRef, *, podman: Backend, state_dir: Path) -> AsyncIterator[bool]:
    """Around a checkpoint of ``ref`` (podman refuses to checkpoint a paused container): a
    container parked in memory is unpaused first (yields whether it was). Afterwards, a
    container that runs on (leave-running, or a failed checkpoint that restored it) is paused
    again, still parked; one that is gone (exit mode: its image is durable) is parked no more,
    so its memory park record is removed."""
    ctr = await dispatch.inspect(podman, ref)
    paused = str(((ctr or {}).get("State") or {}).get("Status", "")) == "paused"
    if paused:
        await dispatch.unpause(podman, ref, what=f"unpausing {ref} to checkpoint it")
    try:
        yield paused
    finally:
        if paused:
            await _refreeze(ref, podman=podman, state_dir=state_dir)


async def _refreeze(ref: ContainerRef, *, podman: Backend, state_dir: Path) -> None:
    ctr = await dispatch.inspect(podman, ref)
    if str(((ctr or {}).get("State") or {}).get("Status", "")) == "running":
        await dispatch.pause(podman, ref, what=f"parking {ref} in memory again")
        return
    rec = await asyncio.to_thread(load, state_dir, ref)
    if rec is not None and rec.place == "memory":
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(_path(state_dir, ref).unlink)


async def unpark(
    ref: ContainerRef,
    *,
    podman: Backend,
    image_settings: ImageSettings,
    state_dir: Path,
) -> ParkedContainer:
    """Bring the parked container ``ref`` back; its record is removed once it runs."""
    rec = load(state_dir, ref)
    if rec is None:
        raise ParkError(f"{ref} is not parked on this node")
    if rec.place == "memory":
        await dispatch.unpause(podman, ref, what=f"unparking {ref}")
        await for_container(podman, ref).thaw(Timeline())
    elif rec.place == "disk" and isinstance(podman, Podman):
        await podman.run("container", "restore", ref.name, what=f"unparking {ref}")
        await for_container(podman, ref).thaw(Timeline())
    elif rec.place == "disk":
        raise ParkError(f"the park record of {ref} says disk: only podman parks there")
    else:
        await dispatch.restore(
            rec.image_url,
            backend=podman,
            image_settings=image_settings,
            state_dir=state_dir,
            name=ref.name,
        )
    with contextlib.suppress(FileNotFoundError):
        _path(state_dir, ref).unlink()
    return rec
