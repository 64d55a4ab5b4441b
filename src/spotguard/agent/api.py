"""The agent's local API (aiohttp), on loopback ``HOST:PORT`` or a unix socket.

=============== ======= ===================================================================
route           token   answer
=============== ======= ===================================================================
``GET /healthz``  no    ``{"ok": true}`` while the agent's loop runs
``GET /metrics``  no    Prometheus text (see :mod:`spotguard.agent.metrics`)
``GET /status``   yes   jobs, last images, current activity, pending notices
``GET /events``   yes   the recent events, newest first (:class:`~.recent.RecentAnswer`:
                        notices, checkpoints, parks, unparks, restores; the last 200)
``GET /ui``       no    the read-only web page (:mod:`spotguard.webui`); its data comes
                        from ``/status`` and ``/events``, with the token
``POST /drain``   yes   body ``{"reason": str, "wait": bool, "deadline_s": float|null}``:
                        checkpoint every job and stop it (operator drain); with ``wait``
                        the answer comes once the images are durable
=============== ======= ===================================================================

The token is sent as ``Authorization: Bearer <token>``; a missing or wrong one gets 401.
Read-only health and metrics carry no secrets and stay open for probes and scrapers.
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from spotguard.errors import ConfigError, SpotguardError
from spotguard.log import quiet_malformed_requests
from spotguard.webui import add_routes as add_ui
from spotguard.webui import is_ui_path

from .metrics import CONTENT_TYPE, AgentMetrics
from .recent import RecentEvents
from .settings import DRAIN_DEADLINE_MAX, parse_listen

log = logging.getLogger(__name__)


class Controls(Protocol):
    """What the API asks of the daemon."""

    recent: RecentEvents

    @property
    def notices_seen(self) -> list[dict[str, Any]]: ...

    def status(self) -> dict[str, Any]: ...

    async def drain(
        self, reason: str, *, wait: bool, deadline_s: float | None
    ) -> dict[str, Any]: ...


def ensure_token(path: Path, token: str | None) -> str:
    """The API token: the configured one, else the one in ``path`` (``StateDir.api_token``,
    created 0600 on first use, so local root tools can read it and nobody else can)."""
    if token:
        return token
    try:
        existing = path.read_text().strip()
    except FileNotFoundError:
        existing = ""
    if existing:
        return existing
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    value = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


class AgentApi:
    """Serves :class:`Controls` and :class:`AgentMetrics` on ``listen``."""

    def __init__(self, controls: Controls, metrics: AgentMetrics, listen: str, token: str) -> None:
        self.controls = controls
        self.metrics = metrics
        self.listen = listen
        self.token = token
        self._runner: web.AppRunner | None = None
        self.address: str = listen

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/status", self._status)
        app.router.add_get("/events", self._events)
        app.router.add_post("/drain", self._drain)
        add_ui(app, "agent")
        return app

    async def start(self) -> None:
        """Bind and serve. Port 0 picks a free port; :attr:`address` tells which."""
        quiet_malformed_requests()  # a request aiohttp cannot parse: a warning, no traceback
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        where = parse_listen(self.listen)
        site: web.BaseSite
        if isinstance(where, Path):
            where.parent.mkdir(parents=True, exist_ok=True)
            where.unlink(missing_ok=True)
            site = web.UnixSite(self._runner, str(where))
            await site.start()
            os.chmod(where, 0o600)
            self.address = f"unix:{where}"
        else:
            host, port = where
            site = web.TCPSite(self._runner, host, port)
            try:
                await site.start()
            except OSError as exc:
                why = (
                    "is in use (is another agent running?)"
                    if exc.errno == errno.EADDRINUSE
                    else (f"cannot be listened on: {exc.strerror or exc}")
                )
                raise ConfigError(f"api_listen {host}:{port} {why}") from exc
            server = site._server
            sockets = getattr(server, "sockets", None) or []
            if sockets:
                port = int(sockets[0].getsockname()[1])
            self.address = f"{host}:{port}"
        log.info("local API listening", extra={"step": "api", "listen": self.address})

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The token on every route but health, metrics and the page; aiohttp's own refusals
        (no route, a wrong method, a body over 1 MiB) as one JSON line like every other."""
        try:
            if not (request.path in ("/healthz", "/metrics") or is_ui_path(request.path)):
                given = request.headers.get("Authorization", "")
                expected = f"Bearer {self.token}"
                if not hmac.compare_digest(given.encode(), expected.encode()):
                    return web.json_response({"error": "missing or wrong token"}, status=401)
            result: web.StreamResponse = await handler(request)
            return result
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            error = " ".join((exc.text or exc.reason).split())
            return web.json_response({"error": error}, status=exc.status, headers=allow)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.controls.status(), dumps=_dumps)

    async def _events(self, request: web.Request) -> web.Response:
        answer = self.controls.recent.read(self.controls.notices_seen)
        return web.Response(text=answer.model_dump_json(), content_type="application/json")

    async def _drain(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            req = DrainRequest.model_validate_json(raw) if raw.strip() else DrainRequest()
        except ValidationError as exc:
            errors = exc.errors()
            if bad := [e["input"] for e in errors if e["loc"][:1] == ("deadline_s",)]:
                return _refused(_DEADLINE, bad[0])
            return _refused("malformed drain request: " + "; ".join(
                f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in errors
            ))  # fmt: skip
        if req.deadline_s is not None and not 0 < req.deadline_s <= DRAIN_DEADLINE_MAX:
            return _refused(_DEADLINE, req.deadline_s)
        try:
            result = await self.controls.drain(
                req.reason or "operator drain", wait=req.wait, deadline_s=req.deadline_s
            )
        except SpotguardError as exc:  # a typed refusal is one JSON line, never a 500
            return _refused(f"{type(exc).__name__}: {exc}")
        return web.json_response(result, status=200 if req.wait else 202, dumps=_dumps)


class DrainRequest(BaseModel):
    """Body of ``POST /drain`` (may be empty: the defaults). Strict, like the controller's
    wire: ``"wait": "false"`` is refused, not taken as true; an unknown field is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    reason: str | None = None  # None or "": "operator drain"
    wait: bool = False
    deadline_s: float | None = None  # checked against DRAIN_DEADLINE_MAX by the handler


_DEADLINE = f"deadline_s must be a number of seconds in (0, {DRAIN_DEADLINE_MAX:g}]"


def _refused(msg: str, *got: object) -> web.Response:
    """A refused drain: one log line and a 400 with the error (``got``: the bad value)."""
    error = f"{msg}, got {got[0]!r:.200}" if got else msg
    log.warning("drain refused", extra={"step": "api", "error": error})
    return web.json_response({"error": error}, status=400)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, default=str)
