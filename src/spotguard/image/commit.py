"""The store side of committing an image: the writing marker, chunk durability, the gc race
checks, and the authenticated manifest written last with if-absent semantics.

Why a module of its own: these steps are what makes an image visible exactly once and only
when complete (docs/image-format.md, "Durability"); the chunk pipeline
(:mod:`spotguard.image.writer`) and the file cutting (:mod:`spotguard.image.sink`) never
touch a manifest. :meth:`~spotguard.image.writer.ImageWriter.commit` calls them in order:
:func:`sync_chunks`, :func:`recheck_preexisting`, :func:`build_manifest`,
:func:`write_manifest`, :func:`remove_writing_marker`.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from spotguard.errors import ImageError, ObjectNotFound, PreconditionFailed
from spotguard.image.keys import ImageKeys
from spotguard.image.manifest import (
    WRITING_MARKER,
    Codec,
    Encryption,
    FileEntry,
    ImageRef,
    Manifest,
    Totals,
)
from spotguard.names import chunk_key
from spotguard.store import ImageStore
from spotguard.store.base import get_capped


async def put_writing_marker(store: ImageStore, ref: ImageRef, started: float) -> None:
    """Write (or refresh) the marker that tells gc a writer is using this job's chunks."""
    body = {"job": ref.job, "image_id": ref.image_id, "host": socket.gethostname()}
    body["started"] = datetime.fromtimestamp(started, UTC).isoformat()
    await store.put(f"{ref.prefix}/{WRITING_MARKER}", json.dumps(body).encode())


async def remove_writing_marker(store: ImageStore, ref: ImageRef) -> None:
    """Remove the writing marker (gc removes one left behind after its grace period)."""
    await store.delete(f"{ref.prefix}/{WRITING_MARKER}")


async def sync_chunks(store: ImageStore, ref: ImageRef, addrs: Iterable[str]) -> None:
    """Make every chunk the manifest will name durable, the deduplicated ones included (one
    left unsynced by a crashed writer becomes durable here, or the manifest is not
    written)."""
    keys = sorted(chunk_key(ref.job, a) for a in addrs)
    try:
        await store.sync(keys)
    except ObjectNotFound as exc:
        raise ImageError(
            f"a chunk of image {ref.url} vanished before it was made durable "
            f"(concurrent gc?): {exc}; no manifest written"
        ) from exc


async def recheck_preexisting(
    store: ImageStore, ref: ImageRef, addrs: Iterable[str], io_workers: int
) -> None:
    """A chunk skipped because it was in the store must still be there (a gc racing the
    writer must not leave the manifest pointing at nothing)."""
    sem = asyncio.Semaphore(io_workers)

    async def check(a: str) -> str | None:
        async with sem:
            return None if await store.exists(chunk_key(ref.job, a)) else a

    missing = [a for a in await asyncio.gather(*(check(a) for a in sorted(addrs))) if a]
    if missing:
        raise ImageError(
            f"{len(missing)} deduplicated chunk(s) vanished during the write "
            f"(concurrent gc?), e.g. {missing[0]}; no manifest written"
        )


def build_manifest(
    ref: ImageRef,
    files: list[FileEntry],
    *,
    codec: Codec,
    keys: ImageKeys,
    meta: dict[str, Any],
    sequence: int,
) -> Manifest:
    """The manifest of ``files``, authenticated with ``keys`` (see spotguard.image.keys)."""
    unique: dict[str, int] = {}
    for f in files:
        for c in f.chunks:
            unique[c.digest] = c.stored_size
    totals = Totals(
        files=len(files),
        chunks=sum(len(f.chunks) for f in files),
        unique_chunks=len(unique),
        bytes=sum(f.size for f in files),
        stored_bytes=sum(unique.values()),
    )
    enc = Encryption(key_id=keys.cipher.key_id) if keys.cipher else None
    m = Manifest(
        job=ref.job,
        image_id=ref.image_id,
        sequence=sequence,
        codec=codec,
        encryption=enc,
        files=files,
        totals=totals,
        meta=meta,
    )
    try:
        m.auth = keys.sign(m.unsigned(), encrypted=enc is not None)
    except (TypeError, ValueError) as exc:  # meta that JSON cannot carry
        raise ImageError(f"image {ref.url}: manifest cannot be serialised: {exc}") from exc
    return m


async def write_manifest(store: ImageStore, ref: ImageRef, manifest: Manifest) -> None:
    """Write the manifest if absent: the image becomes visible here, complete, or not at all.
    A retried put whose first attempt landed finds its own bytes there: that is success."""
    data = manifest.to_bytes()
    try:
        await store.put(ref.manifest_key, data, if_absent=True)
    except PreconditionFailed as exc:
        existing = await get_capped(store, ref.manifest_key, len(data))
        if existing != data:
            raise ImageError(
                f"image {ref.url} already exists; refusing to overwrite its manifest"
            ) from exc
