"""What is in a store: list images, find the newest complete one, verify, garbage-collect.

gc's safety rules (docs/image-format.md has the reasoning):

* it never deletes the newest complete image (``keep`` is at least 1), and deletes an old image
  by removing its manifest first — an image is either whole or absent;
* "newest" is by authenticated sequence (:mod:`spotguard.image.history`), not by id: anyone
  who can write to the bucket can put a manifest under an id that sorts last. Only images
  that authenticate under this host's keys (without keys: every readable one) are ranked
  and deleted; a manifest that does not authenticate is left whole, its chunks referenced,
  and named in ``images_unauthenticated`` for the operator to remove;
* it deletes a chunk only if no remaining manifest references it, it is older than the grace
  period, and no writer is active on the job (a ``writing.json`` marker younger than the grace
  period) — a writer that skipped a chunk because it was already stored must not lose it.
  Writers also re-check their skipped chunks right before committing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from spotguard.errors import (
    ConfigError,
    ImageCorrupt,
    ImageError,
    ImageNotFound,
    SpotguardError,
)
from spotguard.image.codec import Cipher
from spotguard.image.history import complete_images, genuine_images, resolve
from spotguard.image.keys import ImageKeys
from spotguard.image.manifest import (
    WRITING_MARKER,
    ImageRef,
    Manifest,
    ManifestBudget,
    fetch_manifest,
)
from spotguard.image.reader import ImageReader, VerifyReport
from spotguard.image.settings import ImageSettings
from spotguard.image.stats import ProgressFn
from spotguard.image.writer import store_for
from spotguard.names import check_job_name, chunk_key, image_prefix
from spotguard.store import ImageStore, ObjectInfo

log = logging.getLogger(__name__)


@dataclass
class ImageInfo:
    """One image (complete or still being written) as listed by :func:`list_images`."""

    url: str
    job: str
    image_id: str
    complete: bool
    created: datetime | None = None
    bytes: int = 0
    stored_bytes: int = 0
    files: int = 0
    encrypted: bool = False
    sequence: int = 0
    signed_by: list[str] = field(default_factory=list)  # key ids claimed (checked on read)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "job": self.job,
            "image_id": self.image_id,
            "complete": self.complete,
            "created": self.created.isoformat() if self.created else None,
            "bytes": self.bytes,
            "stored_bytes": self.stored_bytes,
            "files": self.files,
            "encrypted": self.encrypted,
            "sequence": self.sequence,
            "signed_by": self.signed_by,
        }


@dataclass
class GcResult:
    """What :func:`gc` removed (or would remove, with ``dry_run``)."""

    store: str
    jobs: list[str] = field(default_factory=list)
    images_kept: list[str] = field(default_factory=list)
    images_deleted: list[str] = field(default_factory=list)
    images_unauthenticated: list[str] = field(default_factory=list)
    stale_markers_deleted: int = 0
    chunks_deleted: int = 0
    bytes_freed: int = 0
    chunks_kept_young: int = 0
    chunks_kept_referenced: int = 0
    skipped_chunks_writer_active: list[str] = field(default_factory=list)
    dry_run: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "jobs": self.jobs,
            "images_kept": self.images_kept,
            "images_deleted": self.images_deleted,
            "images_unauthenticated": self.images_unauthenticated,
            "stale_markers_deleted": self.stale_markers_deleted,
            "chunks_deleted": self.chunks_deleted,
            "bytes_freed": self.bytes_freed,
            "chunks_kept_young": self.chunks_kept_young,
            "chunks_kept_referenced": self.chunks_kept_referenced,
            "chunk_gc_skipped_writer_active": self.skipped_chunks_writer_active,
            "dry_run": self.dry_run,
        }


async def _jobs(store: ImageStore, job: str | None) -> list[str]:
    if job is not None:
        try:
            return [check_job_name(job)]
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    out = []
    for name in await store.list_dirs(""):
        try:
            out.append(check_job_name(name))
        except ValueError:
            continue
    return out


async def _manifest(store: ImageStore, ref: ImageRef, size: int | None = None) -> Manifest:
    return (await fetch_manifest(store, ref.manifest_key, ref.url, size=size))[0]


async def latest_image(
    store_url: str, job: str, *, settings: ImageSettings, keys: ImageKeys | None = None
) -> str | None:
    """URL of the newest complete image of ``job`` in the store (by authenticated sequence,
    see :mod:`spotguard.image.history`), or None when it has no complete image."""
    k = keys if keys is not None else ImageKeys.from_settings(settings)
    store = store_for(store_url, settings)
    try:
        ref = ImageRef(store.url, check_job_name(job), "latest")
        return (await resolve(store, ref, k)).url
    except ImageNotFound:
        return None
    finally:
        await store.aclose()


async def list_images(
    store_url: str, job: str | None = None, *, settings: ImageSettings
) -> list[ImageInfo]:
    """Every image of ``job`` (or of every job) in the store, oldest first per job; images
    still being written (or abandoned) appear with ``complete=False``. Nothing here is
    authenticated: ``signed_by`` is what a manifest claims (``images verify`` checks it)."""
    s = settings
    store = store_for(store_url, s)
    try:
        out: list[ImageInfo] = []
        sem = asyncio.Semaphore(s.io_workers)
        budget = ManifestBudget()  # manifest bytes read and parsed at once
        for j in await _jobs(store, job):
            prefix = image_prefix(j, "")
            ids: dict[str, int | None] = {}  # image id -> its manifest's size (None: none)
            for info in await store.list(prefix):
                rest = info.key[len(prefix) :]
                image_id = rest.split("/", 1)[0]
                if rest == f"{image_id}/manifest.json":
                    ids[image_id] = info.size
                else:
                    ids.setdefault(image_id, None)
            refs = [ImageRef(store.url, j, i) for i in sorted(ids)]

            async def info_of(ref: ImageRef, size: int | None) -> ImageInfo:
                if size is None:
                    return ImageInfo(ref.url, ref.job, ref.image_id, complete=False)
                async with sem, budget.hold(size):
                    try:
                        m = await _manifest(store, ref, size)
                    except ImageError as exc:
                        log.warning(
                            "unreadable manifest", extra={"image": ref.url, "error": str(exc)}
                        )
                        return ImageInfo(ref.url, ref.job, ref.image_id, complete=False)
                return ImageInfo(
                    ref.url,
                    ref.job,
                    ref.image_id,
                    complete=True,
                    created=m.created,
                    bytes=m.totals.bytes,
                    stored_bytes=m.totals.stored_bytes,
                    files=m.totals.files,
                    encrypted=m.encryption is not None,
                    sequence=m.sequence,
                    signed_by=[f"{a.alg}:{a.key_id}" for a in m.auth],
                    meta=m.meta,
                )

            out += await asyncio.gather(*(info_of(r, ids[r.image_id]) for r in refs))
        return out
    finally:
        await store.aclose()


async def verify_image(
    image_url: str,
    *,
    settings: ImageSettings,
    cipher: Cipher | None = None,
    progress: ProgressFn | None = None,
    raise_on_error: bool = True,
) -> VerifyReport:
    """Authenticate the manifest (raising :class:`~spotguard.errors.ImageUntrusted` whatever
    ``raise_on_error`` says), then fetch and check every chunk (hash, size, decryption).

    Raises :class:`~spotguard.errors.ImageCorrupt` naming the bad chunk(s) unless
    ``raise_on_error`` is false (then the report lists them).
    """
    async with ImageReader(image_url, settings=settings, cipher=cipher) as reader:
        report = await reader.verify(progress)
    if report.bad and raise_on_error:
        names = ", ".join(f"{b['chunk']} (in {b['files']})" for b in report.bad[:5])
        raise ImageCorrupt(
            f"image {report.image_url} has {len(report.bad)} corrupt chunk(s): {names}",
            chunk=report.bad[0]["chunk"],
        )
    return report


async def gc(
    store_url: str,
    job: str | None,
    keep: int,
    *,
    grace_s: float | None = None,
    dry_run: bool = False,
    settings: ImageSettings,
    trust_store: bool = False,
) -> GcResult:
    """Delete all but the newest ``keep`` complete images of ``job`` (every job when None),
    stale writing markers, and chunks no remaining image references (see the module doc).

    On a host without any image key nothing can be authenticated, so a manifest planted in
    the store would pass for the newest image and the genuine ones be deleted: gc then
    deletes nothing (:class:`ConfigError`) unless ``trust_store`` says the store is trusted
    (a single machine, the demo); ``dry_run`` still reports."""
    if keep < 1:
        raise ConfigError(
            "gc --keep must be at least 1: the newest complete image is never deleted"
        )
    s = settings
    grace = timedelta(seconds=s.gc_grace_s if grace_s is None else grace_s)
    keys = ImageKeys.from_settings(s)
    if not keys.required and not trust_store and not dry_run:
        raise ConfigError(
            "images gc deletes only images it can authenticate, and this host holds no image "
            "key (verify_key_file / encryption_key_file): nothing deleted; set a key, or pass "
            "--trust-store where no one else can write the store"
        )
    store = store_for(store_url, s)
    result = GcResult(store.url, dry_run=dry_run)
    try:
        for j in await _jobs(store, job):
            result.jobs.append(j)
            await _gc_job(store, j, keep, grace, dry_run, result, keys)
    finally:
        await store.aclose()
    log.info("gc done", extra=result.to_json())
    return result


async def _referenced(
    store: ImageStore, job: str, kept: list[str], untrusted: list[str], result: GcResult
) -> set[str]:
    """Chunks the kept images name, and those a manifest that does not authenticate names
    (it is left whole: what it names is not gc's to judge)."""
    referenced: set[str] = set()
    for image_id in kept:
        ref = ImageRef(store.url, job, image_id)
        result.images_kept.append(ref.url)
        referenced |= set((await _manifest(store, ref)).chunk_refs())
    for image_id in untrusted:
        ref = ImageRef(store.url, job, image_id)
        result.images_unauthenticated.append(ref.url)
        try:
            referenced |= set((await _manifest(store, ref)).chunk_refs())
        except SpotguardError:
            continue
    if untrusted:
        log.warning(
            "manifests that do not authenticate were left alone",
            extra={"job": job, "what": f"{len(untrusted)} manifest(s)"},
        )
    return referenced


async def _gc_job(
    store: ImageStore,
    job: str,
    keep: int,
    grace: timedelta,
    dry_run: bool,
    result: GcResult,
    keys: ImageKeys,
) -> None:
    now = datetime.now(UTC)
    prefix = image_prefix(job, "")
    listing = await store.list(prefix)
    by_image: dict[str, list[ObjectInfo]] = {}
    for info in listing:
        by_image.setdefault(info.key[len(prefix) :].split("/", 1)[0], []).append(info)
    complete = await complete_images(store, job)
    ranked = [g.image_id for g in await genuine_images(store, job, keys, complete)]
    kept, dropped = ranked[-keep:], ranked[:-keep]
    untrusted = sorted(set(complete) - set(ranked))
    active = False
    for image_id, objs in by_image.items():
        if image_id in complete:
            continue
        markers = [o for o in objs if o.key.endswith("/" + WRITING_MARKER)]
        if any(now - m.modified < grace for m in markers):
            active = True
            continue
        for o in objs:  # an abandoned write: only its marker remains
            if not dry_run:
                await store.delete(o.key)
            result.stale_markers_deleted += 1
    for image_id in dropped:
        ref = ImageRef(store.url, job, image_id)
        if not dry_run:
            await store.delete(ref.manifest_key)  # first: the image is gone as a whole
            for o in by_image.get(image_id, []):
                if o.key != ref.manifest_key:
                    await store.delete(o.key)
        result.images_deleted.append(ref.url)
    referenced = await _referenced(store, job, kept, untrusted, result)
    if active:
        result.skipped_chunks_writer_active.append(job)
        log.info("a writer is active: chunks of this job are not collected", extra={"job": job})
        return
    chunk_prefix = chunk_key(job, "00")[: -len("00/00")]
    sem = asyncio.Semaphore(16)

    async def drop(o: ObjectInfo) -> None:
        async with sem:
            if not dry_run:
                try:
                    await store.delete(o.key)
                except SpotguardError as exc:
                    log.warning("could not delete chunk", extra={"key": o.key, "error": str(exc)})
                    return
            result.chunks_deleted += 1
            result.bytes_freed += o.size

    doomed = []
    for o in await store.list(chunk_prefix):
        addr = o.key.rsplit("/", 1)[-1]
        if addr in referenced:
            result.chunks_kept_referenced += 1
            continue
        if now - o.modified < grace:
            result.chunks_kept_young += 1
            continue
        doomed.append(o)
    await asyncio.gather(*(drop(o) for o in doomed))
