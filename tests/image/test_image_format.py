"""The image format on a local store: round trips, streaming API, manifest-last commit, dedup,
verification, encryption and gc."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from spotguard.contracts import chunk_key
from spotguard.errors import (
    ConfigError,
    DecryptionError,
    ImageCorrupt,
    ImageError,
    ImageNotFound,
)
from spotguard.image import (
    FORMAT,
    Cipher,
    ImageReader,
    ImageSettings,
    ImageWriter,
    Manifest,
    TransferStats,
    gc,
    generate_key,
    latest_image,
    list_images,
    pull_dir,
    pull_image,
    push_dir,
    verify_image,
)
from spotguard.image.manifest import ImageRef

CHUNK = 256 << 10
S = ImageSettings(chunk_size=CHUNK, workers=2, max_inflight_mb=16)


def make_dir(root: Path, seed: int = 0) -> Path:
    """A CRIU-like image directory: a page file (random + zero + float-ish), small files,
    a captured-output subdirectory, an empty file and an executable bit."""
    rnd = os.urandom(2 * CHUNK)
    floats = bytes((i * 37 + seed) % 7 for i in range(300_000))
    (root / "out").mkdir(parents=True)
    (root / "pages-1.img").write_bytes(rnd + bytes(3 * CHUNK) + floats)
    (root / "core-42.img").write_bytes(os.urandom(1234))
    (root / "out" / "stdout").write_bytes(b"step 1\nstep 2\n")
    (root / "empty.img").write_bytes(b"")
    (root / "job.json").write_text(json.dumps({"seed": seed}))
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    return root


def same_tree(a: Path, b: Path) -> bool:
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return fa == fb and all(
        (a / f).read_bytes() == (b / f).read_bytes()
        and (a / f).stat().st_mode == (b / f).stat().st_mode
        for f in fa
    )


async def test_push_pull_round_trip_and_manifest(tmp_path: Path) -> None:
    src = make_dir(tmp_path / "src")
    store = (tmp_path / "store").as_uri()
    seen: list[int] = []
    res = await push_dir(
        src,
        store,
        "train-1",
        {"gpu": {"count": 0}},
        settings=S,
        progress=lambda st: seen.append(st.bytes),
    )
    m = res.manifest
    assert m.format == FORMAT and m.job == "train-1" and m.meta == {"gpu": {"count": 0}}
    assert m.codec.chunk_size == CHUNK and m.codec.level == 1 and m.encryption is None
    pages = m.file("pages-1.img")
    assert [c.size for c in pages.chunks][:-1] == [CHUNK] * (len(pages.chunks) - 1)
    assert sum(c.size for c in pages.chunks) == pages.size
    assert m.file("empty.img").chunks == [] and m.file("run.sh").mode == 0o755
    assert m.totals.files == 6 and m.totals.bytes == sum(f.size for f in m.files)
    assert m.totals.unique_chunks < m.totals.chunks  # the zero chunks are stored once
    assert seen and seen == sorted(seen) and seen[-1] == m.totals.bytes
    assert res.stats.bytes_skipped >= 2 * CHUNK  # repeated zero chunks within the image
    assert json.loads(json.dumps(res.to_json()))["image"] == res.image_url
    raw = json.loads(
        (tmp_path / "store" / "train-1" / "images" / m.image_id / "manifest.json").read_bytes()
    )
    assert raw["format"] == "spotguard-image/2" and raw["sequence"] == 1 and raw["auth"] == []
    assert Manifest.model_validate(raw) == m

    dest = tmp_path / "dest"
    pulled = await pull_image(res.image_url, dest, settings=S)
    assert same_tree(src, dest)
    assert pulled.manifest == m and pulled.stats.bytes == m.totals.bytes


async def test_streaming_writer_and_ordered_reader(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    data = os.urandom(3 * CHUNK + 999)
    async with ImageWriter(store, "svc", settings=S) as w:
        f = w.file("stream/pages.img")
        pos = 0
        for size in (1, 1000, CHUNK, 77, 2 * CHUNK):  # odd sizes across chunk borders
            await f.write(data[pos : pos + size])
            pos += size
        await f.write(data[pos:])
        await f.close()
        m = await w.commit({"k": "v"})
    assert m.file("stream/pages.img").size == len(data)
    async with ImageReader(f"{store}/svc/images/latest", settings=S, readahead=2) as r:
        assert r.manifest.image_id == m.image_id
        out = b"".join([b async for b in r.iter_file("stream/pages.img")])
    assert out == data


async def test_no_manifest_without_commit_and_previous_image_survives(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    first = await push_dir(make_dir(tmp_path / "a"), store, "job", settings=S)
    w = ImageWriter(store, "job", settings=S)

    async def failing_checkpoint() -> None:
        async with w:
            await w.add_file(tmp_path / "a" / "pages-1.img", "pages-1.img")
            raise RuntimeError("engine failed")

    with pytest.raises(RuntimeError, match="engine failed"):
        await failing_checkpoint()
    async with ImageWriter(store, "job", settings=S) as w2:
        f = w2.file("x")
        await f.write(b"never committed")
        await f.close()
    assert not (tmp_path / "store" / "job" / "images" / w.image_id / "manifest.json").exists()
    assert await latest_image(store, "job", settings=S) == first.image_url
    with pytest.raises(ImageNotFound, match="no manifest"):
        await pull_dir(f"{store}/job/images/{w.image_id}", tmp_path / "d", settings=S)
    listed = {i.image_id: i.complete for i in await list_images(store, "job", settings=S)}
    assert listed == {first.manifest.image_id: True}  # abandoned writers left no marker


async def test_manifest_is_never_overwritten(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    src = make_dir(tmp_path / "a")
    first = await push_dir(src, store, "job", settings=S, image_id="20260101T000000000000Z-aaaaaa")
    with pytest.raises(ImageError, match="already exists"):
        await push_dir(src, store, "job", {"o": 1}, settings=S, image_id=first.manifest.image_id)
    again = await pull_image(first.image_url, tmp_path / "d", settings=S)
    assert again.manifest.meta == {}


async def test_dedup_uploads_only_changed_chunks(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    src = make_dir(tmp_path / "src")
    first = await push_dir(src, store, "nb", settings=S)
    second = await push_dir(src, store, "nb", settings=S)
    assert second.stats.stored_bytes == 0
    assert second.stats.bytes_skipped == second.stats.bytes == first.stats.bytes
    # change one byte in the middle of the page file: exactly one chunk is new
    pages = bytearray((src / "pages-1.img").read_bytes())
    pages[CHUNK + 10] ^= 1
    (src / "pages-1.img").write_bytes(bytes(pages))
    third = await push_dir(src, store, "nb", settings=S)
    assert third.stats.chunks - third.stats.chunks_skipped == 1
    assert 0 < third.stats.stored_bytes <= CHUNK + 100
    assert third.stats.bytes_skipped == third.stats.bytes - CHUNK
    pulled = await pull_image(third.image_url, tmp_path / "d", settings=S)
    assert same_tree(src, pulled.dest)


async def test_corrupt_chunk_is_refused_by_name(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    res = await push_dir(make_dir(tmp_path / "src"), str(store_dir), "job", settings=S)
    victim = res.manifest.file("pages-1.img").chunks[0].digest
    path = store_dir / chunk_key("job", victim)
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    path.write_bytes(bytes(blob))

    with pytest.raises(ImageCorrupt, match=victim) as exc:
        await verify_image(res.image_url, settings=S)
    assert exc.value.chunk == victim
    report = await verify_image(res.image_url, settings=S, raise_on_error=False)
    assert [b["chunk"] for b in report.bad] == [victim] and "pages-1.img" in report.bad[0]["files"]

    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(ImageCorrupt, match=f"{victim}.*pages-1.img") as exc2:
        await pull_dir(res.image_url, dest, settings=S)
    assert exc2.value.chunk == victim
    assert list(dest.rglob("*.img")) == []  # no file of a bad image is left behind


async def test_missing_chunk_is_corrupt_image(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    res = await push_dir(make_dir(tmp_path / "src"), str(store_dir), "job", settings=S)
    victim = res.manifest.file("core-42.img").chunks[0].digest
    (store_dir / chunk_key("job", victim)).unlink()
    with pytest.raises(ImageCorrupt, match=f"{victim}.*missing"):
        await pull_dir(res.image_url, tmp_path / "d", settings=S)


async def test_encryption_round_trip_dedup_and_key_errors(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    src = make_dir(tmp_path / "src")
    key = generate_key()
    keyfile = tmp_path / "key"
    keyfile.write_text(key.hex())
    enc = ImageSettings(chunk_size=CHUNK, workers=2, encryption_key_file=keyfile)
    res = await push_dir(src, str(store_dir), "sec", settings=enc)
    m = res.manifest
    assert m.encryption is not None and m.encryption.key_id == Cipher.from_key(key).key_id
    assert m.encryption.address == "BLAKE3-keyed"
    # stored chunks reveal neither the plaintext nor its plain (unkeyed) BLAKE3 hash
    core = (src / "core-42.img").read_bytes()
    ref = m.file("core-42.img").chunks[0]
    from blake3 import blake3

    assert ref.digest != blake3(core).hexdigest()
    assert core not in (store_dir / chunk_key("sec", ref.digest)).read_bytes()

    again = await push_dir(src, str(store_dir), "sec", settings=enc)
    assert again.stats.stored_bytes == 0  # dedup works under the same key

    # the newest image (an older one is refused as a rollback where a key is held)
    assert same_tree(src, (await pull_image(again.image_url, tmp_path / "ok", settings=enc)).dest)
    plain = ImageSettings(chunk_size=CHUNK)
    with pytest.raises(DecryptionError, match="is encrypted"):
        await pull_dir(res.image_url, tmp_path / "nokey", settings=plain)
    wrong = ImageSettings(chunk_size=CHUNK, encryption_key=generate_key().hex())  # type: ignore[arg-type]
    with pytest.raises(DecryptionError, match="wrong encryption key"):
        await pull_dir(res.image_url, tmp_path / "wrong", settings=wrong)
    with pytest.raises(ConfigError, match="32 bytes"):
        ImageWriter(str(store_dir), "sec", settings=ImageSettings(encryption_key="abc"))  # type: ignore[arg-type]


async def test_gc_keeps_newest_and_referenced_chunks(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    store = str(store_dir)
    urls = []
    for seed in range(3):
        src = make_dir(tmp_path / f"s{seed}", seed)
        urls.append((await push_dir(src, store, "job", settings=S)).image_url)
    with pytest.raises(ConfigError, match="at least 1"):
        await gc(store, "job", 0, settings=S)
    dry = await gc(store, "job", 1, grace_s=0, dry_run=True, settings=S)
    assert len(dry.images_deleted) == 2 and dry.chunks_deleted > 0
    assert len(await list_images(store, "job", settings=S)) == 3

    # a writer in progress keeps every chunk
    async with ImageWriter(store, "job", settings=S) as w:
        busy = await gc(store, "job", 1, grace_s=3600, settings=S, trust_store=True)
        assert busy.skipped_chunks_writer_active == ["job"] and busy.chunks_deleted == 0
        assert len(busy.images_deleted) == 2
        f = w.file("f")
        await f.write(b"x")
        await f.close()
        newest = await w.commit()
    done = await gc(store, "job", 1, grace_s=0, settings=S, trust_store=True)
    assert done.images_kept == [ImageRef(Path(store).as_uri(), "job", newest.image_id).url]
    assert done.chunks_deleted > 0 and done.bytes_freed > 0
    left = {p.name for p in (store_dir / "job" / "chunks").rglob("*") if p.is_file()}
    assert left == set(newest.chunk_refs())
    with pytest.raises(ImageNotFound):
        await pull_dir(urls[0], tmp_path / "gone", settings=S)


async def test_progress_stats_are_json(tmp_path: Path) -> None:
    st = TransferStats(total=10)
    st.bytes = 5
    assert json.loads(json.dumps(st.to_json()))["total"] == 10
    with pytest.raises(ImageError, match="does not exist"):
        await push_dir(tmp_path / "nope", str(tmp_path / "s"), "job", settings=S)
    with pytest.raises(ConfigError, match="not an image URL"):
        await pull_dir(str(tmp_path / "s" / "job"), tmp_path / "d", settings=S)


def test_a_1_tib_manifest_is_within_the_reader_limits_and_a_larger_one_is_never_written() -> None:
    """Readers bound what they parse (spotguard.image.manifest): a 1 TiB image at 16 MiB
    chunks (65,536 chunk references, the limit) writes and parses; one chunk more is refused
    by the writer (an image its readers would refuse is never written) and by the reader."""
    from spotguard.image.manifest import MAX_CHUNKS, MAX_MANIFEST_BYTES, ChunkRef, Codec, FileEntry

    size = 16 << 20
    chunks = [
        ChunkRef.model_construct(digest=f"{i:064x}", size=size, stored_size=size, raw=False)
        for i in range(MAX_CHUNKS)
    ]
    m = Manifest(
        job="big",
        image_id="20261126T000000000000Z",
        codec=Codec(chunk_size=size),
        files=[FileEntry(name="pages-1.img", size=size * MAX_CHUNKS, chunks=chunks)],
    )
    data = m.to_bytes()
    assert m.files[0].size == 1 << 40 and len(data) < MAX_MANIFEST_BYTES  # 10.9 MB
    assert Manifest.parse(data, "big")[0].files[0].chunks[-1] == chunks[-1]
    m.files[0].chunks.append(ChunkRef(digest="f" * 64, size=1, stored_size=1))
    with pytest.raises(ImageError, match="65537 chunk references"):
        m.to_bytes()
    one_more = b'"chunks": [{"digest": "' + b"f" * 64 + b'", "size": 1, "stored_size": 1}, '
    with pytest.raises(ImageError, match="65537 chunk references"):
        Manifest.parse(data.replace(b'"chunks": [', one_more, 1), "big")
