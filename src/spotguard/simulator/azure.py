"""The emulator's Azure instance metadata service under ``/metadata``.

Requests need ``Metadata: true`` and an ``api-version`` (else 400, as on Azure).

* ``GET /metadata/scheduledevents`` — ``{"DocumentIncarnation": n, "Events": [...]}``; the
  incarnation grows whenever the events change.
* ``POST /metadata/scheduledevents`` — ``{"StartRequests": [{"EventId": ...}]}`` approves
  events: they show ``EventStatus: Started`` and the acknowledgement is recorded.
* ``GET /metadata/instance`` — ``compute`` (vmId, vmSize, location, zone, name, priority ...);
  ``/metadata/instance/compute/<field>?format=text`` gives one field (``userData`` is base64).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from aiohttp import web

from spotguard.notices.timefmt import rfc1123
from spotguard.simulator.state import STATE, SimInputError, SimState


def _check(request: web.Request) -> web.Response | None:
    if request.headers.get("Metadata", "").lower() != "true":
        return web.json_response(
            {"error": "Bad request. Required metadata header not specified"}, status=400
        )
    if "api-version" not in request.query:
        return web.json_response(
            {"error": "Bad request. api-version was not specified"}, status=400
        )
    return None


def document(state: SimState) -> dict[str, Any]:
    events = [
        {
            "EventId": n.id,
            "EventStatus": "Started" if n.started else "Scheduled",
            "EventType": n.action,
            "ResourceType": "VirtualMachine",
            "Resources": [state.facts.name],
            "NotBefore": "" if n.started else rfc1123(n.not_before),
            "Description": f"{n.action} (spotguard metadata-sim)",
            "EventSource": "Platform",
            "DurationInSeconds": -1 if n.kind == "preempt" else 0,
        }
        for n in state.azure_events()
    ]
    return {"DocumentIncarnation": state.azure_incarnation, "Events": events}


def compute(state: SimState) -> dict[str, Any]:
    f = state.facts
    user_data = base64.b64encode((f.user_data or "").encode()).decode()
    return {
        "vmId": f.instance_id,
        "name": f.name,
        "vmSize": f.instance_type,
        "location": f.region_name,
        "zone": f.zone,
        "priority": "Spot" if f.spot else "Regular",
        "subscriptionId": f.project_id,
        "userData": user_data,
        "tagsList": [],
    }


async def events(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if (bad := _check(request)) is not None:
        return bad
    if request.method == "POST":
        try:
            body = json.loads(await request.text())
            ids = [str(r["EventId"]) for r in body["StartRequests"]]
            state.acknowledge(ids)
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"Bad request: {exc}"}, status=400)
        except SimInputError as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)
        return web.Response(status=200)
    return web.json_response(document(state))


async def instance(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if (bad := _check(request)) is not None:
        return bad
    doc: dict[str, Any] = {"compute": compute(state), "network": {"interface": []}}
    tail = [p for p in request.match_info.get("tail", "").split("/") if p]
    node: Any = doc
    for part in tail:
        if not isinstance(node, dict) or part not in node:
            return web.json_response({"error": "Not found"}, status=404)
        node = node[part]
    if request.query.get("format") == "text" and not isinstance(node, dict | list):
        return web.Response(text=str(node))
    return web.json_response(node)


def routes() -> list[web.RouteDef]:
    return [
        web.get("/metadata/scheduledevents", events),
        web.post("/metadata/scheduledevents", events),
        web.get("/metadata/instance", instance),
        web.get("/metadata/instance/{tail:.*}", instance),
    ]
