"""Kept images: staged images on this host that are not durable in the store yet.

A staged image is *recorded* (``{state_dir}/kept/<job>-<dir>.json``) the moment it is complete
in its staging directory — in ``exit`` mode that is before CRIU stops the job — and the record
is removed only once the image's manifest is in the store. So at any time, an agent killed
during an upload leaves a record naming the staged copy, and the next agent pushes it and
reports it durable: an exit image is never lost between "the job was stopped" and "the
manifest is written".

A staging directory that holds a complete image (its ``spotguard-image.json``) but no record —
left by an older agent, or by one killed in the instant between writing the two — is
*adopted*: a record is written for it and it is pushed like any other. Anything else under the
staging roots is left where it is (logged), never deleted: only what this module can account
for is removed, and only after its image is durable.

Kept images are pushed to the store the agent is configured with now; a record naming another
store says so in a log line (a kept image never retries a URL given to an earlier agent).
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from spotguard import safefs
from spotguard.checkpoint import seal
from spotguard.checkpoint.engine import Mode
from spotguard.checkpoint.meta import META_NAME, ImageMeta
from spotguard.errors import CheckpointError, ImageError, UnsafePath
from spotguard.facts import GpuInventory, HostFacts, InstanceFacts
from spotguard.image import ImageSettings, push_dir
from spotguard.statedir import StateDir
from spotguard.timeline import Timeline

from .results import CheckpointResult, Frozen, Landed

log = logging.getLogger(__name__)

_MAX_RECORD = 16 << 20
#: a staging directory made by DirectoryTarget: ``<job>-<UTC stamp>``
_STAGED_NAME = re.compile(r"^(?P<job>[a-z0-9][a-z0-9._-]{0,62})-\d{8}T\d{6}\d+Z$")


class KeptImage(BaseModel):
    """One staged image waiting for the store (the record file's content, typed)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    record: Path
    job: str
    dir: Path
    store_url: str  # the store it was meant for ("" for an adopted orphan)
    mode: Mode
    meta: dict[str, Any]  # the manifest's meta (caller's meta + the engine's image facts)
    level: int | None = None
    kept_at: float
    frozen_at: float
    freeze_seconds: float = 0.0
    error: str = ""  # the last push failure ("" while the first push runs)
    adopted: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "dir": str(self.dir),
            "store_url": self.store_url,
            "mode": str(self.mode),
            "kept_at": self.kept_at,
            "error": self.error,
            "adopted": self.adopted,
        }


def image_meta(base: dict[str, Any], meta: ImageMeta, frozen_at: float) -> dict[str, Any]:
    """The manifest meta of a staged image: ``base`` (instance, notice, plan, reason) plus the
    engine's facts about the image."""
    from datetime import UTC, datetime

    return {
        **base,
        "mode": meta.mode,
        "gpu": meta.gpu.to_json(),
        "host": meta.host.to_json(),
        "criu_version": meta.criu_version,
        "staging": meta.staging,
        "frozen_at": datetime.fromtimestamp(frozen_at, UTC).isoformat(),
    }


class KeptImages:
    """The kept-image records of one host (``{state_dir}/kept``) and the staging roots that
    the images live under."""

    def __init__(self, state_dir: Path, staging_roots: Sequence[Path]) -> None:
        self.folder = StateDir(state_dir).kept
        self.roots = list(staging_roots)
        #: the host key staged images are sealed under (checked before a push, which signs)
        self.key = seal.HostKey.for_state(state_dir)

    def _path(self, job: str, images_dir: Path) -> Path:
        return self.folder / f"{job}-{images_dir.name}.json"

    def _write(self, kept: KeptImage) -> None:
        with safefs.opened_private_dir(self.folder) as dfd:
            safefs.write_at(dfd, kept.record.name, kept.model_dump_json().encode())

    def keep(
        self,
        *,
        job: str,
        images_dir: Path,
        store_url: str,
        mode: Mode,
        meta: dict[str, Any],
        level: int | None,
        frozen_at: float,
        adopted: bool = False,
    ) -> KeptImage:
        """Record a complete staged image before its upload starts. Raises
        :class:`CheckpointError` when the record cannot be written: the caller must then not
        stop the job (in exit mode the freeze fails and the job runs on)."""
        kept = KeptImage(
            record=self._path(job, images_dir),
            job=job,
            dir=images_dir,
            store_url=store_url,
            mode=mode,
            meta=meta,
            level=level,
            kept_at=time.time(),
            frozen_at=frozen_at,
            adopted=adopted,
        )
        try:
            self._write(kept)
        except OSError as exc:
            raise CheckpointError(
                f"cannot record the staged image of {job!r} in {self.folder}: {exc.strerror}"
            ) from exc
        return kept

    def update(self, kept: KeptImage, **changes: Any) -> KeptImage:
        """The record with ``changes`` (best effort: the old record still names the image)."""
        new = kept.model_copy(update=changes)
        try:
            self._write(new)
        except OSError as exc:
            log.warning(
                "cannot update a kept-image record",
                extra={"step": "upload", "job": kept.job, "error": str(exc)},
            )
        return new

    async def release(self, kept: KeptImage) -> None:
        """The image is durable (or no longer wanted): remove the record, then the copy."""
        kept.record.unlink(missing_ok=True)
        await asyncio.to_thread(shutil.rmtree, kept.dir, True)

    def scan(self, *, job: str | None = None) -> list[KeptImage]:
        """Every kept image, oldest first (``job``: only its): the records, plus staged
        directories with a complete image and no record, adopted (a record is written)."""
        out = [k for k in self._records() if job is None or k.job == job]
        known = {k.dir.resolve() for k in self._records()}
        for d in self._orphans():
            if d.resolve() in known:
                continue
            kept = self._adopt(d)
            if kept is not None and (job is None or kept.job == job):
                out.append(kept)
        return sorted(out, key=lambda k: k.kept_at)

    def _records(self) -> list[KeptImage]:
        out = []
        if self.folder.is_dir():
            safefs.ensure_private_dir(self.folder)
        for path in sorted(self.folder.glob("*.json")) if self.folder.is_dir() else []:
            try:
                with safefs.opened_private_dir(self.folder) as dfd:
                    data = safefs.read_at(dfd, path.name, limit=_MAX_RECORD)
                kept = KeptImage.model_validate_json(data)
            except (OSError, ValidationError, ValueError, UnsafePath) as exc:
                log.error(
                    "unreadable kept-image record left in place",
                    extra={"step": "upload", "file": str(path), "error": str(exc)[:200]},
                )
                continue
            if kept.record != path:
                kept = kept.model_copy(update={"record": path})
            if not kept.dir.is_dir():
                log.error(
                    "a kept image's directory is gone; it cannot be pushed",
                    extra={"step": "upload", "job": kept.job, "dir": str(kept.dir)},
                )
                path.unlink(missing_ok=True)
                continue
            out.append(kept)
        return out

    def _orphans(self) -> list[Path]:
        found = []
        for root in self.roots:
            try:
                entries = sorted(root.iterdir()) if root.is_dir() else []
            except OSError:
                continue
            for d in entries:
                if not (d.is_dir() and _STAGED_NAME.match(d.name)):
                    continue
                if (d / META_NAME).is_file():
                    found.append(d)
                else:
                    log.warning(
                        "staging directory without a complete image left in place",
                        extra={"step": "upload", "dir": str(d)},
                    )
        return found

    def _adopt(self, d: Path) -> KeptImage | None:
        """A record for an orphan staged image — only one this host sealed, in a private
        staging root: a directory planted there is logged and left alone, never pushed (a
        push signs it with the fleet's key)."""
        try:
            safefs.ensure_private_dir(d.parent)
            seal.verify(d, self.key)
            meta = ImageMeta.read(d)
            job = str(meta.job["name"])
            mode = Mode(meta.mode)
            at = (d / META_NAME).stat().st_mtime
        except (ImageError, OSError, KeyError, ValueError, UnsafePath) as exc:
            log.warning(
                "staged image not understood or not sealed by this host; left in place",
                extra={"step": "upload", "dir": str(d), "error": str(exc)[:200]},
            )
            return None
        try:
            kept = self.keep(
                job=job,
                images_dir=d,
                store_url="",
                mode=mode,
                meta={**image_meta({}, meta, at), "adopted": True},
                level=None,
                frozen_at=at,
                adopted=True,
            )
        except CheckpointError as exc:
            log.error("cannot adopt a staged image", extra={"dir": str(d), "error": str(exc)})
            return None
        log.warning(
            "staged image without a record adopted; it will be pushed",
            extra={"step": "upload", "job": job, "dir": str(d), "mode": str(mode)},
        )
        return kept


def verify_kept(kept: KeptImage, images: KeptImages) -> None:
    """The kept image is in a private staging directory and exactly as this host sealed it
    (:mod:`spotguard.checkpoint.seal`), or :class:`~spotguard.errors.ImageUntrusted`: a
    push signs what it uploads, so nothing else may reach it."""
    safefs.ensure_private_dir(kept.dir.parent)
    seal.verify(kept.dir, images.key)


async def push_kept(
    kept: KeptImage,
    store_url: str,
    *,
    images: KeptImages,
    image_settings: ImageSettings,
    instance: InstanceFacts | None = None,
) -> CheckpointResult:
    """Push a kept image to ``store_url`` (chunks the store already has are skipped, manifest
    last); once it is durable, remove the staged copy and its record. Raises like
    :func:`~spotguard.image.push_dir` (the image stays kept then)."""
    if kept.store_url and kept.store_url != store_url:
        log.warning(
            "kept image pushed to the configured store, not the one it was first meant for",
            extra={
                "step": "upload",
                "job": kept.job,
                "store": store_url,
                "reason": f"was {kept.store_url}",
            },
        )
    tl = Timeline()
    await asyncio.to_thread(verify_kept, kept, images)
    push = await push_dir(
        kept.dir,
        store_url,
        kept.job,
        kept.meta,
        settings=image_settings,
        level=kept.level,
        timeline=tl,
    )
    await images.release(kept)
    m = kept.meta
    host = m.get("host")
    frozen = Frozen(
        job=kept.job,
        mode=kept.mode,
        gpu=GpuInventory.from_json(m.get("gpu")),
        host=HostFacts.from_json(host) if isinstance(host, dict) else HostFacts.probe(None),
        instance=(
            InstanceFacts.from_json(m["instance"])
            if isinstance(m.get("instance"), dict) and m["instance"]
            else instance or InstanceFacts()
        ),
        frozen_at=kept.frozen_at,
        freeze_seconds=kept.freeze_seconds,
        pause_seconds=None,
        plan=m.get("plan") if isinstance(m.get("plan"), dict) else None,
    )
    result = CheckpointResult.of(frozen, Landed(push.image_url, push.stats, tl, time.time(), False))
    log.info(
        "kept image durable",
        extra={
            "job": kept.job,
            "step": "durable",
            "image": result.image_url,
            "bytes": result.bytes,
            "stored_bytes": result.stored_bytes,
            "seconds_kept": round(result.durable_at - kept.kept_at, 3),
        },
    )
    return result
