"""Restore an image URL on this host, and bring back a job a killed process left mid-freeze.

Restore, in order::

    1. open     the image (``…/images/latest`` resolved) and read its manifest
    2. verify   every chunk is fetched and checked (hash, size, decryption) before any file
                of the job is written or CRIU starts; a bad or missing chunk raises
                :class:`~spotguard.errors.ImageCorrupt`. A staged image is verified by its
                pull (each chunk before it is written, all before the engine runs); a
                streamed one by a verify pass first (it is then read twice: the price of
                never feeding CRIU an image that cannot finish)
    3. source   a streamed image is served to CRIU from the store (nothing staged); any other
                is pulled into staging (tmpfs or disk)
    4. engine   preflight (refuses a mismatched host), files, CRIU, GPU — the job runs again

Every failure is a :class:`~spotguard.errors.SpotguardError`: a full disk or an unreadable
staging directory is raised as :class:`~spotguard.errors.CheckpointError` naming the place.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import shutil
from pathlib import Path

from spotguard import safefs, workdirs
from spotguard.checkpoint.engine import Engine, RestoreResult
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.procfacts import start_time
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, RestoreSource, plan_staging
from spotguard.errors import CheckpointError, ImageError
from spotguard.image import ImageReader, ImageSettings, Manifest, verify_image
from spotguard.image.transfer import pull_to_tmp
from spotguard.timeline import Timeline

from .checkpoint import engine_for

log = logging.getLogger(__name__)


async def _open(image_url: str, image_settings: ImageSettings) -> tuple[str, Manifest, str]:
    """The image's own URL (``…/latest`` resolved), its manifest and who authenticated it
    ("" on a host without keys)."""
    async with ImageReader(image_url, settings=image_settings) as reader:
        return reader.url, reader.manifest, reader.authenticated


async def _verify(url: str, image_settings: ImageSettings, tl: Timeline) -> None:
    """Fetch and check every chunk before anything of the job is touched."""
    with tl.step("verify", image=url) as st:
        report = await verify_image(url, settings=image_settings)
        st.detail.update(chunks=report.chunks, bytes=report.bytes)


def _host_error(what: str, exc: OSError) -> CheckpointError:
    return CheckpointError(f"restore cannot {what}: {exc.strerror or exc}")


async def restore(
    image_url: str,
    *,
    settings: CheckpointSettings,
    image_settings: ImageSettings,
    engine: Engine | None = None,
    job_name: str | None = None,
) -> RestoreResult:
    """Restore the image at ``image_url`` on this host (the steps above); the job runs again
    when this returns. ``job_name``, when given, must match the image's job."""
    eng = engine or engine_for(settings)
    resolved, manifest, authenticated = await _open(image_url, image_settings)
    if job_name is not None and manifest.job != job_name:
        raise ImageError(f"{image_url} holds job {manifest.job!r}, not {job_name!r}")
    tl = Timeline()
    streamed = "stream" in manifest.meta
    if streamed:
        await _verify(resolved, image_settings, tl)
    need = manifest.totals.bytes
    source: RestoreSource
    pulled_dir: Path | None = None
    if streamed:
        from spotguard.stream.source import StreamSource

        tl.mark("staging", mode="stream", path=resolved, reason="streamed image")
        source = StreamSource(resolved, settings=image_settings)
    else:
        await asyncio.to_thread(clear_orphans, settings)
        try:
            staging = plan_staging(
                need, settings.shm_dir, settings.disk_staging_dir, settings.memory_margin
            )
            tl.mark("staging", mode=staging.mode, path=staging.path, reason=staging.reason)
            await asyncio.to_thread(safefs.ensure_private_dir, Path(staging.path))
            pulled = await pull_to_tmp(
                resolved, staging.path, prefix=_owned_prefix(), settings=image_settings,
                timeline=tl,
            )  # fmt: skip
        except OSError as exc:
            raise _host_error("stage the image", exc) from exc
        pulled_dir = pulled.dest
        source = DirectorySource(pulled.dest, verified_by=authenticated)
    try:
        rr = await eng.restore(source, state_dir=settings.state_dir)
    except OSError as exc:
        raise _host_error("write the job", exc) from exc
    finally:
        if pulled_dir is not None:
            await asyncio.to_thread(shutil.rmtree, pulled_dir, True)
    tl.steps.extend(rr.timeline.steps)
    log.info(
        "image restored",
        extra={
            "job": rr.job.name,
            "step": "restored",
            "pid": rr.pid,
            "image": resolved,
            "bytes": need,
            "seconds": round(tl.span(), 3),
        },
    )
    return dataclasses.replace(rr, timeline=tl, image_url=resolved)


#: a restore's staged image: ``restore-PID-START-NS-RANDOM`` (the process that pulled it and
#: its PID namespace; older names have no ``NS``)
_OWNED = re.compile(r"^restore-(\d+)-(\d+)(?:-(\d+))?-[0-9a-f]+$")


def _owned_prefix() -> str:
    """The name a staged image starts with: the restoring process's pid, start time and PID
    namespace, so that what a killed restore staged is known as such (:func:`clear_orphans`)."""
    return f"restore-{os.getpid()}-{start_time('self') or 0}-{workdirs.pid_namespace()}-"


def clear_orphans(settings: CheckpointSettings) -> list[Path]:
    """Remove every staged image (``restore-PID-START-NS-…`` under the staging directories)
    whose restoring process is gone — a restore killed midway leaves its pulled image, tens
    of GB of tmpfs, behind; the agent runs this at start and every restore before staging.
    Only this PID namespace's restores are judged (:func:`spotguard.workdirs.orphaned`: an
    agent in a container that shares the staging tmpfs sees none of the host's processes).
    Returns what was removed (each logged)."""
    gone: list[Path] = []
    judged = workdirs.judged_namespace()
    for root in (settings.shm_dir, settings.disk_staging_dir):
        for d in sorted(root.glob("restore-*")) if root.is_dir() else []:
            m = _OWNED.match(d.name)
            owner = None if m is None else (int(m[1]), int(m[2]), _int(m[3]))
            if owner is None or not workdirs.orphaned(*owner, judged=judged):
                continue  # another naming (kept as it is), or its restore may still run
            shutil.rmtree(d, ignore_errors=True)
            log.warning(
                "removed the staged image of a restore that was killed", extra={"path": str(d)}
            )
            gone.append(d)
    return gone


def _int(text: str | None) -> int | None:
    return int(text) if text else None


async def recover(job: JobInfo, *, settings: CheckpointSettings) -> bool:
    """Bring back ``job`` if a killed process left it mid-freeze (the engine's ``recover``,
    which reads the engine's ``operation.json`` marker: the one crash marker)."""
    return await engine_for(settings).recover(job)
