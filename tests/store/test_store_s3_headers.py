"""An S3-compatible server whose answers lack a header S3 always sends: a clear StoreError
naming the object and the header, never ``KeyError: 'ContentLength'``. The server is a real
HTTP server on a loopback port that answers like S3, minus the header."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from spotguard.errors import StoreError
from spotguard.store.s3 import S3Store


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            method = head.split(b" ", 1)[0]
            lines = [
                b"HTTP/1.1 200 OK",
                b"Last-Modified: Mon, 23 Nov 2026 10:00:00 GMT",
                b'ETag: "0123456789abcdef0123456789abcdef"',
                b"x-amz-request-id: no-length",
            ]
            if method == b"GET":  # a body without its length: read to the end
                lines.append(b"Connection: close")
                writer.write(b"\r\n".join(lines) + b"\r\n\r\nhello")
                await writer.drain()
                break
            writer.write(b"\r\n".join(lines) + b"\r\n\r\n")  # HEAD: no Content-Length
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def no_length_s3(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    server = await asyncio.start_server(_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    try:
        yield url
    finally:
        server.close()
        await server.wait_closed()


async def test_head_without_content_length_is_a_clear_store_error(no_length_s3: str) -> None:
    async with S3Store("bucket", "pfx") as store:
        with pytest.raises(StoreError) as err:
            await store.stat("images/x/manifest.json")
    msg = str(err.value)
    assert "s3://bucket/pfx/images/x/manifest.json" in msg and "Content-Length" in msg, msg
    assert "KeyError" not in msg
