"""The metadata emulator: one aiohttp server for AWS (``/latest``), GCP (``/computeMetadata``),
Azure (``/metadata``) and the control API (``/_sim``), on one port.

:class:`MetadataSim` runs it inside any asyncio program (tests, ``spotguard demo``)::

    async with MetadataSim() as sim:
        os.environ.update(sim.env())          # point every source at it
        sim.state.send("aws", "preempt", in_seconds=120)

``spotguard metadata-sim --port N`` runs the same server as a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from types import TracebackType

from aiohttp import web

from spotguard.notices.endpoints import AWS_ENV, AZURE_ENV, GCP_ENV
from spotguard.simulator import aws, azure, control, gcp
from spotguard.simulator.state import CLOUDS, STATE, Fault, SimFacts, SimState

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PREFIXES = (("/latest/", "aws"), ("/computeMetadata/", "gcp"), ("/metadata/", "azure"))
GARBAGE = b"\x89<html>garbage{{ not what any cloud sends \xff\xfe"


def cloud_of(path: str) -> str | None:
    """Which cloud's metadata a request path belongs to (None for the control API)."""
    for prefix, cloud in PREFIXES:
        if path.startswith(prefix):
            return cloud
    return None


@web.middleware
async def metadata_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Per metadata request: count it, refuse clouds not served, apply injected faults."""
    state = request.app[STATE]
    cloud = cloud_of(request.path)
    if cloud is None:
        return await handler(request)
    state.stats[f"{cloud}.requests"] += 1
    peer = request.transport.get_extra_info("peername") if request.transport else None
    if isinstance(peer, tuple):
        state.peers[cloud].add((str(peer[0]), int(peer[1])))
    if cloud not in state.clouds:
        return web.Response(status=404, text="Not Found")
    fault = state.take_fault(cloud, request.path_qs)
    if fault is not None:
        return await _fault(state, fault, cloud)
    return await handler(request)


async def _fault(state: SimState, fault: Fault, cloud: str) -> web.Response:
    headers = {"Metadata-Flavor": "Google", "ETag": "garbage"} if cloud == "gcp" else {}
    if fault.mode == "garbage":
        body = GARBAGE if fault.body is None else fault.body.encode()
        return web.Response(body=body, headers=headers, content_type="text/plain")
    if fault.mode == "hang":
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.closing.wait(), fault.hang_s)
        return web.Response(status=504, text="simulated hang ended")
    return web.Response(status=fault.status, text=f"simulated fault {fault.id}")


def make_app(state: SimState) -> web.Application:
    """The aiohttp application serving ``state``."""
    app = web.Application(middlewares=[metadata_middleware, control.errors])
    app[STATE] = state
    app.add_routes(aws.routes() + gcp.routes() + azure.routes() + control.routes())
    return app


class MetadataSim:
    """The emulator as an async context manager; ``url`` is where it listens."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        clouds: tuple[str, ...] = CLOUDS,
        facts: SimFacts | None = None,
        max_token_ttl: int | None = None,
        imdsv1: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self.state = SimState(
            clouds=clouds, facts=facts, max_token_ttl=max_token_ttl, imdsv1=imdsv1
        )
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (valid once started)."""
        if self._runner is None:
            raise RuntimeError("MetadataSim is not started")
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment variables that point every spotguard source (and the cloud SDKs'
        metadata lookups) at this emulator."""
        return {
            AWS_ENV: self.url + "/",
            GCP_ENV: f"{self.host}:{self.port}",
            AZURE_ENV: self.url,
            "SPOTGUARD_SIM_URL": self.url,
        }

    async def start(self) -> None:
        """Bind and serve (``port=0`` picks a free port, then ``port`` holds it)."""
        runner = web.AppRunner(make_app(self.state), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            self.port = int(sock.getsockname()[1])
            await web.SockSite(runner, sock).start()
        except OSError:
            sock.close()
            await runner.cleanup()
            raise
        self._runner = runner
        log.info("metadata-sim listening", extra={"url": self.url, "clouds": self.state.clouds})

    async def stop(self) -> None:
        """Stop serving; held long-polls and hangs end at once."""
        self.state.closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> MetadataSim:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
