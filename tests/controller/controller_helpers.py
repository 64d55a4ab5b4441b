"""Shared by the controller tests: a real controller over HTTP with the local provider, whose
"VMs" run the stand-in agent (sg_standin_agent.py)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from spotguard.contracts import EventKind, make_event
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.image.settings import ImageSettings
from spotguard.providers.base import InstanceRef, Market
from spotguard.providers.local import LocalProvider, LocalSettings

TOKEN = "s3cret-token"
STANDIN = str(Path(__file__).with_name("sg_standin_agent.py"))
VM1 = {"provider": "local", "instance_id": "vm-first", "region": "local", "zone": "local-1"}


class Api:
    """A tiny client for the tests: real HTTP with the bearer token."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url
        self.s = session

    async def event(self, job: str, kind: EventKind, **kw: Any) -> dict[str, Any]:
        ev = make_event(job=job, kind=kind, **kw)
        return await self.post_raw(ev.model_dump_json())

    async def post_raw(self, body: str, token: str | None = TOKEN) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.s.post(self.url + "/v1/events", data=body, headers=headers) as r:
            out: dict[str, Any] = await r.json()
            out["_status"] = r.status
            return out

    async def get(self, path: str) -> dict[str, Any]:
        async with self.s.get(self.url + path, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            out: dict[str, Any] = await r.json()
            out["_status"] = r.status
            return out

    async def migrate(self, job: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.s.post(
            f"{self.url}/v1/jobs/{job}/migrate",
            json=body,
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as r:
            out: dict[str, Any] = await r.json()
            out["_status"] = r.status
            return out

    async def wait_state(self, job: str, state: str, within: float = 20.0) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        while True:
            view = await self.get(f"/v1/jobs/{job}")
            if view.get("state") == state:
                return view
            if loop.time() > end:
                raise AssertionError(
                    f"{job} is {view.get('state')} ({view.get('reason')}), not {state}"
                )
            await asyncio.sleep(0.05)


async def held_state(api: Api, job: str, state: str, seconds: float) -> dict[str, Any]:
    """The job's view after it stayed in ``state`` for ``seconds`` (asserted on every look)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while True:
        view = await api.get(f"/v1/jobs/{job}")
        assert view["state"] == state, (view["state"], view["reason"])
        if loop.time() > end:
            return view
        await asyncio.sleep(0.05)


def settings(tmp_path: Path, **kw: Any) -> ControllerSettings:
    base: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "state": tmp_path / "controller.db",
        "provider": "local",
        "controller_token": TOKEN,
        "default_store": f"file://{tmp_path}/store",
        "tick_s": 0.05,
        "notice_grace_s": 0.3,
        "capacity_retry_s": 0.0,
    }
    base.update(kw)
    return ControllerSettings(**base)


def local(tmp_path: Path, **env: str) -> LocalProvider:
    return LocalProvider(
        LocalSettings(
            local_root=tmp_path / "local",
            local_agent_command=[sys.executable, STANDIN],
            local_env=env,
            local_gpus=False,
        )
    )


Factory = Callable[..., Any]


@pytest.fixture
async def api_factory(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    stack: list[tuple[ControllerServer, LocalProvider]] = []
    session = aiohttp.ClientSession()

    async def make(**kw: Any) -> tuple[Api, ControllerServer, LocalProvider]:
        env = kw.pop("env", {})
        sources = kw.pop("sources", ())
        prov = local(tmp_path, **env)
        srv = ControllerServer(
            settings(tmp_path, **kw),
            provider=prov,
            image=ImageSettings.model_validate({}),
            sources=sources,
        )
        await srv.__aenter__()
        stack.append((srv, prov))
        return Api(srv.url, session), srv, prov

    yield make
    for srv, prov in reversed(stack):
        await srv.__aexit__(None, None, None)
        # local VMs outlive a controller, like cloud instances: stop the ones the test started
        for vm in sorted((tmp_path / "local" / "vms").glob("vm-*")):
            ref = InstanceRef("local", vm.name, "local", "local-1", "local", Market.ON_DEMAND)
            await prov.terminate(ref)
    await session.close()
