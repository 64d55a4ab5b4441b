"""Hostile requests against every route a real controller registers (read from its aiohttp
router, so a new route is fuzzed without touching this file): bodies that are not JSON or
not the right JSON, numbers out of range, huge and deeply nested documents, odd path
segments and queries, wrong methods and content types, an oversized body, no token, a wrong
token, a VM token of another job.

Each answer must come within :data:`LIMIT_S`, never be a 5xx nor a dropped connection, and
an error must be one JSON object with an ``error`` message; nothing may be logged with a
traceback, and no job or NCCL group may change. Deterministic: every random body comes from
one seeded generator."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from controller_helpers import TOKEN, VM1, Factory

from sgtest import json_error_problem
from spotguard.contracts import EventKind
from spotguard.controller.server import ControllerServer

#: aiohttp's own answer for a path no route serves: kept as text on purpose, the controller
#: client tells a proxy's 404 (retried) from the controller's JSON one (no such job)
NO_ROUTE = b"404: Not Found"
#: an answer later than this is a hang
LIMIT_S = 5.0
JOB = "fz-a"  # the job the fuzz runs against (it exists)
OTHER = "fz-b"  # another job: its VM token must not act for JOB
SEED = 20240531


@dataclass
class Case:
    """One hostile request."""

    method: str
    path: str
    body: bytes | None = None
    token: str | None = TOKEN
    headers: dict[str, str] = field(default_factory=dict)
    why: str = ""
    parser: bool = False  # refused by aiohttp's HTTP parser, before any handler: a text 400

    def __str__(self) -> str:
        size = "" if self.body is None else f" [{len(self.body)} B body]"
        return f"{self.why}: {self.method} {self.path[:120]}{size}"


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _bodies(rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """Bodies no route takes: not JSON, JSON of the wrong type, bad fields and values."""
    yield "not JSON", b"this is not json {"
    yield "binary garbage", bytes(rng.getrandbits(8) for _ in range(512))
    yield "invalid UTF-8", b'{"to": "\xff\xfe"}'
    yield "lone surrogate", b'{"job": "\\ud800", "to": "\\udfff"}'
    yield "empty object", b"{}"
    for what, doc in (("list", []), ("string", "x"), ("number", 7), ("null", None)):
        yield f"JSON {what}", json.dumps(doc).encode()
    yield "extra field only", b'{"surprise": 1}'
    yield "wrong types", json.dumps({"job": 7, "to": [], "immediate": "yes", "kind": 1}).encode()
    for n in ("2e308", "NaN", "Infinity", "-Infinity", str(2**70), str(-(2**70)), "-1"):
        for key in ("epoch", "schema_version"):  # an event's numbers
            yield f"{key}={n}", f'{{"job": "{JOB}", "kind": "started", "{key}": {n}}}'.encode()
        for key in ("to", "immediate", "mode", "members"):  # migrate's, unpark's, a group's
            yield f"{key}={n}", f'{{"job": "{JOB}", "to": "x", "{key}": {n}}}'.encode()
    yield "1 MB string", json.dumps({"job": "x" * 1_000_000, "to": "y" * 1_000_000}).encode()
    yield (
        "1 MB event reason",
        json.dumps({"job": JOB, "kind": "parked", "image_url": "z" * 1_000_000}).encode(),
    )
    yield "depth 10,000", _deep(10_000)
    yield "depth 10,000 in an object", b'{"job": "fz-a", "to": ' + _deep(10_000) + b"}"
    yield "bad job name", json.dumps({"job": "../x", "kind": "started"}).encode()
    yield "NUL job name", json.dumps({"job": "a\x00b", "kind": "started", "mode": 3}).encode()
    yield "unknown event kind", json.dumps({"job": JOB, "kind": "explode"}).encode()
    yield "freeze: bad mode", json.dumps({"job": JOB, "mode": "explode"}).encode()
    yield "round: bad members", json.dumps({"job": JOB, "members": [{"pid": "x"}]}).encode()
    yield "round: huge pid", json.dumps({"job": JOB, "members": [{"pid": 2**70}]}).encode()


def _segments() -> Iterator[tuple[str, str]]:
    """Hostile values of one path segment (quoted as one segment)."""
    for what, raw in (
        ("../x", "../x"),
        ("NUL", "a\x00b"),
        ("%00", "%00"),
        ("4000 chars", "n" * 4000),
        ("unicode", "ジョブ"),
        ("lone surrogate", "\udcff"),
        ("dot", "."),
        ("empty-ish", " "),
    ):
        yield what, quote(raw, safe="", errors="surrogateescape")


def _fill(canonical: str, value: str) -> str:
    out = canonical
    for name in ("job", "group", "round", "name"):
        out = out.replace("{" + name + "}", value)
    return out


def cases(routes: list[tuple[str, str]], vm_other: str) -> Iterator[Case]:
    """Every hostile request, for every (method, path template) in ``routes``."""
    rng = random.Random(SEED)
    bodies = list(_bodies(rng))
    for method, canonical in routes:
        path = _fill(canonical, JOB)
        takes_body = method in ("POST", "PUT", "PATCH")
        for what, body in bodies if takes_body else []:
            yield Case(method, path, body, why=f"body {what}")
            yield Case(method, path, body, headers={"Content-Type": "text/plain"}, why=what)
        if takes_body:
            yield Case(method, path, b"x" * (20 * 1024 * 1024), why="20 MB body")
            yield Case(
                method, path, b"{}", headers={"Content-Type": "application/x-www-form-urlencoded"},
                why="form content type",
            )  # fmt: skip
        if "{" in canonical:
            for what, seg in _segments():
                yield Case(method, _fill(canonical, seg), b"{}" if takes_body else None,
                           why=f"segment {what}")  # fmt: skip
        for query in ("epoch=%C2%B2", "epoch=-1", f"epoch={2**70}", "epoch=NaN", "after=x",
                      "after=-1", f"after={2**70}", "have=%C2%B2", "wait=NaN", "wait=inf",
                      "wait=-1e400", "wait=-5", "have=1e3", "after=%00"):  # fmt: skip
            yield Case(method, f"{path}?{query}", b"{}" if takes_body else None,
                       why=f"query {query}")  # fmt: skip
        for wrong in ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
            if wrong != method:
                yield Case(wrong, path, b"{}", why=f"method {wrong}")
        yield Case(method, path, b"{}", token=None, why="no token")
        yield Case(method, path, b"{}", token="wrong-token", why="wrong token")
        yield Case(method, path, b"{}", token="", why="empty bearer")
        yield Case(method, path, b"{}", token="sgvm1.fz-a.99.AAAA", why="forged VM token")
        yield Case(method, path, b"{}", token=vm_other, why="VM token of another job")
        yield Case(method, path, b"{}", headers={"Authorization": "Basic " + "A" * 8000},
                   token=None, why="8 KB auth header")  # fmt: skip
        yield Case(method, path, b"{}", headers={"X-Big": "h" * 16_000}, why="16 KB header",
                   parser=True)  # fmt: skip
        if "{" in canonical:
            yield Case(method, _fill(canonical, "n" * 9000), b"{}", why="9000-char segment",
                       parser=True)  # fmt: skip


@dataclass
class Outcome:
    status: int | None
    body: bytes
    content_type: str
    problem: str | None = None


async def send(s: aiohttp.ClientSession, url: str, case: Case) -> Outcome:
    headers = dict(case.headers)
    if case.token is not None and "Authorization" not in headers:
        headers["Authorization"] = f"Bearer {case.token}"
    try:
        async with asyncio.timeout(LIMIT_S):
            async with s.request(
                case.method, url + case.path, data=case.body, headers=headers,
                skip_auto_headers=() if "Content-Type" in headers else ("Content-Type",),
            ) as r:  # fmt: skip
                return Outcome(r.status, await r.read(), r.content_type)
    except TimeoutError:
        return Outcome(None, b"", "", f"no answer within {LIMIT_S} s")
    except aiohttp.ClientError as exc:
        return Outcome(None, b"", "", f"connection: {type(exc).__name__}: {exc}")


def judge(case: Case, out: Outcome, *, json_errors: bool = True) -> str | None:
    """What is wrong with ``out`` as the answer to ``case`` (None: nothing)."""
    if out.problem is not None:
        return out.problem
    assert out.status is not None
    if out.status >= 500:
        return f"{out.status}: {out.body[:300]!r}"
    if case.parser and out.status == 400:
        return None  # aiohttp's parser answers before the app: no JSON, but nothing logged
    if out.status == 404 and out.body == NO_ROUTE:
        return None  # a path no route serves (``/v1/jobs/./x`` is ``/v1/jobs/x``): see below
    if out.status >= 400 and json_errors:
        return json_error_problem(out.status, out.body)
    return None


def registered(srv: ControllerServer) -> list[tuple[str, str]]:
    """(method, path template) of every route the running server registered (HEAD: aiohttp
    adds one per GET)."""
    app = srv._runner.app
    assert app is not None
    routes = app.router.routes()
    return sorted(
        {(r.method, r.resource.canonical) for r in routes if r.method != "HEAD" and r.resource}
    )


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        f"{r.name}: {r.getMessage()[:200]}"
        for r in caplog.records
        if r.exc_info is not None or "Traceback" in r.getMessage()
    ]


def _facts(view: dict[str, Any]) -> dict[str, Any]:
    return {
        k: view.get(k)
        for k in ("state", "owner", "epoch", "image_url", "restarts", "instance", "history")
    }


async def _two_jobs_started(api_factory: Factory) -> tuple[Any, ControllerServer, Any]:
    """A controller with JOB and OTHER started on VM1: its client, its server, and JOB's
    record as the API shows it (what no refused request may change)."""
    api, srv, _ = await api_factory()
    for job in (JOB, OTHER):
        assert (await api.event(job, EventKind.STARTED, instance=VM1))["_status"] == 200
    return api, srv, await api.get(f"/v1/jobs/{JOB}")


async def test_every_controller_route_answers_hostile_requests_typed(
    api_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    api, srv, before = await _two_jobs_started(api_factory)
    vm_other = srv.controller.keys.issue(OTHER, 0)
    routes = registered(srv)
    templates = {t for _m, t in routes}
    assert {
        "/v1/events",
        "/v1/jobs/{job}/migrate",
        "/v1/groups/{group}/rounds/{round}",
    } <= templates
    bad: list[str] = []
    n = 0
    async with aiohttp.ClientSession() as s:
        for case in cases(routes, vm_other):
            out = await send(s, srv.url, case)
            n += 1
            ui_asset = case.path.startswith("/ui/")  # the page's assets: text, like the page
            if (problem := judge(case, out, json_errors=not ui_asset)) is not None:
                bad.append(f"{case} -> {problem}")
    assert n > 500
    assert not bad, f"{len(bad)} of {n} hostile requests answered badly:\n" + "\n".join(bad)
    assert not (tb := no_tracebacks(caplog)), tb
    after = await api.get(f"/v1/jobs/{JOB}")
    assert _facts(after) == _facts(before)
    assert srv.controller.rendezvous.groups == {} or all(
        g.freeze.generation == 0 and not g.rounds for g in srv.controller.rendezvous.groups.values()
    )


async def test_a_token_that_may_not_act_never_reaches_the_effect(
    api_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """Well-formed requests that would change JOB or a group, sent with no token, a wrong or
    forged one, or the VM token of another job: each is refused (401/403) and nothing moves."""
    caplog.set_level(logging.DEBUG)
    api, srv, before = await _two_jobs_started(api_factory)
    vm_own = srv.controller.keys.issue(JOB, 0)
    vm_other = srv.controller.keys.issue(OTHER, 0)
    event = json.dumps({"job": JOB, "kind": "job_finished"}).encode()
    effects = [
        ("POST", "/v1/events", event, "vm"),
        ("GET", f"/v1/jobs/{JOB}/directive", None, "vm"),
        ("GET", "/v1/jobs", None, "admin"),
        ("GET", f"/v1/jobs/{JOB}", None, "admin"),
        ("POST", f"/v1/jobs/{JOB}/migrate", b'{"to": "local"}', "admin"),
        ("POST", f"/v1/jobs/{JOB}/unpark", b"{}", "admin"),
        ("POST", f"/v1/jobs/{JOB}/retry", b"{}", "admin"),
        ("POST", "/v1/groups/g1/freeze", json.dumps({"job": JOB}).encode(), "vm"),
        ("PUT", "/v1/groups/g1/rounds/r1", json.dumps({"job": JOB}).encode(), "vm"),
    ]
    forged = vm_own[:-4] + ("AAAA" if not vm_own.endswith("AAAA") else "BBBB")
    bad: list[str] = []
    async with aiohttp.ClientSession() as s:
        for method, path, body, who in effects:
            tokens = [(None, 401), ("wrong", 401), (forged, 401), (vm_other, 403)]
            if who == "admin":
                tokens.append((vm_own, 403))  # the job's own VM token is no admin token
            for token, want in tokens:
                case = Case(method, path, body, token=token, why=f"token {str(token)[:12]}")
                out = await send(s, srv.url, case)
                problem = judge(case, out) or (
                    None if out.status == want else f"{out.status}, not {want}: {out.body[:200]!r}"
                )
                if problem is not None:
                    bad.append(f"{case} -> {problem}")
    assert not bad, "\n".join(bad)
    assert not (tb := no_tracebacks(caplog)), tb
    assert _facts(await api.get(f"/v1/jobs/{JOB}")) == _facts(before)
    assert srv.controller.rendezvous.groups == {}
