"""One supervisor for every notice source: the agent's bus and the controller's fleet watch
restart a failing source (a NoticeError or a bug) the same way."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from spotguard.contracts import StartedEvent
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.errors import MetadataUnavailable
from spotguard.image.settings import ImageSettings
from spotguard.notices.backoff import Backoff
from spotguard.notices.base import Notice
from spotguard.notices.fleet import SqsFleetSource
from spotguard.notices.supervisor import SourceSupervisor
from spotguard.providers.aws import AwsProvider, AwsSettings
from spotguard.testing import ScriptedSource, make_notice

TOKEN = "supervisor-test-token"
IID = "i-0ccccccccccccccc3"


class BuggyOnce(SqsFleetSource):
    """The real SQS fleet source, with a bug (not a NoticeError) on its first receive."""

    receives = 0

    async def _receive(self) -> list[dict[str, Any]]:
        self.receives += 1
        if self.receives == 1:
            raise KeyError("Messages")
        return await super()._receive()


def _spot_warning(instance_id: str) -> str:
    return json.dumps(
        {
            "version": "0",
            "id": "7e2f6c1d-0000-4000-8000-000000000001",
            "detail-type": "EC2 Spot Instance Interruption Warning",
            "source": "aws.ec2",
            "account": "123456789012",
            "time": "2099-01-01T00:00:00Z",
            "region": "us-east-1",
            "resources": [f"arn:aws:ec2:us-east-1a:instance/{instance_id}"],
            "detail": {"instance-id": instance_id, "instance-action": "terminate"},
        }
    )


async def test_controller_restarts_a_fleet_source_that_fails_with_a_bug(
    aws_env: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import boto3

    caplog.set_level(logging.INFO, logger="spotguard.notices")
    queue = boto3.client("sqs").create_queue(QueueName="supervisor-bug")["QueueUrl"]
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
    source = BuggyOnce(queue, wait_time=1)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    inst = {"provider": "aws", "instance_id": IID, "instance_type": "g5.xlarge",
            "region": "us-east-1", "zone": "us-east-1a", "spot": True}  # fmt: skip
    async with (
        ControllerServer(
            settings, provider=provider, image=ImageSettings.model_validate({}), sources=[source]
        ) as srv,
        aiohttp.ClientSession(headers=headers) as http,
    ):
        started = StartedEvent.model_validate(
            {"job": "fleet-job", "instance": inst, "store": "s3://b"}
        )
        async with http.post(srv.url + "/v1/events", data=started.model_dump_json()) as r:
            assert r.status == 200, await r.text()
        boto3.client("sqs").send_message(QueueUrl=queue, MessageBody=_spot_warning(IID))
        state = None
        for _ in range(200):
            async with http.get(srv.url + "/v1/jobs/fleet-job") as r:
                state = (await r.json())["state"]
            if state == "interrupting":
                break
            await asyncio.sleep(0.05)
    assert source.receives >= 2, "the source was never watched again after the bug"
    assert state == "interrupting"
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "notice source aws-fleet-sqs failed: KeyError: 'Messages'" in text


async def test_supervisor_restarts_after_errors_and_bugs_and_reports_health() -> None:
    got: list[Notice] = []

    async def deliver(notice: Notice) -> None:
        got.append(notice)

    script = [make_notice(notice_id="a"), MetadataUnavailable("refused"), ValueError("bug"),
              make_notice(notice_id="b")]  # fmt: skip
    source = ScriptedSource(script, name="s")
    sup = SourceSupervisor(source, deliver, backoff=Backoff(0.01, 0.02))
    await asyncio.wait_for(sup.run(), 5)
    assert [n.id for n in got] == ["a", "b"] and source.watches == 3
    assert (sup.health.state, sup.health.failures, sup.health.notices) == ("finished", 0, 2)
    assert sup.health.last_error == "ValueError: bug"


async def test_a_failing_consumer_is_a_failure_too_and_the_source_goes_on() -> None:
    calls: list[str] = []

    async def deliver(notice: Notice) -> None:
        calls.append(notice.id)
        if len(calls) == 1:
            raise RuntimeError("consumer bug")

    source = ScriptedSource([make_notice(notice_id="a"), make_notice(notice_id="b")])
    sup = SourceSupervisor(source, deliver, backoff=Backoff(0.01, 0.02))
    await asyncio.wait_for(sup.run(), 5)
    assert calls == ["a", "b"] and source.watches == 2
