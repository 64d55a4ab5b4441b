"""The emulator's control API under ``/_sim`` (JSON in, JSON out; errors as
``{"error": "..."}`` with 400 or 404). See docs/notices.md for examples.

=======================  =====================================================================
``POST /_sim/notices``   inject: ``{"cloud", "kind", "action"?, "in_seconds"?, "id"?}`` → 201
``GET /_sim/notices``    every notice with its state
``PATCH /_sim/notices/{id}``  change ``action``, ``in_seconds`` or ``state``
``DELETE /_sim/notices/{id}`` cancel (withdraw) the notice
``POST /_sim/faults``    ``{"mode": "error"|"garbage"|"hang", "cloud"?, "path"?, "status"?,
                         "count"?, "seconds"?, "hang_s"?}`` → 201
``GET|DELETE /_sim/faults``   list / clear faults
``GET|POST /_sim/instance``   read / change instance facts (partial update)
``POST /_sim/config``    ``{"max_token_ttl"?: int|null, "imdsv1"?: bool}``
``DELETE /_sim/tokens``  revoke every IMDSv2 token (clients then get 401)
``GET /_sim/stats``      request counters, token fetches, 401s, Azure acknowledgements,
                         distinct client connections per cloud
``POST /_sim/reset``     back to the start
=======================  =====================================================================
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from spotguard.simulator.state import STATE, SimInputError, SimState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _state(request: web.Request) -> SimState:
    state = request.app[STATE]
    return state


async def _body(request: web.Request) -> dict[str, Any]:
    text = await request.text()
    if not text.strip():
        return {}
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise SimInputError(f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise SimInputError("request body must be a JSON object")
    return body


def _only(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = set(body) - allowed
    if unknown:
        raise SimInputError(f"unknown fields {sorted(unknown)}; allowed: {sorted(allowed)}")


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn bad control requests into ``{"error": ...}`` answers."""
    try:
        return await handler(request)
    except SimInputError as exc:
        return web.json_response({"error": str(exc)}, status=exc.status)


async def send(request: web.Request) -> web.Response:
    body = await _body(request)
    _only(body, {"cloud", "kind", "action", "in_seconds", "id"})
    notice = _state(request).send(
        str(body.get("cloud")),
        str(body.get("kind")),
        body.get("action"),
        body.get("in_seconds"),
        body.get("id"),
    )
    return web.json_response(notice.to_json(), status=201)


async def list_notices(request: web.Request) -> web.Response:
    return web.json_response([n.to_json() for n in _state(request).notices.values()])


async def get_notice(request: web.Request) -> web.Response:
    return web.json_response(_state(request).get(request.match_info["id"]).to_json())


async def update(request: web.Request) -> web.Response:
    body = await _body(request)
    _only(body, {"action", "in_seconds", "state"})
    notice = _state(request).update(request.match_info["id"], **body)
    return web.json_response(notice.to_json())


async def cancel(request: web.Request) -> web.Response:
    return web.json_response(_state(request).cancel(request.match_info["id"]).to_json())


async def add_fault(request: web.Request) -> web.Response:
    body = await _body(request)
    _only(body, {"mode", "cloud", "path", "status", "count", "seconds", "hang_s", "body"})
    fault = _state(request).add_fault(str(body.pop("mode", "")), **body)
    return web.json_response(fault.to_json(), status=201)


async def list_faults(request: web.Request) -> web.Response:
    return web.json_response([f.to_json() for f in _state(request).faults])


async def clear_faults(request: web.Request) -> web.Response:
    _state(request).faults.clear()
    return web.json_response([])


async def get_instance(request: web.Request) -> web.Response:
    return web.json_response(_state(request).facts.to_json())


async def set_instance(request: web.Request) -> web.Response:
    state = _state(request)
    state.facts = state.facts.updated(await _body(request))
    state.changed()
    return web.json_response(state.facts.to_json())


async def configure(request: web.Request) -> web.Response:
    state = _state(request)
    body = await _body(request)
    _only(body, {"max_token_ttl", "imdsv1"})
    if "max_token_ttl" in body:
        ttl = body["max_token_ttl"]
        if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool) or ttl < 1):
            raise SimInputError("max_token_ttl must be a positive integer or null")
        state.max_token_ttl = ttl
    if "imdsv1" in body:
        if not isinstance(body["imdsv1"], bool):
            raise SimInputError("imdsv1 must be true or false")
        state.imdsv1 = body["imdsv1"]
    return web.json_response({"max_token_ttl": state.max_token_ttl, "imdsv1": state.imdsv1})


async def revoke_tokens(request: web.Request) -> web.Response:
    state = _state(request)
    revoked = len(state.tokens)
    state.tokens.clear()
    return web.json_response({"revoked": revoked})


async def stats(request: web.Request) -> web.Response:
    state = _state(request)
    return web.json_response(
        {
            "counters": dict(state.stats),
            "connections": {c: len(p) for c, p in state.peers.items()},
            "acks": state.acks,
            "azure_incarnation": state.azure_incarnation,
        }
    )


async def reset(request: web.Request) -> web.Response:
    _state(request).reset()
    return web.json_response({"reset": True})


def routes() -> list[web.RouteDef]:
    return [
        web.post("/_sim/notices", send),
        web.get("/_sim/notices", list_notices),
        web.get("/_sim/notices/{id}", get_notice),
        web.patch("/_sim/notices/{id}", update),
        web.delete("/_sim/notices/{id}", cancel),
        web.post("/_sim/faults", add_fault),
        web.get("/_sim/faults", list_faults),
        web.delete("/_sim/faults", clear_faults),
        web.get("/_sim/instance", get_instance),
        web.post("/_sim/instance", set_instance),
        web.post("/_sim/config", configure),
        web.delete("/_sim/tokens", revoke_tokens),
        web.get("/_sim/stats", stats),
        web.post("/_sim/reset", reset),
    ]
