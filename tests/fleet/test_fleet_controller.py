"""The controller acts on a fleet notice (EventBridge → SQS → SqsFleetSource) exactly as on an
agent's NOTICE report: both jobs end in the same state, holding the same notice."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from spotguard.contracts import AnyEvent, EventKind, make_event
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.image.settings import ImageSettings
from spotguard.notices.fleet import SqsFleetSource
from spotguard.providers.aws import AwsProvider, AwsSettings

TOKEN = "fleet-test-token"


def instance(iid: str) -> dict[str, Any]:
    return {
        "provider": "aws",
        "instance_id": iid,
        "instance_type": "g5.xlarge",
        "region": "us-east-1",
        "zone": "us-east-1a",
        "spot": True,
    }


@pytest.fixture
async def controller(
    fleet_queue: tuple[str, Any], tmp_path: Path, aws_env: str
) -> AsyncIterator[str]:
    url, _ = fleet_queue
    settings = ControllerSettings(
        listen="127.0.0.1:0",
        state=tmp_path / "c.db",
        provider="aws",
        controller_token=TOKEN,
        tick_s=0.05,
    )
    provider = AwsProvider(
        AwsSettings(aws_regions=["us-east-1"], aws_endpoint_url=aws_env, aws_max_attempts=1)
    )
    source = SqsFleetSource(url, wait_time=1)
    async with ControllerServer(
        settings, provider=provider, image=ImageSettings.model_validate({}), sources=[source]
    ) as srv:
        yield srv.url


async def post(s: aiohttp.ClientSession, url: str, ev: AnyEvent) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with s.post(url + "/v1/events", data=ev.model_dump_json(), headers=headers) as r:
        assert r.status == 200, await r.text()


async def job(s: aiohttp.ClientSession, url: str, name: str) -> dict[str, Any]:
    async with s.get(url + f"/v1/jobs/{name}", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
        return out


async def test_fleet_spot_warning_is_handled_like_an_agent_notice(
    controller: str, fleet_queue: tuple[str, Any]
) -> None:
    _, events = fleet_queue
    by_agent, by_fleet = instance("i-0aaaaaaaaaaaaaaa1"), instance("i-0bbbbbbbbbbbbbbb2")
    async with aiohttp.ClientSession() as s:
        for name, inst in (("via-agent", by_agent), ("via-fleet", by_fleet)):
            started = make_event(job=name, kind=EventKind.STARTED, instance=inst, store="s3://b")
            await post(s, controller, started)
        before = await job(s, controller, "via-fleet")
        notice = {
            "id": "n-1",
            "cloud": "aws",
            "kind": "preempt",
            "deadline": "2099-01-01T00:00:00Z",
        }
        report = make_event(
            job="via-agent", kind=EventKind.NOTICE, instance=by_agent, notice=notice
        )
        await post(s, controller, report)
        entry = {
            "Source": "aws.ec2",
            "DetailType": "EC2 Spot Instance Interruption Warning",
            "Detail": json.dumps(
                {"instance-id": by_fleet["instance_id"], "instance-action": "terminate"}
            ),
        }
        assert events.put_events(Entries=[entry])["FailedEntryCount"] == 0
        agent_view = await job(s, controller, "via-agent")
        assert agent_view["state"] != before["state"], "an agent NOTICE moves the job on"
        for _ in range(300):
            fleet_view = await job(s, controller, "via-fleet")
            if fleet_view["state"] != before["state"]:
                break
            await asyncio.sleep(0.05)
    assert fleet_view["state"] == agent_view["state"]
    assert fleet_view["state"] == "interrupting"
    notice_seen = fleet_view["data"]["notice"]
    assert (notice_seen["cloud"], notice_seen["kind"], notice_seen["action"]) == (
        "fleet",
        "preempt",
        "terminate",
    )
    last = fleet_view["history"][-1]
    assert last["detail"]["instance"] == by_fleet["instance_id"]
    assert last["reason"] == agent_view["history"][-1]["reason"].replace(
        by_agent["instance_id"], by_fleet["instance_id"]
    )
