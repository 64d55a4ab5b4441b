"""Transient store failures (5xx, dropped and cut connections) are retried; lasting ones are
typed errors. The faults come from a real proxy in front of the moto server."""

from __future__ import annotations

import os

import pytest

from spotguard.errors import StoreUnavailable
from spotguard.store import RetryPolicy, open_store

FAST = RetryPolicy(attempts=4, initial=0.01, maximum=0.05, jitter=0)


async def test_5xx_and_dropped_connections_are_retried(fault_proxy, s3_bucket: str) -> None:  # type: ignore[no-untyped-def]
    fault_proxy.add("PUT", "/a", "503", times=2)
    fault_proxy.add("PUT", "/b", "drop", times=1)
    fault_proxy.add("GET", "/a", "cut", times=1)
    async with open_store(s3_bucket, retry=FAST) as store:
        await store.put("a", b"A" * 50_000)
        await store.put("b", b"B" * 50_000)
        assert await store.get("a") == b"A" * 50_000
        assert await store.get("b") == b"B" * 50_000
        assert store.retries == 4
    assert [f.hits for f in fault_proxy.faults] == [2, 1, 1]


async def test_multipart_part_failure_retries_only_that_part(fault_proxy, s3_bucket: str) -> None:  # type: ignore[no-untyped-def]
    fault_proxy.add("PUT", "partNumber=2", "503", times=1)
    store = open_store(s3_bucket, retry=FAST)
    store.multipart_threshold = store.part_size = 5 << 20  # type: ignore[attr-defined]
    data = os.urandom(11 << 20)
    async with store:
        await store.put("big", data)
        assert await store.get("big") == data
        assert store.retries == 1


async def test_lasting_failure_is_store_unavailable(fault_proxy, s3_bucket: str) -> None:  # type: ignore[no-untyped-def]
    fault_proxy.add("PUT", "/x", "503", times=100)
    async with open_store(s3_bucket, retry=FAST) as store:
        with pytest.raises(StoreUnavailable, match="ServiceUnavailable"):
            await store.put("x", b"data")
        assert not await store.exists("x")
    assert fault_proxy.faults[0].hits == FAST.attempts
