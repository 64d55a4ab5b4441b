"""Stores under fault, every backend against its real server: moto (S3) and fake-gcs-server
(GCS) behind a fault-injecting HTTP proxy, and a real directory (a small tmpfs for a full
disk). For each store call — put, get, head (stat), list, and the manifest commit
(``put(..., if_absent=True)``) — a store that answers 5xx, hangs, drops the connection, cuts
the body short, is full, or sends odd headers:

* transient (5xx, hang, drop, short body) once → retried, the call succeeds, one retry counted;
* transient for good → :class:`StoreUnavailable` (retryable) after exactly ``attempts``
  requests, within a bounded time (a hang costs one ``timeout`` per attempt, never for ever),
  and a write that never succeeded left nothing behind;
* full (507, EntityTooLarge, ENOSPC) → a plain :class:`StoreError` saying so, not retried, and
  nothing written (a commit that fails never leaves a manifest);
* odd headers (no Content-Length, wrong ETag) → the call still returns the object's bytes.

Whole objects only: the image layer fetches every chunk whole (there are no ranged GETs), so
a "ranged get" is the same case as a get.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spotguard.errors import DestinationError, StoreError, StoreUnavailable
from spotguard.image import ImageSettings, pull_image, push_dir
from spotguard.store import BlockingStore, RetryPolicy, open_store

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 0.5
FAST = RetryPolicy(attempts=3, initial=0.01, maximum=0.02, jitter=0, timeout=TIMEOUT)
DATA = b"0123456789abcdef" * 4096  # 64 KiB

OPS = ("put", "get", "head", "list", "commit")


def _method(backend: str, op: str) -> str:
    if op in ("put", "commit"):
        return "PUT" if backend == "s3" else "POST"
    if op == "head" and backend == "s3":
        return "HEAD"
    return "GET"


def _match(backend: str, op: str) -> str:
    """A substring of the request's path and query that only this op's request has."""
    if op == "list":
        return "prefix="
    if backend == "gcs" and op == "put":  # the object's name travels in the upload's body
        return "uploadType=multipart"
    if backend == "gcs" and op == "commit":
        return "ifGenerationMatch=0"
    if op == "get" and backend == "gcs":
        return "alt=media"
    return f"k-{op}"


async def _run(store: BlockingStore, op: str) -> Any:
    """The faulted call, after its object was put (without faults) where it needs one."""
    key = f"j/k-{op}"
    if op == "put":
        await store.put(key, DATA)
        return await store.get(key)
    if op == "commit":
        await store.put(key, DATA, if_absent=True)
        return await store.get(key)
    if op == "get":
        return await store.get(key)
    if op == "head":
        info = await store.stat(key)
        return info.size if info else None
    return [i.key for i in await store.list("j/k-list")]


def _expected(op: str) -> Any:
    if op == "head":
        return len(DATA)
    if op == "list":
        return ["j/k-list"]
    return DATA


Setup = Callable[..., Awaitable[tuple[Any, BlockingStore]]]
#: for faults that never make the client wait: a loaded machine's slow server must not time a
#: request out (a commit whose first attempt landed is then refused as "already exists")
PATIENT = RetryPolicy(attempts=3, initial=0.01, maximum=0.02, jitter=0, timeout=30)
#: one hang, then an answer: the hang costs one timeout, long enough that the retry's own
#: answer from a loaded machine's server is never taken for a second hang
ONE_HANG = RetryPolicy(attempts=3, initial=0.01, maximum=0.02, jitter=0, timeout=2)


@pytest.fixture(params=["s3", "gcs"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def faulted(backend: str, request: pytest.FixtureRequest) -> Setup:
    """``faulted(op)`` → (the proxy, a store through it) with ``op``'s object in place."""
    proxy = request.getfixturevalue("fault_proxy" if backend == "s3" else "gcs_fault_proxy")
    bucket = request.getfixturevalue("s3_bucket" if backend == "s3" else "gcs_bucket")

    async def setup(op: str, retry: RetryPolicy = FAST) -> tuple[Any, BlockingStore]:
        if op in ("get", "head", "list"):
            # seeded through a patient store of its own: a loaded machine's slow server must
            # not turn the seeding put into a retry counted against the store under test
            async with open_store(f"{bucket}/pfx", retry=PATIENT) as seeder:
                await seeder.put(f"j/k-{op}", DATA)
        return proxy, open_store(f"{bucket}/pfx", retry=retry)

    return setup


def _transient_cases() -> list[tuple[str, str]]:
    out = []
    for op in OPS:
        for action in ("500", "503", "hang", "drop"):
            out.append((op, action))
        if op in ("get", "list"):
            out.append((op, "cut"))
    return out


@pytest.mark.parametrize(("op", "action"), _transient_cases())
async def test_transient_fault_once_is_retried(
    backend: str, faulted: Setup, op: str, action: str
) -> None:
    # only a hang makes the client wait; the other faults answer at once, so their retry is
    # given all the time a loaded machine's server needs (a timed-out retry counts twice)
    policy = ONE_HANG if action == "hang" else PATIENT
    proxy, store = await faulted(op, policy)
    fault = proxy.add(_method(backend, op), _match(backend, op), action, times=1)
    start = time.monotonic()
    async with store:
        assert await _run(store, op) == _expected(op)
        assert store.retries == 1
    assert fault.hits == 1
    # a hang costs one timeout and no more: the client never waits on a fault for ever
    assert time.monotonic() - start < ONE_HANG.timeout + 5


@pytest.mark.parametrize(("op", "action"), [(o, a) for o in OPS for a in ("503", "hang", "drop")])
async def test_lasting_fault_is_store_unavailable_in_bounded_time(
    backend: str, faulted: Setup, op: str, action: str
) -> None:
    proxy, store = await faulted(op)
    fault = proxy.add(_method(backend, op), _match(backend, op), action, times=1000)
    start = time.monotonic()
    async with store:
        with pytest.raises(StoreUnavailable) as err:
            await _run(store, op)
        elapsed = time.monotonic() - start
        assert store.retries == FAST.attempts - 1
        proxy.faults.clear()
        if op in ("put", "commit"):
            assert await store.stat(f"j/k-{op}") is None, "a failed write left an object"
    assert fault.hits == FAST.attempts
    assert "\n" not in str(err.value) and not err.value.image_fault and err.value.retryable
    assert elapsed < FAST.attempts * (TIMEOUT + FAST.maximum) + 5, elapsed


@pytest.mark.parametrize(
    ("op", "action"), [(o, a) for o in ("put", "commit") for a in ("507", "too-large")]
)
async def test_full_store_is_a_clear_error_not_retried(
    backend: str, faulted: Setup, op: str, action: str
) -> None:
    proxy, store = await faulted(op, PATIENT)
    fault = proxy.add(_method(backend, op), _match(backend, op), action, times=1000)
    async with store:
        with pytest.raises(StoreError, match="no room in the store") as err:
            await _run(store, op)
        assert not isinstance(err.value, StoreUnavailable)
        assert store.retries == 0
        proxy.faults.clear()
        assert await store.stat(f"j/k-{op}") is None
    assert fault.hits == 1


def _odd_cases(backend: str) -> list[tuple[str, str]]:
    out = [(op, "bad-etag") for op in OPS]
    out += [(op, "no-length") for op in ("get", "list")]
    return out


@pytest.mark.parametrize(("op", "action"), sorted(set(_odd_cases("s3")) | set(_odd_cases("gcs"))))
async def test_odd_headers_still_give_the_object(
    backend: str, faulted: Setup, op: str, action: str
) -> None:
    proxy, store = await faulted(op, PATIENT)
    fault = proxy.add(_method(backend, op), _match(backend, op), action, times=1000)
    async with store:
        assert await _run(store, op) == _expected(op)
    assert fault.hits >= 1


async def test_s3_get_into_without_content_length_reads_to_the_end(
    fault_proxy: Any, s3_bucket: str
) -> None:
    """The restore path reads chunks into reused buffers: a chunked answer (no
    Content-Length) is read to its end, not ``KeyError: 'ContentLength'``; one larger than
    the buffer is read only one byte past it (never whole: a bucket writer's oversized object
    must not be read into memory), which tells the reader it is not the chunk it wants."""
    async with open_store(s3_bucket, retry=FAST) as store:
        await store.put("c", DATA)
        fault_proxy.add("GET", "/c", "no-length", times=2)
        buf = memoryview(bytearray(len(DATA) * 2))
        assert bytes(await store.get_into("c", buf)) == DATA
        small = memoryview(bytearray(10))
        assert bytes(await store.get_into("c", small)) == DATA[:11]


# --- file:// ---------------------------------------------------------------------------------

Mount = Callable[[str, str], Path]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Mount]:
    """``tmpfs(name, options)``: a real tmpfs mounted under tmp_path (unmounted after), so a
    write really fails with ENOSPC or EROFS."""
    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        mnt = tmp_path / name
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)]).returncode:
            pytest.skip("needs root to mount a tmpfs")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("op", ["put", "commit"])
async def test_file_store_disk_full_is_a_clear_error_and_leaves_nothing(
    tmpfs: Mount, op: str
) -> None:
    small_disk = tmpfs("small", "size=1m")
    async with open_store(small_disk.as_uri(), retry=FAST) as store:
        await store.put("j/first", b"x" * 1000)
        with pytest.raises(StoreError, match="no room in the store") as err:
            await store.put("j/manifest.json", b"y" * (2 << 20), if_absent=op == "commit")
        assert not isinstance(err.value, StoreUnavailable)
        assert store.retries == 0
        assert await store.stat("j/manifest.json") is None
        assert [i.key for i in await store.list("j/")] == ["j/first"]
    assert sorted(p.name for p in (small_disk / "j").iterdir()) == ["first"]  # no temp files


async def test_a_pull_into_a_full_disk_is_one_typed_line_and_leaves_nothing(
    tmpfs: Mount, tmp_path: Path
) -> None:
    """``images pull`` (restore's first step from a store to a directory) into a disk that
    fills while the chunks are written: a ``DestinationError`` naming the place and the cause
    — not the ``OSError`` of the thread that wrote, nor an ``ImageError`` (the image is fine:
    an older one would fail the same way) — and the files it made removed."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(3 << 20))  # random: stored as it is
    res = await push_dir(src, (tmp_path / "store").as_uri(), "job", settings=ImageSettings())
    dest = tmpfs("small", "size=1m") / "image"
    with pytest.raises(
        DestinationError, match=f"cannot write the image into {dest}: No space"
    ) as err:
        await pull_image(res.image_url, dest, settings=ImageSettings())
    assert "\n" not in str(err.value) and not err.value.image_fault and err.value.retryable
    assert not dest.exists() or list(dest.iterdir()) == []


async def test_file_store_read_only_is_a_clear_error(tmpfs: Mount) -> None:
    ro = tmpfs("ro", "ro,size=1m")
    async with open_store(ro.as_uri(), retry=FAST) as store:
        with pytest.raises(StoreError) as err:
            await store.put("j/manifest.json", b"{}", if_absent=True)
        assert not isinstance(err.value, StoreUnavailable)
        assert store.retries == 0
    assert (
        "\n" not in str(err.value)
        and not err.value.image_fault
        and err.value.retryable
        and "j/manifest.json" in str(err.value)
    )
