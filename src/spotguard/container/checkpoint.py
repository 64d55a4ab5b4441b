"""Checkpoint a podman container into a store as one spotguard image.

Order (each step timed in the result's timeline)::

    inspect (running? config, image digest) ─► image writer opened (an unusable store fails
      here, before the job stops) ─► GPU processes locked and checkpointed (:mod:`.gpu`)
      ─► podman container checkpoint --export (CRIU through runc:
      process tree, writable layer, podman's config) ─► image writer (chunks → BLAKE3 → zstd
      → store, signed manifest LAST, with the typed ContainerImage record in its meta)
      ─► exit mode: remove the container

Exit mode streams: podman exports into a FIFO that the image writer reads as it is written
(:class:`Export`), so the archive is never written to disk and the upload overlaps the
export. Leave-running exports to a private temp file, restores the container in place, then
uploads, so the container's pause never waits for the store.

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
import contextlib
import logging
import os
import select
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard import safefs, workdirs
from spotguard.container.gpu import for_container
from spotguard.container.podman import Podman
from spotguard.container.runtime import once_more_if_criu_failed
from spotguard.container.spec import (
    ARCHIVE_NAME,
    ContainerConfig,
    ContainerImage,
    ContainerRef,
)
from spotguard.errors import ContainerError, JobError, JobNotFound, RuntimeCriuError, SpotguardError
from spotguard.image.settings import ImageSettings
from spotguard.image.sink import FileSink
from spotguard.image.stats import TransferStats
from spotguard.image.writer import ImageWriter
from spotguard.modes import Mode
from spotguard.statedir import StateDir
from spotguard.stream.protocol import set_pipe_size
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
    stats: TransferStats  # the upload's (the agent reports them)
    frozen_at: float  # Unix time podman's checkpoint ended (the state on this host's disk)
    freeze_seconds: float  # the checkpoint step: dump, writable layer, export
    pause_seconds: float | None  # leave-running: checkpoint start → running again
    durable_at: float  # Unix time the manifest was written
    streamed: bool  # podman's archive went straight into the store (no file on disk)

    def to_json(self) -> dict[str, Any]:
        return {
            "container": self.container,
            "job": self.job,
            "image": self.image_url,
            "image_url": self.image_url,  # the name process checkpoints give it
            "mode": self.mode.value,
            "pause_seconds": self.pause_seconds,
            "bytes": self.bytes,
            "stored_bytes": self.stored_bytes,
            "timeline": self.timeline.to_list(),
        }


#: the FIFO podman exports into when the archive is streamed
FIFO_NAME = "export.fifo"

#: a work directory this old was left by a process that died (a checkpoint or restore
#: removes its own when it ends, whatever happened)
STALE_WORK_S = 24 * 3600.0


def work_dir(state_dir: Path) -> Path:
    """A fresh private directory for a runtime archive, under ``state_dir``, named after this
    process (:mod:`spotguard.workdirs`); those a killed spotguard left are removed first (an
    archive is as large as the job's memory): at once where their name says whose they were,
    after a day where it does not."""
    base = safefs.ensure_private_dir(StateDir(state_dir).containers)
    workdirs.sweep(base)
    now = time.time()
    for old in base.glob("ckpt-*"):
        try:
            if not old.is_symlink() and old.is_dir() and now - old.stat().st_mtime > STALE_WORK_S:
                shutil.rmtree(old, ignore_errors=True)
                log.warning("stale container work directory removed", extra={"dir": str(old)})
        except OSError:
            continue
    return workdirs.make("ckpt-", base)


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
    meta: dict[str, Any] | None = None,
    on_frozen: Callable[[float], None] | None = None,
) -> ContainerCheckpoint:
    """Checkpoint the running container ``ref`` into a new image of ``ref.job`` in the store
    at ``store_url`` (exit mode: the container is removed once the image is durable).
    ``meta``: more of the manifest's meta (the agent's job, instance and host facts; the
    container record wins); ``on_frozen(t)`` is called once podman's checkpoint has ended."""
    tl = Timeline()
    mode = Mode.RESUME if leave_running else Mode.EXIT
    with tl.step("inspect"):
        config = await inspect_running(podman, ref)
        version = await podman.version()
        graph_root, run_root = await podman.storage_roots()
    args = ["--compress", "none", "--ignore-volumes"]
    args.append("--keep")  # never podman's --leave-running: see the module's doc
    if tcp_established:
        args.append("--tcp-established")
    tmp = await asyncio.to_thread(work_dir, state_dir)
    writer = ImageWriter(store_url, ref.job, settings=image_settings, timeline=tl)
    gpu = for_container(podman, ref)
    try:
        # the writer first: a store that cannot take the image fails before the job stops
        async with writer:
            export = Export(podman, ref, tmp, writer, streamed=not leave_running)
            with tl.step("podman checkpoint", mode=mode, streamed=export.streamed) as dump:
                await gpu.freeze(tl)  # GPU memory into the processes' host memory first
                await export.run(args)
            frozen_at = time.time()
            pause_s: float | None = None
            if leave_running:
                with tl.step("podman restore in place"):
                    await podman.run(
                        "container",
                        "restore",
                        ref.name,
                        what=(
                            f"resuming {ref} after its checkpoint (it is stopped, its "
                            f"checkpoint kept: podman container restore {ref.name})"
                        ),
                    )
                if not gpu.already:  # a container parked in memory stays off the GPU
                    await gpu.thaw(tl)
                pause_s = time.time() - dump.start
            if on_frozen is not None:
                on_frozen(frozen_at)
            with tl.step("push", image=writer.url):
                size = await export.into_image()
                record = ContainerImage(
                    runtime_version=version,
                    criu_version=podman.criu_version(),
                    mode=mode,
                    archive_bytes=size,
                    config=config,
                    graph_root=graph_root,
                    run_root=run_root,
                    gpu=gpu.record(),
                )
                await writer.commit({**(meta or {}), **record.to_meta()})
        durable_at = time.time()
    except BaseException:
        if not leave_running:  # exit mode: a failed checkpoint never leaves the job stopped
            await _bring_back(podman, ref)
        if gpu.frozen:  # ... nor its GPU processes checkpointed or locked
            await gpu.thaw_quietly(tl)
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
        stats=writer.stats,
        frozen_at=frozen_at,
        freeze_seconds=frozen_at - dump.start,
        pause_seconds=pause_s,
        durable_at=durable_at,
        streamed=export.streamed,
    )


class Export:
    """podman's ``--export`` of one checkpoint, into the image as :data:`ARCHIVE_NAME`.

    Streamed (exit mode): podman writes into a FIFO in the private work directory while the
    image writer reads it, chunk by chunk, into the store — the archive never lands on disk,
    and the upload overlaps podman's export. Else (leave-running) podman writes a file and the
    writer reads it after the container is restored in place: the container's pause then
    does not wait for the store."""

    def __init__(
        self, podman: Podman, ref: ContainerRef, tmp: Path, writer: ImageWriter, streamed: bool
    ) -> None:
        self.podman, self.ref, self.writer, self.streamed = podman, ref, writer, streamed
        self.path = tmp / (FIFO_NAME if streamed else ARCHIVE_NAME)
        self._pump: asyncio.Task[int] | None = None

    async def run(self, args: list[str]) -> None:
        """``podman container checkpoint NAME --export PATH ARGS``; once more if podman's CRIU
        failed (:func:`once_more_if_criu_failed`: the container ran on; streamed, only when
        podman never opened the FIFO — CRIU dumps before podman exports — so nothing was read)."""
        argv = [self.ref.name, "--export", str(self.path), *args]
        what = f"checkpointing {self.ref}"
        if not self.streamed:

            async def to_file() -> None:
                await self.podman.checkpoint(*argv, what=what)

            await once_more_if_criu_failed(to_file, job=self.ref.job)
            return
        await asyncio.to_thread(os.mkfifo, self.path, 0o600)
        sink = self.writer.file(ARCHIVE_NAME, mode=0o600)

        async def to_fifo() -> None:
            # the read end is open before podman starts: what podman writes is never lost,
            # even if it finishes before the pump first reads
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            # as large as fs.pipe-max-size allows (never raised here): fewer wakeups both sides
            with contextlib.suppress(OSError):
                set_pipe_size(fd, self.writer.settings.pipe_mb << 20)
            stop = threading.Event()
            self._pump = pump = asyncio.create_task(_pump(fd, sink, stop))
            try:
                await self.podman.checkpoint(*argv, what=what)
            except BaseException as exc:
                stop.set()  # a pump still waiting for podman to open the FIFO ends
                await asyncio.wait({pump})
                failed = None if pump.cancelled() else pump.exception()
                if failed is not None:  # the store's error closed the pipe: that is the cause
                    raise failed from exc
                if isinstance(exc, RuntimeCriuError) and (sink.size or sink.closed):
                    raise ContainerError(str(exc)) from exc  # podman exported: not again
                raise

        await once_more_if_criu_failed(to_fifo, job=self.ref.job)

    async def into_image(self) -> int:
        """The archive in the image (streamed: the rest of the pipe); its size."""
        if self._pump is not None:
            return await self._pump
        return (await self.writer.add_file(self.path, ARCHIVE_NAME)).size


async def _pump(fd: int, sink: FileSink, stop: threading.Event) -> int:
    """Read the FIFO ``fd`` (opened non-blocking) to its end into ``sink``: wait until podman
    has opened it and written (or ``stop``), then read blocking until podman closes it."""
    try:
        if not await asyncio.to_thread(_writer_came, fd, stop):
            return 0
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            try:
                await sink.read_from(f)
            except BaseException:
                # podman holds the FIFO read-write (it counts as a reader): closing ours would
                # not stop it, it would wait on a full pipe; read the rest, so it ends
                await asyncio.to_thread(_drain, f)
                raise
    finally:
        os.close(fd)  # podman, if still writing, gets EPIPE
    await sink.close()
    return sink.size


def _drain(f: Any) -> None:
    while f.read(1 << 20):
        pass


def _writer_came(fd: int, stop: threading.Event) -> bool:
    """Wait until the FIFO has data or its writer came and went (Linux reports POLLHUP only
    after a writer has connected); False once ``stop`` is set first."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while not stop.is_set():
        if poller.poll(100):
            return True
    return False


async def _bring_back(podman: Podman, ref: ContainerRef) -> None:
    """Restore the container in place from the checkpoint podman kept (exit mode, the image
    not durable) unless it still runs (the checkpoint failed before it stopped); logged,
    never raised over the error that brought us here."""
    try:
        ctr = await podman.inspect(ref.name)
        if ctr is not None and (ctr.get("State") or {}).get("Status") == "running":
            return
        await podman.run("container", "restore", ref.name, what=f"bringing {ref} back")
        log.warning("container restored in place after a failed checkpoint", extra={"job": ref.job})
    except SpotguardError as exc:
        log.error(
            "container could not be brought back after a failed checkpoint",
            extra={"job": ref.job, "error": str(exc)},
        )
