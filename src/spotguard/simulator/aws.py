"""The emulator's AWS instance metadata service (IMDSv2 enforced) under ``/latest``.

Tokens come from ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``
(1-21600); every other request needs a valid, unexpired ``X-aws-ec2-metadata-token`` or gets
401 (unless the emulator was started with IMDSv1 allowed). Absent things answer 404, as on EC2.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta

from aiohttp import web

from spotguard.notices.timefmt import aws_event_time, rfc3339
from spotguard.simulator.state import STATE, SimState

TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
_TWO_HOURS = timedelta(hours=2)


def _instance_action(state: SimState) -> str | None:
    active = state.active("aws", "preempt")
    if not active:
        return None
    n = active[-1]
    return json.dumps({"action": n.action, "time": rfc3339(n.not_before)})


def _rebalance(state: SimState) -> str | None:
    active = state.active("aws", "rebalance")
    return json.dumps({"noticeTime": rfc3339(active[0].created)}) if active else None


def _scheduled(state: SimState) -> str:
    events = []
    for n in state.notices.values():
        if n.cloud != "aws" or n.kind != "maintenance":
            continue
        events.append(
            {
                "Code": n.action,
                "Description": f"scheduled {n.action} (spotguard metadata-sim)",
                "EventId": n.id,
                "NotBefore": aws_event_time(n.not_before),
                "NotAfter": aws_event_time(n.not_before.replace(microsecond=0) + _TWO_HOURS),
                "State": {"cancelled": "canceled"}.get(n.state, n.state),
            }
        )
    return json.dumps(events)


def _paths(state: SimState) -> dict[str, Callable[[], str | None]]:
    f = state.facts
    return {
        "meta-data/instance-id": lambda: f.instance_id,
        "meta-data/instance-type": lambda: f.instance_type,
        "meta-data/instance-life-cycle": lambda: "spot" if f.spot else "on-demand",
        "meta-data/placement/availability-zone": lambda: f.zone,
        "meta-data/placement/region": lambda: f.region_name,
        "meta-data/hostname": lambda: f.name,
        "meta-data/spot/instance-action": lambda: _instance_action(state),
        "meta-data/events/recommendations/rebalance": lambda: _rebalance(state),
        "meta-data/events/maintenance/scheduled": lambda: _scheduled(state),
        "user-data": lambda: f.user_data,
    }


def _listing(paths: dict[str, Callable[[], str | None]], prefix: str) -> str | None:
    names = sorted(
        {
            p[len(prefix) :].split("/")[0] + ("/" if "/" in p[len(prefix) :] else "")
            for p in paths
            if p.startswith(prefix)
        }
    )
    return "\n".join(names) if names else None


async def token(request: web.Request) -> web.Response:
    state = request.app[STATE]
    raw = request.headers.get(TTL_HEADER, "")
    try:
        ttl = int(raw)
    except ValueError:
        ttl = 0
    if not 1 <= ttl <= 21600:
        return web.Response(status=400, text=f"{TTL_HEADER} must be 1-21600")
    token, ttl = state.new_token(ttl)
    return web.Response(text=token, headers={TTL_HEADER: str(ttl)})


async def get(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.token_valid(request.headers.get(TOKEN_HEADER)) and not (
        state.imdsv1 and TOKEN_HEADER not in request.headers
    ):
        state.stats["aws.unauthorized"] += 1
        return web.Response(status=401, text="Unauthorized")
    tail = request.match_info["tail"]
    paths = _paths(state)
    getter = paths.get(tail.rstrip("/"))
    value = getter() if getter is not None else _listing(paths, tail.rstrip("/") + "/")
    if value is None:
        return web.Response(status=404, text="Not Found")
    return web.Response(text=value)


def routes() -> list[web.RouteDef]:
    return [
        web.put("/latest/api/token", token),
        web.get("/latest/{tail:.*}", get),
    ]
