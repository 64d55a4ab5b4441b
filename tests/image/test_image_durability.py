"""Durability of file-store images: chunks are fsynced in one batch before the manifest, and a
chunk file left short by a crashed writer (plus a power loss) is never trusted by dedup."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from spotguard.contracts import chunk_key
from spotguard.errors import ImageError
from spotguard.image import ImageSettings, ImageWriter, latest_image, pull_image
from spotguard.image.codec import Cipher

CHUNK = 256 << 10
S = ImageSettings(chunk_size=CHUNK, workers=2, max_inflight_mb=2)


class Abandon(Exception):
    """Leaves the writer without committing: what a crashed writer leaves in the store."""


def source(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "pages-1.img").write_bytes(os.urandom(5 * CHUNK + 999))
    (root / "core-1.img").write_bytes(os.urandom(4000))
    return root


async def write_files(w: ImageWriter, src: Path, produced: bool = False) -> None:
    """Each file of ``src`` into the image: read by the writer, or ``produced`` — copied in
    chunk by chunk by a producer, which finds each chunk's address in its own thread (as
    the memory a freeze copies beside CRIU is)."""
    for p in sorted(await asyncio.to_thread(lambda: list(src.iterdir()))):
        if not produced:
            await w.add_file(p, p.name)
            continue
        data = p.read_bytes()

        def fill(off: int, view: memoryview, data: bytes = data) -> None:
            view[:] = data[off : off + len(view)]

        await w.file(p.name).produce(len(data), fill)


async def crashed_writer(store: Path, src: Path, cipher: Cipher | None) -> None:
    """Every chunk stored, then the writer dies before its commit."""
    async with ImageWriter(store.as_uri(), "job", settings=S, cipher=cipher) as w:
        await write_files(w, src)
        await asyncio.gather(*w._tasks)
        raise Abandon


async def writer_losing_a_chunk(store: Path, src: Path) -> None:
    """Every chunk stored, one removed behind the writer's back, then the commit."""
    async with ImageWriter(store.as_uri(), "job", settings=S) as w:
        await write_files(w, src)
        await asyncio.gather(*w._tasks)
        victim = next(p for p in (store / "job" / "chunks").rglob("*") if p.is_file())
        victim.unlink()
        await w.commit()


@pytest.mark.parametrize("encrypted", [False, True])
async def test_short_chunk_from_crashed_writer_is_written_again(
    encrypted: bool, tmp_path: Path
) -> None:
    src = source(tmp_path / "src")
    store = tmp_path / "store"
    cipher = Cipher.from_key(os.urandom(32)) if encrypted else None
    with pytest.raises(Abandon):
        await crashed_writer(store, src, cipher)
    chunks = sorted((store / "job" / "chunks").rglob("*"), key=lambda p: p.name)
    chunks = [c for c in chunks if c.is_file()]
    assert len(chunks) == 7  # 6 chunks of pages-1.img, 1 of core-1.img
    # What a power loss after that crash can leave: renamed files, empty or short.
    empty, short = chunks[0], chunks[1]
    whole = {empty: empty.stat().st_size, short: short.stat().st_size}
    os.truncate(empty, 0)
    os.truncate(short, whole[short] // 2)

    async with ImageWriter(store.as_uri(), "job", settings=S, cipher=cipher) as w:
        await write_files(w, src)
        manifest = await w.commit()
    assert w.stats.chunks_skipped == 5  # the intact chunks were reused, the damaged rewritten
    for path, size in whole.items():
        assert path.stat().st_size == size
    refs = manifest.chunk_refs()
    assert {refs[empty.name].stored_size, refs[short.name].stored_size} == set(whole.values())
    pulled = await pull_image(w.url, tmp_path / "dest", settings=S, cipher=cipher)
    for name in ("pages-1.img", "core-1.img"):
        assert (pulled.dest / name).read_bytes() == (src / name).read_bytes()


@pytest.mark.parametrize("produced", [False, True], ids=["read", "produced"])
async def test_a_raw_chunk_looked_up_and_written_in_one_call_is_still_checked(
    produced: bool, tmp_path: Path
) -> None:
    """Raw chunks (which do not compress) on a file store are looked up and, if absent,
    written in one call in the store's thread; one found stored is still decoded before it
    is trusted, and a short one written again — whether the writer read the file or a
    producer copied it in and found the addresses in its own thread."""
    big = ImageSettings(chunk_size=1 << 20, workers=2, max_inflight_mb=8)
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(3 * (1 << 20) + 999))
    store = tmp_path / "store"
    async with ImageWriter(store.as_uri(), "job", settings=big) as w:
        await write_files(w, src, produced)
        first = await w.commit()
    assert w.stats.chunks_raw == 3 and w.stats.chunks_skipped == 0
    raw = [r for r in first.file("pages-1.img").chunks if r.raw]
    victim = store / chunk_key("job", raw[1].digest)
    os.truncate(victim, victim.stat().st_size // 2)
    async with ImageWriter(store.as_uri(), "job", settings=big) as w:
        await write_files(w, src, produced)
        second = await w.commit()
    assert w.stats.chunks_skipped == 3  # two raw and the short tail reused, the damaged not
    assert victim.stat().st_size == raw[1].stored_size
    again = second.file("pages-1.img").chunks
    assert [(r.digest, r.stored_size) for r in again] == [
        (r.digest, r.stored_size) for r in first.file("pages-1.img").chunks
    ]
    assert [r.raw for r in again[:3]] == [True] * 3
    pulled = await pull_image(w.url, tmp_path / "dest", settings=big)
    assert (pulled.dest / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()


async def test_chunk_gone_before_sync_means_no_manifest(tmp_path: Path) -> None:
    src = source(tmp_path / "src")
    store = tmp_path / "store"
    with pytest.raises(ImageError, match="vanished before it was made durable"):
        await writer_losing_a_chunk(store, src)
    assert not list(store.rglob("manifest.json"))
    assert await latest_image(store.as_uri(), "job", settings=S) is None
