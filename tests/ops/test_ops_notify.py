"""Notifications (issue 17): webhooks told of notice, frozen, durable, relaunched, restored,
failed (and park's parked/unparked) — a generic JSON POST and a Slack-compatible message, per
event — from a real agent and a real controller state DB, against a real local HTTP server."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.controller.state import Change, JobRecord, JobState, StateDB
from spotguard.image.settings import ImageSettings
from spotguard.notices.settings import NoticeSettings
from spotguard.notify import Notification, Notifier, NotifyEvent, NotifySettings


@dataclass
class Hooks:
    """A local webhook receiver: ``/json`` and ``/slack`` record bodies, ``/fail`` answers 500."""

    url: str = ""
    got: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    fails: int = 0

    async def wait(self, path: str, n: int, within_s: float = 30) -> list[dict[str, Any]]:
        for _ in range(int(within_s * 20)):
            if len(self.got.get(path, [])) >= n:
                break
            await asyncio.sleep(0.05)
        return self.got.get(path, [])


@pytest.fixture
async def hooks() -> AsyncIterator[Hooks]:
    h = Hooks()

    async def record(request: web.Request) -> web.Response:
        h.got.setdefault(request.path, []).append(await request.json())
        return web.json_response({"ok": True})

    async def fail(request: web.Request) -> web.Response:
        h.fails += 1
        return web.json_response({"error": "down"}, status=500)

    app = web.Application()
    app.router.add_post("/json", record)
    app.router.add_post("/slack", record)
    app.router.add_post("/fail", fail)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    h.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        yield h
    finally:
        await runner.cleanup()


async def test_generic_and_slack_webhooks_get_each_wanted_event(hooks: Hooks) -> None:
    n = Notifier(
        NotifySettings(
            webhook_url=[f"{hooks.url}/json"],
            slack_webhook_url=[f"{hooks.url}/slack"],
            notify_events=[NotifyEvent.FAILED, NotifyEvent.PARKED],
        )
    )
    n.notify(Notification(event=NotifyEvent.PARKED, job="serve", source="park", reason="idle"))
    n.notify(Notification(event=NotifyEvent.FROZEN, job="serve", source="agent"))  # not wanted
    await n.aclose()
    (body,) = hooks.got["/json"]
    assert body["event"] == "parked" and body["job"] == "serve" and body["reason"] == "idle"
    assert body["source"] == "park" and body["schema_version"] == 1 and body["host"]
    (slack,) = hooks.got["/slack"]
    assert set(slack) == {"text"}
    assert slack["text"].startswith("spotguard: job `serve` is parked on ")
    assert slack["text"].endswith(": idle")
    assert n.sent == 2 and n.failed == 0


async def test_a_failing_webhook_is_retried_logged_and_never_raises(
    hooks: Hooks, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("spotguard.notify.asyncio.sleep", _no_wait)
    n = Notifier(NotifySettings(webhook_url=[f"{hooks.url}/fail", "http://127.0.0.1:9/x"]))
    with caplog.at_level(logging.WARNING, logger="spotguard.notify"):
        n.notify(Notification(event=NotifyEvent.FAILED, job="train", source="agent"))
        await n.aclose()
    assert hooks.fails == 3, "three attempts"
    assert n.failed == 2 and n.sent == 0
    lines = [r for r in caplog.records if r.getMessage() == "webhook failed"]
    assert {r.__dict__["error"].split(" ")[0] for r in lines} >= {"HTTP"}
    assert all("/fail" not in r.__dict__["url"] for r in lines), "the URL's path is secret"


async def _no_wait(_: float) -> None:
    return None


async def test_the_controller_tells_of_relaunch_restore_and_failure(
    hooks: Hooks, tmp_path: Path
) -> None:
    notifier = Notifier(NotifySettings(webhook_url=[f"{hooks.url}/json"]))
    db = await StateDB.open(tmp_path / "controller.db")
    db.on_transition = notifier.controller_transition
    try:
        for state, reason in [
            (JobState.PROTECTED, ""),
            (JobState.RESTORING, "launched i-2"),
            (JobState.PROTECTED, "restored"),
            (JobState.FAILED, "no capacity anywhere"),
        ]:

            def move(r: JobRecord | None, s: JobState = state, why: str = reason) -> Change:
                rec = r or JobRecord(name="train", state=s)
                rec.state, rec.reason = s, why
                rec.image_url = "s3://b/train/images/1"
                return Change(rec, why)

            await db.change("train", move)
    finally:
        await db.close()
    await notifier.aclose()
    got = [(b["event"], b["state"], b["reason"]) for b in hooks.got["/json"]]
    assert got == [
        ("relaunched", "restoring", "launched i-2"),
        ("restored", "protected", "restored"),
        ("failed", "failed", "no capacity anywhere"),
    ]
    assert all(b["source"] == "controller" for b in hooks.got["/json"])


async def test_a_real_agent_tells_of_notice_frozen_and_durable(
    hooks: Hooks, tmp_path: Path, criu_bin: str, sleeper: subprocess.Popen[bytes]
) -> None:
    """An operator drain of a real process: the agent's reports reach the webhook."""
    notifier = Notifier(
        NotifySettings(webhook_url=[f"{hooks.url}/json"], slack_webhook_url=[f"{hooks.url}/slack"])
    )
    agent = Agent(
        AgentSettings(
            job=[str(sleeper.pid)], store=(tmp_path / "store").as_uri(), api_listen="127.0.0.1:0"
        ),
        CheckpointSettings(state_dir=tmp_path / "state", criu=criu_bin, stream="off"),
        NoticeSettings(cloud="none"),
        image=ImageSettings(),
        notifier=notifier,
    )
    run = asyncio.create_task(agent.run())
    try:
        for _ in range(100):
            if any(w.active for w in agent.workers.values()):
                break
            await asyncio.sleep(0.1)
        answer = await asyncio.wait_for(
            agent.drain("kernel upgrade", wait=True, deadline_s=None), 120
        )
        (result,) = answer["results"]
        assert result.get("url"), answer
        bodies = await hooks.wait("/json", 3)
    finally:
        agent.request_stop()
        await asyncio.wait_for(run, 60)
    events = [b["event"] for b in bodies]
    assert events[:3] == ["notice", "frozen", "durable"], events
    job = f"pid-{sleeper.pid}"
    assert all(b["job"] == job and b["source"] == "agent" for b in bodies)
    assert bodies[0]["reason"] == "manual drain notice"
    assert bodies[2]["image_url"] == result["url"]
    texts = [m["text"] for m in hooks.got["/slack"]]
    assert f"spotguard: job `{job}` has a complete image on " in texts[2]
