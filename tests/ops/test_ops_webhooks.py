"""Issue 28.5, webhooks: a job woken by a client connecting (wake-on-connect) sends the
``unparked`` webhook as ``spotguard unpark`` does; a job's notifications arrive in the order
they happened (``durable`` never before ``frozen``, even when the first POST is retried).
Real local HTTP receivers; the wake-on-connect case with real CLI processes and CRIU."""

from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from aiohttp import web
from ops_helpers import clean_env, free_port

from sgtest import wait_for as _until
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import list_jobs
from spotguard.notify import Notification, Notifier, NotifyEvent, NotifySettings
from spotguard.park import record
from spotguard.statedir import StateDir

JOBS = str(Path(__file__).resolve().parents[1] / "park" / "park_jobs.py")


class _Receiver(http.server.BaseHTTPRequestHandler):
    got: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).got.append(json.loads(body))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    got: list[dict[str, Any]] = []
    handler = type("Receiver", (_Receiver,), {"got": got})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/hook", got
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def conf(tmp_path: Path, criu_bin: str, receiver: tuple[str, Any]) -> Iterator[Path]:
    state = tmp_path / "state"
    cfg = tmp_path / "spotguard.toml"
    cfg.write_text(
        f'[checkpoint]\nstate_dir = "{state}"\ncriu = "{criu_bin}"\n'
        f'shm_dir = "{tmp_path / "shm"}"\ncriu_timeout = 60\n'
        f'[park]\nmemory_dir = "{tmp_path / "shm" / "parked"}"\n'
        f'[agent]\napi_listen = "unix:{tmp_path / "no-agent.sock"}"\n'
        f'[notify]\nwebhook_url = ["{receiver[0]}"]\n'
    )
    yield cfg
    for rec in record.all_records(state):
        if rec.waker_pid and proctree.alive(rec.waker_pid):
            proctree.signal_all([rec.waker_pid], 9)
    for job in list_jobs(state):
        if proctree.alive(job.pid):
            proctree.signal_all([job.pid], 9)


def sgc(conf: Path, *args: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["spotguard", *args], capture_output=True, text=True,
                         env=clean_env(SPOTGUARD_CONFIG=str(conf)), timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return res


@pytest.mark.criu
@pytest.mark.parametrize("place", ["memory", "tmpfs"])
def test_wake_on_connect_sends_the_unparked_webhook(
    conf: Path, tmp_path: Path, receiver: tuple[str, list[dict[str, Any]]], place: str
) -> None:
    got = receiver[1]
    port = free_port()
    sgc(conf, "run", "--name", "web", "--nccl", "restrict", "--", sys.executable, JOBS, "server",
        str(port))  # fmt: skip
    out = StateDir(tmp_path / "state").job("web") / "stdout"
    _until(lambda: out.exists() and "listening" in out.read_text(), "the server")
    sgc(conf, "park", "web", "--to", place, "--wake-on-connect")
    _until(lambda: [g["event"] for g in got] == ["parked"], "the parked webhook")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/next", timeout=120) as r:
        assert r.read() == b"1"  # answered by the woken job
    _until(lambda: len(got) >= 2, "the unparked webhook", limit=30)
    assert [g["event"] for g in got] == ["parked", "unparked"], got
    assert got[1]["job"] == "web" and got[1]["source"] == "park"
    assert "connect" in got[1]["reason"], got[1]


@pytest.fixture
async def flaky() -> AsyncIterator[tuple[str, list[str]]]:
    """A webhook that answers 503 to a job's first ``frozen`` POST, then 200 to everything:
    the order in which it accepted events."""
    accepted: list[str] = []
    refused: set[str] = set()

    async def hook(request: web.Request) -> web.Response:
        body = await request.json()
        key = f"{body['job']}:{body['event']}"
        if body["event"] == "frozen" and key not in refused:
            refused.add(key)
            return web.json_response({"error": "busy"}, status=503)
        accepted.append(key)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/hook", accepted
    finally:
        await runner.cleanup()


async def test_durable_never_arrives_before_frozen(flaky: tuple[str, list[str]]) -> None:
    url, accepted = flaky
    n = Notifier(NotifySettings(webhook_url=[url]))
    for job in ("a", "b"):
        n.notify(Notification(event=NotifyEvent.FROZEN, job=job, source="agent"))
        n.notify(Notification(event=NotifyEvent.DURABLE, job=job, source="agent"))
    n.notify(Notification(event=NotifyEvent.NOTICE, job="c", source="agent"))
    await asyncio.wait_for(n.aclose(timeout_s=30), 40)
    for job in ("a", "b"):
        assert accepted.index(f"{job}:frozen") < accepted.index(f"{job}:durable"), accepted
    # another job's notification does not wait behind a retried one
    assert accepted[0] == "c:notice", accepted
    assert n.sent == 5 and n.failed == 0
