"""A job's images in order: complete ids, authenticated sequences, ``latest``, rollback.

Every manifest carries ``sequence``, one more than the largest sequence among the job's
authenticated images when it was written, and covered by the manifest's authentication. So a
host holding keys can tell which genuine image is newest whatever the ids say (ids are
timestamps from possibly skewed clocks, and anyone with store access can write any id), and
refuse a genuine but *older* image handed to it as if it were current (a rollback), unless
``allow_rollback`` says the operator wants exactly that.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from spotguard.errors import (
    ImageError,
    ImageNotFound,
    ImageRollback,
    ObjectNotFound,
    UnsignedImage,
)
from spotguard.image.keys import ImageKeys
from spotguard.image.manifest import ImageRef, Manifest, ManifestBudget, fetch_manifest
from spotguard.names import image_prefix, manifest_key
from spotguard.store import ImageStore

log = logging.getLogger(__name__)

SCAN_REQUESTS = 16  # manifests fetched at once when scanning a job's images (and at most
# MAX_MANIFEST_BYTES of them read and parsed at once: ManifestBudget)


@dataclass(frozen=True, order=True)
class Genuine:
    """An image whose manifest authenticates under this host's keys (ordered by sequence)."""

    sequence: int
    image_id: str


async def complete_images(store: ImageStore, job: str) -> dict[str, int]:
    """The job's images that have a manifest: id -> the manifest's listed size, in id order."""
    prefix = image_prefix(job, "")
    found = {}
    for info in await store.list(prefix):
        rest = info.key[len(prefix) :]
        if rest.count("/") == 1 and rest.endswith("/manifest.json"):
            found[rest.split("/", 1)[0]] = info.size
    return dict(sorted(found.items()))


async def complete_image_ids(store: ImageStore, job: str) -> list[str]:
    """Ids of the job's images that have a manifest, in id order."""
    return list(await complete_images(store, job))


async def genuine_images(
    store: ImageStore, job: str, keys: ImageKeys, listed: dict[str, int] | None = None
) -> list[Genuine]:
    """The job's complete images that authenticate under ``keys`` (on a host without keys:
    every readable one), oldest sequence first; ``listed`` is :func:`complete_images`.

    Anyone with store access can put junk there, so a manifest that fails is skipped with its
    :class:`ImageError` logged, never raised, and the scan is bounded: 16 requests at once, at
    most one manifest cap of bytes read and parsed at once (:class:`ManifestBudget`), a
    manifest listed over the cap is not read at all."""
    if listed is None:
        listed = await complete_images(store, job)
    sem = asyncio.Semaphore(SCAN_REQUESTS)
    budget = ManifestBudget()

    async def one(image_id: str, size: int) -> Genuine | None:
        where = ImageRef(store.url, job, image_id).url
        async with sem, budget.hold(size):
            try:
                m, raw = await fetch_manifest(store, manifest_key(job, image_id), where, size=size)
                keys.authenticate(raw, m, where)
            except (ImageError, ObjectNotFound) as exc:
                log.debug("image skipped", extra={"image": where, "error": str(exc)})
                return None
            if m.job != job or m.image_id != image_id:
                return None  # a genuine manifest copied to another place
            return Genuine(m.sequence, image_id)

    found = await asyncio.gather(*(one(i, n) for i, n in listed.items()))
    return sorted(g for g in found if g is not None)


async def next_sequence(store: ImageStore, job: str, keys: ImageKeys) -> int:
    """The sequence for a new image of ``job``: one past its newest authenticated image."""
    genuine = await genuine_images(store, job, keys)
    return genuine[-1].sequence + 1 if genuine else 1


async def resolve(store: ImageStore, ref: ImageRef, keys: ImageKeys) -> ImageRef:
    """``…/images/latest`` → the job's image with the largest authenticated sequence (ids break
    ties); any other ref unchanged."""
    if ref.image_id != "latest":
        return ref
    ids = await complete_images(store, ref.job)
    if not ids:
        raise ImageNotFound(f"no complete image of job {ref.job!r} in {store.url}")
    genuine = await genuine_images(store, ref.job, keys, ids)
    if not genuine:
        raise UnsignedImage(
            f"none of the {len(ids)} complete image(s) of job {ref.job!r} in {store.url} "
            "authenticates under this host's keys"
        )
    return ImageRef(ref.store, ref.job, genuine[-1].image_id)


async def refuse_rollback(store: ImageStore, m: Manifest, keys: ImageKeys, where: str) -> None:
    """Raise :class:`ImageRollback` when the job has an authenticated image with a larger
    sequence than ``m`` (only on a host that holds keys, unless ``allow_rollback``)."""
    if not keys.required or keys.allow_rollback:
        return
    genuine = await genuine_images(store, m.job, keys)
    if genuine and genuine[-1].sequence > m.sequence:
        newest = genuine[-1]
        raise ImageRollback(
            f"image {where} has sequence {m.sequence}, but job {m.job!r} has a newer "
            f"authenticated image {newest.image_id} (sequence {newest.sequence}): refusing a "
            "rollback (set allow_rollback to restore an older image on purpose)"
        )
