"""Restore from a file store's own pages (``ImageReader.read_chunk_owned(mapped=True)``): a raw
chunk in a store on tmpfs is mapped read-only, hashed in place and handed on by reference —
only where nobody but this user can change the file, and only after its hash matched."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotguard.contracts import chunk_key
from spotguard.errors import ImageCorrupt
from spotguard.image import ImageSettings, push_dir
from spotguard.image.buffers import OwnedChunk
from spotguard.image.manifest import ChunkRef
from spotguard.image.reader import ImageReader
from spotguard.store.file import FileStore, in_memory
from spotguard.stream import pipes

CHUNK = 1 << 20
S = ImageSettings(chunk_size=CHUNK, workers=2)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory on tmpfs (``/dev/shm``), removed after the test."""
    if not Path("/dev/shm").is_dir():
        pytest.fail("no /dev/shm: the mapped restore needs a tmpfs to test on")
    path = Path(tempfile.mkdtemp(prefix="sg-mapped-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def _image(root: Path, tmp_path: Path) -> tuple[str, bytes, ChunkRef]:
    """An image of one file of random (raw-stored) chunks in a file store at ``root``: its
    URL, the file's bytes, and its first chunk."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    data = os.urandom(3 * CHUNK + 4096)
    (src / "pages-1.img").write_bytes(data)
    res = await push_dir(src, root.as_uri(), "mapped", settings=S)
    ref = res.manifest.file("pages-1.img").chunks[0]
    assert ref.raw
    return res.image_url, data, ref


def _bytes(chunk: OwnedChunk) -> bytes:
    return b"".join(bytes(chunk.map[o : o + n]) for o, n in chunk.parts)


async def _read_all(url: str, mapped: bool) -> tuple[bytes, int]:
    """The file's bytes read chunk by chunk, and how many chunks came as the store's map."""
    out, maps = [], 0
    async with ImageReader(url, settings=S) as reader:
        async for chunk in reader.iter_file_owned("pages-1.img", mapped=mapped):
            maps += chunk.spans is not None
            out.append(_bytes(chunk))
            chunk.close()
    return b"".join(out), maps


async def test_raw_chunks_in_a_memory_store_come_as_the_stores_own_pages(
    shm: Path, tmp_path: Path
) -> None:
    url, data, _ref = await _image(shm, tmp_path)
    got, maps = await _read_all(url, mapped=True)
    assert got == data
    assert maps == 3  # every raw chunk (a 4 KiB tail is always compressed: never mapped)
    got, maps = await _read_all(url, mapped=False)
    assert got == data and maps == 0  # not asked for: read into buffers, as before


async def test_a_mapped_chunk_whose_bytes_changed_is_refused(shm: Path, tmp_path: Path) -> None:
    url, _data, ref = await _image(shm, tmp_path)
    path = shm / chunk_key("mapped", ref.digest)
    with path.open("r+b") as f:  # one byte of a block, the file's owner and mode kept
        f.seek(13 + 3 + 1000)
        b = f.read(1)
        f.seek(13 + 3 + 1000)
        f.write(bytes([b[0] ^ 0xFF]))
    async with ImageReader(url, settings=S) as reader:
        with pytest.raises(ImageCorrupt, match="hash check"):
            await reader.read_chunk_owned(ref, mapped=True)


async def test_a_damaged_frame_layout_is_read_the_general_way_and_refused(
    shm: Path, tmp_path: Path
) -> None:
    url, _data, ref = await _image(shm, tmp_path)
    path = shm / chunk_key("mapped", ref.digest)
    with path.open("r+b") as f:  # a block header: no longer the writer's raw layout
        f.seek(13)
        f.write(b"\x00\x00\x00")
    async with ImageReader(url, settings=S) as reader:
        with pytest.raises(ImageCorrupt):
            await reader.read_chunk_owned(ref, mapped=True)


@pytest.mark.parametrize("how", ["group-writable", "other-writable", "another-owner", "disk"])
async def test_a_file_others_could_change_or_on_a_disk_is_read_not_mapped(
    how: str, shm: Path, tmp_path: Path
) -> None:
    root = tmp_path / "store" if how == "disk" else shm
    url, data, ref = await _image(root, tmp_path)
    path = root / chunk_key("mapped", ref.digest)
    if how == "group-writable":
        path.chmod(0o664)
    elif how == "other-writable":
        path.chmod(0o646)
    elif how == "another-owner":
        if os.geteuid() != 0:
            pytest.skip("changing a file's owner needs root")  # CI runs as root
        os.chown(path, 65534, 65534)
    store = FileStore(root)
    try:
        assert await store.map_object(chunk_key("mapped", ref.digest)) is None
    finally:
        await store.aclose()
    async with ImageReader(url, settings=S) as reader:
        chunk = await reader.read_chunk_owned(ref, mapped=True)
        assert chunk.spans is None  # read into a buffer of its own
        assert _bytes(chunk) == data[:CHUNK]
        chunk.close()


def test_in_memory_tells_tmpfs_from_a_disk(shm: Path, tmp_path: Path) -> None:
    # the suite's temporary files are on the machine's disk (ext4 on CI), /dev/shm is tmpfs
    for path, want in ((shm / "f", True), (tmp_path / "f", False)):
        path.write_bytes(b"x")
        fd = os.open(path, os.O_RDONLY)
        try:
            assert in_memory(fd) is want, path
        finally:
            os.close(fd)


def test_splice_parts_puts_the_parts_in_order_through_a_small_pipe() -> None:
    import mmap

    n = 8 * (128 << 10) + 8 * 3
    buf = mmap.mmap(-1, n)
    buf[:] = os.urandom(n)
    parts = [(3 + i * ((128 << 10) + 3), 128 << 10) for i in range(8)]
    want = b"".join(buf[o : o + k] for o, k in parts)
    r, w = os.pipe()
    os.set_blocking(w, False)
    got = bytearray()

    def drain() -> None:
        while chunk := os.read(r, 1 << 16):
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        pipes.splice_parts(w, buf, parts, threading.Event())  # 1 MiB through a 64 KiB pipe
    finally:
        os.close(w)
        reader.join(10)
        os.close(r)
    assert bytes(got) == want
