"""An HTTP proxy in front of an EC2 endpoint that answers chosen errors — for failover tests.

No EC2 emulator can be told "this zone has no capacity", so :class:`Ec2FaultProxy` sits
between boto3 and the emulator (moto in server mode, or any EC2 endpoint) and, for requests
matching a :class:`Fault`, answers the error EC2 would (``InsufficientInstanceCapacity``,
``SpotMaxPriceTooLow`` ...) in EC2's XML shape, or forwards the request and holds the answer
for a while (a slow launch, to kill a controller mid-call). Everything else is forwarded as is.

Example::

    async with Ec2FaultProxy(moto_url) as proxy:
        proxy.faults.append(Fault(zones={"us-east-1a"}))
        # point boto3 at proxy.url; RunInstances in us-east-1a now fails like EC2 does
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from dataclasses import dataclass, field
from types import TracebackType
from urllib.parse import parse_qsl

import aiohttp
from aiohttp import web

_REGION_RE = re.compile(r"Credential=[^/]+/\d+/([a-z0-9-]+)/ec2/")


@dataclass
class Fault:
    """Which requests to break and how. ``None`` fields match anything."""

    action: str = "RunInstances"
    code: str = "InsufficientInstanceCapacity"
    zones: set[str] | None = None
    regions: set[str] | None = None
    market: str | None = None  # "spot" | "on-demand"
    delay_s: float = 0.0  # > 0: forward the request, then hold the answer this long
    status: int = 500

    def matches(self, action: str, region: str, zone: str, market: str) -> bool:
        return (
            action == self.action
            and (self.zones is None or zone in self.zones)
            and (self.regions is None or region in self.regions)
            and (self.market is None or market == self.market)
        )


@dataclass
class Call:
    """One request seen by the proxy."""

    action: str
    region: str
    zone: str
    market: str
    outcome: str  # "forwarded" | error code


@dataclass
class Ec2FaultProxy:
    """Async context manager serving on 127.0.0.1 (``.url``) in the running event loop."""

    upstream: str
    faults: list[Fault] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    port: int = 0

    async def __aenter__(self) -> Ec2FaultProxy:
        self._release = asyncio.Event()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._session = aiohttp.ClientSession()
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._release.set()
        await self._runner.cleanup()
        await self._session.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        params = dict(parse_qsl(body.decode("utf-8", "replace"))) if body else {}
        params.update(request.query)
        action = params.get("Action", "")
        m = _REGION_RE.search(request.headers.get("Authorization", ""))
        region = m.group(1) if m else ""
        zone = params.get("Placement.AvailabilityZone", "")
        market = "spot" if params.get("InstanceMarketOptions.MarketType") == "spot" else "on-demand"
        fault = next((f for f in self.faults if f.matches(action, region, zone, market)), None)
        if fault is not None and fault.delay_s <= 0:
            self.calls.append(Call(action, region, zone, market, fault.code))
            return web.Response(status=fault.status, text=_error_xml(fault.code, zone))
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")
        }
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body, headers=headers
        ) as up:
            payload = await up.read()
            status = up.status
            ctype = up.headers.get("Content-Type", "text/xml")
        self.calls.append(Call(action, region, zone, market, "forwarded"))
        if fault is not None:  # hold the answer (ends early when the proxy closes)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._release.wait(), fault.delay_s)
        return web.Response(status=status, body=payload, headers={"Content-Type": ctype})


def _error_xml(code: str, zone: str) -> str:
    msg = (
        "We currently do not have sufficient capacity in the Availability Zone you "
        f"requested ({zone})."
    )
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Response><Errors><Error><Code>{code}</Code><Message>{msg}</Message></Error></Errors>"
        f"<RequestID>{uuid.uuid4()}</RequestID></Response>"
    )
