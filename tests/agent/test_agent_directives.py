"""The agent asks the controller what it wants (``GET /v1/jobs/{job}/directive``): a migration
of an idle job — no notice, no periodic checkpoint, so no event whose answer could carry it —
is drained within a few polls. The agent runs with ``cloud = none``: no metadata service, no
detection, operator (and controller) drains only. Real controller over HTTP, real CRIU, the
real ``spotguard migrate`` command."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from agent_helpers import Host, inert_fleet, job_argv, running_agent, wait_until

from spotguard.agent.sources import cloud_sources
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import start_job
from spotguard.controller.server import ControllerServer
from spotguard.image.settings import ImageSettings
from spotguard.notices.factory import resolve_cloud
from spotguard.notices.settings import NoticeSettings
from spotguard.providers.base import InstanceRef, Market

pytestmark = pytest.mark.criu

TOKEN = "directive-token"
SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))


async def test_cloud_none_has_no_metadata_source_and_no_detection() -> None:
    cloud, sources = await cloud_sources(NoticeSettings(cloud="none"))
    assert (cloud, sources) == (None, [])
    assert await resolve_cloud(NoticeSettings(cloud="none")) is None


async def test_migrate_of_an_idle_job_is_drained_through_the_directive_poll(
    host: Host, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    provider, settings = inert_fleet(tmp_path, store, TOKEN)
    job = await start_job(job_argv("--steps", "400", "--step-seconds", "0.05", "--mb", "4",
                                   "--gpu", "no"), "train", state_dir=host.state)  # fmt: skip
    try:
        async with ControllerServer(
            settings, provider=provider, image=ImageSettings.model_validate({})
        ) as srv:
            async with running_agent(
                host, None, cloud="none", job=["train"], store=store,
                controller_url=srv.url, controller_token=TOKEN, directive_poll_s=0.3,
            ) as agent:  # fmt: skip
                await wait_until(lambda: "train" in agent.workers and agent.bus is not None)
                assert agent.cloud is None and agent.bus is not None
                assert [s.name for s in agent.bus.sources] == ["manual"]
                await wait_until(lambda: agent.reporter.sent >= 1)  # STARTED reached it
                proc = await asyncio.create_subprocess_exec(
                    SPOTGUARD, "migrate", "train", "--to", "local", "--controller-url", srv.url,
                    env={**os.environ, "SPOTGUARD_CONTROLLER_TOKEN": TOKEN},  # never argv (ps)
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                )  # fmt: skip
                _, err = await proc.communicate()
                assert proc.returncode == 0, err.decode()
                worker = agent.workers["train"]
                await wait_until(lambda: worker.state == "exited", limit_s=20)
                assert worker.last_image is not None
                assert (worker.last_notice or "").startswith("manual-")
                assert agent.directives is not None and agent.directives.polls >= 1
                assert not proctree.alive(job.pid)
            view = await srv.controller.view("train")
            moves = [h["to"] for h in view["history"] if h["from"] != h["to"]]
            assert moves[:4] == ["protected", "interrupting", "checkpointed", "launching"], moves
            assert view["image_url"] == worker.last_image.image_url
    finally:
        if proctree.alive(job.pid):
            os.kill(job.pid, signal.SIGKILL)
        for vm in sorted((tmp_path / "local" / "vms").glob("vm-*")):
            ref = InstanceRef("local", vm.name, "local", "local-1", "local", Market.ON_DEMAND)
            await provider.terminate(ref)
