"""The one client of the controller's HTTP API, for everything that talks to it: the agent's
reports (:mod:`spotguard.agent.reporter`) and directive polls (:mod:`spotguard.agent.
directives`), the park side asking who owns a parked job (:mod:`spotguard.park.report`),
the agents of an NCCL group meeting at the controller (:mod:`spotguard.groupwire`), and the
CLI (``jobs``, ``migrate``).

Paths come from :mod:`spotguard.controller.routes`; answers are the wire models
(:class:`~spotguard.contracts.EventAnswer`, :class:`~spotguard.contracts.Directive`), read
leniently: a field this side does not know (a newer controller's) is dropped and logged once,
as the controller's edge does with agents' events. Every failure is typed:

=================================  ==========================================================
unreachable, timeout, other 5xx    :class:`ControllerError` (retryable)
503 (the state file)               :class:`StateError` (retryable)
401 (an unknown token)             :class:`TokenRejected` (retryable: a token being rotated)
403 (may not act there)            :class:`AuthError`
404                                :class:`JobNotFound`; without the controller's
                                   JSON error (a proxy or load balancer that does not
                                   know the route yet): :class:`ControllerError` (retryable)
413                                :class:`EventTooLarge`
429                                :class:`EventRateLimited` (retryable, ``retry_after``)
400, 409, other 4xx                :class:`ControllerRefused`
=================================  ==========================================================

One client may serve many requests over one connection pool (``async with client:``, as the
reporter and the directive poll do); outside such a block each request opens its own.
"""

from __future__ import annotations

import json
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from spotguard.contracts import Directive, EventAnswer
from spotguard.controller import routes
from spotguard.controller.views import JobView
from spotguard.errors import (
    AuthError,
    ControllerError,
    ControllerRefused,
    EventRateLimited,
    EventTooLarge,
    JobNotFound,
    SpotguardError,
    StateError,
    TokenRejected,
    without_type,
)
from spotguard.groupwire import FreezeRequest, GroupFreeze, Round, RoundEntry

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

#: (model, field) pairs of answers already logged as carrying an unknown field
_LOGGED: set[tuple[str, str]] = set()


def read_answer(model: type[M], data: object) -> M | None:
    """``data`` (a decoded JSON answer) as ``model``; fields ``model`` does not know are
    dropped (logged once per field); None when it is not such an answer at all."""
    if not isinstance(data, dict):
        return None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = exc.errors()
    unknown = {str(e["loc"][0]) for e in problems if e["type"] == "extra_forbidden"}
    if len(unknown) != len(problems) or any(len(e["loc"]) != 1 for e in problems):
        return None
    new = sorted(f for f in unknown if (model.__name__, f) not in _LOGGED)
    if new:
        _LOGGED.update((model.__name__, f) for f in new)
        log.warning(
            "unknown field in the controller's answer ignored (logged once per field)",
            extra={"kind": model.__name__, "fields": new},
        )
    try:
        return model.model_validate({k: v for k, v in data.items() if k not in unknown})
    except ValidationError:
        return None


@dataclass(frozen=True)
class Reply:
    """One answer of the controller: its status, its JSON decoded (None when it is not
    JSON), its text, and ``Retry-After`` in seconds (0 when not given)."""

    status: int
    data: object
    text: str
    retry_after: int = 0


def error_for(reply: Reply) -> SpotguardError:
    """The typed error of an answer whose status is 400 or more."""
    status, data = reply.status, reply.data
    said = data.get("error") if isinstance(data, dict) else None
    error = without_type(str(said)) if said is not None else reply.text[:200]  # for people
    if status == 401:
        return TokenRejected(f"controller refused the token: {error}")
    if status == 403:
        return AuthError(f"controller refused the token: {error}")
    if status == 404:
        if said is None:  # not the controller's answer: something in between, for now
            return ControllerError(f"HTTP 404 from something other than the controller: {error}")
        return JobNotFound(error)
    if status == 413:
        return EventTooLarge(f"the controller refused: {error}")
    if status == 429:
        return EventRateLimited(f"the controller refused: {error}", reply.retry_after or 1)
    if status == 503:
        return StateError(f"the controller failed (HTTP {status}): {error}")
    if status >= 500:
        return ControllerError(f"the controller failed (HTTP {status}): {error}")
    if status in (400, 409):
        return ControllerRefused(f"the controller refused: {error}")
    return ControllerRefused(f"the controller refused (HTTP {status}): {error}")


class ControllerClient:
    """The controller at ``url`` as typed calls, with the bearer ``token``."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout_s: float = 30.0,
        ca_file: Path | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.ssl: ssl.SSLContext | bool = True
        if ca_file is not None:
            try:
                self.ssl = ssl.create_default_context(cafile=str(ca_file))
            except (OSError, ssl.SSLError) as exc:
                raise ControllerError(f"CA file {ca_file} unusable: {exc}") from exc
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- the agent ------------------------------------------------------------------------

    async def send_event(self, body: bytes) -> EventAnswer | None:
        """``POST`` one agent event (its JSON). The controller's answer — also when it
        refused the event as a non-owner's (409 with ``stand_down``) — or None when the
        answer is not an :class:`EventAnswer` (the event was taken all the same)."""
        headers = {"Content-Type": "application/json"}
        reply = await self._request("POST", routes.EVENTS, data=body, headers=headers)
        if reply.status < 300 or reply.status == 409:  # 409: the job moved on, or we lost it
            return read_answer(EventAnswer, reply.data)
        raise error_for(reply)

    async def directive(self, job: str, epoch: int | None = None) -> Directive:
        """What the controller wants from ``job``'s agent now, asked as an agent of
        ``epoch`` (None: by the token's own epoch, or as the admin)."""
        path = routes.path(routes.DIRECTIVE, job)
        if epoch is not None:
            path += f"?epoch={epoch}"
        data = await self._json("GET", path)
        if isinstance(data, dict):
            data.setdefault("job", job)
        answer = read_answer(Directive, data)
        if answer is None:
            raise ControllerError(f"the controller's directive for {job!r} is not understood")
        return answer

    # --- NCCL groups (spotguard.groupwire) -----------------------------------------------

    async def group_freeze(self, group: str, req: FreezeRequest) -> GroupFreeze:
        """``req.job`` joins ``group``'s open freeze generation, or opens the next one: the
        generation it is in now."""
        path = routes.group_path(routes.GROUP_FREEZE, group)
        data = await self._json("POST", path, req.model_dump(mode="json"))
        return self._wire(GroupFreeze, data, f"freeze of group {group!r}")

    async def watch_group(self, group: str, after: int, wait_s: float) -> GroupFreeze:
        """``group``'s newest freeze generation once it is past ``after``, or after
        ``wait_s`` seconds (a long poll; the controller waits 30 s at most)."""
        path = routes.group_path(routes.GROUP_FREEZE, group) + f"?after={after}&wait={wait_s}"
        data = await self._json("GET", path, limit=self._longer(wait_s))
        return self._wire(GroupFreeze, data, f"freeze of group {group!r}")

    async def put_round(self, group: str, round: str, entry: RoundEntry) -> Round:
        """Put ``entry`` (its job's, replacing one it put before) in ``round`` of ``group``'s
        current generation: the round as it is now."""
        path = routes.group_path(routes.GROUP_ROUND, group, round)
        data = await self._json("PUT", path, entry.model_dump(mode="json"))
        return self._wire(Round, data, f"round {round!r} of group {group!r}")

    async def get_round(self, group: str, round: str, have: int, wait_s: float) -> Round:
        """``round`` of ``group`` once it holds more than ``have`` entries (or another
        generation opened), or after ``wait_s`` seconds with what it holds (a long poll)."""
        path = routes.group_path(routes.GROUP_ROUND, group, round) + f"?have={have}&wait={wait_s}"
        data = await self._json("GET", path, limit=self._longer(wait_s))
        return self._wire(Round, data, f"round {round!r} of group {group!r}")

    # --- the CLI (admin token) ------------------------------------------------------------

    async def jobs(self) -> list[EventAnswer]:
        """Every job the controller knows, as its summary."""
        data = await self._json("GET", routes.JOBS)
        rows = data.get("jobs") if isinstance(data, dict) else None
        out = [read_answer(EventAnswer, row) for row in rows or []]
        return [a for a in out if a is not None]

    async def job(self, job: str) -> JobView:
        """One job as the controller shows it: state, owner, history, images."""
        data = await self._json("GET", routes.path(routes.JOB, job))
        view = read_answer(JobView, data)
        if view is None:
            raise ControllerError(f"the controller's view of {job!r} is not understood")
        return view

    async def migrate(self, job: str, to: str, *, immediate: bool) -> EventAnswer:
        """Move ``job`` to the region or instance type ``to`` (now: from its newest image)."""
        body = {"to": to, "immediate": immediate}
        return self._summary(await self._json("POST", routes.path(routes.MIGRATE, job), body))

    async def unpark(self, job: str, to: str | None = None) -> EventAnswer:
        """Relaunch ``job``, parked to a store, optionally ``to`` a region or instance type."""
        body = {"to": to} if to else {}
        return self._summary(await self._json("POST", routes.path(routes.UNPARK, job), body))

    async def retry(self, job: str, to: str | None = None) -> EventAnswer:
        """Relaunch the failed ``job`` from its newest image with a fresh restart budget."""
        body = {"to": to} if to else {}
        return self._summary(await self._json("POST", routes.path(routes.RETRY, job), body))

    # --- any route ------------------------------------------------------------------------

    async def get(self, path: str) -> dict[str, Any]:
        """``GET`` a route (see :mod:`~spotguard.controller.routes`) as a JSON object."""
        data = await self._json("GET", path)
        return data if isinstance(data, dict) else {"value": data}

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST`` ``body`` to a route as a JSON object."""
        data = await self._json("POST", path, body)
        return data if isinstance(data, dict) else {"value": data}

    # --- plumbing -------------------------------------------------------------------------

    @staticmethod
    def _summary(data: object) -> EventAnswer:
        answer = read_answer(EventAnswer, data)
        if answer is None:
            raise ControllerError("the controller's answer is not a job summary")
        return answer

    @staticmethod
    def _wire(model: type[M], data: object, what: str) -> M:
        answer = read_answer(model, data)
        if answer is None:
            raise ControllerError(f"the controller's answer about the {what} is not understood")
        return answer

    def _longer(self, wait_s: float) -> aiohttp.ClientTimeout:
        """The timeout of a long poll of ``wait_s`` seconds: the poll's own wait on top of
        the usual one, so that the poll is never cut short."""
        usual = self.timeout.total if self.timeout.total is not None else 30.0
        return aiohttp.ClientTimeout(total=usual + max(wait_s, 0.0))

    async def _json(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        limit: aiohttp.ClientTimeout | None = None,
    ) -> object:
        """The decoded answer of a request that must succeed (else its typed error)."""
        reply = await self._request(method, path, body=body, limit=limit)
        if reply.status >= 400:
            raise error_for(reply)
        return reply.data

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
        limit: aiohttp.ClientTimeout | None = None,
    ) -> Reply:
        """One request (``body`` as JSON, or ``data`` as is; ``limit``: a timeout other than the
        client's). Unreachable, a timeout or a TLS failure is a retryable
        :class:`ControllerError`."""
        sent = dict(headers or {})
        if self.token:
            sent["Authorization"] = f"Bearer {self.token}"
        own = self._session is None
        session = self._session or aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with session.request(
                method,
                self.url + path,
                json=body,
                data=data,
                headers=sent,
                ssl=self.ssl,
                timeout=limit or self.timeout,
            ) as r:
                text = await r.text()
                status = r.status
                wait = r.headers.get("Retry-After", "")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise ControllerError(
                f"the spotguard controller at {self.url} is unreachable ({_why(exc)})"
            ) from exc
        finally:
            if own:
                await session.close()
        try:
            decoded: object = json.loads(text) if text else None
        except ValueError:
            decoded = None
        return Reply(status, decoded, text, int(wait) if wait.isdigit() else 0)


def _why(exc: BaseException) -> str:
    """Why a request got no answer, as a person reads it (aiohttp's repr names its
    connection key and nested errors)."""
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return f"its TLS certificate is not trusted: {exc.certificate_error}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        err = exc.os_error
        if isinstance(err, ConnectionRefusedError):
            return "connection refused"
        return err.strerror or str(err) or type(err).__name__
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return "no answer in time"
    return str(exc) or type(exc).__name__
