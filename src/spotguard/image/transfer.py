"""Whole-directory transfers: an image directory to a store (push) and back (pull).

These are what ``spotguard checkpoint --to URL`` and ``spotguard restore URL`` call. Both return
JSON-able results (bytes, bytes skipped by dedup, rates, timeline) and take a ``progress``
callback that receives :class:`~spotguard.image.stats.TransferStats` after every chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard.errors import ConfigError, DestinationError, ImageError, SpotguardError
from spotguard.image.buffers import BufferPool, Lease
from spotguard.image.codec import Cipher, compress_bound
from spotguard.image.manifest import ChunkRef, FileEntry, Manifest
from spotguard.image.reader import ImageReader, chunk_plan
from spotguard.image.settings import ImageSettings
from spotguard.image.stats import ProgressFn, TransferStats
from spotguard.image.writer import ImageWriter
from spotguard.timeline import Timeline

log = logging.getLogger(__name__)


@dataclass
class PushResult:
    """What :func:`push_dir` did."""

    image_url: str
    manifest: Manifest
    stats: TransferStats
    timeline: Timeline = field(default_factory=Timeline)

    def to_json(self) -> dict[str, Any]:
        return {
            "image": self.image_url,
            "job": self.manifest.job,
            "image_id": self.manifest.image_id,
            "files": self.manifest.totals.files,
            "encrypted": self.manifest.encryption is not None,
            **self.stats.to_json(),
            "timeline": self.timeline.to_list(),
        }


@dataclass
class PullResult:
    """What :func:`pull_image` did."""

    image_url: str
    dest: Path
    manifest: Manifest
    stats: TransferStats
    refetches: int = 0
    timeline: Timeline = field(default_factory=Timeline)

    def to_json(self) -> dict[str, Any]:
        return {
            "image": self.image_url,
            "dest": str(self.dest),
            "job": self.manifest.job,
            "image_id": self.manifest.image_id,
            "files": self.manifest.totals.files,
            "refetches": self.refetches,
            **self.stats.to_json(),
            "timeline": self.timeline.to_list(),
        }


def dir_files(root: Path) -> list[tuple[Path, str]]:
    """Regular files under ``root`` as (path, relative name), in a stable order."""
    out: list[tuple[Path, str]] = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                log.warning("skipping non-regular file", extra={"path": str(p)})
                continue
            out.append((p, p.relative_to(root).as_posix()))
    return out


async def push_dir(
    directory: str | Path,
    store_url: str,
    job: str,
    meta: dict[str, Any] | None = None,
    *,
    image_id: str | None = None,
    progress: ProgressFn | None = None,
    settings: ImageSettings,
    cipher: Cipher | None = None,
    chunk_size: int | None = None,
    level: int | None = None,
    dedup: bool | None = None,
    timeline: Timeline | None = None,
) -> PushResult:
    """Write every regular file under ``directory`` as a new image of ``job`` in the store at
    ``store_url``; the manifest (with ``meta``) is written last. Returns a :class:`PushResult`.

    Raises :class:`~spotguard.errors.ImageError` for an unusable directory and the store's
    errors when it fails for good; in every failure case no manifest exists.
    """
    root = Path(directory)
    if not await asyncio.to_thread(root.is_dir):
        raise ImageError(f"image directory {root} does not exist")
    files = await asyncio.to_thread(dir_files, root)
    tl = timeline if timeline is not None else Timeline()
    writer = ImageWriter(
        store_url,
        job,
        image_id,
        settings=settings,
        cipher=cipher,
        chunk_size=chunk_size,
        level=level,
        dedup=dedup,
        progress=progress,
        timeline=tl,
    )
    writer.stats.total = sum(p.stat().st_size for p, _ in files)
    with tl.step("push", image=writer.url, files=len(files)):
        async with writer:
            for path, name in files:
                await writer.add_file(path, name)
            manifest = await writer.commit(meta)
    return PushResult(writer.url, manifest, writer.stats, tl)


async def pull_image(
    image_url: str,
    dest_dir: str | Path,
    *,
    progress: ProgressFn | None = None,
    settings: ImageSettings,
    cipher: Cipher | None = None,
    timeline: Timeline | None = None,
) -> PullResult:
    """Download, verify and decompress the image at ``image_url`` (``…/images/latest`` works)
    into ``dest_dir``. Chunks are fetched in parallel and written in place with ``pwrite``;
    a chunk used several times is fetched once. Nothing unverified is ever written.

    On failure the files this call created are removed and the error propagates
    (:class:`~spotguard.errors.ImageNotFound`, :class:`~spotguard.errors.ImageCorrupt`,
    :class:`~spotguard.errors.DecryptionError`, store errors; a :class:`DestinationError`
    naming ``dest`` when it fills or fails while the image is written into it).
    """
    s = settings
    dest = Path(dest_dir)
    tl = timeline if timeline is not None else Timeline()
    async with ImageReader(image_url, settings=s, cipher=cipher) as reader:
        m = reader.manifest
        reader.stats.total = m.totals.bytes
        created: list[Path] = []
        made: list[Path] = []  # directories this call created
        fds: dict[str, int] = {}
        ok = False
        try:
            with tl.step("pull", image=reader.url, files=m.totals.files, bytes=m.totals.bytes):
                for f in m.files:
                    fds[f.name] = _create(dest, f, made, created)
                await _fetch_all(reader, fds, progress, dest)
                for f in m.files:
                    try:
                        os.fsync(fds[f.name])
                        os.fchmod(fds[f.name], f.mode)
                    except OSError as exc:
                        raise _unwritable(dest, f.name, exc) from exc
            ok = True
        finally:
            for fd in fds.values():
                os.close(fd)
            if not ok:
                for p in created:
                    p.unlink(missing_ok=True)
                for d in reversed(made):
                    with contextlib.suppress(OSError):
                        d.rmdir()
        reader.stats.finished = time.monotonic()
        result = PullResult(reader.url, dest, m, reader.stats, reader.refetches, tl)
    log.info("image pulled", extra={"image": result.image_url, **result.stats.to_json()})
    return result


def _create(dest: Path, f: FileEntry, made: list[Path], created: list[Path]) -> int:
    """Create file ``f`` under ``dest`` (with its directories, recorded in ``made``) at its
    size; its descriptor. The manifest's names and sizes were checked when it was read
    (:meth:`Manifest.check_files`), so an ``OSError`` here is the destination's: under
    /proc, read-only, full, or a path too long with ``dest`` in front."""
    p = dest / f.name
    try:
        _mkdirs(p.parent, made)
        if p.exists():
            raise ImageError(f"restore target {p} already exists; use an empty dir")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the image into {dest}: {exc.strerror} ({exc.filename})"
        ) from exc
    created.append(p)
    try:
        os.ftruncate(fd, f.size)
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"cannot write the image into {dest}: {exc.strerror} ({p})") from exc
    return fd


def _mkdirs(d: Path, made: list[Path]) -> None:
    """``mkdir -p d``, recording each directory it creates (removed again on failure)."""
    missing: list[Path] = []
    while not d.exists():
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        m.mkdir(exist_ok=True)
        made.append(m)


def _unwritable(dest: Path, name: str, exc: OSError) -> DestinationError:
    """The destination failed while the verified image was written into it (full, an I/O
    error): one line naming the place and the cause, the pull undone by its caller. Not an
    :class:`ImageError`: the image is fine, and an older one would fail the same way."""
    return DestinationError(f"cannot write the image into {dest}: {exc.strerror} ({name})")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


async def _fetch_all(
    reader: ImageReader, fds: dict[str, int], progress: ProgressFn | None, dest: Path
) -> None:
    """Every distinct chunk once: fetched into a pooled buffer, decoded and verified into
    another, written in place at each offset that uses it (a write that fails is the
    destination's: :func:`_unwritable`). Stored-bytes buffers bound the requests in flight;
    plaintext buffers bound the chunks between decode and write."""
    plan = chunk_plan(reader.manifest)
    refs = [t[0][2] for t in plan.values()]
    if not refs:
        return
    window = reader.fetch_window()
    stored_pool = BufferPool(max(compress_bound(r.size) for r in refs), window)
    plain_pool = BufferPool(max(r.size for r in refs), reader.workers + 1)

    async def one(targets: list[tuple[str, int, ChunkRef]]) -> None:
        ref = targets[0][2]
        stored = Lease(stored_pool, await stored_pool.acquire(), None)
        plain: Lease | None = None
        reuse = True
        try:
            plain = Lease(plain_pool, await plain_pool.acquire(), None)
            data = await reader.read_chunk_into(ref, stored, plain)
            stored.release()
            for i, (name, offset, _ref) in enumerate(targets):
                try:
                    await asyncio.to_thread(_pwrite_all, fds[name], data, offset)
                except OSError as exc:
                    raise _unwritable(dest, name, exc) from exc
                if i:  # repeated chunk: written again, fetched once
                    reader.stats.bytes += ref.size
                    reader.stats.bytes_skipped += ref.size
                    reader.stats.chunks += 1
                    reader.stats.chunks_skipped += 1
            if progress is not None:
                progress(reader.stats)
        except asyncio.CancelledError:
            reuse = False  # a worker thread may still be using the buffers
            raise
        finally:
            for lease in (stored, plain):
                if lease is not None:
                    lease.release() if reuse else lease.discard()

    tasks = [asyncio.create_task(one(t)) for t in plan.values()]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        stored_pool.close()
        plain_pool.close()


async def pull_dir(
    image_url: str,
    dest_dir: str | Path,
    *,
    progress: ProgressFn | None = None,
    settings: ImageSettings,
    cipher: Cipher | None = None,
    timeline: Timeline | None = None,
) -> Manifest:
    """Like :func:`pull_image`, returning just the manifest (its ``meta`` carries the engine's
    facts); pass ``timeline`` to collect the step timings."""
    result = await pull_image(
        image_url, dest_dir, progress=progress, settings=settings, cipher=cipher, timeline=timeline
    )
    return result.manifest


async def pull_to_tmp(
    image_url: str, parent: str | Path, *, prefix: str = "restore-", **kwargs: Any
) -> PullResult:
    """Pull into a fresh directory under ``parent``, named ``prefix`` and a random tail
    (removed again on failure)."""
    dest = Path(parent) / f"{prefix}{uuid.uuid4().hex[:8]}"
    dest.mkdir(parents=True)
    try:
        return await pull_image(image_url, dest, **kwargs)
    except (SpotguardError, OSError):
        shutil.rmtree(dest, ignore_errors=True)
        raise
