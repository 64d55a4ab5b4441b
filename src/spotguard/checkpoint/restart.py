"""``criu restore`` for the engine's restore step, retried while the host still holds what
the image needs for a moment: PIDs a job killed a moment ago holds as zombies, ports its
closed connections hold in TIME_WAIT (cleared first where the kernel allows:
:func:`.sockets.clear_time_wait`). Only the engine calls it (its ``criu_restore`` step).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from spotguard.errors import CriuError

from . import mounts, sockets
from .criu import Criu
from .meta import ImageMeta
from .settings import CheckpointSettings
from .staging import RestoreSource

log = logging.getLogger(__name__)


async def criu_restore(
    criu: Criu,
    source: RestoreSource,
    meta: ImageMeta,
    settings: CheckpointSettings,
    detail: dict[str, Any],
) -> int:
    """``criu restore``. A job without its own PID namespace had its PIDs freed before
    (preflight step); should the kernel still refuse one ("Can't fork ... File exists"),
    a restore from a directory is retried up to the ``pid_wait`` setting. The same for a
    port the image binds that connections of the job's last run, closed, still hold in
    TIME_WAIT (restored on the same host within 60 s: an NCCL job's bootstrap listener)."""
    s = settings
    loop = asyncio.get_running_loop()
    if meta.listen_ports:  # restored on the host it ran on: its closed connections' ports
        detail["time_wait_cleared"] = await asyncio.to_thread(
            sockets.clear_time_wait, meta.listen_ports
        )
    start = loop.time()
    deadline = start + s.pid_wait
    while True:
        attempt = loop.time()
        detail["retry_wait_s"] = attempt - start
        try:
            # the host mounts of the job's namespace: bound from this host's paths, or
            # empty stand-ins for those the job does not use and this host lacks
            job = str(meta.job.get("name", ""))
            with mounts.planned(meta.mounts if meta.mount_ns else [], job=job) as plan:
                return await criu.restore(
                    source.images_dir,
                    stream=source.stream,
                    manage_cgroups=s.manage_cgroups,
                    time_limit=s.criu_timeout,
                    mount_ns=meta.mount_ns,
                    external_mounts=plan.args,
                    # memory carried beside CRIU is not back yet: nothing of the job may
                    # run before it is (a thread of it could read or run on it)
                    leave_stopped=bool(meta.gpu_pages or meta.cpu_pages),
                )
        except CriuError as exc:
            held = _pid_still_held(exc) and meta.root_ns_pid != 1
            waiting = _port_in_time_wait(exc)
            if source.stream or not (held or waiting) or loop.time() > deadline:
                raise
            if held:
                log.info("a PID of the image is still held by the kernel; retrying")
            else:
                log.info("a port of the image is held by closed connections; retrying")
            await asyncio.sleep(1.0)


def _pid_still_held(exc: CriuError) -> bool:
    return "Can't fork for" in exc.log_tail and "File exists" in exc.log_tail


def _port_in_time_wait(exc: CriuError) -> bool:
    """CRIU could not bind a socket, and closed connections on this host are in TIME_WAIT
    (they clear within 60 s; a port held by a live socket fails the same way after the wait)."""
    return "Address already in use" in exc.log_tail and bool(sockets.time_wait_ports())
