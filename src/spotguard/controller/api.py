"""The controller's HTTP API (aiohttp).

===========================================  ======  ===============================================
``POST /v1/events``                          VM      an :data:`~spotguard.contracts.AgentEvent`; 200
                                                     an :class:`~spotguard.contracts.EventAnswer`
                                                     (409 with ``stale`` and ``stand_down``: the
                                                     sender does not own the job)
``GET /v1/jobs/{job}/directive``             VM      a :class:`~spotguard.contracts.Directive`
                                                     (agents poll it; admin: ``?epoch=N``)
``GET /v1/jobs``                             admin   every job (summary)
``GET /v1/jobs/{job}``                       admin   one job: state, owner, history, images
``POST /v1/jobs/{job}/migrate``              admin   ``{"to": REGION|TYPE, "immediate": false}``
``POST /v1/jobs/{job}/unpark``               admin   ``{"to": REGION|TYPE}`` (optional): relaunch a
                                                     job parked to a store (409 when not parked)
``POST /v1/jobs/{job}/retry``                admin   ``{"to": REGION|TYPE}`` (optional): relaunch a
                                                     FAILED job from its newest image with a fresh
                                                     restart budget (409 when not failed)
``POST /v1/groups/{group}/freeze``           VM      a :class:`~spotguard.groupwire.FreezeRequest`:
                                                     join or open a freeze; 200 its ``GroupFreeze``
``GET /v1/groups/{group}/freeze``            any     ``?after=G&wait=S``: the newest GroupFreeze
                                                     once past ``G`` or after ``S`` s (long poll)
``PUT /v1/groups/{group}/rounds/{round}``    VM      a :class:`~spotguard.groupwire.RoundEntry` (one
                                                     per job); 200 the ``Round``
``GET /v1/groups/{group}/rounds/{round}``    any     ``?have=N&wait=S``: the Round once it holds
                                                     more than ``N`` entries, or after ``S`` s (long
                                                     poll)
``GET /healthz``                             —       ``{"ok": true, "jobs": N}``
``GET /metrics``                             —       Prometheus text format
``GET /ui``                                  —       the read-only web page (:mod:`spotguard.webui`;
                                                     its data comes from the admin routes above)
===========================================  ======  ===============================================

The paths are declared once, in :mod:`spotguard.controller.routes` (shared with the client).

"VM" routes take the admin token or a VM token scoped to that job
(:mod:`spotguard.controller.tokens`); "admin" routes only the admin token. Errors are JSON
``{"error": "..."}``: 401 missing/wrong token, 403 a token that may not act there, 400
malformed body or bad request (unknown instance type, GPU mismatch), 404 unknown job, 409
conflicting state or a non-owner's event, 413 an event over :data:`MAX_EVENT_BYTES`
(``EventTooLarge``), 429 too many events or bytes from one token for one job
(``EventRateLimited``, with ``Retry-After``), 503 state file unusable. The 413 and 429
answers also carry the error's ``code``. A wrong method (405, with ``Allow``) or any body over
4 MiB (413) is JSON too; only a path no route serves gets aiohttp's text 404.

The NCCL groups' routes (:mod:`spotguard.groupwire`; kept in memory by the controller's
:class:`~spotguard.controller.rendezvous.Rendezvous`) answer 400 for a group or round name
that is not a ``groupwire.Name`` or a bad number, 403 for a job the token may not act for,
413 (``EventTooLarge``) for a body over :data:`MAX_ROUND_BYTES` / :data:`MAX_FREEZE_BYTES`,
409 (``ControllerRefused``) past a bound of the rendezvous. "any": any valid token.

What one token can make the controller store is capped (every event is kept in the state
file): an event's body is read up to :data:`MAX_EVENT_BYTES` and refused past it, before it
is parsed; and each (job, token) pair may send :data:`EVENTS_PER_WINDOW` events and
:data:`EVENT_BYTES_PER_WINDOW` bytes per :data:`EVENT_WINDOW_S` seconds (a sliding window,
in memory). An agent's reporter retries a 429 with backoff and drops a 413 (logged).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from spotguard.contracts import SCHEMA, EventAnswer
from spotguard.controller import routes
from spotguard.controller.core import Controller, directive_of
from spotguard.controller.edge import LOGGED_FIELDS, instance_info, parse_lenient
from spotguard.controller.state import JobRecord
from spotguard.controller.tokens import Caller
from spotguard.controller.views import JobView
from spotguard.errors import (
    AuthError,
    ConfigError,
    ControllerError,
    EventRateLimited,
    EventTooLarge,
    JobNotFound,
    NoMatchingOffer,
    PrecheckError,
    ProviderError,
    SpotguardError,
    StateError,
    UnknownInstanceType,
)
from spotguard.groupwire import FreezeRequest, Name, RoundEntry
from spotguard.webui import add_routes as add_ui

log = logging.getLogger(__name__)

CONTROLLER_KEY: web.AppKey[Controller] = web.AppKey("controller", Controller)
CALLER: web.RequestKey[Caller] = web.RequestKey("caller", Caller)  # the verified caller

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: the largest agent event taken, in bytes of its JSON body (real events are a few KiB: a
#: CRIU failure's log tail is the largest)
MAX_EVENT_BYTES = 256 * 1024
#: per (job, token): at most this many events and bytes in any EVENT_WINDOW_S seconds
EVENT_WINDOW_S = 60
EVENTS_PER_WINDOW = 120
EVENT_BYTES_PER_WINDOW = 2 * 1024 * 1024
#: the largest round entry taken (an NCCL group's round), in bytes of its JSON body
MAX_ROUND_BYTES = 1024 * 1024
#: the largest freeze request taken (a job, a reason, a mode: a few hundred bytes)
MAX_FREEZE_BYTES = 64 * 1024
_READ_CHUNK = 64 * 1024
_NAME: TypeAdapter[str] = TypeAdapter(Name)


class EventLimiter:
    """Sliding-window caps on what one token may make the controller store for one job."""

    def __init__(
        self,
        window_s: float = EVENT_WINDOW_S,
        events: int = EVENTS_PER_WINDOW,
        nbytes: int = EVENT_BYTES_PER_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s, self.events, self.nbytes, self.clock = window_s, events, nbytes, clock
        self.seen: dict[tuple[str, str], deque[tuple[float, int]]] = {}
        self.warned: dict[tuple[str, str], float] = {}  # one log line per key and window

    def take(self, key: tuple[str, str], size: int) -> None:
        """Count one event of ``size`` bytes for ``key``, or :class:`EventRateLimited`."""
        now = self.clock()
        q = self.seen.setdefault(key, deque())
        while q and q[0][0] <= now - self.window_s:
            q.popleft()
        over = None
        if len(q) >= self.events:
            over = f"{self.events} events"
        elif sum(b for _t, b in q) + size > self.nbytes:
            over = f"{self.nbytes} bytes of events"
        if over is None:
            q.append((now, size))
            if len(self.seen) > 1024:  # forget keys whose window is empty
                self.seen = {k: v for k, v in self.seen.items() if v}
            return
        retry = max(1, math.ceil(q[0][0] + self.window_s - now)) if q else 1
        if self.warned.get(key, 0.0) <= now - self.window_s:
            self.warned[key] = now
            log.warning(
                "events refused: over the limit of one token for one job",
                extra={"job": key[0], "vm": key[1], "reason": f"over {over} per window"},
            )
        raise EventRateLimited(
            f"job {key[0]!r}: this token sent more than {over} in {self.window_s:.0f} s; "
            f"retry in {retry} s",
            retry,
        )


LIMITER_KEY: web.AppKey[EventLimiter] = web.AppKey("event_limiter", EventLimiter)


async def _read_event(request: web.Request) -> bytes:
    """The event's body, read up to :data:`MAX_EVENT_BYTES`; :class:`EventTooLarge` past it
    (announced by Content-Length or not), before anything is parsed."""
    return await _read_body(request, MAX_EVENT_BYTES, "event", "events")


async def _read_body(request: web.Request, limit: int, what: str, whats: str) -> bytes:
    """The request's body, read up to ``limit`` bytes; :class:`EventTooLarge` (413) past it
    (announced by Content-Length or not), before anything is parsed."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise EventTooLarge(
            f"{what} of {declared} bytes; the controller takes {whats} of {limit} bytes at most"
        )
    body = bytearray()
    while chunk := await request.content.read(_READ_CHUNK):
        body += chunk
        if len(body) > limit:
            raise EventTooLarge(
                f"{what} of more than {limit} bytes; the controller takes {whats} of "
                f"{limit} bytes at most"
            )
    return bytes(body)


class MigrateRequest(BaseModel):
    """Body of ``POST /v1/jobs/{job}/migrate``."""

    model_config = ConfigDict(extra="forbid")
    to: str
    immediate: bool = False


class UnparkRequest(BaseModel):
    """Body of ``POST /v1/jobs/{job}/unpark`` (may be empty): where to bring the job back."""

    model_config = ConfigDict(extra="forbid")
    to: str | None = None


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def _typed(status: int, exc: SpotguardError, **headers: str) -> web.Response:
    body = {"error": f"{type(exc).__name__}: {exc}", "code": exc.code}
    return web.json_response(body, status=status, headers=headers or None)


def _problems(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


@web.middleware
async def auth_and_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bearer token on /v1/*; typed errors → JSON answers (never a traceback)."""
    if request.path.startswith(routes.API_PREFIX):
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or not header[7:].strip():
            return _error(401, "missing bearer token", **{"WWW-Authenticate": "Bearer"})
        try:
            request[CALLER] = request.app[CONTROLLER_KEY].keys.verify(header[7:].strip())
        except AuthError:
            log.warning("wrong token", extra={"path": request.path, "peer": request.remote})
            return _error(401, "wrong bearer token", **{"WWW-Authenticate": "Bearer"})
    try:
        return await handler(request)
    except AuthError as exc:
        log.warning("token refused", extra={"path": request.path, "error": str(exc)})
        return _error(403, str(exc))
    except JobNotFound as exc:
        return _error(404, str(exc))
    except (UnknownInstanceType, NoMatchingOffer, PrecheckError, ConfigError) as exc:
        return _error(400, f"{type(exc).__name__}: {exc}")
    except EventTooLarge as exc:
        log.warning("event refused: too large", extra={"peer": request.remote, "error": str(exc)})
        return _typed(413, exc)
    except EventRateLimited as exc:
        return _typed(429, exc, **{"Retry-After": str(exc.retry_after)})
    except StateError as exc:
        log.error("state unusable", extra={"error": str(exc)})
        return _error(503, str(exc))
    except (ControllerError, ProviderError) as exc:
        return _error(409, f"{type(exc).__name__}: {exc}")
    except SpotguardError as exc:
        return _error(500, f"{type(exc).__name__}: {exc}")
    except web.HTTPException as exc:  # aiohttp's own refusals: a wrong method, a body too large
        if exc.status < 400 or exc.status == 404:
            raise  # no route: aiohttp's text 404, which the client tells from the controller's
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
        return _error(exc.status, " ".join((exc.text or exc.reason).split()), **allow)


def _summary(rec: JobRecord, asker_epoch: int | None = None) -> dict[str, Any]:
    d = directive_of(rec, asker_epoch)
    answer = EventAnswer(
        **d.model_dump(),
        instance=instance_info(rec.instance) if rec.instance else None,
        pending=rec.pending,
        image_url=rec.image_url,
        restarts=rec.restarts,
        since=rec.since,
    )
    out = answer.model_dump(mode="json")
    out["reason"] = rec.reason if not d.stand_down else d.reason  # the job's, for the CLI
    return out


def _caller(request: web.Request) -> Caller:
    return request[CALLER]


def _admin(request: web.Request) -> None:
    if not _caller(request).admin:
        raise AuthError("this route needs the admin token; a VM token may not use it")


async def post_event(request: web.Request) -> web.Response:
    body = await _read_event(request)
    try:
        ev, ignored = parse_lenient(body)
    except ValidationError as exc:
        msg = f"malformed event: {_problems(exc)}"
        log.warning("malformed event", extra={"peer": request.remote, "error": msg})
        return _error(400, msg)
    new = [n for n in ignored if (ev.kind.value, n) not in LOGGED_FIELDS]
    if new:
        LOGGED_FIELDS.update((ev.kind.value, n) for n in new)
        log.warning(
            "unexpected field in an agent report ignored (logged once per kind and field)",
            extra={"job": ev.job, "kind": ev.kind.value, "fields": new},
        )
    if ev.schema_version != SCHEMA:
        return _error(
            400, f"event schema {ev.schema_version}; this controller speaks schema {SCHEMA}"
        )
    caller = _caller(request)
    if caller.may_act_for(ev.job):  # else refused below (403), nothing stored
        who = "admin" if caller.admin else f"vm-epoch-{caller.epoch}"
        request.app[LIMITER_KEY].take((ev.job, who), len(body))
    done = await request.app[CONTROLLER_KEY].handle_event(ev, caller, ignored=ignored)
    epoch = _caller(request).epoch if not _caller(request).admin else ev.epoch
    out = {**_summary(done.record, epoch), "duplicate": not done.applied}
    if done.stale is not None:
        out |= {"stale": True, "stand_down": True, "error": f"not the job's owner: {done.stale}"}
        return web.json_response(out, status=409)
    return web.json_response(out)


async def list_jobs(request: web.Request) -> web.Response:
    _admin(request)
    jobs = await request.app[CONTROLLER_KEY].db.jobs()
    return web.json_response({"jobs": [_summary(r) for r in jobs]})


async def show_job(request: web.Request) -> web.Response:
    _admin(request)
    view = await request.app[CONTROLLER_KEY].view(request.match_info["job"])
    return web.json_response(JobView.model_validate(view).to_json())


async def migrate_job(request: web.Request) -> web.Response:
    _admin(request)
    try:
        req = MigrateRequest.model_validate_json(await request.read())
    except ValidationError as exc:
        return _error(400, f"malformed migrate request: {_problems(exc)}")
    c = request.app[CONTROLLER_KEY]
    rec = await c.migrate(request.match_info["job"], req.to, immediate=req.immediate)
    return web.json_response(_summary(rec))


async def unpark_job(request: web.Request) -> web.Response:
    _admin(request)
    raw = await request.read()
    try:
        req = UnparkRequest.model_validate_json(raw) if raw.strip() else UnparkRequest()
    except ValidationError as exc:
        return _error(400, f"malformed unpark request: {_problems(exc)}")
    c = request.app[CONTROLLER_KEY]
    rec = await c.unpark(request.match_info["job"], req.to)
    return web.json_response(_summary(rec))


async def retry_job(request: web.Request) -> web.Response:
    _admin(request)
    raw = await request.read()
    try:
        req = UnparkRequest.model_validate_json(raw) if raw.strip() else UnparkRequest()
    except ValidationError as exc:
        return _error(400, f"malformed retry request: {_problems(exc)}")
    rec = await request.app[CONTROLLER_KEY].retry(request.match_info["job"], req.to)
    return web.json_response(_summary(rec))


async def directive(request: web.Request) -> web.Response:
    raw = request.query.get("epoch")
    if raw is not None and not (raw.isascii() and raw.isdigit()):  # not "²": int() refuses it
        return _error(400, f"epoch must be a number, got {raw!r}")
    out = await request.app[CONTROLLER_KEY].directive(
        request.match_info["job"], _caller(request), int(raw) if raw is not None else None
    )
    return web.json_response(out.model_dump(mode="json"))


def _bad_name(request: web.Request) -> web.Response | None:
    """400 when the path's group or round is not a :data:`spotguard.groupwire.Name`."""
    for what in ("group", "round"):
        value = request.match_info.get(what)
        if value is None:
            continue
        try:
            _NAME.validate_python(value)
        except ValidationError:
            return _error(400, f"bad {what} name {value!r}: 1 to 128 of [A-Za-z0-9._-]")
    return None


def _poll(request: web.Request, count: str) -> tuple[int, float] | web.Response:
    """``?{count}=N&wait=S`` of a long poll (N a whole number, S seconds; both 0 when
    absent), or 400."""
    raw_n, raw_wait = request.query.get(count, "0"), request.query.get("wait", "0")
    if not (raw_n.isascii() and raw_n.isdigit() and len(raw_n) <= 18):
        return _error(400, f"{count} must be a whole number, got {raw_n!r}")
    try:
        wait = float(raw_wait)
    except ValueError:
        wait = math.nan
    if not math.isfinite(wait):
        return _error(400, f"wait must be a number of seconds, got {raw_wait!r}")
    return int(raw_n), wait


def _wire(model: BaseModel) -> web.Response:
    return web.Response(text=model.model_dump_json(), content_type="application/json")


_M = TypeVar("_M", FreezeRequest, RoundEntry)


async def _as_member(
    request: web.Request, model: type[_M], limit: int, what: str, whats: str
) -> _M | web.Response:
    """The body of a group route as ``model`` (read up to ``limit`` bytes), from a caller that
    may act for the job it names (:class:`AuthError` otherwise); a 400 for a bad name or body."""
    if (bad := _bad_name(request)) is not None:
        return bad
    body = await _read_body(request, limit, what, whats)
    try:
        got = model.model_validate_json(body)
    except ValidationError as exc:
        return _error(400, f"malformed {what}: {_problems(exc)}")
    if not _caller(request).may_act_for(got.job):
        raise AuthError(f"this token may not act for job {got.job!r}")
    return got


async def open_freeze(request: web.Request) -> web.Response:
    req = await _as_member(
        request, FreezeRequest, MAX_FREEZE_BYTES, "freeze request", "freeze requests"
    )
    if isinstance(req, web.Response):
        return req
    rv = request.app[CONTROLLER_KEY].rendezvous
    return _wire(rv.open(request.match_info["group"], req))


async def watch_freeze(request: web.Request) -> web.Response:
    if (bad := _bad_name(request)) is not None:
        return bad
    if isinstance(asked := _poll(request, "after"), web.Response):
        return asked
    rv = request.app[CONTROLLER_KEY].rendezvous
    return _wire(await rv.watch(request.match_info["group"], *asked))


async def put_round(request: web.Request) -> web.Response:
    entry = await _as_member(request, RoundEntry, MAX_ROUND_BYTES, "round entry", "round entries")
    if isinstance(entry, web.Response):
        return entry
    rv = request.app[CONTROLLER_KEY].rendezvous
    return _wire(rv.put(request.match_info["group"], request.match_info["round"], entry))


async def get_round(request: web.Request) -> web.Response:
    if (bad := _bad_name(request)) is not None:
        return bad
    if isinstance(asked := _poll(request, "have"), web.Response):
        return asked
    rv = request.app[CONTROLLER_KEY].rendezvous
    info = request.match_info
    return _wire(await rv.get(info["group"], info["round"], *asked))


async def healthz(request: web.Request) -> web.Response:
    jobs = await request.app[CONTROLLER_KEY].db.jobs()
    return web.json_response({"ok": True, "jobs": len(jobs)})


async def metrics(request: web.Request) -> web.Response:
    c = request.app[CONTROLLER_KEY]
    body = generate_latest(c.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _end_long_polls(app: web.Application) -> None:
    """The server stops: its groups' long polls answer now instead of holding it up."""
    app[CONTROLLER_KEY].rendezvous.close()


def make_app(controller: Controller) -> web.Application:
    """The aiohttp application serving ``controller`` (callers verified by its keys)."""
    app = web.Application(middlewares=[auth_and_errors], client_max_size=4 * 1024 * 1024)
    app[CONTROLLER_KEY] = controller
    app[LIMITER_KEY] = EventLimiter()
    app.router.add_post(routes.EVENTS, post_event)
    app.router.add_get(routes.JOBS, list_jobs)
    app.router.add_get(routes.JOB, show_job)
    app.router.add_post(routes.MIGRATE, migrate_job)
    app.router.add_post(routes.UNPARK, unpark_job)
    app.router.add_post(routes.RETRY, retry_job)
    app.router.add_get(routes.DIRECTIVE, directive)
    app.router.add_post(routes.GROUP_FREEZE, open_freeze)
    app.router.add_get(routes.GROUP_FREEZE, watch_freeze)
    app.router.add_put(routes.GROUP_ROUND, put_round)
    app.router.add_get(routes.GROUP_ROUND, get_round)
    app.router.add_get(routes.HEALTHZ, healthz)
    app.router.add_get(routes.METRICS, metrics)
    app.on_shutdown.append(_end_long_polls)
    add_ui(app, "controller")  # GET /ui: the read-only page over this API (spotguard.webui)
    return app
