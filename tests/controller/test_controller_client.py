"""The one controller client (:mod:`spotguard.controller.client`) against a real controller over
HTTP: typed answers (EventAnswer, Directive) on the routes the server registers, each failure a
typed error, and answers from a newer controller (an unknown field) still read."""

from __future__ import annotations

from pathlib import Path

import pytest
from controller_helpers import TOKEN, VM1, Factory

from spotguard.contracts import Directive, EventAnswer, EventKind, make_event
from spotguard.controller import routes
from spotguard.controller.client import ControllerClient, read_answer
from spotguard.controller.tokens import TokenKeys
from spotguard.errors import (
    AuthError,
    ControllerError,
    ControllerRefused,
    EventTooLarge,
    JobNotFound,
    TokenRejected,
)


async def test_every_route_the_server_serves_is_declared_once(api_factory: Factory) -> None:
    _api, srv, _ = await api_factory()
    declared = {v for k, v in vars(routes).items() if k.isupper() and k != "API_PREFIX"}
    served = {r.canonical for r in srv._runner.app.router.resources()}
    assert declared <= served  # pages outside the API (the web UI's) are their module's
    assert {r for r in served if r.startswith(routes.API_PREFIX)} <= declared
    assert routes.path(routes.DIRECTIVE, "a b") == "/v1/jobs/a%20b/directive"
    with pytest.raises(ValueError, match="needs a job"):
        routes.path(routes.JOB)


async def test_agent_calls_are_typed_and_a_fenced_report_says_stand_down(
    api_factory: Factory, tmp_path: Path
) -> None:
    api, _srv, _ = await api_factory()
    keys = TokenKeys(TOKEN)
    started = make_event(EventKind.STARTED, job="train", instance=VM1)
    async with ControllerClient(api.url, keys.issue("train", 0)) as vm:
        answer = await vm.send_event(started.model_dump_json().encode())
        assert isinstance(answer, EventAnswer)
        assert (answer.job, answer.state, answer.stand_down) == ("train", "protected", False)
        again = await vm.send_event(started.model_dump_json().encode())
        assert again is not None and again.duplicate
        said = await vm.directive("train")
        assert isinstance(said, Directive) and said.owner.instance_id == "vm-first"
        assert (await vm.directive("train", epoch=0)).stand_down is False
        image = f"file://{tmp_path}/store/train/images/20260101T000000000000Z-abcdef"
        durable = make_event(EventKind.DURABLE, job="train", instance=VM1, image_url=image)
        await vm.send_event(durable.model_dump_json().encode())
    admin = ControllerClient(api.url, TOKEN)
    moved = await admin.migrate("train", "local", immediate=True)  # epoch 1 owns it now
    assert moved.job == "train" and moved.state == "launching"
    old = ControllerClient(api.url, keys.issue("train", 0))
    finished = make_event(EventKind.JOB_FINISHED, job="train", instance=VM1)
    fenced = await old.send_event(finished.model_dump_json().encode())  # a 409
    assert fenced is not None and fenced.stand_down and fenced.stale
    assert fenced.owner.epoch == 1 and (fenced.error or "").startswith("not the job's owner")
    assert (await admin.directive("train", epoch=0)).stand_down is True
    [row] = await admin.jobs()
    assert row.job == "train" and row.owner.epoch == 1
    view = await admin.job("train")
    assert view.name == "train" and view.history


async def test_each_failure_is_a_typed_error(api_factory: Factory, tmp_path: Path) -> None:
    api, _srv, _ = await api_factory()
    admin = ControllerClient(api.url, TOKEN)
    with pytest.raises(JobNotFound):
        await admin.job("nobody")
    with pytest.raises(TokenRejected, match="refused the token") as wrong:
        await ControllerClient(api.url, "wrong").jobs()
    assert wrong.value.retryable  # an agent's reports retry it
    vm = ControllerClient(api.url, TokenKeys(TOKEN).issue("train", 0))
    with pytest.raises(AuthError, match="admin token") as forbidden:
        await vm.jobs()
    assert not forbidden.value.retryable and not isinstance(forbidden.value, TokenRejected)
    with pytest.raises(ControllerRefused, match="the controller refused"):
        await admin.send_event(b'{"kind": "started"}')
    with pytest.raises(EventTooLarge):
        await admin.send_event(b"{" + b" " * (300 * 1024) + b"}")
    await api.event("busy", EventKind.STARTED, instance=VM1)
    with pytest.raises(ControllerRefused, match="not parked"):
        await admin.unpark("busy")
    closed = ControllerClient("http://127.0.0.1:9", TOKEN, timeout_s=2)
    with pytest.raises(ControllerError, match="unreachable") as down:
        await closed.directive("train")
    assert down.value.retryable
    # said as a person would read it: the URL and the cause, not the exception's repr
    assert str(down.value) == (
        "the spotguard controller at http://127.0.0.1:9 is unreachable (connection refused)"
    )


def test_an_answer_with_a_field_this_side_does_not_know_is_still_read() -> None:
    newer = {"job": "train", "state": "protected", "owner": {"epoch": 2}, "lease_s": 30}
    answer = read_answer(Directive, newer)
    assert answer is not None and answer.owner.epoch == 2
    assert read_answer(Directive, {"ok": True}) is None  # not a directive at all
    assert read_answer(Directive, ["train"]) is None


async def test_a_404_that_is_not_the_controllers_answer_is_retried(tmp_path: Path) -> None:
    """A proxy or load balancer in front of the controller answering 404 with a page of its
    own (a route it does not know yet) is not the controller saying "no such job": the
    reporter's event must be sent again later, not dropped."""
    from aiohttp import web

    from spotguard.errors import ControllerError

    async def page(_request: web.Request) -> web.Response:
        return web.Response(status=404, text="<html>404 Not Found</html>")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", page)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        client = ControllerClient(f"http://127.0.0.1:{port}", TOKEN)
        with pytest.raises(ControllerError, match="other than the controller") as middlebox:
            await client.send_event(b"{}")
        assert middlebox.value.retryable
    finally:
        await runner.cleanup()
