"""Agent test helpers: a real HTTP controller endpoint that records agent events, the sample
job, one simulated host's places, and an agent running in the test's event loop."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from sgtest import free_port as free_port
from sgtest import until
from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.controller.settings import ControllerSettings
from spotguard.image import ImageSettings
from spotguard.notices.settings import NoticeSettings
from spotguard.planner import PlannerSettings
from spotguard.providers.local import LocalProvider, LocalSettings

TOKEN = "controller-token"


class EventSink:
    """``POST /v1/events`` on a loopback port, in its own thread (usable from subprocesses).

    Answers 401 without the right bearer token, 503 for the first ``fail_first`` requests,
    else 200, and keeps each accepted event once (by ``event_id``)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.requests = 0
        self.fail_first = 0
        self.answer: dict[str, Any] = {"ok": True}  # what the controller says back
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._runner: web.AppRunner | None = None

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/events", self._post)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def _post(self, request: web.Request) -> web.Response:
        self.requests += 1
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "token"}, status=401)
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.json_response({"error": "busy"}, status=503)
        body = await request.json()
        if all(e["event_id"] != body["event_id"] for e in self.events):
            self.events.append(body)
        return web.json_response(self.answer)

    def kinds(self, job: str | None = None) -> list[str]:
        return [e["kind"] for e in list(self.events) if job is None or e["job"] == job]

    def start(self) -> EventSink:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        async def _stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


async def wait_until(cond: Callable[[], object], limit_s: float = 30.0) -> None:
    """Poll ``cond`` until it is true (fails the test after ``limit_s``): ``sgtest.until``
    for the agent tests, which name no condition."""
    await until(cond, "a condition of the agent test", limit_s)


async def settled(count: Callable[[], int], quiet_s: float = 1.5, limit_s: float = 20.0) -> int:
    """``count()`` once it has not changed for ``quiet_s`` (fails the test after ``limit_s``):
    a number that work still in flight may raise — a loaded host's late connection — read
    only once that work is over, not after a fixed sleep."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    last, since = count(), loop.time()
    while loop.time() - since < quiet_s:
        assert loop.time() < end, f"the count kept changing for {limit_s:.0f} s (now {last})"
        await asyncio.sleep(0.1)
        if (now := count()) != last:
            last, since = now, loop.time()
    return last


JOB_ARGS = ("--steps", "70", "--step-seconds", "0.05", "--mb", "4", "--seed", "7", "--gpu", "no")


def job_argv(*args: str) -> list[str]:
    """The deterministic sample job (same arguments → byte-identical output)."""
    return [sys.executable, "-m", "spotguard.demo.job", *(args or JOB_ARGS)]


async def job_output_when_done(job_dir: Any, limit_s: float = 60.0) -> str:
    """The job's stdout once its init wrote ``exit_status`` (the command ended)."""
    d = Path(job_dir)
    await wait_until(lambda: (d / "exit_status").exists(), limit_s)
    return (d / "stdout").read_text()


def proc_state(pid: int) -> str | None:
    """The one-letter state of a process (R, S, T, t, Z ...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@dataclass
class Host:
    """One simulated VM's local places: state dir, in-memory staging, CRIU."""

    state: Path
    shm: Path
    criu: str

    def checkpoint_settings(self, **kw: Any) -> CheckpointSettings:
        return CheckpointSettings(state_dir=self.state, shm_dir=self.shm, criu=self.criu, **kw)


@asynccontextmanager
async def running_agent(
    host: Host,
    sink: EventSink | None,
    *,
    cloud: str = "aws",
    checkpoint: dict[str, Any] | None = None,
    **agent: Any,
) -> AsyncIterator[Agent]:
    """An :class:`Agent` running in this event loop until the block ends (``checkpoint``:
    extra engine settings, e.g. ``{"stream": "off"}`` for the staging path)."""
    agent.setdefault("api_listen", "127.0.0.1:0")
    agent.setdefault("assignment", host.state / "no-assignment.json")
    if sink is not None:
        agent.setdefault("controller_url", sink.url)
        agent.setdefault("controller_token", TOKEN)
    settings = AgentSettings(**agent)
    notices = NoticeSettings(cloud=cloud, poll_interval=0.2, long_poll=5, timeout=2.0)
    daemon = Agent(
        settings,
        host.checkpoint_settings(**(checkpoint or {})),
        notices,
        image=ImageSettings(),
        planner=PlannerSettings(),
    )
    task = asyncio.create_task(daemon.run())
    try:
        yield daemon
    finally:
        daemon.request_stop()
        await asyncio.wait_for(task, 60)


class FlakyProxy:
    """A TCP proxy on a loopback port, in its own thread, in front of a real server (moto):
    while ``broken`` it drops every connection at once (an unreachable store); while
    ``stalled`` it holds every byte, on open connections too (a store that hangs); else it
    passes bytes both ways."""

    def __init__(self, target_url: str) -> None:
        host, port = target_url.removeprefix("http://").rstrip("/").split(":")
        self.target = (host, int(port))
        self.broken = False
        self.stalled = False
        self.dropped = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._server: asyncio.base_events.Server | None = None

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", 0)
        )
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.broken:
            self.dropped += 1
            writer.close()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(1 << 16):
                    while self.stalled:  # noqa: ASYNC110 - set from the test's thread
                        await asyncio.sleep(0.05)
                    w.write(data)
                    await w.drain()
            except OSError:
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    def start(self) -> FlakyProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        async def _stop() -> None:
            if self._server is not None:
                self._server.close()
            self.stalled = False
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def inert_fleet(tmp_path: Path, store: str, token: str) -> tuple[LocalProvider, ControllerSettings]:
    """A local provider whose VMs run no agent (they only sleep: the job stays with the
    controller's new owner, unreported) and the settings of a controller over it."""
    provider = LocalProvider(
        LocalSettings(
            local_root=tmp_path / "local",
            local_agent_command=[sys.executable, "-c", "import time; time.sleep(60)"],
            local_gpus=False,
        )
    )
    settings = ControllerSettings(
        listen="127.0.0.1:0",
        state=tmp_path / "controller.db",
        provider="local",
        controller_token=token,
        default_store=store,
        tick_s=0.05,
    )
    return provider, settings
