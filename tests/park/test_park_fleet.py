"""A park to a store, as the controller sees it: ``spotguard park --to URL`` on a node whose
agent settings name a controller reports the job parked (real controller over HTTP, real
CRIU job, file:// store); an agent started afterwards keeps it parked there (it reports no
``started`` for a job whose process is gone); unparked by hand on the node, the agent
protects it again and the controller has it ``protected``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from park_helpers import JOBS, ok_json

from sgtest import sg
from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.image import ImageSettings
from spotguard.notices.settings import NoticeSettings
from spotguard.park import record
from spotguard.planner import PlannerSettings
from spotguard.providers.local import LocalProvider, LocalSettings

pytestmark = pytest.mark.criu

TOKEN = "park-fleet-token"


@pytest.fixture
async def controller(tmp_path: Path) -> AsyncIterator[ControllerServer]:
    """A real controller (local provider; no VM is launched in these tests)."""
    settings = ControllerSettings(
        listen="127.0.0.1:0",
        state=tmp_path / "controller.db",
        provider="local",
        controller_token=TOKEN,
        tick_s=0.05,
    )
    prov = LocalProvider(LocalSettings(local_root=tmp_path / "local", local_gpus=False))
    async with ControllerServer(settings, provider=prov, image=ImageSettings()) as srv:
        yield srv


async def view(url: str, job: str) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{url}/v1/jobs/{job}", headers={"Authorization": f"Bearer {TOKEN}"}) as r,
    ):
        out: dict[str, Any] = await r.json()
        return out


async def until(cond: Any, what: str, limit: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + limit
    while not await cond():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def spotguard(config: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The command line (:func:`sgtest.sg`), in a thread: the controller serves on this
    test's event loop."""
    return await asyncio.to_thread(
        sg, *args, config=config, env={"PYTHONUNBUFFERED": "1", **env}, timeout=120
    )


async def test_park_to_a_store_is_reported_and_an_agent_keeps_it_parked_until_unparked(
    config: Path, state_dir: Path, tmp_path: Path, criu_bin: str, controller: ControllerServer
) -> None:
    url, store = controller.url, (tmp_path / "store").as_uri()
    ok_json(
        await spotguard(
            config, "run", "--name", "nb", "--json", "--", sys.executable, JOBS, "sleeper"
        )
    )
    to_controller = {"SPOTGUARD_CONTROLLER_URL": url, "SPOTGUARD_CONTROLLER_TOKEN": TOKEN}
    res = await spotguard(
        config, "park", "nb", "--to", store, "--reason", "tea", "--json", **to_controller
    )
    parked = ok_json(res)
    assert (parked["place"], parked["controller"]) == ("store", "reported")
    v = await view(url, "nb")
    assert (v["state"], v["image_url"]) == ("parked", parked["where"])
    assert v["reason"] == f"parked to {parked['where']} on an unnamed instance (tea)"

    # An agent that starts now finds the job parked: it does not call it started (or done).
    settings = AgentSettings(
        job=["nb"], store=store, api_listen="127.0.0.1:0", controller_url=url,
        controller_token=TOKEN, assignment=tmp_path / "no-assignment.json",
    )  # fmt: skip
    ckpt = CheckpointSettings(state_dir=state_dir, criu=criu_bin, shm_dir=tmp_path / "shm")
    agent = Agent(
        settings, ckpt, NoticeSettings(cloud="none"), image=ImageSettings(),
        planner=PlannerSettings(),
    )  # fmt: skip
    task = asyncio.create_task(agent.run())
    try:

        async def seen_parked() -> bool:
            w = agent.workers.get("nb")
            return w is not None and w.state == "parked"

        await until(seen_parked, "the agent to see the job parked")
        await asyncio.sleep(1.0)
        assert (await view(url, "nb"))["state"] == "parked"
        # Unparked by hand on this node: the agent protects it again and says so.
        back = ok_json(await spotguard(config, "unpark", "nb", "--json"))
        assert record.load(state_dir, "nb") is None

        async def protected() -> bool:
            return (await view(url, "nb"))["state"] == "protected"

        await until(protected, "the controller to have the job protected again")
        assert agent.workers["nb"].pid == back["pid"]
        moves = [(h["from"], h["to"]) for h in (await view(url, "nb"))["history"]]
        # The controller first heard of the job as parked (no agent ran before the park).
        assert [m for m in moves if m[0] != m[1]] == [(None, "parked"), ("parked", "protected")]
    finally:
        agent.request_stop()
        await asyncio.wait_for(task, 60)


async def test_a_job_the_controller_brought_back_elsewhere_is_not_unparked_here_too(
    config: Path, state_dir: Path, tmp_path: Path
) -> None:
    """Parked to a store from this node, then ``jobs unpark`` through the controller onto
    another VM (epoch 1): unparking it here by hand as well would run the job twice. The node
    asks the controller first, refuses in one line, drops its stale record, and the image
    stays in the store for the VM that owns the job now."""
    settings = ControllerSettings(
        listen="127.0.0.1:0", state=tmp_path / "controller.db", provider="local",
        controller_token=TOKEN, tick_s=0.05,
    )  # fmt: skip
    # the new VM's agent never reports: the job stays "launching" there, owned by epoch 1
    prov = LocalProvider(
        LocalSettings(
            local_root=tmp_path / "local", local_gpus=False, local_agent_command=["sleep", "300"]
        )
    )
    store = (tmp_path / "store").as_uri()
    async with ControllerServer(settings, provider=prov, image=ImageSettings()) as srv:
        try:
            ok_json(
                await spotguard(
                    config, "run", "--name", "nb", "--json", "--", sys.executable, JOBS, "sleeper"
                )
            )
            env = {"SPOTGUARD_CONTROLLER_URL": srv.url, "SPOTGUARD_CONTROLLER_TOKEN": TOKEN}
            parked = ok_json(await spotguard(config, "park", "nb", "--to", store, "--json", **env))
            assert parked["controller"] == "reported"
            rec = record.load(state_dir, "nb")
            assert rec is not None and rec.controller_epoch == 0

            async with (
                aiohttp.ClientSession() as s,
                s.post(
                    f"{srv.url}/v1/jobs/nb/unpark", headers={"Authorization": f"Bearer {TOKEN}"}
                ) as r,
            ):
                assert r.status == 200, await r.text()
            assert (await view(srv.url, "nb"))["owner"]["epoch"] == 1

            res = await spotguard(config, "unpark", "nb", **env)
            assert res.returncode != 0
            (line,) = res.stderr.strip().splitlines()[-1:]
            assert line.startswith("spotguard: error: job 'nb' is not unparked here:"), res.stderr
            assert "epoch 1; this node parked it under epoch 0" in line
            assert f"the image stays at {parked['where']}" in line
            assert "Traceback" not in res.stderr
            assert record.load(state_dir, "nb") is None  # the stale record is gone
            assert (await view(srv.url, "nb"))["state"] in {"launching", "restoring"}  # untouched
            manifest = Path(parked["where"].removeprefix("file://")) / "manifest.json"
            assert manifest.is_file()
            again = await spotguard(config, "unpark", "nb", **env)
            assert again.returncode != 0 and "is not parked" in again.stderr
        finally:
            for vm in (tmp_path / "local" / "vms").glob("*/vm.json"):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(json.loads(vm.read_text())["pid"], signal.SIGKILL)
