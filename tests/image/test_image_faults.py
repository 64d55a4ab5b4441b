"""Images under failure: a flaky store (via a real fault proxy in front of moto), a writer
killed mid-upload, and chunks that arrive damaged."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from spotguard.errors import ConfigError, ImageCorrupt, StoreUnavailable
from spotguard.image import (
    ImageReader,
    ImageSettings,
    ImageWriter,
    gc,
    latest_image,
    list_images,
    pull_image,
    push_dir,
)
from spotguard.store.file import FileStore

CHUNK = 256 << 10
S = ImageSettings(chunk_size=CHUNK, workers=2, max_inflight_mb=4, retries=4)


def random_dir(root: Path, size: int) -> Path:
    root.mkdir(parents=True)
    (root / "pages-1.img").write_bytes(os.urandom(size))
    (root / "core-1.img").write_bytes(os.urandom(5000))
    return root


async def test_flaky_store_push_completes_and_pulls_equal(
    fault_proxy,  # type: ignore[no-untyped-def]
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    src = random_dir(tmp_path / "src", 6 * CHUNK)
    fault_proxy.add("PUT", "/chunks/", "503", times=3)
    fault_proxy.add("PUT", "/chunks/", "drop", times=2)
    fault_proxy.add("HEAD", "/chunks/", "503", times=2)
    fault_proxy.add("PUT", "manifest.json", "lose", times=1)  # landed, answer lost
    fault_proxy.add("GET", "/chunks/", "cut", times=2)
    res = await push_dir(src, s3_bucket, "flaky", settings=S)
    assert res.stats.retries >= 7
    assert all(f.times == 0 for f in fault_proxy.faults[:4])
    pulled = await pull_image(res.image_url, tmp_path / "dest", settings=S)
    assert (pulled.dest / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()


async def test_store_down_for_good_leaves_no_image(
    fault_proxy,  # type: ignore[no-untyped-def]
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    good = await push_dir(random_dir(tmp_path / "a", 2 * CHUNK), s3_bucket, "job", settings=S)
    fault_proxy.add("PUT", "/chunks/", "503", times=1000)
    with pytest.raises(StoreUnavailable):
        await push_dir(random_dir(tmp_path / "b", 4 * CHUNK), s3_bucket, "job", settings=S)
    assert await latest_image(s3_bucket, "job", settings=S) == good.image_url
    assert [i.complete for i in await list_images(s3_bucket, "job", settings=S)] == [True]


async def test_damaged_chunk_in_transit_is_refetched_once(
    fault_proxy,  # type: ignore[no-untyped-def]
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    src = random_dir(tmp_path / "src", 3 * CHUNK)
    res = await push_dir(src, s3_bucket, "job", settings=S)
    victim = res.manifest.file("pages-1.img").chunks[1].digest
    fault_proxy.add("GET", victim, "flip", times=1)
    pulled = await pull_image(res.image_url, tmp_path / "once", settings=S)
    assert pulled.refetches == 1
    assert (pulled.dest / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()

    fault_proxy.add("GET", victim, "flip", times=2)  # bad twice: refuse, naming the chunk
    async with ImageReader(res.image_url, settings=S) as r:
        with pytest.raises(ImageCorrupt, match=victim) as exc:
            async for _ in r.iter_file("pages-1.img"):
                pass
    assert exc.value.chunk == victim


CHILD = """
import asyncio, sys, time
from spotguard.image import ImageSettings, push_dir

def progress(st):
    print("progress", st.chunks, flush=True)
    time.sleep(0.2)

S = ImageSettings(chunk_size=256 << 10, workers=1, max_inflight_mb=1)
asyncio.run(push_dir(sys.argv[1], sys.argv[2], "counter", settings=S, progress=progress))
print("finished", flush=True)
"""


async def test_writer_killed_mid_upload_previous_image_still_restores(
    counter_job,  # type: ignore[no-untyped-def]
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    counter_job.start()
    token, n, crc, _ = counter_job.dump(tmp_path / "dump")
    good = await push_dir(tmp_path / "dump", s3_bucket, "counter", settings=S)

    big = random_dir(tmp_path / "next", 24 * CHUNK)
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        str(big),
        s3_bucket,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert child.stdout is not None
    line = await asyncio.wait_for(child.stdout.readline(), timeout=60)
    assert line.startswith(b"progress")
    os.kill(child.pid, signal.SIGKILL)  # the agent dies mid-upload
    assert await child.wait() == -signal.SIGKILL

    images = await list_images(s3_bucket, "counter", settings=S)
    assert [i.complete for i in images] == [True, False]  # the killed one has no manifest
    assert await latest_image(s3_bucket, "counter", settings=S) == good.image_url

    pulled = await pull_image(f"{s3_bucket}/counter/images/latest", tmp_path / "r", settings=S)
    counter_job.restore(pulled.dest)
    t2, n2, crc2, _ = counter_job.wait_for(lambda s: s[1] > n + 3)
    assert (t2, crc2) == (token, crc) and n2 > n

    swept = await gc(s3_bucket, "counter", 1, grace_s=0, settings=S, trust_store=True)
    assert swept.stale_markers_deleted == 1 and swept.chunks_deleted > 0
    assert [i.complete for i in await list_images(s3_bucket, "counter", settings=S)] == [True]


async def test_a_pull_into_a_place_that_cannot_be_written_is_refused_typed(
    tmp_path: Path,
) -> None:
    """``images pull URL DEST`` where DEST cannot be made (under /proc) or sits under a file:
    a ConfigError naming the place — the command's one line — not an unexpected OSError."""
    store = f"file://{tmp_path / 'store'}"
    res = await push_dir(random_dir(tmp_path / "src", 2 * CHUNK), store, "job", settings=S)
    (tmp_path / "a-file").write_text("x")
    for dest in (Path("/proc/no-such-dir"), tmp_path / "a-file" / "under"):
        with pytest.raises(ConfigError, match=f"cannot write the image into {dest}"):
            await pull_image(res.image_url, dest, settings=S)


class _HungDeletes(FileStore):
    """A file store whose deletes hang (a store that stopped answering mid-way)."""

    async def delete(self, key: str) -> None:
        await asyncio.Event().wait()


async def test_an_abandoned_write_does_not_wait_for_a_hung_store_to_drop_its_marker(
    tmp_path: Path,
) -> None:
    """A write given up (a pause given way to a notice's exit, a deadline) removes its
    writing marker on the way out; with the store hung, that removal must not hold the
    caller — the exit waits for the pause to end — beyond a few seconds: gc removes a stale
    marker after its grace period."""
    store = _HungDeletes(tmp_path / "store")

    async def given_up() -> None:
        async with ImageWriter(store, "job", settings=S) as w:  # type: ignore[arg-type]
            f = w.file("pages-1.img")
            await f.write(os.urandom(2 * CHUNK))
            raise RuntimeError("given up")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="given up"):
        await asyncio.wait_for(given_up(), 60)
    assert time.monotonic() - started < 15
    await store.aclose()
