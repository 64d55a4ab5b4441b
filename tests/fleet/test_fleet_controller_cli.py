"""``spotguard controller`` started the way a user starts it builds the fleet source from its
settings (env ``SPOTGUARD_FLEET_*`` and flags): a spot warning put through EventBridge → SQS
(moto) moves the job exactly as the agent's own NOTICE report moves another job."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sgtest import free_port
from spotguard.contracts import EventKind, make_event

TOKEN = "fleet-cli-token"


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
def controller_proc(fleet_queue: tuple[str, Any], tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``spotguard controller`` as a subprocess: queue URL from the environment, the rest as
    flags (AWS_ENDPOINT_URL, set by the aws_env fixture, points boto3 at moto)."""
    queue_url, _ = fleet_queue
    port = free_port()
    log = tmp_path / "controller.log"
    env = {
        **os.environ,
        "SPOTGUARD_FLEET_QUEUE_URL": queue_url,
        "SPOTGUARD_CONTROLLER_TOKEN": TOKEN,
        "SPOTGUARD_LOCAL_ROOT": str(tmp_path / "local"),
    }
    env.pop("SPOTGUARD_CONFIG", None)
    exe = str(Path(sys.executable).with_name("spotguard"))
    args = [
        exe,
        "controller",
        "--listen",
        f"127.0.0.1:{port}",
        "--state",
        str(tmp_path / "state.db"),
        "--provider",
        "local",
        "--tick-s",
        "0.05",
        "--region",
        "us-east-1",
        "--wait-time",
        "1",
    ]
    with log.open("ab") as f:
        proc = subprocess.Popen(
            args, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)


async def call(
    s: aiohttp.ClientSession, method: str, url: str, body: str | None = None
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with s.request(method, url, data=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
        return out


async def test_controller_command_reads_fleet_settings_and_acts_on_a_spot_warning(
    controller_proc: tuple[str, Path], fleet_queue: tuple[str, Any]
) -> None:
    url, log = controller_proc
    _, events = fleet_queue
    by_agent, by_fleet = instance("i-0aaaaaaaaaaaaaa01"), instance("i-0bbbbbbbbbbbbbb02")
    loop = asyncio.get_running_loop()
    end = loop.time() + 30
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/healthz") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            assert loop.time() < end, log.read_text()
            await asyncio.sleep(0.1)
        for name, inst in (("cli-agent", by_agent), ("cli-fleet", by_fleet)):
            ev = make_event(job=name, kind=EventKind.STARTED, instance=inst)
            await call(s, "POST", url + "/v1/events", ev.model_dump_json())
        deadline = "2099-01-01T00:00:00Z"
        notice = {"id": "n-cli", "cloud": "aws", "kind": "preempt", "deadline": deadline}
        ev = make_event(job="cli-agent", kind=EventKind.NOTICE, instance=by_agent, notice=notice)
        agent_view = await call(s, "POST", url + "/v1/events", ev.model_dump_json())
        assert agent_view["state"] == "interrupting"
        entry = {
            "Source": "aws.ec2",
            "DetailType": "EC2 Spot Instance Interruption Warning",
            "Detail": json.dumps(
                {"instance-id": by_fleet["instance_id"], "instance-action": "terminate"}
            ),
        }
        assert events.put_events(Entries=[entry])["FailedEntryCount"] == 0
        while True:
            view = await call(s, "GET", url + "/v1/jobs/cli-fleet")
            if view["state"] != "protected":
                break
            assert loop.time() < end, log.read_text()
            await asyncio.sleep(0.05)
    assert view["state"] == agent_view["state"]
    assert view["data"]["notice"]["cloud"] == "fleet"
    assert view["data"]["notice"]["action"] == "terminate"
    assert view["history"][-1]["detail"]["instance"] == by_fleet["instance_id"]
    assert "watching fleet notices" in log.read_text()
