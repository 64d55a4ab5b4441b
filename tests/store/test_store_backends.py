"""Every store backend against a real server: file directory, moto S3, fake-gcs-server."""

from __future__ import annotations

import os
from pathlib import Path

import boto3
import pytest

from spotguard.errors import ConfigError, ObjectNotFound, PreconditionFailed, StoreUnavailable
from spotguard.store import RetryPolicy, open_store
from spotguard.store.file import FileStore
from spotguard.store.gcs import GcsStore
from spotguard.store.s3 import S3Store


async def test_round_trip_list_and_delete(store_url: str) -> None:
    async with open_store(store_url) as store:
        await store.put("j/chunks/ab/abc", b"chunk-bytes")
        await store.put("j/images/1/manifest.json", b"{}")
        await store.put("k/images/2/writing.json", b"{}")
        assert await store.get("j/chunks/ab/abc") == b"chunk-bytes"
        info = await store.stat("j/chunks/ab/abc")
        assert info is not None and info.size == len(b"chunk-bytes")
        assert await store.stat("j/chunks/ab/nope") is None
        assert [i.key for i in await store.list("j/")] == [
            "j/chunks/ab/abc",
            "j/images/1/manifest.json",
        ]
        assert await store.list_dirs("") == ["j", "k"]
        assert await store.list_dirs("j/images/") == ["1"]
        await store.delete("j/chunks/ab/abc")
        await store.delete("j/chunks/ab/abc")  # absent: fine
        assert not await store.exists("j/chunks/ab/abc")
        with pytest.raises(ObjectNotFound):
            await store.get("j/chunks/ab/abc")


async def test_if_absent_never_overwrites(store_url: str) -> None:
    async with open_store(store_url) as store:
        await store.put("j/images/1/manifest.json", b"first", if_absent=True)
        with pytest.raises(PreconditionFailed):
            await store.put("j/images/1/manifest.json", b"second", if_absent=True)
        assert await store.get("j/images/1/manifest.json") == b"first"
        await store.put("j/images/1/manifest.json", b"third")  # plain put replaces
        assert await store.get("j/images/1/manifest.json") == b"third"


def test_open_store_picks_backend_by_scheme(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), FileStore)
    assert isinstance(open_store(tmp_path.as_uri()), FileStore)
    s3 = open_store("s3://bucket/a/b")
    assert isinstance(s3, S3Store) and (s3.bucket, s3.prefix) == ("bucket", "a/b")
    gs = open_store("gs://bucket")
    assert isinstance(gs, GcsStore) and gs.prefix == ""
    for bad in ("ftp://x/y", "s3://", "file://host/x"):
        with pytest.raises(ConfigError):
            open_store(bad)


async def test_file_store_writes_atomically_and_stays_inside_root(tmp_path: Path) -> None:
    async with FileStore(tmp_path) as store:
        await store.put("a/b", b"x" * 1000)
        leftovers = [p.name for p in (tmp_path / "a").iterdir()]
        assert leftovers == ["b"]  # no temporary files remain
        with pytest.raises(Exception, match="escapes the store root"):
            await store.put("../outside", b"x")


async def test_s3_multipart_parallel_parts_with_checksums_and_sse(s3_bucket: str) -> None:
    store = open_store(s3_bucket + "/mp", sse="AES256")
    assert isinstance(store, S3Store)
    store.multipart_threshold = store.part_size = 5 << 20
    data = os.urandom((5 << 20) * 2 + 12345)  # three parts; the short tail joins the second
    async with store:
        await store.put("big", data)
        assert await store.get("big") == data
    head = boto3.client("s3").head_object(Bucket=s3_bucket[5:], Key="mp/big")
    assert head["ServerSideEncryption"] == "AES256"
    assert head["ETag"].endswith('-2"')  # a multipart upload of two parts


async def test_unreachable_store_is_unavailable_after_retries(
    aws_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: refused
    store = open_store("s3://nowhere", retry=RetryPolicy(attempts=3, initial=0.01, jitter=0))
    async with store:
        with pytest.raises(StoreUnavailable, match="nowhere"):
            await store.get("k")
        assert store.retries == 2


async def test_sync_makes_plain_puts_durable_and_names_missing_keys(store_url: str) -> None:
    async with open_store(store_url) as store:
        keys = ["j/chunks/ab/ab1", "j/chunks/ab/ab2", "j/chunks/cd/cd1", "top"]
        for k in keys:
            await store.put(k, k.encode() * 100)
        await store.sync(keys)  # S3/GCS: acknowledged PUTs are durable already
        await store.sync([])
        for k in keys:
            assert await store.get(k) == k.encode() * 100
        if isinstance(store, FileStore):
            with pytest.raises(ObjectNotFound, match="nope"):
                await store.sync(["j/chunks/ab/ab1", "j/chunks/ab/nope"])
