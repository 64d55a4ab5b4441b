"""The emulator's GCP metadata server under ``/computeMetadata/v1``.

Requests need ``Metadata-Flavor: Google`` (else 403); answers carry it and an ``ETag``.
``?wait_for_change=true`` holds the request until the value's ETag differs from
``last_etag`` (or from the ETag at the time of the request when none is given), or until
``timeout_sec`` passes, and then answers with the current value — as the real server does.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from aiohttp import web

from spotguard.simulator.state import STATE, SimState

FLAVOR = {"Metadata-Flavor": "Google"}
MAX_WAIT = 3600.0


def _maintenance(state: SimState) -> str:
    active = state.active("gcp", "maintenance")
    return active[-1].action if active else "NONE"


def _paths(state: SimState) -> dict[str, Callable[[], str | None]]:
    f = state.facts
    project_number = str(int(hashlib.sha256(f.project_id.encode()).hexdigest()[:10], 16))
    paths: dict[str, Callable[[], str | None]] = {
        "instance/id": lambda: f.instance_id,
        "instance/name": lambda: f.name,
        "instance/hostname": lambda: f"{f.name}.c.{f.project_id}.internal",
        "instance/machine-type": lambda: (
            f"projects/{project_number}/machineTypes/{f.instance_type}"
        ),
        "instance/zone": lambda: f"projects/{project_number}/zones/{f.zone}",
        "instance/preempted": lambda: "TRUE" if state.active("gcp", "preempt") else "FALSE",
        "instance/maintenance-event": lambda: _maintenance(state),
        "instance/scheduling/preemptible": lambda: "TRUE" if f.spot else "FALSE",
        "instance/scheduling/provisioning-model": lambda: "SPOT" if f.spot else "STANDARD",
        "project/project-id": lambda: f.project_id,
        "project/numeric-project-id": lambda: project_number,
    }
    attributes = dict(f.attributes)
    if f.user_data is not None:
        attributes.setdefault("user-data", f.user_data)
    for key, value in attributes.items():
        paths[f"instance/attributes/{key}"] = lambda v=value: v  # type: ignore[misc]
    paths["instance/attributes"] = lambda: "".join(f"{k}\n" for k in sorted(attributes)) or ""
    return paths


def _value(state: SimState, path: str) -> str | None:
    getter = _paths(state).get(path.rstrip("/"))
    return getter() if getter is not None else None


async def get(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if request.headers.get("Metadata-Flavor") != "Google":
        return web.Response(status=403, text="Missing Metadata-Flavor:Google header.")
    path = request.match_info["tail"]
    value = _value(state, path)
    if value is None:
        return web.Response(status=404, text="Not Found", headers=FLAVOR)
    etag = state.gcp_etag(path, value)
    if request.query.get("wait_for_change", "").lower() == "true":
        last = request.query.get("last_etag") or etag
        try:
            wait = min(float(request.query.get("timeout_sec", MAX_WAIT)), MAX_WAIT)
        except ValueError:
            return web.Response(status=400, text="bad timeout_sec", headers=FLAVOR)
        deadline = time.monotonic() + wait
        while etag == last and not state.closing.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await state.wait_changed(left)
            value = _value(state, path)
            if value is None:
                return web.Response(status=404, text="Not Found", headers=FLAVOR)
            etag = state.gcp_etag(path, value)
    return web.Response(text=value, headers={**FLAVOR, "ETag": etag})


def routes() -> list[web.RouteDef]:
    return [web.get("/computeMetadata/v1/{tail:.*}", get)]
