"""Remote cases of issue 27's weaker items: webhooks (no redirect followed, credentials never
logged) against real local HTTP servers."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiohttp import web

from spotguard.notify import Notification, Notifier, NotifyEvent, NotifySettings


async def _server(handler: Any) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"127.0.0.1:{port}"


async def test_a_webhook_redirect_is_not_followed_and_credentials_are_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A webhook that answers 307 towards the metadata service (a stand-in here) gets the
    POST; the metadata service gets nothing; the log line names the host, not the
    ``user:password`` of the URL."""
    metadata_hits: list[str] = []

    async def metadata(request: web.Request) -> web.Response:
        metadata_hits.append(request.path)
        return web.Response(text="role-credentials")

    md_runner, md = await _server(metadata)
    hook_hits: list[str] = []

    async def hook(request: web.Request) -> web.Response:
        hook_hits.append(request.path)
        raise web.HTTPTemporaryRedirect(f"http://{md}/latest/meta-data/iam/security-credentials/")

    hook_runner, host = await _server(hook)
    try:
        n = Notifier(NotifySettings(webhook_url=[f"http://ops:s3cr3t-pw@{host}/hook/T0K3N"]))
        with caplog.at_level(logging.DEBUG):
            n.notify(Notification(event=NotifyEvent.FAILED, job="train", source="agent"))
            await n.aclose()
    finally:
        await hook_runner.cleanup()
        await md_runner.cleanup()
    assert hook_hits == ["/hook/T0K3N"]
    assert metadata_hits == []
    assert n.failed == 1 and n.sent == 0
    ours = [r for r in caplog.records if r.name.startswith("spotguard")]
    text = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in ours)
    assert "webhook failed" in text and "redirect" in text
    assert "s3cr3t-pw" not in text and "ops:" not in text and "T0K3N" not in text
