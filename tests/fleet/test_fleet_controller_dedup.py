"""One interruption, two reports: the agent on the VM (AWS IMDS, here the metadata-sim) and the
fleet queue (EventBridge → SQS, here moto) carry the same notice id. The controller applies the
first and records the second as a duplicate, whichever comes first; two instances warned in the
same second (same notice id) are still two interruptions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from spotguard.contracts import AnyEvent, EventKind, make_event
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.facts import InstanceFacts
from spotguard.image.settings import ImageSettings
from spotguard.notices.aws import AwsImdsSource
from spotguard.notices.base import Notice
from spotguard.notices.fleet import SqsFleetSource
from spotguard.notices.instance import instance_facts
from spotguard.notices.settings import NoticeSettings
from spotguard.providers.local import LocalProvider, LocalSettings
from spotguard.simulator import MetadataSim, SimClient

TOKEN = "dedup-token"


@pytest.fixture
async def sim(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MetadataSim]:
    async with MetadataSim() as server:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        yield server


@pytest.fixture
async def controller(
    fleet_queue: tuple[str, Any], tmp_path: Path, aws_env: str
) -> AsyncIterator[str]:
    settings = ControllerSettings(
        listen="127.0.0.1:0",
        state=tmp_path / "c.db",
        provider="local",
        controller_token=TOKEN,
        tick_s=0.05,
        notice_grace_s=600,
    )
    provider = LocalProvider(LocalSettings(local_root=tmp_path / "local", local_gpus=False))
    source = SqsFleetSource(fleet_queue[0], wait_time=1)
    async with ControllerServer(
        settings, provider=provider, image=ImageSettings.model_validate({}), sources=[source]
    ) as srv:
        yield srv.url


async def agent_sees_spot_warning(sim: MetadataSim) -> tuple[InstanceFacts, Notice]:
    """What the agent on the VM sees: its instance facts and the IMDS spot notice."""
    async with SimClient(sim.url) as c:
        await c.send("aws", "preempt", action="terminate", in_seconds=120)
    facts = await instance_facts("aws", NoticeSettings())
    source = AwsImdsSource(poll_interval=0.05)
    try:
        async for notice in source.watch():
            return facts, notice
    finally:
        await source.aclose()
    raise AssertionError("the IMDS source yielded nothing")


def eventbridge_warning(events: Any, instance_id: str, deadline: Any) -> None:
    """The spot warning EventBridge sends two minutes before the deadline IMDS shows."""
    entry = {
        "Source": "aws.ec2",
        "DetailType": "EC2 Spot Instance Interruption Warning",
        "Detail": json.dumps({"instance-id": instance_id, "instance-action": "terminate"}),
        "Time": deadline - timedelta(seconds=120),
    }
    assert events.put_events(Entries=[entry])["FailedEntryCount"] == 0


class Api:
    def __init__(self, url: str, s: aiohttp.ClientSession) -> None:
        self.url, self.s = url, s
        self.headers = {"Authorization": f"Bearer {TOKEN}"}

    async def post(self, ev: AnyEvent) -> dict[str, Any]:
        async with self.s.post(
            self.url + "/v1/events", data=ev.model_dump_json(), headers=self.headers
        ) as r:
            assert r.status == 200, await r.text()
            out: dict[str, Any] = await r.json()
            return out

    async def job(self, name: str) -> dict[str, Any]:
        async with self.s.get(self.url + f"/v1/jobs/{name}", headers=self.headers) as r:
            assert r.status == 200, await r.text()
            out: dict[str, Any] = await r.json()
            return out

    async def until(self, name: str, what: str, check: Any) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        end = loop.time() + 20
        while True:
            view = await self.job(name)
            if check(view):
                return view
            assert loop.time() < end, f"{name}: never {what}: {view['history'][-3:]}"
            await asyncio.sleep(0.05)

    async def metrics(self) -> str:
        async with self.s.get(self.url + "/metrics") as r:
            return await r.text()


def moves_into_interrupting(view: dict[str, Any]) -> int:
    return sum(1 for h in view["history"] if h["to"] == "interrupting" and h["from"] != h["to"])


async def test_agent_first_then_fleet_is_a_duplicate(
    sim: MetadataSim, controller: str, fleet_queue: tuple[str, Any]
) -> None:
    facts, notice = await agent_sees_spot_warning(sim)
    assert facts.instance_id
    async with aiohttp.ClientSession() as s:
        api = Api(controller, s)
        await api.post(
            make_event(job="agent-first", kind=EventKind.STARTED, instance=facts.to_json())
        )
        r = await api.post(
            make_event(
                job="agent-first",
                kind=EventKind.NOTICE,
                instance=facts.to_json(),
                notice=notice.to_json(),
            )
        )
        assert (r["state"], r["duplicate"]) == ("interrupting", False)
        before = await api.job("agent-first")
        eventbridge_warning(fleet_queue[1], facts.instance_id, notice.deadline)
        view = await api.until(
            "agent-first",
            "saw the fleet copy",
            lambda v: any("duplicate notice" in h["reason"] for h in v["history"]),
        )
        text = await api.metrics()
    dup = next(h for h in view["history"] if "duplicate notice" in h["reason"])
    assert dup["detail"]["duplicate_of"]["origin"] == "the agent"
    assert f"from the fleet queue on {facts.instance_id}" in dup["reason"]
    assert view["state"] == "interrupting"
    assert moves_into_interrupting(view) == 1
    assert view["deadline"] == before["deadline"]
    assert view["data"]["notice"]["cloud"] == "aws"  # the first report's notice stays
    assert 'spotguard_controller_duplicate_events_total{kind="notice"} 1.0' in text


async def test_fleet_first_then_agent_is_a_duplicate_and_neighbours_are_not(
    sim: MetadataSim, controller: str, fleet_queue: tuple[str, Any]
) -> None:
    facts, notice = await agent_sees_spot_warning(sim)
    assert facts.instance_id
    neighbour = {**facts.to_json(), "instance_id": "i-0fedcba9876543210"}
    async with aiohttp.ClientSession() as s:
        api = Api(controller, s)
        await api.post(
            make_event(job="fleet-first", kind=EventKind.STARTED, instance=facts.to_json())
        )
        await api.post(make_event(job="neighbour", kind=EventKind.STARTED, instance=neighbour))
        # Both instances are warned in the same second: the notice ids are equal.
        eventbridge_warning(fleet_queue[1], facts.instance_id, notice.deadline)
        eventbridge_warning(fleet_queue[1], neighbour["instance_id"], notice.deadline)
        for name in ("fleet-first", "neighbour"):
            await api.until(name, "interrupting", lambda v: v["state"] == "interrupting")
        r = await api.post(
            make_event(
                job="fleet-first",
                kind=EventKind.NOTICE,
                instance=facts.to_json(),
                notice=notice.to_json(),
            )
        )
        assert (r["state"], r["duplicate"]) == ("interrupting", True)
        view = await api.job("fleet-first")
        other = await api.job("neighbour")
    assert view["data"]["notice"]["id"] == notice.id == other["data"]["notice"]["id"]
    last = view["history"][-1]
    assert last["reason"].startswith(f"duplicate notice {notice.id} from the agent")
    assert last["detail"]["duplicate_of"]["origin"] == "the fleet queue"
    assert moves_into_interrupting(view) == 1
    assert moves_into_interrupting(other) == 1
    assert not any("duplicate" in h["reason"] for h in other["history"])
