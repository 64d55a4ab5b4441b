"""Hostile requests against every route of the agent's local API (read from its aiohttp
router, so a new route is fuzzed without touching this file), served for real on a loopback
port over a stand-in of the daemon that records every drain it is asked for.

Each answer must come within :data:`LIMIT_S`, never be a 5xx nor a dropped connection; an
error from a JSON route must be one JSON object with a one-line ``error``; nothing may be
logged with a traceback; and no hostile request may reach the drain. Deterministic: every
random body comes from one seeded generator."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from sgtest import json_error_problem
from spotguard.agent.api import AgentApi
from spotguard.agent.metrics import AgentMetrics
from spotguard.agent.recent import RecentEvents

TOKEN = "agent-fuzz-token"
LIMIT_S = 5.0
SEED = 20240531
#: cases aiohttp's HTTP parser refuses before any handler (a line or header over 8190
#: bytes): a text 400, but nothing logged with a traceback
PARSER = ("16 KB header", "path nnnnnnnnn (9000)")


class StandIn:
    """The daemon as the API sees it (:class:`spotguard.agent.api.Controls`)."""

    def __init__(self) -> None:
        self.recent = RecentEvents()
        self.drains: list[tuple[str, bool, float | None]] = []

    @property
    def notices_seen(self) -> list[dict[str, Any]]:
        return []

    def status(self) -> dict[str, Any]:
        return {"jobs": [], "notices": []}

    async def drain(self, reason: str, *, wait: bool, deadline_s: float | None) -> dict[str, Any]:
        self.drains.append((reason, wait, deadline_s))
        return {"notice": {"id": "drain-1"}, "results": []}


@pytest.fixture
async def served() -> AsyncIterator[tuple[AgentApi, StandIn]]:
    daemon = StandIn()
    api = AgentApi(daemon, AgentMetrics(), "127.0.0.1:0", TOKEN)
    await api.start()
    try:
        yield api, daemon
    finally:
        await api.aclose()


def _bodies(rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """Bodies /drain must refuse: not JSON, not an object, fields of the wrong type or range."""
    yield "not JSON", b"drain please {"
    yield "binary garbage", bytes(rng.getrandbits(8) for _ in range(512))
    yield "invalid UTF-8", b'{"reason": "\xff\xfe"}'
    for what, doc in (("list", []), ("string", "x"), ("number", 7), ("null", None)):
        yield f"JSON {what}", json.dumps(doc).encode()
    for n in ("2e308", "NaN", "Infinity", "-Infinity", str(2**70), "-1", "0", "true", '"60"'):
        yield f"deadline_s={n}", f'{{"deadline_s": {n}}}'.encode()
    yield "1 MB reason of the wrong type", json.dumps({"reason": ["x" * 1_000_000]}).encode()
    yield "wait not a boolean", b'{"wait": "false"}'
    yield "reason not a string", b'{"reason": {"a": 1}}'
    yield "extra field", b'{"reason": "x", "surprise": 1}'
    yield "depth 10,000", b"[" * 10_000 + b"]" * 10_000
    yield "depth 10,000 in an object", b'{"reason": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    yield "20 MB", b"x" * (20 * 1024 * 1024)


def cases(
    routes: list[tuple[str, str]],
) -> Iterator[tuple[str, str, str, bytes | None, dict[str, str]]]:
    """(why, method, path, body, headers) of every hostile request."""
    rng = random.Random(SEED)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for method, path in routes:
        if method == "POST":
            for what, body in _bodies(rng):
                yield f"body {what}", method, path, body, auth
                yield (
                    f"text/plain {what}",
                    method,
                    path,
                    body,
                    {**auth, "Content-Type": "text/plain"},
                )
        for wrong in ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
            if wrong != method:
                yield f"method {wrong}", wrong, path, b"{}", auth
        for query in ("x=%00", "wait=NaN", "deadline_s=1e308"):
            yield f"query {query}", method, f"{path}?{query}", b"[]", auth  # not a drain
        yield "no token", method, path, b"{}", {}
        yield "wrong token", method, path, b"{}", {"Authorization": "Bearer wrong"}
        yield "empty bearer", method, path, b"{}", {"Authorization": "Bearer "}
        yield "token as Basic", method, path, b"{}", {"Authorization": f"Basic {TOKEN}"}
        yield "16 KB header", method, path, b"{}", {**auth, "X-Big": "h" * 16_000}
    for seg in ("..%2Fx", "%00", "n" * 4000, "n" * 9000):
        what = f"path {seg[:9]} ({len(seg)})"
        yield what, "GET", f"/ui/static/{seg}", None, {}
        yield what, "POST", f"/{seg}", b"{}", auth


def _judge(why: str, path: str, status: int | None, body: bytes) -> str | None:
    assert status is not None
    if status >= 500:
        return f"{status}: {body[:300]!r}"
    if status < 400 or path.startswith("/ui") or (why in PARSER and status == 400):
        return None  # the page's assets answer text, as the page does
    return json_error_problem(status, body)


async def test_every_agent_api_route_answers_hostile_requests_typed(
    served: tuple[AgentApi, StandIn], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    api, daemon = served
    url = f"http://{api.address}"
    routes = sorted(
        {
            (r.method, r.resource.canonical)
            for r in api.app().router.routes()
            if r.method != "HEAD" and r.resource is not None
        }
    )
    assert ("POST", "/drain") in routes and ("GET", "/status") in routes
    bad: list[str] = []
    n = 0
    async with aiohttp.ClientSession() as s:
        for why, method, path, body, headers in cases(routes):
            status, got, problem = None, b"", None
            try:
                async with asyncio.timeout(LIMIT_S):
                    async with s.request(method, url + path, data=body, headers=headers) as r:
                        status, got = r.status, await r.read()
            except TimeoutError:
                problem = f"no answer within {LIMIT_S} s"
            except aiohttp.ClientError as exc:
                problem = f"connection: {type(exc).__name__}: {exc}"
            n += 1
            wrong = problem or _judge(why, path, status, got)
            if wrong is not None:
                bad.append(f"{why}: {method} {path[:80]} -> {wrong}")
    assert n > 100
    assert not bad, f"{len(bad)} of {n} hostile requests answered badly:\n" + "\n".join(bad)
    tracebacks = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.exc_info is not None]
    assert not tracebacks, tracebacks
    assert daemon.drains == [], "a hostile request reached the drain"


async def test_a_well_formed_drain_still_reaches_the_daemon(
    served: tuple[AgentApi, StandIn],
) -> None:
    """The refusals above are of the input, not of the route: the CLI's body is taken."""
    api, daemon = served
    async with aiohttp.ClientSession() as s:
        body = {"reason": "operator drain", "wait": False, "deadline_s": 120}
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with s.post(f"http://{api.address}/drain", json=body, headers=headers) as r:
            assert r.status == 202, await r.text()
        async with s.post(f"http://{api.address}/drain", headers=headers) as r:
            assert r.status == 202, await r.text()  # no body: the defaults
    assert daemon.drains == [("operator drain", False, 120.0), ("operator drain", False, None)]
