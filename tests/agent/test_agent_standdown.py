"""Standing down (14.2): an agent whose job is owned elsewhere stops acting for it.

* A real controller (local provider) moves the job to a new VM under a new ownership epoch;
  the new VM's agent reports the job restored there. The old VM's agent — still protecting
  its copy, with the fleet token or with its own epoch's VM token — learns it from the
  controller's answers (the directive poll, its reports), stands down: no checkpoint at the
  next notice, no report, the process left alone; restarted, it leaves the job alone.
* The job's newest image in the store was written by another instance after this agent's last
  one: the agent stands down at start, without a controller.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from agent_helpers import EventSink, Host, inert_fleet, job_argv, running_agent, wait_until

from spotguard.agent.ledger import Ledger
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import start_job
from spotguard.contracts import Assignment, InstanceInfo, RestoredEvent
from spotguard.controller.server import ControllerServer
from spotguard.controller.tokens import TokenKeys
from spotguard.image import ImageSettings, push_dir
from spotguard.providers.base import InstanceRef, Market
from spotguard.simulator import MetadataSim

pytestmark = pytest.mark.criu

TOKEN = "standdown-fleet-token"
LONG_JOB = job_argv("--steps", "4000", "--step-seconds", "0.05", "--mb", "4", "--gpu", "no")


@pytest.fixture
async def sim(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MetadataSim]:
    async with MetadataSim() as s:
        for key, value in s.env().items():
            monkeypatch.setenv(key, value)
        yield s


async def _restored_on_new_vm(url: str, vm_dir: Path, image_url: str) -> None:
    """What the new VM's agent reports once it restored the job (with its epoch's token)."""
    a = Assignment.model_validate_json((vm_dir / "assignment.json").read_text())
    assert a.epoch == 1 and a.image_url == image_url
    ev = RestoredEvent(
        job="train",
        instance=InstanceInfo(provider="local", instance_id="vm-new"),
        image_url=a.image_url,
        attempt=a.attempt,
    )
    headers = {"Authorization": f"Bearer {a.controller_token}"}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/events", data=ev.model_dump_json(), headers=headers) as r,
    ):
        assert r.status == 200, await r.text()


@pytest.mark.parametrize("credential", ["fleet-token", "vm-token"])
async def test_an_agent_whose_job_was_relaunched_elsewhere_stands_down(
    host: Host, sim: MetadataSim, tmp_path: Path, credential: str
) -> None:
    store = f"file://{tmp_path}/store"
    provider, settings = inert_fleet(tmp_path, store, TOKEN)
    token = TOKEN if credential == "fleet-token" else TokenKeys(TOKEN).issue("train", 0)
    agent_kw = {
        "job": ["train"],
        "store": store,
        "controller_url": "",
        "controller_token": token,
        "directive_poll_s": 0.3,
    }
    job = await start_job(LONG_JOB, "train", state_dir=host.state)
    try:
        async with ControllerServer(
            settings, provider=provider, image=ImageSettings.model_validate({})
        ) as srv:
            agent_kw["controller_url"] = srv.url
            async with running_agent(host, None, **agent_kw) as agent:
                await wait_until(lambda: "train" in agent.workers)
                sim.state.send("aws", "rebalance")  # a resumed checkpoint: an image to move
                await wait_until(lambda: agent.workers["train"].checkpoints == 1, 60)
                assert await agent.reporter.flush(10)
                image_url = agent.workers["train"].last_image.image_url  # type: ignore[union-attr]
                rec = await srv.controller.db.get("train")
                assert rec is not None and rec.image_url == image_url, rec
                mine = agent.instance.instance_id
                assert mine is not None and rec.data.owner.instance_id == mine

                await srv.controller.migrate("train", "local", immediate=True)
                vms = tmp_path / "local" / "vms"
                await wait_until(lambda: any(vms.glob("vm-*/assignment.json")), 30)
                [vm_dir] = [p.parent for p in vms.glob("vm-*/assignment.json")]
                # the local provider writes the assignment before the controller records the
                # launch (LAUNCHING -> RESTORING); a RESTORED reported in between is recorded
                # and ignored, which a real VM's agent, booting for a minute, never meets
                for _ in range(600):
                    now = await srv.controller.db.get("train")
                    if now is not None and now.state.value == "restoring":
                        break
                    await asyncio.sleep(0.05)
                await _restored_on_new_vm(srv.url, vm_dir, image_url)

                worker = agent.workers["train"]
                await wait_until(lambda: worker.state == "stood_down", 20)
                # (with its epoch's token it may hear so before the new VM reports: fine)
                assert worker.stood_down is not None and "epoch 1" in worker.stood_down
                assert proctree.alive(job.pid)  # left alone: no longer this agent's to stop
                sim.state.send("aws", "preempt", in_seconds=120)
                await asyncio.sleep(2.0)
                assert worker.checkpoints == 1 and worker.state == "stood_down"
                assert proctree.alive(job.pid)
                assert agent.notices_seen  # the notice was seen, and nothing was done for it
            record = Ledger(host.state / "agent" / "jobs").get("train")
            assert record is not None and (record.state, record.pid) == ("stood_down", job.pid)
            view = await srv.controller.view("train")
            assert view["state"] == "protected" and view["owner"]["instance_id"] == "vm-new"
            assert view["owner"]["epoch"] == 1
            heard = len(view["history"])

            # Restarted, the old VM's agent leaves the job alone: no STARTED, no checkpoint.
            async with running_agent(host, None, cloud="none", **agent_kw) as again:
                await wait_until(lambda: "train" in again.workers)
                assert again.workers["train"].state == "stood_down"
                await asyncio.sleep(1.0)
            view = await srv.controller.view("train")
            assert len(view["history"]) == heard, view["history"][heard:]
            assert view["owner"]["instance_id"] == "vm-new"
    finally:
        if proctree.alive(job.pid):
            os.kill(job.pid, signal.SIGKILL)
        for vm in sorted((tmp_path / "local" / "vms").glob("vm-*")):
            ref = InstanceRef("local", vm.name, "local", "local-1", "local", Market.ON_DEMAND)
            await provider.terminate(ref)


async def test_a_newer_image_from_another_instance_makes_the_agent_stand_down(
    host: Host, sink: EventSink, sim: MetadataSim, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    job = await start_job(LONG_JOB, "train", state_dir=host.state)
    try:
        async with running_agent(host, sink, job=["train"], store=store) as agent:
            await wait_until(lambda: "started" in sink.kinds("train"))
            sim.state.send("aws", "rebalance")
            await wait_until(lambda: "durable" in sink.kinds("train"), 60)
            mine = agent.instance.instance_id
        # Meanwhile the job was restored on another instance, which wrote a newer image.
        src = tmp_path / "elsewhere"
        src.mkdir()
        (src / "pages-1.img").write_bytes(os.urandom(4096))
        await asyncio.sleep(1.5)  # its image id (a timestamp) is clearly later
        meta = {"instance": {"instance_id": "i-elsewhere"}}
        newer = await push_dir(src, store, "train", meta, settings=ImageSettings())
        assert mine is not None and mine != "i-elsewhere"
        sink.events.clear()
        async with running_agent(host, sink, job=["train"], store=store) as agent:
            await wait_until(lambda: "train" in agent.workers)
            assert agent.workers["train"].state == "stood_down"
            sim.state.send("aws", "preempt", in_seconds=120)
            await asyncio.sleep(2.0)
            assert agent.workers["train"].checkpoints == 0
        assert sink.kinds("train") == [], sink.kinds("train")  # not even STARTED
        assert proctree.alive(job.pid)
        record = Ledger(host.state / "agent" / "jobs").get("train")
        assert record is not None and record.state == "stood_down"
        assert newer.image_url.startswith(f"{store}/train/images/")
    finally:
        if proctree.alive(job.pid):
            os.kill(job.pid, signal.SIGKILL)
