"""One VM's token against the controller's database (issue 27, item 7): what a token may make
the controller store is capped. A real controller over loopback HTTP, real VM tokens.

Before: any event up to aiohttp's 4 MiB body limit was stored whole, as many as a token cared
to send — 20 events of 3.5 MB grew the state file by hundreds of MB. Now an event over
:data:`~spotguard.controller.api.MAX_EVENT_BYTES` is refused with 413 (``EventTooLarge``)
before it is parsed, and each (job, token) may send at most
:data:`~spotguard.controller.api.EVENTS_PER_WINDOW` events and
:data:`~spotguard.controller.api.EVENT_BYTES_PER_WINDOW` bytes per
:data:`~spotguard.controller.api.EVENT_WINDOW_S` seconds (429, ``EventRateLimited``, with
``Retry-After``); other jobs' tokens are not held back."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from spotguard.contracts import EventKind, make_event
from spotguard.controller import api as controller_api
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.controller.tokens import TokenKeys
from spotguard.image.settings import ImageSettings
from spotguard.providers.local import LocalProvider, LocalSettings

ADMIN = "admin-token-for-limits"
VM = {"provider": "local", "instance_id": "vm-1", "region": "local", "zone": "local-1"}


class _Ctl:
    def __init__(self, srv: ControllerServer, session: aiohttp.ClientSession, db: Path) -> None:
        self.srv, self.s, self.db = srv, session, db

    def db_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.db.parent.glob(self.db.name + "*"))

    async def post(self, body: str | bytes, token: str) -> tuple[int, dict[str, Any], str]:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        async with self.s.post(self.srv.url + "/v1/events", data=body, headers=headers) as r:
            text = await r.text()
            try:
                out = await r.json(content_type=None)
            except ValueError:
                out = {"error": text}
            return r.status, out, r.headers.get("Retry-After", "")


@pytest.fixture
async def ctl(tmp_path: Path) -> AsyncIterator[_Ctl]:
    db = tmp_path / "controller.db"
    settings = ControllerSettings(
        listen="127.0.0.1:0", state=db, provider="local", controller_token=ADMIN,
        default_store=f"file://{tmp_path}/store", tick_s=0.05,
    )  # fmt: skip
    provider = LocalProvider(
        LocalSettings(
            local_root=tmp_path / "local", local_agent_command=[sys.executable, "-c", "pass"],
            local_gpus=False,
        )
    )  # fmt: skip
    srv = ControllerServer(settings, provider=provider, image=ImageSettings.model_validate({}))
    await srv.__aenter__()
    session = aiohttp.ClientSession()
    try:
        yield _Ctl(srv, session, db)
    finally:
        await session.close()
        await srv.__aexit__(None, None, None)


def _event(job: str, pad: int = 0, kind: EventKind = EventKind.STARTED) -> str:
    """A genuine event of ``job``, made ``pad`` bytes larger through a free-text field."""
    ev = make_event(kind, job=job, instance=VM, store="file:///s" + "x" * pad, epoch=0)
    return ev.model_dump_json()


async def test_twenty_events_of_3_5_mb_are_refused_and_store_nothing(ctl: _Ctl) -> None:
    token = TokenKeys(ADMIN).issue("train", 0)
    status, _out, _ = await ctl.post(_event("train"), token)
    assert status == 200
    before = ctl.db_bytes()
    for _ in range(20):
        status, out, _ = await ctl.post(_event("train", pad=3_500_000), token)
        assert status == 413, (status, str(out)[:300])
        assert out["error"].startswith("EventTooLarge:") and out["code"] == "event_too_large"
        assert str(controller_api.MAX_EVENT_BYTES) in out["error"]
    grew = ctl.db_bytes() - before
    assert grew < 1_000_000, f"the state file grew by {grew} bytes"

    # the same size without a Content-Length (chunked) is cut off at the limit too
    async def chunks() -> AsyncIterator[bytes]:
        big = _event("train", pad=3_500_000).encode()
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    headers = {"Authorization": f"Bearer {token}"}
    async with ctl.s.post(ctl.srv.url + "/v1/events", data=chunks(), headers=headers) as r:
        assert r.status == 413 and (await r.json())["code"] == "event_too_large"
    # an event just under the limit is still taken
    status, out, _ = await ctl.post(
        _event("train", pad=controller_api.MAX_EVENT_BYTES - 2000), token
    )
    assert status == 200, out


async def test_one_token_is_held_to_a_count_and_bytes_per_window_others_are_not(
    ctl: _Ctl,
) -> None:
    keys = TokenKeys(ADMIN)
    train, other = keys.issue("train", 0), keys.issue("other", 0)
    answers = [
        await ctl.post(_event("train"), train) for _ in range(controller_api.EVENTS_PER_WINDOW + 10)
    ]
    statuses = [a[0] for a in answers]
    assert statuses[: controller_api.EVENTS_PER_WINDOW] == [200] * controller_api.EVENTS_PER_WINDOW
    assert set(statuses[controller_api.EVENTS_PER_WINDOW :]) == {429}, statuses
    _status, out, retry_after = answers[-1]
    assert out["error"].startswith("EventRateLimited:") and out["code"] == "event_rate_limited"
    assert 0 < int(retry_after) <= controller_api.EVENT_WINDOW_S
    # another job's token is not held back by this one
    assert (await ctl.post(_event("other"), other))[0] == 200
    # bytes: events of 200 KB from a fresh token are cut off once the window holds the limit
    heavy = keys.issue("heavy", 0)
    before = ctl.db_bytes()
    sent = 0
    for _ in range(40):
        status, out, _ = await ctl.post(_event("heavy", pad=200_000), heavy)
        if status == 429:
            assert out["code"] == "event_rate_limited" and "bytes" in out["error"]
            break
        assert status == 200, out
        sent += 1
    assert 0 < sent * 200_000 <= controller_api.EVENT_BYTES_PER_WINDOW
    assert ctl.db_bytes() - before < 2 * controller_api.EVENT_BYTES_PER_WINDOW
