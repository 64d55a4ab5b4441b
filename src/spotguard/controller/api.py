"""The controller's HTTP API (aiohttp).

=======================================  ======  =============================================
``POST /v1/events``                      token   an :class:`~spotguard.contracts.AgentEvent`;
                                                 200 ``{"job", "state", "reason", "action",
                                                 "duplicate"}``
``GET /v1/jobs``                         token   every job (summary)
``GET /v1/jobs/{job}``                   token   one job: state, history, instance, images
``POST /v1/jobs/{job}/migrate``          token   ``{"to": REGION|TYPE, "immediate": false}``
``GET /v1/jobs/{job}/directive``         token   what the agent should do now: ``{"job",
                                                 "action": "drain"|null, "reason", "state",
                                                 "target"}`` (agents poll it)
``GET /healthz``                         —       ``{"ok": true, "jobs": N}``
``GET /metrics``                         —       Prometheus text format
=======================================  ======  =============================================

Errors are JSON ``{"error": "..."}``: 401 missing/wrong token, 400 malformed body or bad
request (unknown instance type, GPU mismatch), 404 unknown job, 409 conflicting state,
503 state file unusable. ``action`` in an event's answer tells the agent what the
controller wants next (``"drain"`` when a migration waits for a fresh image).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError

from spotguard.contracts import SCHEMA, AgentEvent
from spotguard.controller.core import Controller
from spotguard.controller.state import JobRecord
from spotguard.errors import (
    ConfigError,
    ControllerError,
    JobNotFound,
    NoMatchingOffer,
    PrecheckError,
    ProviderError,
    SpotguardError,
    StateError,
    UnknownInstanceType,
)

log = logging.getLogger(__name__)

CONTROLLER_KEY: web.AppKey[Controller] = web.AppKey("controller", Controller)
TOKEN_KEY: web.AppKey[str] = web.AppKey("token", str)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class MigrateRequest(BaseModel):
    """Body of ``POST /v1/jobs/{job}/migrate``."""

    model_config = ConfigDict(extra="forbid")
    to: str
    immediate: bool = False


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def _problems(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


@web.middleware
async def auth_and_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bearer token on /v1/*; typed errors → JSON answers (never a traceback)."""
    if request.path.startswith("/v1/"):
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or not header[7:].strip():
            return _error(401, "missing bearer token", **{"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(header[7:].strip().encode(), request.app[TOKEN_KEY].encode()):
            log.warning("wrong token", extra={"path": request.path, "peer": request.remote})
            return _error(401, "wrong bearer token", **{"WWW-Authenticate": "Bearer"})
    try:
        return await handler(request)
    except JobNotFound as exc:
        return _error(404, str(exc))
    except (UnknownInstanceType, NoMatchingOffer, PrecheckError, ConfigError) as exc:
        return _error(400, f"{type(exc).__name__}: {exc}")
    except StateError as exc:
        log.error("state unusable", extra={"error": str(exc)})
        return _error(503, str(exc))
    except (ControllerError, ProviderError) as exc:
        return _error(409, f"{type(exc).__name__}: {exc}")
    except SpotguardError as exc:
        return _error(500, f"{type(exc).__name__}: {exc}")


def _summary(rec: JobRecord) -> dict[str, Any]:
    return {
        "job": rec.name,
        "state": rec.state.value,
        "reason": rec.reason,
        "action": rec.data.get("action"),
        "instance": rec.instance,
        "pending": rec.pending,
        "image_url": rec.image_url,
        "restarts": rec.restarts,
        "since": rec.since,
    }


async def post_event(request: web.Request) -> web.Response:
    body = await request.read()
    try:
        ev = AgentEvent.model_validate_json(body)
    except ValidationError as exc:
        msg = f"malformed event: {_problems(exc)}"
        log.warning("malformed event", extra={"peer": request.remote, "error": msg})
        return _error(400, msg)
    if ev.schema_version > SCHEMA:
        return _error(400, f"event schema {ev.schema_version} is newer than this controller's")
    rec, applied = await request.app[CONTROLLER_KEY].handle_event(ev)
    return web.json_response({**_summary(rec), "duplicate": not applied})


async def list_jobs(request: web.Request) -> web.Response:
    jobs = await request.app[CONTROLLER_KEY].db.jobs()
    return web.json_response({"jobs": [_summary(r) for r in jobs]})


async def show_job(request: web.Request) -> web.Response:
    view = await request.app[CONTROLLER_KEY].view(request.match_info["job"])
    return web.json_response(view)


async def migrate_job(request: web.Request) -> web.Response:
    try:
        req = MigrateRequest.model_validate_json(await request.read())
    except ValidationError as exc:
        return _error(400, f"malformed migrate request: {_problems(exc)}")
    c = request.app[CONTROLLER_KEY]
    rec = await c.migrate(request.match_info["job"], req.to, immediate=req.immediate)
    return web.json_response(_summary(rec))


async def directive(request: web.Request) -> web.Response:
    out = await request.app[CONTROLLER_KEY].directive(request.match_info["job"])
    return web.json_response(out)


async def healthz(request: web.Request) -> web.Response:
    jobs = await request.app[CONTROLLER_KEY].db.jobs()
    return web.json_response({"ok": True, "jobs": len(jobs)})


async def metrics(request: web.Request) -> web.Response:
    c = request.app[CONTROLLER_KEY]
    body = generate_latest(c.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(controller: Controller, token: str) -> web.Application:
    """The aiohttp application serving ``controller`` behind ``token``."""
    app = web.Application(middlewares=[auth_and_errors], client_max_size=4 * 1024 * 1024)
    app[CONTROLLER_KEY] = controller
    app[TOKEN_KEY] = token
    app.router.add_post("/v1/events", post_event)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{job}", show_job)
    app.router.add_post("/v1/jobs/{job}/migrate", migrate_job)
    app.router.add_get("/v1/jobs/{job}/directive", directive)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app
