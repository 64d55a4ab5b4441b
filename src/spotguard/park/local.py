"""Parked images on this node (``park --to tmpfs`` / ``disk``): where each job's lives, what
a killed park left (a partial image: removed by the next park or unpark of the job, and of
every job by the agent's start, :func:`clear_partials`), an earlier image
set aside (never deleted), a complete image with no record found again. Only this host's
sealed images in its private park directories count (:mod:`spotguard.checkpoint.seal`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path

from spotguard import safefs
from spotguard.checkpoint import seal
from spotguard.checkpoint.meta import META_NAME
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import dir_bytes
from spotguard.errors import JobError, UnsafePath
from spotguard.names import check_job_name

from . import record
from .record import ParkRecord, Place
from .settings import ParkSettings

log = logging.getLogger(__name__)


def image_dir(place: Place, job: str, cs: CheckpointSettings, ps: ParkSettings) -> Path:
    """Where ``job``'s image parked to tmpfs or disk lives on this node."""
    base = ps.memory_dir if place == "tmpfs" else cs.layout.parked_images
    return base / job


def private_base(d: Path) -> None:
    """The directory parked images live in must be root's and 0700 (created so at first
    use): a directory another user created first, or swapped for a link, refuses the park
    or unpark in one line (:class:`~spotguard.errors.UnsafePath`)."""
    safefs.ensure_private_dir(d.parent)


def clear_partial(d: Path) -> None:
    """Remove ``d`` when it holds a partial image — a park to tmpfs or disk killed before
    the image was complete (no metadata: CRIU's files, never restorable). A directory with
    metadata is left to :func:`set_aside` / :func:`find_unrecorded`."""
    if d.is_dir() and not (d / META_NAME).exists():
        shutil.rmtree(d, ignore_errors=True)
        log.warning("removed a partial parked image (a park killed midway)", extra={"path": str(d)})


def clear_partials(settings: CheckpointSettings, ps: ParkSettings) -> list[str]:
    """Remove the partial parked image of every job on this node, in both places (the
    agent's start, after its recovery: a park killed midway and never followed by another
    park or unpark of the job). Each under the job's park lock, never waiting: a park that
    runs now keeps what it is writing. Set-aside images (``<job>.old-…``) and anything not
    named like a job are left alone. Returns the jobs whose partial image went."""
    done: list[str] = []
    for base in (ps.memory_dir, settings.layout.parked_images):
        try:
            entries = sorted(base.iterdir()) if base.is_dir() else []
        except OSError:
            continue
        for d in entries:
            try:
                check_job_name(d.name)
            except ValueError:
                continue
            if d.is_symlink() or not d.is_dir() or (d / META_NAME).exists():
                continue
            try:
                with record.locked(settings.state_dir, d.name, wait=False):
                    private_base(d)
                    clear_partial(d)
            except (JobError, UnsafePath, OSError) as exc:
                log.debug("partial image left", extra={"path": str(d), "error": str(exc)})
                continue
            done.append(d.name)
    return done


def set_aside(d: Path) -> None:
    """Never delete what might be a job's only state: an old directory is renamed, not
    removed (a complete image there with no record is a park that crashed before its record
    was written; :func:`find_unrecorded` finds it)."""
    if d.exists():
        aside = d.with_name(f"{d.name}.old-{int(time.time())}")
        d.rename(aside)
        log.warning("moved an earlier parked image aside", extra={"path": str(aside)})


def find_unrecorded(job: str, settings: CheckpointSettings, ps: ParkSettings) -> ParkRecord | None:
    """A complete parked image of ``job`` with no record (the park was interrupted after the
    job stopped and before its record was written): memory first, then disk; a partial one
    (a park killed before the image was complete) is removed on the way. Only an image
    this host sealed (:mod:`spotguard.checkpoint.seal`) in its private park directory counts:
    a directory planted there is never taken for a park (it is logged and left alone)."""
    places: tuple[Place, ...] = ("tmpfs", "disk")
    key = seal.HostKey.for_state(settings.state_dir)
    for place in places:
        d = image_dir(place, job, settings, ps)
        if not (d / META_NAME).is_file():
            if d.is_dir():  # a park killed before its image was complete: cleaned here
                with contextlib.suppress(UnsafePath):
                    private_base(d)
                    clear_partial(d)
            continue
        try:
            private_base(d)
            safefs.ensure_private_dir(d)
            sealed = seal.is_sealed(d, key)
        except UnsafePath as exc:
            log.warning("parked image directory refused", extra={"path": str(d), "error": str(exc)})
            continue
        if not sealed:
            log.warning(
                "an unsealed image in the park directory is not restored",
                extra={"path": str(d), "job": job},
            )
            continue
        if sealed:
            return ParkRecord(
                job=job,
                place=place,
                location=str(d),
                reason="found after an interrupted park",
                bytes=dir_bytes(d),
            )
    return None
