"""Checkpoint a podman container into a store as one spotguard image.

Order (each step timed in the result's timeline)::

    inspect (running? config, image digest) ─► podman container checkpoint --export
      (CRIU through runc: process tree, writable layer, podman's config; into a private temp
      file) ─► image writer (chunks → BLAKE3 → zstd → store, signed manifest LAST, with the
      typed ContainerImage record in its meta) ─► exit mode: remove the container

podman stops the container at the checkpoint and keeps CRIU's files (``--keep``). Exit
mode: if the image cannot be made durable the container is restored in place from them, so
a failed checkpoint never leaves the job stopped; once it is durable the container is
removed. Leave-running: the container is restored in place from them right after the export,
before the upload. podman's own ``--leave-running`` is not used: it exports the writable
layer after the processes have gone on, so what they write into the container's filesystem
in between lands in the image ahead of their state (after a restore, a counter's line was
written twice). The price is a pause that covers the dump, the export and the restore in
place (under a second for a small job here).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard import safefs
from spotguard.container.podman import Podman
from spotguard.container.spec import (
    ARCHIVE_NAME,
    ContainerConfig,
    ContainerImage,
    ContainerRef,
)
from spotguard.contracts import Mode
from spotguard.errors import JobError, JobNotFound, SpotguardError
from spotguard.image.settings import ImageSettings
from spotguard.image.writer import ImageWriter
from spotguard.timeline import Timeline

log = logging.getLogger(__name__)


@dataclass
class ContainerCheckpoint:
    """What a container checkpoint did."""

    container: str  # podman:NAME
    job: str
    image_url: str
    mode: Mode
    bytes: int  # the runtime's archive
    stored_bytes: int  # written to the store (compressed, not already there)
    timeline: Timeline

    def to_json(self) -> dict[str, Any]:
        return {
            "container": self.container,
            "job": self.job,
            "image": self.image_url,
            "mode": self.mode.value,
            "bytes": self.bytes,
            "stored_bytes": self.stored_bytes,
            "timeline": self.timeline.to_list(),
        }


#: a work directory this old was left by a process that died (a checkpoint or restore
#: removes its own when it ends, whatever happened)
STALE_WORK_S = 24 * 3600.0


def work_dir(state_dir: Path) -> Path:
    """A fresh private directory for a runtime archive, under ``state_dir``; work
    directories left there more than a day ago by a killed spotguard are removed first."""
    base = safefs.ensure_private_dir(state_dir / "containers")
    now = time.time()
    for old in base.glob("ckpt-*"):
        try:
            if not old.is_symlink() and old.is_dir() and now - old.stat().st_mtime > STALE_WORK_S:
                shutil.rmtree(old, ignore_errors=True)
                log.warning("stale container work directory removed", extra={"dir": str(old)})
        except OSError:
            continue
    return Path(tempfile.mkdtemp(prefix="ckpt-", dir=base))


async def inspect_running(podman: Podman, ref: ContainerRef) -> ContainerConfig:
    """The container's config; JobNotFound when there is no such container, JobError when
    it is not running."""
    ctr = await podman.inspect(ref.name)
    if ctr is None:
        raise JobNotFound(f"no podman container {ref.name!r} on this host")
    status = str((ctr.get("State") or {}).get("Status", "unknown"))
    if status != "running":
        raise JobError(f"container {ref} is {status}, not running: nothing to checkpoint")
    image = await podman.image_inspect(str(ctr.get("Image", "")))
    return ContainerConfig.from_inspect(ctr, image)


async def checkpoint_container(
    ref: ContainerRef,
    store_url: str,
    *,
    podman: Podman,
    image_settings: ImageSettings,
    state_dir: Path,
    leave_running: bool = False,
    tcp_established: bool = False,
) -> ContainerCheckpoint:
    """Checkpoint the running container ``ref`` into a new image of ``ref.job`` in the store
    at ``store_url`` (exit mode: the container is removed once the image is durable)."""
    tl = Timeline()
    mode = Mode.RESUME if leave_running else Mode.EXIT
    with tl.step("inspect"):
        config = await inspect_running(podman, ref)
        version = await podman.version()
        graph_root, run_root = await podman.storage_roots()
    tmp = await asyncio.to_thread(work_dir, state_dir)
    try:
        archive = tmp / ARCHIVE_NAME
        args = ["--export", str(archive), "--compress", "none", "--ignore-volumes"]
        args.append("--keep")  # never podman's --leave-running: see the module's doc
        if tcp_established:
            args.append("--tcp-established")
        with tl.step("podman checkpoint", mode=mode):
            await podman.checkpoint(ref.name, *args, what=f"checkpointing {ref}")
        if leave_running:
            with tl.step("podman restore in place"):
                await podman.run(
                    "container",
                    "restore",
                    ref.name,
                    what=(
                        f"resuming {ref} after its checkpoint (it is stopped, its checkpoint "
                        f"kept: podman container restore {ref.name})"
                    ),
                )
        try:
            record = ContainerImage(
                runtime_version=version,
                criu_version=podman.criu_version(),
                mode=mode,
                archive_bytes=archive.stat().st_size,
                config=config,
                graph_root=graph_root,
                run_root=run_root,
            )
            writer = ImageWriter(store_url, ref.job, settings=image_settings, timeline=tl)
            with tl.step("push", image=writer.url):
                async with writer:
                    await writer.add_file(archive, ARCHIVE_NAME)
                    await writer.commit(record.to_meta())
        except BaseException:
            if not leave_running:
                await _bring_back(podman, ref)
            raise
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
    log.info("container checkpointed", extra={"job": ref.job, "image": writer.url, "mode": mode})
    if not leave_running:
        with tl.step("remove"):
            await podman.run("container", "rm", ref.name, what=f"removing {ref} (image durable)")
    return ContainerCheckpoint(
        container=str(ref),
        job=ref.job,
        image_url=writer.url,
        mode=mode,
        bytes=record.archive_bytes,
        stored_bytes=writer.stats.stored_bytes,
        timeline=tl,
    )


async def _bring_back(podman: Podman, ref: ContainerRef) -> None:
    """Restore the container in place from the checkpoint podman kept (exit mode, the image
    not durable); logged, never raised over the error that brought us here."""
    try:
        await podman.run("container", "restore", ref.name, what=f"bringing {ref} back")
        log.warning("container restored in place after a failed checkpoint", extra={"job": ref.job})
    except SpotguardError as exc:
        log.error(
            "container could not be brought back after a failed checkpoint",
            extra={"job": ref.job, "error": str(exc)},
        )
